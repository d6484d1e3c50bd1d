"""Hostile configuration: alias bombs ("billion laughs"), cycles, deep nesting and oversized files
through the real ``kvtier serve --config`` and ``kvtier route --config`` processes (bounded memory
and time, one line, exit 2); sizes that overflow or are absurd; secrets never echoed; values never
formatted whole into a message."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Literal

import pytest

from kvtier.config import MAX_SIZE, SHOW_CHARS, Range, build, load_mapping, parse_bandwidth, parse_size, secret, show
from kvtier.errors import ConfigError

RSS_BOUND_KB = 200 * 1024  # the CLI with its imports peaks at ~50-75 MiB here; the bomb expanded was 1.5 GB
TIME_BOUND_S = 30.0  # a start on a loaded 2-core machine; the bomb ran 31 s before its MemoryError


def billion_laughs(key: str, levels: int = 9, width: int = 9) -> str:
    """A YAML document of ``levels`` nested aliases, ``width`` uses each (width**levels values
    expanded, ~350 bytes), the last one under ``key``."""
    lines = ['a0: &a0 [' + ", ".join(['"lol"'] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    lines.append(f"{key}: *a{levels - 1}")
    return "\n".join(lines) + "\n"


MERGE_BOMB = "\n".join(
    ["m0: &m0 {x: 1}"] + [f"m{i}: &m{i} {{<<: [{', '.join([f'*m{i - 1}'] * 9)}], y{i}: 1}}" for i in range(1, 9)]
    + ["listen: *m8"]) + "\n"

HOSTILE = {
    "billion laughs under a string key": billion_laughs("listen"),
    "billion laughs under the store": billion_laughs("store"),
    "billion laughs under the engines": billion_laughs("engines"),
    "merge-key bomb": MERGE_BOMB,
    "alias cycle": "listen: &a [*a]\n",
    "deep nesting": "listen: " + "[" * 5000 + "]" * 5000 + "\n",
    "too many values": "".join(f"k{i}: {i}\n" for i in range(30_000)),
    "integer of 5000 digits": "max_connections: 1" + "0" * 5000 + "\n",
}


def _run_measured(argv: list[str], timeout: float = 120.0) -> tuple[int, str, float, int]:
    """(exit code, stderr+stdout, seconds, peak RSS in KiB) of one process, measured by wait4."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = start + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)  # polling interval
    elapsed = time.monotonic() - start
    out = proc.stdout.read().decode(errors="replace")
    proc.stdout.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, out, elapsed, usage.ru_maxrss


@pytest.mark.parametrize("command", ["serve", "route"])
@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_yaml_is_one_line_in_bounded_memory_and_time(tmp_path, command, case):
    """Each hostile file makes the real process exit 2 with one line naming the file and the
    problem, within RSS_BOUND_KB and TIME_BOUND_S, and no traceback."""
    path = tmp_path / "hostile.yaml"
    path.write_text(HOSTILE[case])
    code, out, elapsed, rss_kb = _run_measured([sys.executable, "-m", "kvtier.cli", command, "--config", str(path)])
    lines = out.strip().splitlines()
    assert code == 2, out[-3000:]
    assert len(lines) == 1 and str(path) in lines[0], out
    assert "refused" in lines[0] or "cannot be read" in lines[0], out
    assert "Traceback" not in out and "MemoryError" not in out
    assert len(lines[0]) < 400, lines[0]
    # a child's ru_maxrss can carry the forking parent's peak (a long pytest run): judge it
    # against a trivial child forked the same way
    floor_kb = _run_measured([sys.executable, "-c", "pass"])[3]
    assert rss_kb < max(RSS_BOUND_KB, floor_kb + RSS_BOUND_KB), f"peak RSS {rss_kb / 1024:.0f} MiB"
    assert elapsed < TIME_BOUND_S, f"{elapsed:.1f} s"


def test_a_config_file_over_1_mib_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * 120_000)
    with pytest.raises(ConfigError, match=r"larger than 1048576 bytes \(1 MiB\)$"):
        load_mapping(str(path))


