"""The cache server's ``/metrics``: prometheus_client exposition (HELP/TYPE per family, process
metrics), HEAD, a stats source that fails, and the metrics address checked before binding."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.server.client import ServerStore
from kvtier.server.metrics import families, start_metrics


def _scrape(address: str) -> dict:
    """name -> family, parsed by prometheus_client's own parser (which rejects malformed text)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}, text


def _value(family, **labels) -> float:
    return sum(s.value for s in family.samples
               if s.name.endswith(("_total", family.name)) and all(s.labels.get(k) == v for k, v in labels.items()))


def test_served_metrics_parse_with_help_type_and_process_metrics(make_server):
    """A real `kvtier serve` after one put, one hit and one miss: every family parses with a
    HELP text and a TYPE; the store, tier and server counters have the right values and kinds;
    process metrics are there."""
    server = make_server()
    with ServerStore(server.address) as c:
        c.put(b"k" * 32, b"x" * 70_000)
        assert c.get(b"k" * 32) is not None
        assert c.read(b"m" * 32, lambda s: None) is None
    fams, text = _scrape(server.metrics_address)
    for name, fam in fams.items():  # the text names a counter family with its _total suffix
        shown = name + ("_total" if fam.type == "counter" else "")
        assert f"# HELP {shown} " in text and fam.documentation, name
        assert f"# TYPE {shown} {fam.type}\n" in text, name
    assert fams["kvtier_store_hits"].type == "counter" and _value(fams["kvtier_store_hits"]) >= 1
    assert _value(fams["kvtier_store_misses"]) >= 1
    assert fams["kvtier_tier_bytes_written"].type == "counter"
    assert _value(fams["kvtier_tier_bytes_written"], tier="ram") >= 70_000
    assert fams["kvtier_tier_used_bytes"].type == "gauge" and _value(fams["kvtier_tier_used_bytes"], tier="ram") > 0
    assert fams["kvtier_tier_capacity_bytes"].type == "gauge"
    assert _value(fams["kvtier_server_connections"]) >= 1
    assert fams["kvtier_server_connections_open"].type == "gauge"
    assert _value(fams["process_resident_memory_bytes"]) > 0
    assert "process_cpu_seconds" in fams and "python_info" in fams


def test_head_healthz_and_unknown_paths(make_server):
    server = make_server()
    base = f"http://{server.metrics_address}"
    head = urllib.request.urlopen(urllib.request.Request(base + "/metrics", method="HEAD"), timeout=5)
    assert head.status == 200 and head.read() == b""
    assert int(head.headers["Content-Length"]) > 0 and head.headers["Content-Type"].startswith("text/plain")
    assert urllib.request.urlopen(base + "/healthz", timeout=5).read() == b"ok\n"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base + "/nope", timeout=5)
    assert err.value.code == 404


def test_endpoint_takes_a_stats_callable_and_survives_its_failure():
    """The module needs no server: any callable returning a stats dict will do. One that raises
    makes that scrape a 500 with one line; the next scrape works again."""
    state = {"fail": False, "hits": 3}

    def stats() -> dict:
        if state["fail"]:
            raise RuntimeError("store closed")
        return {"hits": state["hits"], "tiers": [{"name": "ram", "hits": 2, "used_bytes": 10, "type": "RamTier"}],
                "server": {"connections": 1, "connections_open": 0}}

    endpoint = start_metrics(stats, "127.0.0.1", 0)
    try:
        address = "%s:%d" % endpoint.server_address[:2]
        fams, _ = _scrape(address)
        assert _value(fams["kvtier_store_hits"]) == 3 and _value(fams["kvtier_tier_hits"], tier="ram") == 2
        state["fail"] = True
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://{address}/metrics", timeout=5)
        assert err.value.code == 500 and err.value.read().decode().count("\n") == 1
        state.update(fail=False, hits=4)
        assert _value(_scrape(address)[0]["kvtier_store_hits"]) == 4
    finally:
        endpoint.close()


def test_families_skip_non_numbers():
    fams = {f.name: f for f in families({"hits": 1, "flag": True, "name": "x",
                                         "tiers": [{"name": "a", "hits": None, "misses": 2}]})}
    assert set(fams) == {"kvtier_store_hits", "kvtier_tier_misses"}


def test_serve_metrics_port_out_of_range_is_one_line_exit_2(tmp_path):
    config = tmp_path / "serve.json"
    config.write_text('{"listen": "unix://%s/s.sock", "metrics": "127.0.0.1:99999"}' % tmp_path)
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "serve.metrics" in lines[0] and "99999" in lines[0], proc.stderr


def test_serve_metrics_port_taken_is_one_line_exit_2(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "serve.json"
        config.write_text('{"listen": "unix://%s/s.sock", "metrics": "127.0.0.1:%d"}' % (tmp_path, port))
        proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--config", str(config)],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "serve.metrics: cannot bind" in lines[0], proc.stderr


def test_tier_codecs_are_in_the_metrics(make_server, tmp_path):
    """Each tier's codec setting is ``kvtier_tier_codec_info``; an ``auto`` tier's choice and its
    inputs are gauges; ``kvtier_tier_coded`` counts the entries a codec stored coded."""
    pytest.importorskip("blosc2")
    import hashlib
    import time

    import numpy as np

    tiers = [{"type": "ram", "capacity": "64MiB"},
             {"type": "fs", "path": str(tmp_path / "fs"), "capacity": "64MiB", "codec": "auto"},
             {"type": "fs", "name": "cold", "path": str(tmp_path / "cold"), "capacity": "64MiB", "codec": "lossless"}]
    server = make_server(store={"tiers": tiers, "element_dtype": "bfloat16"})
    x = np.random.default_rng(0).normal(0, 0.5, 1 << 19).astype(np.float32)
    kv = (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16-like: lossless shrinks it
    with ServerStore(server.address) as c:
        for i in range(3):
            assert c.put(hashlib.sha256(b"codec-%d" % i).digest(), kv.tobytes())
    deadline = time.monotonic() + 30
    while True:  # lower tiers are written behind the put
        fams, _ = _scrape(server.metrics_address)
        done = all(_value(fams["kvtier_tier_puts"], tier=t) >= 3 for t in ("fs", "cold"))
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    info = {(s.labels["tier"], s.labels["codec"]) for s in fams["kvtier_tier_codec_info"].samples}
    assert info == {("ram", "none"), ("fs", "auto"), ("cold", "lossless")}
    assert fams["kvtier_tier_codec_encode_bytes_per_second"].type == "gauge"
    assert _value(fams["kvtier_tier_codec_encode_bytes_per_second"], tier="fs") > 0
    assert _value(fams["kvtier_tier_codec_ratio"], tier="fs") > 1.0
    assert {s.labels["tier"] for s in fams["kvtier_tier_codec_coding"].samples} == {"fs"}
    assert _value(fams["kvtier_tier_coded"], tier="cold") == 3
    assert _value(fams["kvtier_tier_coded"], tier="ram") == 0
