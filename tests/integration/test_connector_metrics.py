"""The connector's metrics on vLLM's own ``/metrics``, its logs under vLLM's logging, and the
kv_load_failure_policy check.

Unit tests build the stats and Prometheus classes the way vLLM does (payload through
``to_dict``/``build_kv_connector_stats``, metrics through ``build_prom_metrics`` with the metric
classes vLLM passes) and parse the exposition with prometheus_client's parser. One end-to-end
test starts vLLM's OpenAI server with the connector, reads a prompt twice (prefix caching off, so
the second read is loaded from kvtier) and scrapes the server's ``/metrics``.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig, check_load_failure_policy
from kvtier.integrations.vllm.connector import KVTierConnector
from kvtier.integrations.vllm.metrics import KVTierConnectorStats, TierDeltas, tier_counters


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _total(families: dict, name: str, suffix: str = "_total", **labels) -> float:
    family = families.get(name)
    if family is None:
        return 0.0
    return sum(s.value for s in family.samples
               if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


# ---------------------------------------------------------------------------------- units


def test_stats_payload_survives_vllms_round_trip_and_aggregation():
    """Two workers' stats, summed as vLLM sums them, rebuilt from their dict in the front end."""
    a, b = KVTierConnectorStats(), KVTierConnectorStats()
    a.count_tier("ram", loaded_chunks=2, loaded_bytes=200)
    a.count(saved_chunks=1, saved_bytes=100)
    a.observe("load_seconds", 0.004)
    b.count_tier("disk", loaded_chunks=1, loaded_bytes=100, dropped=3)
    b.count(load_error_chunks=1, save_dropped=2)
    b.observe("save_seconds", 0.002)
    merged = a.aggregate(b)
    payload = json.loads(json.dumps(merged.to_dict()))  # what crosses the process boundary
    rebuilt = KVTierConnector.build_kv_connector_stats(payload)
    assert rebuilt.data == merged.data
    summary = rebuilt.reduce()
    assert summary["loaded_chunks_ram"] == 2 and summary["loaded_chunks_disk"] == 1
    assert summary["loaded_bytes"] == 300 and summary["load_error_chunks"] == 1
    assert summary["save_dropped"] == 2 and summary["tier_dropped"] == 3
    assert summary["load_ms_avg"] == 4.0 and summary["save_ms_avg"] == 2.0
    assert KVTierConnectorStats().is_empty() and not rebuilt.is_empty()
    assert KVTierConnector.build_kv_connector_stats(None).is_empty()


def test_tier_deltas_report_each_count_once():
    deltas = TierDeltas()
    stats = {"tiers": [{"name": "ram", "hits": 3, "misses": 1, "used_bytes": 9}, {"name": "disk", "hits": 0}]}
    assert deltas.take(stats) == {"ram": {"hits": 3, "misses": 1}}
    assert deltas.take(stats) == {}
    stats["tiers"][0]["hits"] = 5
    assert deltas.take(stats) == {"ram": {"hits": 2, "misses": 0}}
    stats["tiers"][0]["hits"] = 1  # a tier rebuilt: counts from zero
    assert deltas.take(stats)["ram"]["hits"] == 1


def test_tier_counters_read_each_tiers_own_counters_without_io():
    class Stats:
        def __init__(self, **c):
            self.c = c

        def as_dict(self):
            return dict(self.c)

    tiers = [types.SimpleNamespace(name="ram", stats=Stats(hits=2, errors=0)),
             types.SimpleNamespace(name="s3", stats=Stats(hits=0, errors=1)), types.SimpleNamespace(name="x")]
    snapshot = tier_counters(tiers)
    assert snapshot == {"tiers": [{"name": "ram", "hits": 2, "errors": 0}, {"name": "s3", "hits": 0, "errors": 1}]}
    assert TierDeltas().take(snapshot) == {"ram": {"hits": 2, "errors": 0}, "s3": {"hits": 0, "errors": 1}}