def test_a_plain_config_still_loads_with_aliases_used_sparingly(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("base: &ram {type: ram, capacity: 64MiB}\nstore: {tiers: [*ram]}\n")
    assert load_mapping(str(path))["store"]["tiers"][0]["capacity"] == "64MiB"


# ------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("value, needle", [
    ("1" + "0" * 310 + "GB", "larger than the largest size"),
    ("1" + "0" * 5000, "cannot read"),
    ("1" * 1_000_000 + "GB", "cannot read"),
    (2**61, "larger than the largest size"),
    (10**5000, "larger than the largest size"),
    (1e300, "larger than the largest size"),
    (float("inf"), "finite"),
    (float("nan"), "finite"),
    ("inf", "cannot read"),
    ("nan GB", "cannot read"),
    ("-1GB", "cannot read"),
    (-1, "negative"),
    ("1048577TiB", "larger than the largest size"),
    ("1.5 PB", "unknown unit"),
    (True, "expected a byte size"),
], ids=lambda v: show(v)[:30])
def test_parse_size_refuses_overflowing_and_absurd_values_in_one_short_line(value, needle):
    with pytest.raises(ConfigError) as info:
        parse_size(value, "capacity")
    msg = str(info.value)
    assert msg.startswith("capacity: ") and needle in msg and "\n" not in msg, msg
    assert len(msg) < 250, msg


@pytest.mark.parametrize("value, expected", [
    ("1048576TiB", MAX_SIZE), ("1.5GB", 1_500_000_000), ("0.5KiB", 512), ("0.1KiB", 102), ("2 GiB", 2 * 1024**3),
    (4096, 4096), (4096.9, 4096), ("0", 0), ("123456789012345678", 123456789012345678),
])
def test_parse_size_is_exact_up_to_the_bound(value, expected):
    assert parse_size(value) == expected


def test_fleet_load_with_an_overflowing_size_is_one_line_exit_2():
    huge = "1" + "0" * 310 + "GB"
    for args in (["--model-size", huge, "--bandwidth", "1GB/s"], ["--model-size", "1GB", "--bandwidth", huge + "/s"]):
        proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "fleet-load", "--pods", "2", *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "larger than the largest size" in proc.stderr


def test_bandwidth_is_bounded_too():
    with pytest.raises(ConfigError, match="larger than the largest size"):
        parse_bandwidth("1" + "0" * 310 + "GB/s")


# ------------------------------------------------------------------------------------ secrets

SECRET_VALUE = 982734561


@pytest.mark.parametrize("token", [SECRET_VALUE, [SECRET_VALUE], {"v": SECRET_VALUE}, 9.82734561e8])
def test_serve_never_echoes_a_token_of_the_wrong_type(tmp_path, token):
    path = tmp_path / "serve.yaml"
    path.write_text(json.dumps({"listen": f"unix://{tmp_path}/s.sock", "token": token}))
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "serve.token" in proc.stderr and "98273456" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("extra, field", [
    ({"server_token": SECRET_VALUE}, "server_token"),
    ({"tiers": [{"type": "redis", "url": "redis://127.0.0.1:1", "password": SECRET_VALUE}]}, "password"),
    ({"tiers": [{"type": "s3", "bucket": "b", "secret_key": SECRET_VALUE}]}, "secret_key"),
])
def test_connector_and_tier_secrets_are_never_echoed(extra, field):
    from kvtier.integrations.vllm.config import ConnectorConfig

    with pytest.raises(ConfigError) as info:
        ConnectorConfig.from_extra_config(extra)
    msg = str(info.value)
    assert field in msg and str(SECRET_VALUE) not in msg and "hidden" in msg, msg


@dataclasses.dataclass(frozen=True)
class Hidden:
    """Secret fields of each kind a config can declare."""

    pin: int = dataclasses.field(default=1, metadata={"range": Range(lo=1, hi=9), "secret": True})
    auth_key: Literal["alpha", "beta"] = "alpha"
    api_key: str = secret("")


def test_a_secret_field_out_of_range_or_off_its_choices_is_not_echoed():
    for mapping in ({"pin": SECRET_VALUE}, {"auth_key": str(SECRET_VALUE)}, {"api_key": SECRET_VALUE}):
        with pytest.raises(ConfigError) as info:
            build(Hidden, mapping)
        assert str(SECRET_VALUE) not in str(info.value) and "Hidden." in str(info.value), str(info.value)
    assert "s3cr3t" not in repr(Hidden(api_key="s3cr3t"))


# ------------------------------------------------------------------------------- long values


@pytest.mark.parametrize("mapping", [
    {"listen": ["x" * 1000] * 1000},
    {"listen": "unix://" + "x" * 100_000},
    {"listen": "bogus" + "x" * 100_000},
    {"metrics": "h" * 100_000},
    {"max_connections": "9" * 100_000},
    {"hello_timeout_s": "1" * 100_000},
    {"x" * 100_000: 1},
])
def test_a_huge_value_is_shown_cut_short(mapping):
    from kvtier.server.server import ServeConfig

    with pytest.raises(ConfigError) as info:
        ServeConfig.from_mapping(mapping)
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 2 * SHOW_CHARS + 300, msg[:500]
