"""Generate the configuration reference (``configuration.md``) from kvtier's typed config dataclasses.

Used two ways:

* as an MkDocs hook (``hooks:`` in ``mkdocs.yml``): ``on_files`` adds the generated page to the
  site, so every ``mkdocs build`` documents the code as it is;
* from Python or the shell: ``python docs/gen_config_ref.py`` prints the page.

What is documented: every frozen dataclass in ``kvtier/`` (benchmarks excluded) whose name ends
in ``Config`` or ``Options``, found by reading the sources with ``ast`` (so a new config class
appears without editing this file), every dataclass one of their fields is typed with, and each
tier's ``Config`` as the tier registry (``kvtier.tiers.registry.TIERS``) names it. For each
field: name, type, default, the range ``kvtier.config.range_of`` declares, and its text.

Where a field's text comes from, first found wins: ``metadata={"doc": ...}``; a string
statement right after the field (an attribute docstring); a comment on the field's line or on
the lines right above it; an entry of the class docstring (``name: text`` or ````name````
followed by text); an entry of the module docstring's key list (the connector's ``Keys::``);
the same field of a base class; then, for a field still undescribed, the help of the
command-line flag that sets it (``SECTION_COMMANDS``) or the same key's text in another class
of its section, each marked with its origin. Nothing here edits the sources: it parses what is
there.

A module that cannot be imported (an optional dependency missing) is documented from its source
alone: defaults as written, ranges from its ``ranged(...)`` calls.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import html
import importlib
import inspect
import io
import re
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvtier"
EXCLUDE = ("bench",)  # benchmark results are not configuration
PAGE = "configuration.md"

# Sections of the page: (title, what sets it, qualified class names in order). A config class
# found in the sources but not listed here lands in "Other configuration", so none is left out.
SECTIONS: list[tuple[str, str, list[str]]] = [
    ("vLLM connector", "`kv_connector_extra_config` of vLLM's `--kv-transfer-config` (or the YAML/JSON "
     "file named by its `config_file` key). The store's keys below may be given flat here or under `store`.",
     ["kvtier.integrations.vllm.config.ConnectorConfig"]),
    ("Store", "`store` of the connector and of `kvtier serve`.",
     ["kvtier.store.config.StoreConfig", "kvtier.policies.admission.AdmissionConfig"]),
    ("Tiers", "One entry of `tiers`: `{type: NAME, name: optional label, policy: optional eviction policy, "
     "...the keys below}`.", []),  # filled from the tier registry
    ("Cache server", "The YAML file of `kvtier serve --config`.", ["kvtier.server.server.ServeConfig"]),
    ("Router", "The YAML file of `kvtier route --config` (flags override it).",
     ["kvtier.route.config.RouteConfig", "kvtier.route.config.EngineSpec"]),
    ("Weight loader", "`--model-loader-extra-config` of `--load-format kvtier`, and the reader under it and "
     "under `kvtier load`.",
     ["kvtier.integrations.vllm.loader.KVTierLoadOptions", "kvtier.loader.reader.ReaderConfig",
      "kvtier.loader.sources.s3.S3Config", "kvtier.s3client.S3Config"]),
]


@dataclasses.dataclass
class FieldDoc:
    """One documented field."""

    name: str
    type: str
    default: str
    range: str
    doc: str


@dataclasses.dataclass
class ClassDoc:
    """One documented config class."""

    qualname: str  # module.Class
    summary: str
    fields: list[FieldDoc]
    anchor: str
    heading: str


# -- discovery -----------------------------------------------------------------------------
def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_dataclass_node(node: ast.ClassDef) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


@functools.lru_cache(maxsize=1)
def _sources() -> dict[str, tuple[Path, ast.Module]]:
    """module name -> (path, parsed source) for every kvtier module outside EXCLUDE (read once
    per process: a hook run in a long-lived ``mkdocs serve`` re-reads through ``render``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).parts
        if rel[0] in EXCLUDE:
            continue
        out[_module_name(path)] = (path, ast.parse(path.read_text(encoding="utf-8")))
    return out


def discover(sources: dict[str, tuple[Path, ast.Module]] | None = None) -> list[str]:
    """Qualified names (module.Class) of the top-level config dataclasses in the sources."""
    sources = sources if sources is not None else _sources()
    found = []
    for module, (_, tree) in sources.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and _is_dataclass_node(node) and (
                    node.name.endswith("Config") or node.name.endswith("Options")):
                found.append(f"{module}.{node.name}")
    return found