def test_prom_metrics_register_with_vllms_metric_classes_and_parse():
    """build_prom_metrics with metric classes bound to a private registry (vLLM passes its own
    classes the same way): names, HELP/TYPE, labels and values after two observations."""
    registry = CollectorRegistry()
    types_ = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = types.SimpleNamespace(kv_transfer_config=None)
    prom = KVTierConnector.build_prom_metrics(config, types_, ["model_name", "engine"], {0: ["m", "0"]})
    stats = KVTierConnectorStats()
    stats.count_tier("ram", loaded_chunks=2, loaded_bytes=4096, hits=2, misses=1, dropped=1)
    stats.count(saved_chunks=3, saved_bytes=6144, load_error_chunks=1, save_dropped=1)
    stats.observe("load_seconds", 0.003)
    stats.observe("save_seconds", 0.02)
    prom.observe(stats.to_dict(), 0)
    prom.observe(stats.to_dict(), 0)
    text = generate_latest(registry).decode()
    fams = _families(text)
    base = {"model_name": "m", "engine": "0"}
    assert _total(fams, "vllm:kvtier_loaded_chunks", tier="ram", **base) == 4
    assert _total(fams, "vllm:kvtier_loaded_bytes", tier="ram") == 8192
    assert _total(fams, "vllm:kvtier_tier_hits", tier="ram") == 4
    assert _total(fams, "vllm:kvtier_tier_misses", tier="ram") == 2
    assert _total(fams, "vllm:kvtier_tier_dropped", tier="ram") == 2
    assert _total(fams, "vllm:kvtier_saved_chunks", **base) == 6
    assert _total(fams, "vllm:kvtier_saved_bytes") == 12288
    assert _total(fams, "vllm:kvtier_load_errors") == 2 and _total(fams, "vllm:kvtier_saves_dropped") == 2
    assert _total(fams, "vllm:kvtier_load_seconds", "_count") == 2
    assert _total(fams, "vllm:kvtier_save_seconds", "_sum") == pytest.approx(0.04)
    for name, fam in fams.items():
        assert fam.documentation and f"# TYPE {name}" in text, name


def test_failure_policy_warns_in_one_line_or_refuses():
    assert check_load_failure_policy("recompute", True) is None
    warning = check_load_failure_policy("fail", False)
    assert "\n" not in warning and "'fail'" in warning and '"recompute"' in warning
    with pytest.raises(ConfigError) as err:
        check_load_failure_policy("fail", True)
    assert "\n" not in str(err.value) and "require_recompute" in str(err.value)
    assert ConnectorConfig.from_extra_config({"require_recompute": True}).require_recompute
    assert not ConnectorConfig.from_extra_config({}).require_recompute


