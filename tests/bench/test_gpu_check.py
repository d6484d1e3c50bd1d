"""``kvtier bench gpu`` in its CPU mode: the device check runs end to end without a GPU.

It proves the check itself works (layouts built as vLLM allocates them, saves through the real
PageLayout into a RAM tier, bit-exact round trips, every path timed beside the memcpy bound)
and prints one JSON document; on a GPU machine the same code runs with ``--device cuda``.
"""

from __future__ import annotations

import json
import subprocess
import sys

from kvtier.bench import gpu


def test_cpu_mode_round_trips_bit_exact_and_reports_every_path():
    report = gpu.check(device="cpu", quick=True)
    assert report["bit_exact"] is True
    trips = [r for r in report["rows"] if r["op"] == "round_trip"]
    # small and kv-heavy (128-token blocks): 128 and 256 tokens; llama flash (16-token blocks): both
    assert {(r["layout"], r["chunk_tokens"]) for r in trips} == {
        (name, chunk) for name in gpu.CPU_SHAPES for chunk in gpu.CHUNK_TOKENS}
    paths = {(r["layout"], r["chunk_tokens"], r["op"], r["path"]) for r in report["rows"]}
    for name in gpu.CPU_SHAPES:
        for op in ("save", "load"):
            for path in ("per-page", "batched", "batched-torch"):
                assert (name, 256, op, path) in paths
    for row in report["rows"]:
        if row["op"] != "round_trip":
            assert row["gbps"] > 0 and row["ms_per_step"] > 0
    flash = [r for r in report["rows"] if r["layout"] == "llama3-8b-flash" and r["op"] == "save"]
    calls = {r["path"]: r["copy_calls"] for r in flash if r["chunk_tokens"] == 128}
    assert calls["batched-torch"] == 4  # one indexed copy per layer (quick mode: 4 layers)
    assert calls["per-page"] == 4 * 8 * 2 * 4  # layers x blocks x K/V x chunks
    assert set(report["bound_gbps"]) and "overlap" not in report  # overlap is measured on CUDA only


def test_cli_prints_one_json_document():
    out = subprocess.run([sys.executable, "-m", "kvtier", "bench", "gpu", "--device", "cpu", "--quick", "--json",
                          "--shapes", "small-cpu"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["bit_exact"] and report["device"].startswith("cpu")