def _class_node(sources, qualname: str) -> tuple[ast.Module, ast.ClassDef, list[str]] | None:
    module, _, name = qualname.rpartition(".")
    if module not in sources:
        return None
    path, tree = sources[module]
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return tree, node, path.read_text(encoding="utf-8").splitlines()
    return None


HEAVY = ("vllm", "torch")  # modules importing these at the top are read from their source (fast builds)


def _imports_heavy(module: str) -> bool:
    """Whether ``module``'s top level imports vLLM or torch (seconds to import)."""
    found = _sources().get(module)
    if found is None:
        return False
    for node in found[1].body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(n.split(".")[0] in HEAVY for n in names):
            return True
    return False


def _load(qualname: str) -> type | None:
    """The class, or None when its module is heavy (see ``HEAVY``) or cannot be imported here
    (a missing extra): then it is documented from its source."""
    module, _, name = qualname.rpartition(".")
    if _imports_heavy(module):
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - any import failure: document from the source instead
        return None


# -- text of a field -----------------------------------------------------------------------
def _comments(lines: list[str]) -> dict[int, str]:
    """line number (1-based) -> the comment text on that line."""
    out = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
            if tok.type == tokenize.COMMENT:
                out[tok.start[0]] = tok.string.lstrip("#:").strip()
    except (tokenize.TokenError, IndentationError):
        pass
    return out


def _docstring_entries(doc: str, names: list[str], inline: bool = True) -> dict[str, str]:
    """Per-field text from a docstring: ``name: text`` lines (continuations indented deeper),
    ``name  text`` key lists, and (``inline``) ````name````/````b````: text up to the next such
    entry of its paragraph, or a sentence that starts with ````name````."""
    out: dict[str, str] = {}
    if not doc:
        return out
    lines = inspect.cleandoc(doc).splitlines()
    # 1) line entries: "name: text" or "name    text" (a key list), continuation lines deeper
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)([a-z_][a-z0-9_]*)(?::\s+|\s{2,})(\S.*)$", lines[i])
        if m and m.group(2) in names:
            indent = len(m.group(1))
            text = [m.group(3)]
            j = i + 1
            while j < len(lines) and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) > indent:
                text.append(lines[j].strip())
                j += 1
            out.setdefault(m.group(2), " ".join(text))
            i = j
            continue
        i += 1
    if not inline:
        return out
    # 2) inline mentions, per paragraph: ``a``/``b``: text (up to the next such entry), or a
    #    sentence that starts with ``a`` (``concurrency`` 0 means ...)
    mention = re.compile(r"``([a-z_][a-z0-9_]*)``((?:\s*/\s*``[a-z_][a-z0-9_]*``)*)\s*(:)?")
    for para in "\n".join(lines).split("\n\n"):
        flat = " ".join(line.strip() for line in para.splitlines())
        hits = [m for m in mention.finditer(flat) if m.group(1) in names]
        for k, m in enumerate(hits):
            group = [m.group(1)] + re.findall(r"``([a-z_][a-z0-9_]*)``", m.group(2) or "")
            if m.group(3):
                end = next((h.start() for h in hits[k + 1:] if h.group(3)), len(flat))
                text = flat[m.end():end].strip(" ;")
            elif m.start() == 0 or flat[:m.start()].rstrip().endswith("."):
                stop = flat.find(". ", m.end())
                text = flat[m.start(): stop + 1 if stop >= 0 else len(flat)].strip()
            else:
                continue
            for name in group:
                if text and name in names:
                    out.setdefault(name, text)
    return out


def _field_texts(tree: ast.Module, node: ast.ClassDef, lines: list[str]) -> dict[str, str]:
    """name -> text from the field's own comments, attribute docstrings, and the docstrings."""
    comments = _comments(lines)
    names = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    out: dict[str, str] = {}
    body = node.body
    for k, stmt in enumerate(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        doc = _metadata_doc(stmt.value)
        nxt = body[k + 1] if k + 1 < len(body) else None
        if not doc and isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant) \
                and isinstance(nxt.value.value, str):
            doc = inspect.cleandoc(nxt.value.value)
        if not doc:
            doc = " ".join(comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments)
        if not doc:  # comment lines right above the field
            above, n = [], stmt.lineno - 1
            while n in comments and lines[n - 1].lstrip().startswith("#"):
                above.insert(0, comments[n])
                n -= 1
            doc = " ".join(above)
        if doc:
            out[name] = doc
    for source, inline in ((ast.get_docstring(node, clean=False) or "", True),
                           (ast.get_docstring(tree, clean=False) or "", False)):  # the module's: key lists only
        for name, text in _docstring_entries(source, names, inline).items():
            out.setdefault(name, text)
    return out


