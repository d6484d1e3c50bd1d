"""Attacks on a coded server arena (``codec: lossless`` on ``kvtier serve``'s RAM tier).

Real ``kvtier serve`` processes and real clients (no engines). Each test is a defect found by
a hostile client, a careless operator or a racing workload, kept as a regression test:

- an entry larger than the arena (but under the coded arena's raw-byte budget, 16 x) must be
  refused at once, not after evicting every entry the arena holds;
- an entry a reader holds when the coder reaches it must be coded once the reader lets go,
  not re-encoded back to back and then left raw for good;
- a reader whose lease ran out while it decoded (the pages may hold another entry by then) has
  a ``lease_expired`` miss: it must not count the entry corrupt nor delete the key, which may
  hold a good entry written since.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.server import ServerStore
from kvtier.server import protocol as P

from .test_coded_arena import MiB, _arena, _coded, _key, _kv, _raw_decoding
from .test_direct_write import _ask, _wait

pytest.importorskip("blosc2")


def test_an_entry_larger_than_the_arena_is_refused_without_evicting_the_arena(make_server):
    server = make_server(tiers=_arena("4MiB"))  # staging 32 MiB: a 6 MiB write is within quota
    with ServerStore(server.address) as c:
        for i in range(3):
            assert c.put(_key(i), _kv(i))
        assert c.flush(30)
        held = [i for i in range(3) if _key(i) in c]
        assert held == [0, 1, 2]
        assert not c.put(_key(99), _kv(99, 6 * MiB))  # never fits the 4 MiB arena
        assert [i for i in range(3) if _key(i) in c] == held  # nothing evicted for it
        assert c.stats()["tiers"][0]["evictions"] == 0
        for i in held:
            assert c.get(_key(i)) == _kv(i).tobytes()


def _lease_before_coding(c: ServerStore, address: str):
    """A raw-protocol connection holding a lease on a raw (not yet coded) arena entry: its key,
    the socket and the reply. The entry is a promotion from the fs tier: the server promotes it
    into the arena and leases it in the same ``get``, before the coder can have coded it (tried
    on further keys when it did)."""
    for i in range(8):
        assert c.put(_key(i), _kv(i))
        assert c.flush(30)
    for i in range(4):  # the oldest: demoted to fs only
        busy_before = _coded(c)["busy"]
        s = _raw_decoding(address)
        reply = _ask(s, {"op": "get", "key": _key(i)})
        if reply.get("tier") == "fs" and "codec" not in reply:
            return _key(i), s, reply, busy_before
        if reply.get("lease") is not None:
            P.send(s, {"op": "release", "lease": reply["lease"]})
        s.close()
        assert c.flush(30)
    pytest.skip("the coder always coded the promoted entry before its lease")


def test_an_entry_leased_when_the_coder_reaches_it_is_coded_after_the_release(make_server, tmp_path):
    server = make_server(tiers=_arena("4MiB") + [{"type": "fs", "path": str(tmp_path / "fs"), "capacity": "64MiB"}])
    with ServerStore(server.address) as c:
        key, s, reply, busy_before = _lease_before_coding(c, server.address)
        try:
            assert c.flush(60)  # the coder went past the leased entry
            busy = _coded(c)["busy"] - busy_before
            assert busy >= 1
            assert busy <= 2  # not re-encoded back to back while the lease is held
            P.send(s, {"op": "release", "lease": reply["lease"]})
            _wait(lambda: c.stats()["server"]["leases_open"] == 0, what="the lease's release")
            assert c.flush(60)
            again = _ask(s, {"op": "get", "key": key})
            assert again.get("tier") == "ram" and again.get("codec") == 1, again  # coded once the reader let go
            P.send(s, {"op": "release", "lease": again["lease"]})
        finally:
            s.close()
        assert c.get(key) == _kv(int.from_bytes(key[:4], "little")).tobytes()


def test_a_reader_whose_lease_expired_while_decoding_neither_counts_corrupt_nor_deletes(make_server, monkeypatch):
    server = make_server(tiers=_arena("4MiB"), lease_timeout_s=1.0)
    import kvtier.codecs as codecs

    real_decode = codecs.decode_into
    with ServerStore(server.address) as reader, ServerStore(server.address) as other:
        assert other.put(_key(1), _kv(1)) and other.flush(30)
        assert _coded(other)["entries_coded"] == 1
        calls = []

        def slow_decode(codec_id, stored, out, itemsize, dtype=None):  # a reader stalled past its lease
            if not calls:
                calls.append(1)
                _wait(lambda: other.stats()["server"]["leases_expired"] >= 1, timeout=30, what="the lease's expiry")
                assert other.delete(_key(1))
                for i in range(2, 8):  # the arena turns over: the leased pages now hold other entries
                    assert other.put(_key(i), _kv(i))
                assert other.put(_key(1), _kv(101))  # and the key a new, good entry
                assert other.flush(30)
            return real_decode(codec_id, stored, out, itemsize, dtype)

        monkeypatch.setattr(codecs, "decode_into", slow_decode)
        out = np.empty(MiB, dtype=np.uint8)
        assert reader.get_into(_key(1), out) is None  # past its lease: a miss
        assert calls
        stats = reader.stats()["client"]
        assert stats["lease_expired"] == 1 and stats["corrupt"] == 0
        monkeypatch.setattr(codecs, "decode_into", real_decode)
        assert other.get(_key(1)) == _kv(101).tobytes()  # the new entry was not deleted


def test_entries_over_an_fs_tier_are_coded_though_their_write_through_copy_pins_them(make_server, tmp_path):
    # the store's write-through copy to fs pins the new entry while it writes the file, just
    # when the coder reaches it: the entry must be coded after that copy, not left raw
    server = make_server(tiers=_arena("64MiB") + [{"type": "fs", "path": str(tmp_path / "fs"), "capacity": "256MiB"}])
    with ServerStore(server.address) as c:
        for i in range(12):
            assert c.put(_key(i), _kv(i))
        assert c.flush(60)
        state = _coded(c)
        assert state["pending"] == 0
        assert state["entries_coded"] == 12, state
        for i in range(12):
            assert c.get(_key(i)) == _kv(i).tobytes()


def test_a_client_whose_codec_library_fails_to_load_misses_without_deleting(make_server, monkeypatch):
    # blosc2 is found (so the client says it decodes) but does not import (a broken install,
    # an ABI mismatch): that is this client's fault, not the entry's; it must not delete the
    # entries every other engine reads
    import kvtier.codecs as codecs
    from kvtier.errors import ConfigError

    server = make_server(tiers=_arena())
    with ServerStore(server.address) as writer:
        assert writer.put(_key(1), _kv(1)) and writer.flush(30)
        assert _coded(writer)["entries_coded"] == 1

        def broken():
            raise ConfigError("codec 'lossless' needs the blosc2 package (ImportError: undefined symbol)")

        monkeypatch.setattr(codecs, "_lib", broken)
        with ServerStore(server.address) as reader:
            assert reader.get(_key(1)) is None
            assert reader.get(_key(1)) is None
            assert reader.stats()["client"]["corrupt"] == 0
        monkeypatch.undo()
        assert writer.get(_key(1)) == _kv(1).tobytes()  # still there for the others


def test_a_failing_coder_is_counted_and_logged_in_bounded_lines_and_entries_stay_raw(tmp_path, monkeypatch, caplog):
    # an encoder that raises on every entry (a library bug, a buffer it refuses): the coder
    # goes on, every entry is served raw, and the log does not get a traceback per write
    import logging

    from kvtier.codecs import Codec
    from kvtier.tiers.ram import RamConfig, RamTier

    def broken(self, raw, itemsize):
        raise RuntimeError("encoder bug")

    monkeypatch.setattr(Codec, "encode", broken)
    tier = RamTier(RamConfig(capacity=16 * MiB, page_size=16 * 1024, pin_memory=False,
                             shm_path=str(tmp_path / "arena"), codec="lossless"))
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.ram"):
            for i in range(40):
                assert tier.put(_key(i), _kv(i, 64 * 1024))
            assert tier.drain(30)
        state = tier.codec_state()
        assert state["errors"] == 40 and state["entries_coded"] == 0
        assert len([r for r in caplog.records if r.name == "kvtier.tiers.ram"]) <= 2
        out = np.empty(64 * 1024, dtype=np.uint8)
        assert tier.get_into(_key(7), out) == out.size and np.array_equal(out, _kv(7, 64 * 1024))
        assert tier.put(_key(99), _kv(99, 64 * 1024)) and tier.drain(30)  # the coder still runs
        assert tier.codec_state()["errors"] == 41
    finally:
        tier.close()


def test_metrics_show_a_coded_arenas_pages_and_its_coder(make_server):
    # tier_capacity_bytes of a coded arena is its raw-byte budget (16 x its pages): an operator
    # needs the pages, their free bytes and the coder's backlog in /metrics to see it fill
    import re
    import urllib.request

    server = make_server(tiers=_arena("16MiB"))
    with ServerStore(server.address) as c:
        for i in range(4):
            assert c.put(_key(i), _kv(i))
        assert c.flush(30)
        body = urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=10).read().decode()

    def value(name: str) -> float:
        found = re.search(rf'^{name}{{tier="ram"}} (\S+)$', body, re.M)
        assert found, f"{name} missing from /metrics"
        return float(found.group(1))

    assert value("kvtier_tier_codec_arena_bytes") == 16 * MiB
    assert 0 < value("kvtier_tier_codec_stored_bytes") < 4 * MiB
    assert value("kvtier_tier_codec_arena_free_bytes") >= 12 * MiB
    assert value("kvtier_tier_codec_entries_coded") == 4 and value("kvtier_tier_codec_pending") == 0
    assert value("kvtier_tier_codec_errors_total") == 0 and value("kvtier_tier_codec_busy_total") >= 0
