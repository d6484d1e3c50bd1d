"""The base install's command (issue 23): with torch, vLLM, boto3, redis and aiohttp unimportable,
every subcommand's ``--help`` (enumerated from the parser, so a new one is covered) and the light
paths (planning calculators, the simulator, ``kvtier serve`` with RAM and disk tiers) run, exit 0
and print no traceback; a command that needs a blocked module says so in one line naming the
extra, exit 2.

Each check runs in a fresh interpreter whose ``sitecustomize`` (put first on PYTHONPATH) installs
a meta-path finder that raises ``ModuleNotFoundError`` for the blocked names, as a venv without
them would.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from kvtier.cli import build_parser

BLOCKED = ("torch", "vllm", "boto3", "botocore", "redis", "aiohttp")

SITECUSTOMIZE = textwrap.dedent(f"""
    import importlib.abc, sys

    BLOCKED = {set(BLOCKED)!r}

    class _Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, _Blocked())
""")


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory) -> dict:
    """Environment for a subprocess in which the optional modules cannot be imported."""
    site = tmp_path_factory.mktemp("blocker")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("VIRTUAL_ENV", None)
    return env


def _python(env: dict, code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def _kvtier(env: dict, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _help_argvs(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[list[str]]:
    """``[..., "--help"]`` for the parser and every subcommand under it, recursively."""
    out = [[*prefix, "--help"]]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _help_argvs(sub, (*prefix, name))
    return out


def test_the_blocker_blocks(blocked_env):
    """Guard: in the blocked interpreter each blocked module raises ModuleNotFoundError."""
    out = _python(blocked_env, textwrap.dedent(f"""
        import json
        failed = []
        for name in {list(BLOCKED)!r}:
            try:
                __import__(name)
            except ModuleNotFoundError:
                failed.append(name)
        print(json.dumps(failed))
    """))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == list(BLOCKED)


def test_every_subcommands_help_runs_without_optional_modules(blocked_env):
    argvs = _help_argvs(build_parser())
    names = {" ".join(a[:-1]) for a in argvs}
    assert {"", "serve", "route", "pull", "kv-size", "simulate", "bench", "bench gpu", "bench tiers"} <= names
    script = textwrap.dedent(f"""
        import contextlib, io, json, traceback
        from kvtier.cli import main
        results = []
        for argv in {argvs!r}:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(argv)
                except SystemExit as exc:
                    code = exc.code
                except BaseException:
                    code, err = "raised", io.StringIO(traceback.format_exc())
            results.append({{"argv": argv, "code": code, "out": out.getvalue(), "err": err.getvalue()}})
        print(json.dumps(results))
    """)
    out = _python(blocked_env, script, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout)
    assert len(results) == len(argvs)
    for r in results:
        assert r["code"] in (0, None), (r["argv"], r["err"][-2000:])
        assert "usage: kvtier" in r["out"], r["argv"]
        assert "Traceback" not in r["err"], (r["argv"], r["err"][-2000:])


def test_console_script_and_python_dash_m_start(blocked_env):
    script = Path(sys.executable).with_name("kvtier")
    runs = [_kvtier(blocked_env, ["--help"]), _kvtier(blocked_env, ["--version"])]
    if script.exists():
        runs.append(subprocess.run([str(script), "--help"], env=blocked_env, capture_output=True, text=True,
                                   timeout=120))
    for out in runs:
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "kv-size" in runs[0].stdout and "bench" in runs[0].stdout


def test_light_paths_run_without_optional_modules(blocked_env, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                                  "hidden_size": 1536, "torch_dtype": "bfloat16"}))
    cases = [
        (["kv-size", str(config), "--tokens", "4864", "--json"], lambda d: d["total_bytes"] == 139_460_608),
        (["breakeven", "--miss-cost-ms", "10", "--hit-gain-ms", "90", "--json"],
         lambda d: abs(d["breakeven_hit_rate"] - 0.1) < 1e-9),
        (["fleet-load", "--model-size", "140GB", "--pods", "8", "--bandwidth", "10GB/s", "--json"],
         lambda d: d["scenarios"]),
        (["simulate", "--synthetic", "loop:100x3", "--capacity", "50", "--policy", "all", "--json"],
         lambda d: d["requests"] == 300 and d["results"]),
    ]
    for argv, check in cases:
        out = _kvtier(blocked_env, argv)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (argv, out.stderr[-2000:])
        assert check(json.loads(out.stdout)), (argv, out.stdout[:2000])


@pytest.mark.parametrize("argv, module, extra", [
    (["route", "--engine", "http://127.0.0.1:9"], "aiohttp", "kvtier[route]"),
    (["bench", "gpu", "--quick"], "torch", "kvtier[loader]"),
    (["pull", "s3://bucket/model/", "--no-progress", "--cache-dir", "CACHE"], "boto3", "kvtier[s3]"),
])
def test_a_command_needing_a_missing_module_names_its_extra(blocked_env, tmp_path, argv, module, extra):
    argv = [a.replace("CACHE", str(tmp_path / "cache")) for a in argv]
    out = _kvtier(blocked_env, argv)
    err = out.stderr.strip()
    assert out.returncode == 2, err
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"kvtier {' '.join(argv[:2]) if argv[0] == 'bench' else argv[0]}: error:"), err
    assert f"'{module}'" in err and f"pip install '{extra}'" in err, err


def test_serve_runs_without_optional_modules(blocked_env, tmp_path):
    """The base install serves RAM and disk tiers: ready line, /healthz, SIGTERM -> exit 0."""
    prometheus = _python(os.environ, "import prometheus_client")
    if prometheus.returncode != 0:
        pytest.skip("prometheus_client (kvtier[server]) not installed here")
    config = tmp_path / "serve.yaml"
    config.write_text(json.dumps({
        "listen": f"unix://{tmp_path}/run/kvtier.sock", "metrics": "127.0.0.1:0", "staging": "8MiB",
        "shm_dir": str(tmp_path / "shm"),
        "store": {"tiers": [{"type": "ram", "capacity": "16MiB"},
                            {"type": "disk", "path": str(tmp_path / "kv"), "capacity": "64MiB"}]}}))
    (tmp_path / "run").mkdir(mode=0o700)
    (tmp_path / "shm").mkdir(mode=0o700)
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", "serve", "--config", str(config)], env=blocked_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics = _wait_ready(proc, "kvtier serve: ready on ")
        assert metrics, "no metrics address in the ready line"
        with urllib.request.urlopen(f"http://{metrics}/healthz", timeout=10) as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err, err[-2000:]


def _wait_ready(proc: subprocess.Popen, prefix: str, timeout: float = 60) -> str | None:
    """Read stderr until the ready line; the metrics ``HOST:PORT`` it names (or None)."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                pytest.fail(f"exited {proc.returncode} before ready: {''.join(seen)[-2000:]}")
            continue
        seen.append(line)
        if line.startswith(prefix):
            _, _, metrics = line.strip().partition(", metrics http://")
            return metrics or None
    pytest.fail(f"not ready in {timeout} s: {''.join(seen)[-2000:]}")