def _metadata_doc(value: ast.expr | None) -> str:
    if isinstance(value, ast.Call):
        for kw in value.keywords:
            if kw.arg == "metadata" and isinstance(kw.value, ast.Dict):
                for key, val in zip(kw.value.keys, kw.value.values):
                    if isinstance(key, ast.Constant) and key.value == "doc" and isinstance(val, ast.Constant):
                        return str(val.value)
    return ""


# -- types, defaults, ranges ---------------------------------------------------------------
def _type_text(hint: Any) -> str:
    if isinstance(hint, str):
        return hint
    text = typing._type_repr(hint) if hasattr(typing, "_type_repr") else repr(hint)  # noqa: SLF001
    text = re.sub(r"\b(?:kvtier|typing|builtins)\.(?:[a-z_0-9]+\.)*", "", text)
    return text.replace("NoneType", "None")


def _value_text(value: Any) -> str:
    from kvtier.config import Size, format_bytes

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return f"see {type(value).__name__}"
    if isinstance(value, Size) or (isinstance(value, int) and not isinstance(value, bool) and value >= 1024 * 1024
                                   and value % 1024 == 0):
        return f"{int(value)} ({format_bytes(value)})"
    if isinstance(value, (list, tuple)):
        items = [dict(v) if hasattr(v, "keys") and not isinstance(v, dict) else v for v in value]
        return repr(type(value)(items)) if isinstance(value, tuple) else repr(items)
    return repr(value)


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _value_text(f.default)
    factory = f.default_factory
    if factory is dataclasses.MISSING:
        return "required"
    if inspect.isfunction(factory) and factory.__name__ != "<lambda>":  # computed where it runs
        return f"{factory.__module__}.{factory.__name__}()"
    return _value_text(factory())


def _range_from_source(stmt: ast.AnnAssign) -> str:
    """The range of ``x: T = ranged(D, ge=...)`` read from the source (no import)."""
    value = stmt.value
    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) == "ranged":
        from kvtier.config import ranged

        try:
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in value.keywords}
            return str(ranged(None, **kwargs).metadata["range"])
        except (ValueError, TypeError):
            return ""
    return ""


def _fields(qualname: str, sources, base_texts: dict[str, str]) -> tuple[str, list[FieldDoc]] | None:
    """The summary and fields of one class (imported if possible, else from its source)."""
    found = _class_node(sources, qualname)
    if found is None:
        return None
    tree, node, lines = found
    texts = {**base_texts, **_field_texts(tree, node, lines)}
    summary = (ast.get_docstring(node) or "").split("\n\n")[0].replace("\n", " ")
    cls = _load(qualname)
    out = []
    if cls is not None and dataclasses.is_dataclass(cls):
        from kvtier.config import range_of

        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001 - an annotation that does not resolve: keep it as written
            hints = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            rng = range_of(cls, f.name)
            out.append(FieldDoc(f.name, _type_text(hints.get(f.name, f.type)), _default_text(f),
                                str(rng) if rng is not None else "", texts.get(f.name, "")))
        return summary, out
    constants = _constants(tree)
    for stmt in node.body:  # not imported: from the source alone
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out.append(FieldDoc(stmt.target.id, ast.unparse(stmt.annotation), _source_default(stmt, constants),
                                _range_from_source(stmt), texts.get(stmt.target.id, "")))
    return summary, out


def _evaluate(expr: ast.expr, constants: dict[str, Any]) -> Any:
    """The value of a constant expression (literals, arithmetic, ``Size(...)``, module constants);
    ValueError for anything else. Nothing is imported or called but ``Size``."""
    from kvtier.config import Size

    for node in ast.walk(expr):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") != "Size":
            raise ValueError("not a constant")
        if isinstance(node, ast.Name) and node.id not in constants and node.id != "Size":
            raise ValueError("not a constant")
        if isinstance(node, (ast.Attribute, ast.Lambda, ast.Subscript)):
            raise ValueError("not a constant")
    return eval(compile(ast.Expression(expr), "<default>", "eval"), {"__builtins__": {}, "Size": Size, **constants})