def test_connector_refuses_to_start_on_fail_policy_when_required():
    """The switch refuses the engine at the connector's construction (scheduler and worker)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both",
                                kv_connector_extra_config={"require_recompute": True})
    config = types.SimpleNamespace(kv_transfer_config=transfer)
    with pytest.raises(ConfigError, match="require_recompute"):
        KVTierConnector(config, KVConnectorRole.SCHEDULER)


_LOG_SCRIPT = """
import logging
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
from kvtier.integrations.vllm.plugin import route_logs_to_vllm
assert not route_logs_to_vllm()  # vLLM has not configured logging yet: nothing to follow
configure_logging(LoggingConfig())  # what vLLM does at the start of each of its processes
assert route_logs_to_vllm() and route_logs_to_vllm()
logging.getLogger("kvtier.integrations.vllm.connector").info("kvtier-info-line")
logging.getLogger("kvtier.store").debug("kvtier-debug-line")
"""


@pytest.mark.slow
def test_kvtier_logs_follow_vllms_logging_configuration():
    """In a process where vLLM configured logging (and nobody else did), kvtier's INFO records
    come out through vLLM's handler and format; DEBUG stays out at vLLM's default INFO level."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "VLLM_CONFIGURE_LOGGING": "1", "NO_COLOR": "1"}
    proc = subprocess.run([sys.executable, "-c", _LOG_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    line = next(line for line in out.splitlines() if "kvtier-info-line" in line)
    assert " INFO " in line and "[test_connector_metrics" not in line and "pid=" in line  # vLLM's format
    assert "kvtier-debug-line" not in out


# ---------------------------------------------------------------------------------- end to end


@pytest.mark.vllm
def test_metrics_on_vllms_own_endpoint(tmp_path):
    """vLLM's OpenAI server with the connector (kv_load_failure_policy left at "fail"): the
    connector's one-line warning and its INFO line appear in vLLM's log format; after a prompt is
    read twice (prefix caching off: the second read loads 2 chunks from kvtier's RAM tier),
    vLLM's ``/metrics`` parses with prometheus_client and shows kvtier's loaded and saved chunks
    and bytes by tier, the tier's own hits, and load/save time histograms."""
    from kvtier.bench.models import make_random_model

    model = str(make_random_model("small"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    transfer = {"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"tiers": [{"type": "ram", "capacity": "64MiB"}]}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--skip-tokenizer-init",
           "--kv-transfer-config", json.dumps(transfer), "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "1024", "--num-gpu-blocks-override", "16", "--gpu-memory-utilization", "0.3",
           "--enforce-eager", "--dtype", "bfloat16", "--no-enable-prefix-caching"]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    log = tmp_path / "vllm.log"
    from kvtier.harness.procs import spawn

    # through spawn: the server (and its engine processes) die with this test run, even on SIGKILL
    child = spawn(cmd, name="vLLM OpenAI server", log=log, env=env, cwd=tmp_path)
    proc = child.popen
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, log, timeout=300)
        prompt = [(7 * i) % 31000 + 1 for i in range(300)]  # two full 128-token chunks and a tail
        for _ in range(2):
            _complete(base, model, prompt)
        _complete(base, model, [5] * 8)  # one more step, whatever vLLM's output batching
        text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
        fams = _families(text)
        assert _total(fams, "vllm:kvtier_saved_chunks") >= 2
        assert _total(fams, "vllm:kvtier_saved_bytes") >= 2 * 128 * 4096
        assert _total(fams, "vllm:kvtier_loaded_chunks", tier="ram") == 2
        assert _total(fams, "vllm:kvtier_loaded_bytes", tier="ram") == 2 * 128 * 4096
        assert _total(fams, "vllm:kvtier_tier_hits", tier="ram") >= 2
        assert _total(fams, "vllm:kvtier_tier_written_bytes", tier="ram") >= 2 * 128 * 4096
        assert _total(fams, "vllm:kvtier_load_seconds", "_count") >= 1
        assert _total(fams, "vllm:kvtier_save_seconds", "_count") >= 1
        assert _total(fams, "vllm:kvtier_load_errors") == 0
        assert _total(fams, "vllm:kvtier_saves_dropped") == 0 and "vllm:kvtier_saves_dropped" in fams
        for name in fams:
            if name.startswith("vllm:kvtier_"):
                assert f"# HELP {name}" in text and f"# TYPE {name}" in text, name
        logged = log.read_text()
        warnings = [line for line in logged.splitlines() if "kv_load_failure_policy is 'fail'" in line]
        assert len(warnings) == 1 and " WARNING " in warnings[0] and "pid=" in warnings[0], logged[-3000:]
        assert any(" INFO " in line and "kvtier: worker rank 0" in line for line in logged.splitlines()), logged[-3000:]
    finally:
        child.stop(grace=60)


def _wait_healthy(proc: subprocess.Popen, base: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    pytest.fail("vLLM's server did not become healthy:\n" + log.read_text()[-4000:])


def _complete(base: str, model: str, prompt: list[int]) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.status == 200 and json.loads(r.read())["choices"]
