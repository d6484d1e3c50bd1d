"""The ``kvtier`` command: one subcommand per module in this package.

Each command module defines ``register(subparsers)``, which adds its parser and sets
``func=run`` (a callable taking the parsed args and returning an exit code). User mistakes
(any KVTierError) and a missing optional dependency (named with the extra that installs it)
print one line to stderr and exit 2; no traceback. ``_common`` holds the missing-dependency
message (and re-exports ``kvtier.output``'s printing helpers).

Imports: anything in kvtier (it is the top); nothing imports it but ``kvtier.__main__``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from kvtier import __version__
from kvtier.cli._common import missing_dependency
from kvtier.errors import KVTierError

# Each module imports its heavy or optional dependencies inside run(), so --help needs none.
_COMMAND_MODULES = [
    "kvtier.cli.plan",
    "kvtier.cli.bench",
    "kvtier.cli.demo",
    "kvtier.cli.loader",
    "kvtier.cli.serve",
    "kvtier.cli.route",
]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: ``kvtier CMD: error: ... (see kvtier CMD --help)``,
    exit 2. Subcommand parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = _Parser(
        prog="kvtier",
        description="Tiered KV-cache storage and streaming weight loading for LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


# command -> the module it imports first: its optional dependencies are checked before the
# command reads its configuration, and a missing one is named with its extra (one line)
_IMPORTS_FIRST = {
    "route": "kvtier.route.proxy",
}


def command_label(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    """The (sub)command ``argv`` names, as messages print it: ``route``, ``bench gpu``; ``""``
    when it names none. Reads the parser's subcommand tables only (nothing is imported)."""
    words: list[str] = []
    for word in argv:
        if word.startswith("-"):
            continue
        choices = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if not choices or word not in choices:
            break
        words.append(word)
        parser = choices[word]
    return " ".join(words)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script. A user mistake (KVTierError) or a missing optional
    module (named with what installs it) prints ``kvtier CMD: error: ...`` on one line and
    returns 2, also when the module is needed to build a subcommand's parser."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    label = command_label(parser, argv)
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        if label in _IMPORTS_FIRST:
            importlib.import_module(_IMPORTS_FIRST[label])
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `kvtier ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KVTierError as exc:
        print(f"kvtier {label}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        message = missing_dependency(exc)
        if message is None:
            raise
        print(f"kvtier {label}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