def _constants(tree: ast.Module) -> dict[str, Any]:
    """Module-level ``NAME = constant expression`` assignments (e.g. ``MiB = 1024 * 1024``)."""
    out: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = _evaluate(node.value, out)
            except Exception:  # noqa: BLE001 - not a constant: not needed
                pass
    return out


def _source_default(stmt: ast.AnnAssign, constants: dict[str, Any]) -> str:
    """The default of a field as its source states it, evaluated where it is a constant."""
    value = stmt.value
    if value is None:
        return "required"
    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in ("ranged", "field"):
        default = next((kw.value for kw in value.keywords if kw.arg == "default"), value.args[0] if value.args else None)
        if default is None:
            return ast.unparse(value)
        value = default
    try:
        return _value_text(_evaluate(value, constants))
    except Exception:  # noqa: BLE001 - an expression: shown as written
        return ast.unparse(value)


def _base_texts(qualname: str, sources) -> dict[str, str]:
    """Texts of the fields of the class's base classes (a subclass inherits their docs)."""
    cls = _load(qualname)
    out: dict[str, str] = {}
    if cls is None:
        return out
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base) and base.__module__.startswith("kvtier"):
            found = _class_node(sources, f"{base.__module__}.{base.__name__}")
            if found:
                out.update(_field_texts(*found))
    return out


def _nested(qualname: str) -> list[str]:
    """Dataclasses that fields of ``qualname`` are typed with (a config within a config)."""
    cls = _load(qualname)
    if cls is None:
        return []
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001
        return []
    out = []

    def walk(h):
        if isinstance(h, type) and dataclasses.is_dataclass(h) and h.__module__.startswith("kvtier"):
            out.append(f"{h.__module__}.{h.__name__}")
        for arg in typing.get_args(h):
            walk(arg)

    for f in dataclasses.fields(cls):
        walk(hints.get(f.name))
    return out


def tier_configs() -> list[tuple[str, str]]:
    """(tier type, qualified name of its Config) for every tier the registry names."""
    from kvtier.tiers.registry import TIERS

    out = []
    for kind in TIERS.names():
        target = TIERS._entries[kind] if hasattr(TIERS, "_entries") else None  # noqa: SLF001
        try:
            cfg = TIERS.get(kind).Config
            out.append((kind, f"{cfg.__module__}.{cfg.__qualname__}"))
        except Exception:  # noqa: BLE001 - the tier's extra is missing: find its Config in the source
            spec = target[0] if isinstance(target, tuple) else target
            module, _, cls_name = str(spec).partition(":")
            out.append((kind, _config_of_source(module, cls_name)))
    return out


def _config_of_source(module: str, cls_name: str) -> str:
    sources = _sources()
    _, tree = sources[module]
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and any(getattr(t, "id", "") == "Config" for t in stmt.targets):
                    return f"{module}.{ast.unparse(stmt.value)}"
    raise LookupError(f"{module}:{cls_name} declares no Config")


# -- the page ------------------------------------------------------------------------------
def collect() -> list[tuple[str, str, list[ClassDoc]]]:
    """Every section with its documented classes; every discovered config class is in one."""
    sources = _sources()
    discovered = discover(sources)
    tiers = tier_configs()
    done: set[str] = set()
    sections = []
    tier_names = {q: kind for kind, q in tiers}
    listed = {q for _, _, names in SECTIONS for q in names} | set(tier_names)  # each in its own section
    for title, intro, names in SECTIONS:
        queue = [q for _, q in tiers] if title == "Tiers" else list(names)
        docs = []
        while queue:
            q = queue.pop(0)
            if q in done:
                continue
            done.add(q)
            got = _fields(q, sources, _base_texts(q, sources))
            if got is None:
                continue
            short = q.rpartition(".")[2]
            heading = f"`type: {tier_names[q]}` ({short})" if q in tier_names else short
            anchor = re.sub(r"[^a-z0-9]+", "-", (f"tier-{tier_names[q]}" if q in tier_names else q).lower()).strip("-")
            docs.append(ClassDoc(q, got[0], got[1], anchor, heading))
            queue[0:0] = [n for n in _nested(q) if n not in done and n not in listed]
        _fill_gaps(title, docs)
        sections.append((title, intro, docs))
    rest = [q for q in discovered if q not in done]
    others = []
    for q in rest:
        got = _fields(q, sources, _base_texts(q, sources))
        if got:
            others.append(ClassDoc(q, got[0], got[1], re.sub(r"[^a-z0-9]+", "-", q.lower()), q.rpartition(".")[2]))
            done.add(q)
    if others:
        sections.append(("Other configuration", "Config classes not placed in a section above.", others))
    return sections


