"""Shared pytest fixtures: real servers (redis-server, SeaweedFS) and per-test namespaces.

Servers are session-scoped (started once, on loopback ports, through ``kvtier.harness.procs`` so
they die with this pytest process even when it is SIGKILLed) and skip the requesting test with a
clear reason only when their binary is missing; a server that is installed but does not get
ready is an error, never a skip. Services left behind by an earlier, killed run are reaped when
the session starts. Per-test helpers hand out fresh key prefixes,
buckets and Redis databases so tests never see each other's data.

Other fixture groups may be appended below; keep one section per concern.
"""

from __future__ import annotations

import itertools
import os
import random
import uuid

import pytest

# ---------------------------------------------------------------------------------------------
# Shuffled order (the race check: tests must not depend on the order they run in)


def pytest_addoption(parser) -> None:
    parser.addoption("--shuffle", metavar="SEED", type=int, default=None,
                     help="run the tests in a random order drawn from SEED (print it to repeat an order)")


def pytest_report_header(config) -> str | None:
    seed = config.getoption("--shuffle")
    return None if seed is None else f"test order shuffled with --shuffle {seed}"


def pytest_collection_modifyitems(session, config, items) -> None:
    seed = config.getoption("--shuffle")
    if seed is not None:
        items[:] = shuffled(items, random.Random(seed))
    _skip_bench_runs_on_slow_cpus(items)


def shuffled(items: list, rng: random.Random) -> list:
    """``items`` in a random order that keeps each test file's tests together, and each class's
    within its file: the files in a random order, the classes and free tests of a file in a random
    order, the tests of a class in a random order. A test's neighbours still change from seed to
    seed (the order-dependence this check looks for), while a module- or class-scoped fixture (a
    shared vLLM engine, a server) is set up once per file or class instead of once per test: a
    whole shuffle tore the suite's shared engines down and started them again between tests."""
    files: dict[str, dict[str, list]] = {}
    for item in items:
        path, _, rest = item.nodeid.partition("::")
        group = rest.split("::")[0] if "::" in rest else ""  # a class, or "" for free tests
        files.setdefault(path, {}).setdefault(group, []).append(item)
    out: list = []
    for groups in rng.sample(list(files.values()), len(files)):
        units: list[list] = [[t] for t in groups.pop("", [])] + list(groups.values())
        for unit in rng.sample(units, len(units)):
            out.extend(rng.sample(unit, len(unit)))
    return out


# ---------------------------------------------------------------------------------------------
# Benchmark smoke runs (marker bench_e2e): whole `kvtier bench` runs on real engines


def _skip_bench_runs_on_slow_cpus(items) -> None:
    """Skip the ``bench_e2e`` tests, with the reason, on a CPU without native bf16 unless
    ``KVTIER_BENCH_E2E=1`` (``make test-bench``): there the bf16 engines prefill ~4 x slower and
    these two runs alone take ~12 of the suite's minutes, which CI's 90-minute budget cannot spare."""
    from kvtier.bench.models import native_bf16

    if os.environ.get("KVTIER_BENCH_E2E") == "1" or native_bf16():
        return
    skip = pytest.mark.skip(reason="bench_e2e: this CPU has no native bf16 (engines ~4 x slower); "
                                   "run them with `make test-bench`")
    for item in items:
        if item.get_closest_marker("bench_e2e") is not None:
            item.add_marker(skip)


# ---------------------------------------------------------------------------------------------
# Real servers


def pytest_sessionstart(session) -> None:
    """Kill services whose owner (an earlier test or benchmark run) died without stopping them."""
    from kvtier.harness.procs import reap_stale

    reap_stale()


def pytest_sessionfinish(session, exitstatus) -> None:
    """Stop (and name) services this session started and never stopped: each one is a leak."""
    from kvtier.harness.procs import reap_owned

    leaked = reap_owned()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if leaked and reporter is not None:
        reporter.write_line(f"warning: services left running by the tests, now killed: {', '.join(leaked)}",
                            yellow=True)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A ``RedisService`` (``.url``, ``.port``, ``.stop()``, ``.start()``) for the session."""
    from kvtier.harness.services import BinaryMissing, redis_server as start_redis

    try:
        cm = start_redis(tmp_path_factory.mktemp("redis"))
        service = cm.__enter__()
    except BinaryMissing as exc:
        pytest.skip(f"redis-server unavailable: {exc}")
    try:
        yield service
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """An ``S3Service`` (``.endpoint_url``, ``.bucket``, keys, ``.client()``) backed by weed mini."""
    pytest.importorskip("boto3", reason="boto3 not installed (pip install kvtier[s3])")
    from kvtier.harness.services import BinaryMissing, seaweedfs

    try:
        cm = seaweedfs(tmp_path_factory.mktemp("weed"))
        service = cm.__enter__()
    except BinaryMissing as exc:
        pytest.skip(f"SeaweedFS unavailable: {exc}")
    try:
        yield service
    finally:
        cm.__exit__(None, None, None)


# ---------------------------------------------------------------------------------------------
# Fresh namespaces per test

_redis_dbs = itertools.count(1)  # db 0 is left to ad-hoc use; 64 databases are configured


@pytest.fixture
def key_prefix() -> str:
    """A unique key/object prefix such as ``t-1a2b3c4d/`` for one test."""
    return f"t-{uuid.uuid4().hex[:8]}/"


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of a fresh, empty Redis logical database on the session server (cycles through 1..63)."""
    import redis

    db = 1 + (next(_redis_dbs) - 1) % 63
    url = redis_server.url_for_db(db)
    if not redis_server.running:  # a fault test may have left it stopped
        redis_server.start()
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    return url


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A freshly created, empty bucket on the session S3 server."""
    return s3_server.create_bucket(f"t-{uuid.uuid4().hex[:12]}")