# The commands whose flags set the keys of a section: a key the code leaves undescribed takes the
# help text of the flag of the same name.
SECTION_COMMANDS = {"Cache server": ("serve",), "Router": ("route",), "Weight loader": ("load", "pull", "shard", "probe")}


def _fill_gaps(title: str, docs: list[ClassDoc]) -> None:
    """Describe the fields the code leaves undescribed from what else exists: the help of the
    command-line flag that sets the same key, else the same key's text in another class of the
    section (each marked with where it came from)."""
    flags = _flag_help(SECTION_COMMANDS.get(title, ()))
    siblings: dict[str, tuple[str, str]] = {}
    for d in docs:
        for f in d.fields:
            if f.doc:
                siblings.setdefault(f.name, (d.qualname.rpartition(".")[2], f.doc))
    for d in docs:
        for f in d.fields:
            if f.doc:
                continue
            if f.name in flags:
                f.doc = flags[f.name]
            elif f.name in siblings and siblings[f.name][0] != d.qualname.rpartition(".")[2]:
                f.doc = f"(as in {siblings[f.name][0]}) {siblings[f.name][1]}"


def _flag_help(commands: tuple[str, ...]) -> dict[str, str]:
    """dest -> "`--flag` of `kvtier CMD`: help" for the flags of the given subcommands."""
    if not commands:
        return {}
    import argparse

    try:
        from kvtier.cli import build_parser

        parser = build_parser()
    except Exception:  # noqa: BLE001 - the CLI cannot be built here: no flag texts
        return {}
    subs = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})  # noqa: SLF001
    out: dict[str, str] = {}
    for command in commands:
        sub = subs.get(command)
        for action in getattr(sub, "_actions", ()):
            if not action.option_strings or not action.help or action.help == argparse.SUPPRESS:
                continue
            text = action.help
            if "%(" in text:
                try:
                    text = text % {**vars(action), "prog": f"kvtier {command}"}
                except (KeyError, TypeError, ValueError):
                    pass
            out.setdefault(action.dest, f"`{action.option_strings[-1]}` of `kvtier {command}`: {text}")
    return out


def _cell(text: str) -> str:
    """Text for a table cell (a pipe would end the cell)."""
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _code_cell(text: str) -> str:
    """Code for a table cell: inline HTML, because Markdown keeps ``\\|`` literally in a code span."""
    return "<code>" + html.escape(" ".join(text.split()), quote=False).replace("|", "&#124;") + "</code>"


def render() -> str:
    """The Markdown of the configuration reference (the sources as they are now)."""
    _sources.cache_clear()
    out = ["# Configuration reference", "",
           "Generated from the typed config dataclasses by `docs/gen_config_ref.py` at every docs build: "
           "names, types, defaults and ranges are the code's. Every config is built with "
           "`kvtier.config.build`: an unknown key, a value of the wrong type or out of its range is one "
           "`ConfigError` line naming the key and the valid choices. Sizes take units (`4096`, `512MiB`, "
           "`2GiB`, `1.5GB`: KB/MB/GB are powers of 1000, KiB/MiB/GiB powers of 1024). A range "
           "`[1, inf)` includes 1; `(0, 1]` excludes 0. Checks across fields or beyond a declared range "
           "are in each class's `__post_init__`/`check`.", ""]
    for title, intro, docs in collect():
        out += [f"## {title}", "", intro, ""]
        for d in docs:
            out += [f"### {d.heading} {{#{d.anchor}}}", "", f"`{d.qualname}`" + (f": {d.summary}" if d.summary else ""), ""]
            out += ["| key | type | default | range | description |", "|---|---|---|---|---|"]
            for f in d.fields:
                out.append(f"| `{f.name}` | {_code_cell(f.type)} | {_code_cell(f.default)} | {_cell(f.range) or '-'} "
                           f"| {_cell(f.doc) or '-'} |")
            out.append("")
    return "\n".join(out)


# -- the MkDocs hook -----------------------------------------------------------------------
def on_files(files, config):  # noqa: ANN001 - MkDocs' hook signature
    """Add the generated page to the site (MkDocs >= 1.6)."""
    from mkdocs.structure.files import File

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(render())
