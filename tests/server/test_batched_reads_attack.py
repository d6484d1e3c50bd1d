"""Hostile review of batched reads (``get_many``/``release_many``, ``ServerStore.read_many``,
``KVTierWorker._read_many``, the demo's ``kvtier-serve`` setting).

Real ``kvtier serve`` processes (``make_server``) and real clients throughout; a forged reply is
a real reply edited on its way into the client (``_forge``), an older server is the real one
seen through a filter that drops what it would not know. Tests that pass document rules that
hold; ``xfail(strict=True)`` tests name a defect and pass (as XPASS -> failure) once it is fixed.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec
from kvtier.integrations.vllm.worker import KVTierWorker
from kvtier.keys import KEY_BYTES, WorkerShare, chunk_keys
from kvtier.server import ServerStore
from kvtier.server import protocol as P
from tests.integration.test_async_saves import GEOMETRY, NUM_BLOCKS, _kv_caches, _pages, _same, _saves
from tests.server.test_direct_write import _ask, _key, _payload, _raw, _reserve, _server_stats, _wait
from tests.server.test_hardening import _wait_stopped

MiB = 1 << 20
ARENA_8M = [{"type": "ram", "capacity": "8MiB", "page_size": "64KiB", "policy": "lru"}]


def _collect(out: dict):
    def consume(i: int, segments) -> None:
        assert i not in out, f"consume called twice for index {i}"
        out[i] = b"".join(bytes(s) for s in segments)
    return consume


def _forge(monkeypatch, c: ServerStore, edit) -> list[dict]:
    """Edit each real ``get_many`` reply with ``edit(answer)`` before the client sees it; the
    messages the client sent are recorded (returned list)."""
    real, sent = c._call, []

    def call(message, deadline, reply=True):
        sent.append(message)
        answer = real(message, deadline, reply)
        if message["op"] == "get_many" and answer is not None:
            answer = edit(answer)
        return answer

    monkeypatch.setattr(c, "_call", call)
    return sent


def _leases_back(address: str, timeout: float = 10.0) -> None:
    _wait(lambda: _server_stats(address)["server"]["leases_open"] == 0, timeout, "leases_open == 0")


# ------------------------------------------------------------------------------ holds: the client


def test_duplicate_keys_in_one_batch_each_get_their_own_bytes_and_every_lease_comes_back(make_server):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        data = {i: _payload(i, 65536 * i + 13).tobytes() for i in (1, 2)}
        assert c.put(_key(1), data[1]) and c.put(_key(2), data[2])
        order = [1, 2, 1, 3, 1, 2]
        got: dict = {}
        assert c.read_many([_key(i) for i in order], _collect(got)) == ["ram", "ram", "ram", None, "ram", "ram"]
        assert got == {j: data[k] for j, k in enumerate(order) if k != 3}
        assert c.stats()["server"]["leases_open"] == 0
        # the pages are reusable: delete both and fill the arena to the last page
        assert c.delete(_key(1)) and c.delete(_key(2))
        fill = [(_key(100 + j), bytes([j]) * MiB) for j in range(8)]
        assert c.put_many(fill) == [True] * 8


def test_a_delete_and_overwrite_during_the_copies_do_not_change_the_leased_bytes(make_server):
    """While ``consume`` copies item 0, another client deletes every key of the batch and writes
    the arena full: the later items' pages are leased, so their bytes are still the originals."""
    server = make_server(tiers=ARENA_8M)
    originals = {i: _payload(i, MiB) for i in range(3)}
    with ServerStore(server.address) as c, ServerStore(server.address) as other:
        assert c.put_many([(_key(i), originals[i]) for i in range(3)]) == [True] * 3
        got: dict = {}
        stored_meanwhile: list = []

        def consume(i, segments):
            if i == 0:
                for k in range(3):
                    assert other.delete(_key(k))
                stored_meanwhile.extend(other.put_many([(_key(50 + j), bytes([0xEE]) * MiB) for j in range(8)]))
            got[i] = b"".join(bytes(s) for s in segments)

        assert c.read_many([_key(i) for i in range(3)], consume) == ["ram"] * 3
        assert {i: got[i] for i in range(3)} == {i: originals[i].tobytes() for i in range(3)}
        assert stored_meanwhile.count(True) <= 5  # three pinned MiB were not handed out
        assert c.stats()["server"]["leases_open"] == 0
        assert c.put_many([(_key(90 + j), b"z" * MiB) for j in range(3)]) == [True] * 3  # freed now


def test_a_batch_whose_pages_were_reused_after_the_lease_expired_is_all_misses(make_server):
    """The last item's copy is slow; the server reaps the leases and another client overwrites
    the pages meanwhile: no item of the batch is a hit, though consume saw them."""
    server = make_server(tiers=[{"type": "ram", "capacity": "2MiB", "page_size": "64KiB", "policy": "lru"}],
                         lease_timeout_s=0.3)
    with ServerStore(server.address) as c, ServerStore(server.address) as other:
        assert c.put_many([(_key(i), bytes([i + 1]) * MiB) for i in range(2)]) == [True] * 2
        seen: dict = {}

        def consume(i, segments):
            if i == 1:
                _wait(lambda: other.stats()["server"]["leases_expired"] >= 2, 5, "reaped")
                assert other.delete(_key(0)) and other.delete(_key(1))
                assert other.put(_key(7), b"\xee" * (2 * MiB))
            seen[i] = b"".join(bytes(s) for s in segments)

        assert c.read_many([_key(0), _key(1)], consume) == [None, None]
        assert sorted(seen) == [0, 1] and b"\xee" in seen[1]  # really reused under the copy
        assert c.stats()["client"]["lease_expired"] == 1


def test_a_consume_that_raises_on_a_coded_entry_still_gives_every_lease_back(make_server):
    pytest.importorskip("blosc2")
    tiers = [{"type": "ram", "capacity": "8MiB", "page_size": "16KiB", "policy": "lru", "codec": "lossless"}]
    server = make_server(tiers=tiers)
    kv = (np.arange(MiB // 2, dtype=np.uint16) % 509).astype(np.uint16).view(np.uint8)
    with ServerStore(server.address) as c:
        assert c.put(_key(1), kv) and c.flush(30)
        assert c.stats()["tiers"][0]["codec"]["entries_coded"] == 1

        def consume(i, segments):
            raise RuntimeError(f"boom {i}")

        with pytest.raises(RuntimeError, match="boom 0"):
            c.read_many([_key(1), _key(1)], consume)
        assert c.stats()["server"]["leases_open"] == 0


def test_forged_extents_are_misses_never_exceptions_and_the_real_leases_go_back(make_server, monkeypatch):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        assert c.put_many([(_key(i), bytes([i]) * 4096) for i in range(6)]) == [True] * 6
        size = c._map.arena.size
        bad = [[[size - 10, 100]], [["a", 1]], [[-1, 5]], None, [[0, 4096, 1]]]

        def edit(answer):
            for item, extents in zip(answer["items"], bad):
                if extents is None:
                    del item["extents"]
                else:
                    item["extents"] = extents
            return answer

        sent = _forge(monkeypatch, c, edit)
        got: dict = {}
        assert c.read_many([_key(i) for i in range(6)], _collect(got)) == [None] * 5 + ["ram"]
        assert got == {5: bytes([5]) * 4096}
        released = [m for m in sent if m["op"] == "release_many"]
        assert len(released) == 1 and len(released[0]["leases"]) == 6
        assert c.stats()["server"]["leases_open"] == 0


def test_forged_duplicate_leases_cost_at_most_the_lease_timeout(make_server, monkeypatch):
    """A reply naming one lease twice: the client releases what it was told; the lease it was
    not told of is reaped by the server, and the client keeps working."""
    server = make_server(tiers=ARENA_8M, lease_timeout_s=0.5)
    with ServerStore(server.address) as c:
        assert c.put_many([(_key(i), bytes([i]) * 4096) for i in range(2)]) == [True] * 2

        def edit(answer):
            answer["items"][1]["lease"] = answer["items"][0]["lease"]
            return answer

        _forge(monkeypatch, c, edit)
        got: dict = {}
        assert c.read_many([_key(0), _key(1)], _collect(got)) == ["ram", "ram"]
        assert got == {0: b"\0" * 4096, 1: b"\1" * 4096}
        _leases_back(server.address, 5)
        monkeypatch.undo()
        assert c.read_many([_key(0)], lambda i, s: None) == ["ram"]


def test_a_batch_past_the_client_deadline_is_all_misses_and_the_server_frees_its_leases(make_server):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address, timeout=0.5) as c:
        assert c.put_many([(_key(i), bytes([i]) * 4096) for i in range(3)]) == [True] * 3
        os.killpg(server.proc.pid, 19)  # SIGSTOP: the reply comes late
        try:
            _wait_stopped(server.proc.pid)  # a stop is delivered asynchronously: a loaded machine may still answer first
            assert c.read_many([_key(i) for i in range(3)], lambda i, s: pytest.fail("consumed")) == [None] * 3
        finally:
            os.killpg(server.proc.pid, 18)  # SIGCONT
        assert c.stats()["client"]["timeouts"] >= 1
    _leases_back(server.address)


# ------------------------------------------------------------------------------ holds: the server


def test_release_many_cannot_release_another_connections_leases_and_junk_is_refused(make_server):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        assert c.put(_key(1), b"q" * 4096)
    a, b = _raw(server.address), _raw(server.address)
    try:
        lease = _ask(a, {"op": "get_many", "keys": [_key(1)]})["items"][0]["lease"]
        P.send(b, {"op": "release_many", "leases": [lease, lease, -(1 << 63), (1 << 64) - 1]})
        for junk in ([[lease]], [float(lease)], [None], [lease, "x"], list(range(65))):
            reply = _ask(b, {"op": "release_many", "leases": junk})
            assert not reply["ok"] and reply["error"] == P.MALFORMED, (junk, reply)
        assert _ask(b, {"op": "lookup", "keys": [_key(1)]})["n"] == 1
        assert _server_stats(server.address)["server"]["leases_open"] == 1  # still a's
        P.send(a, {"op": "release_many", "leases": [lease]})
        assert _ask(a, {"op": "lookup", "keys": [_key(1)]})["n"] == 1
        assert _server_stats(server.address)["server"]["leases_open"] == 0
    finally:
        a.close()
        b.close()


def test_a_malformed_get_many_takes_no_lease_even_for_its_valid_keys(make_server):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        assert c.put(_key(1), b"q" * 4096)
    s = _raw(server.address)
    try:
        for keys in ([_key(1), 5], [_key(1), None], [_key(1), _key(1)[:-1]], [_key(1)] * 65):
            reply = _ask(s, {"op": "get_many", "keys": keys})
            assert not reply["ok"] and reply["error"] == P.MALFORMED
        assert _server_stats(server.address)["server"]["leases_open"] == 0
    finally:
        s.close()


def test_the_lease_cap_bounds_a_connection_across_batches_and_its_end_frees_them(make_server):
    server = make_server(tiers=ARENA_8M, max_leases_per_client=4)
    with ServerStore(server.address) as c:
        assert c.put(_key(1), b"q" * 4096)
    s = _raw(server.address)
    try:
        first = _ask(s, {"op": "get_many", "keys": [_key(1)] * P.MAX_BATCH_ITEMS})["items"]
        assert sum(it["tier"] is not None for it in first) == 4
        second = _ask(s, {"op": "get_many", "keys": [_key(1)] * 8})["items"]
        assert all(it == {"tier": None} for it in second)
        assert _ask(s, {"op": "get", "key": _key(1)}) == {"ok": True, "tier": None}
        stats = _server_stats(server.address)["server"]
        assert stats["leases_open"] == 4 and stats["lease_quota"] == 60 + 8 + 1
    finally:
        s.close()
    _leases_back(server.address)


def test_a_get_many_during_an_open_direct_write_aborts_it_and_is_served(make_server):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        assert c.put(_key(1), b"q" * 4096)
    s = _raw(server.address)
    try:
        assert _reserve(s, _key(2), 8192)["status"] == "ok"
        reply = _ask(s, {"op": "get_many", "keys": [_key(1), _key(2)]})
        assert reply["ok"] and reply["items"][0]["tier"] == "ram" and reply["items"][1] == {"tier": None}
        P.send(s, {"op": "release_many", "leases": [reply["items"][0]["lease"]]})
        assert _ask(s, {"op": "lookup", "keys": [_key(2)]})["n"] == 0
    finally:
        s.close()
    stats = _server_stats(server.address)["server"]
    assert stats["direct_aborted"] >= 1 and stats["leases_open"] == 0


# ------------------------------------------------------------------------------ defects: the client


def test_a_hit_without_a_valid_lease_is_not_consumed(make_server, monkeypatch):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        assert c.put_many([(_key(i), bytes([i]) * 4096) for i in range(3)]) == [True] * 3

        def edit(answer):
            items = answer["items"]
            items[0]["lease"], items[1]["lease"] = True, "7"
            del items[2]["lease"]
            return answer

        _forge(monkeypatch, c, edit)
        got: dict = {}
        found = c.read_many([_key(i) for i in range(3)], _collect(got))
        assert found == [None, None, None] and got == {}


def test_a_tier_that_is_not_a_string_is_never_returned(make_server, monkeypatch):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        assert c.put_many([(_key(i), bytes([i]) * 4096) for i in range(3)]) == [True] * 3

        def edit(answer):
            for item, tier in zip(answer["items"], (["ram"], 7, True)):
                item["tier"] = tier
            return answer

        _forge(monkeypatch, c, edit)
        found = c.read_many([_key(i) for i in range(3)], lambda i, s: None)
        assert all(t is None or isinstance(t, str) for t in found), found


def test_read_many_hits_what_reads_one_by_one_hit_under_a_small_lease_cap(make_server):
    server = make_server(tiers=ARENA_8M, max_leases_per_client=4)
    with ServerStore(server.address) as c:
        keys = [_key(i) for i in range(6)]
        assert c.put_many([(k, b"x" * 4096) for k in keys]) == [True] * 6
        assert [c.read(k, lambda s: None) for k in keys] == ["ram"] * 6
        assert c.read_many(keys, lambda i, s: None) == ["ram"] * 6


def test_read_many_against_a_server_without_get_many_still_hits(make_server, monkeypatch):
    server = make_server(tiers=ARENA_8M)
    old_hello = {"ok", "version", "server_id", "arena", "staging", "page_size", "tiers", "lease_timeout_s",
                 "direct_writes", "arena_codec", "batch_writes", "write_share"}
    real_recv, real_send_by = P.recv, P.send_by

    def recv(sock, *args, **kwargs):  # what an older server's hello would not say
        reply = real_recv(sock, *args, **kwargs)
        if isinstance(reply, dict) and "server_id" in reply and "arena" in reply:
            reply = {k: v for k, v in reply.items() if k in old_hello}
        return reply

    def send_by(sock, message, deadline):  # ops an older server does not know
        if message.get("op") in ("get_many", "release_many"):
            message = {**message, "op": message["op"] + "@unknown"}
        return real_send_by(sock, message, deadline)

    monkeypatch.setattr(P, "recv", recv)
    monkeypatch.setattr(P, "send_by", send_by)
    with ServerStore(server.address) as c:
        assert c.put(_key(1), b"x" * 4096)
        assert c.read(_key(1), lambda s: None) == "ram"
        got: dict = {}
        assert c.read_many([_key(1)], _collect(got)) == ["ram"] and got == {0: b"x" * 4096}


def test_one_bad_key_does_not_cost_the_rest_of_the_batch(make_server):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        assert c.put(_key(1), b"x" * 4096)
        short = b"k" * (KEY_BYTES - 1)
        assert c.read(short, lambda s: None) is None  # a miss, not an exception
        assert c.read_many([_key(1), short], lambda i, s: None) == ["ram", None]


# ------------------------------------------------------------------------------ the worker

def _server_worker(address: str) -> tuple[KVTierWorker, dict[str, torch.Tensor]]:
    config = ConnectorConfig.from_extra_config({"server": address, "transfer_mode": "sync"})
    worker = KVTierWorker(config, GEOMETRY, WorkerShare())
    assert isinstance(worker.store, ServerStore) and worker.store.reads_in_batches
    kv = _kv_caches(0)
    worker.register_kv_caches(kv)
    return worker, kv


def _doc_keys(n: int) -> list[bytes]:
    return chunk_keys(list(range(n * GEOMETRY.chunk_tokens)), b"ns", GEOMETRY.chunk_tokens)


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_the_worker_recomputes_from_a_wrong_size_entry_on_and_deletes_it(make_server, bad):
    server = make_server(tiers=ARENA_8M)
    worker, kv = _server_worker(server.address)
    try:
        keys, src = _doc_keys(3), list(range(0, 6))
        before = _pages(kv, src)
        worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys, src)))
        store = worker.store
        assert store.lookup([worker._key(k) for k in keys]) == 3
        wrong = worker._key(keys[bad])
        assert store.delete(wrong) and store.put(wrong, b"\x7f" * (worker._layout.chunk_bytes - 2))
        batches = store.stats()["server"]["get_batches"]
        dst = list(range(10, 16))
        for t in kv.values():
            t[dst] = 0
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r2", keys, 0, dst, 0)]))
        assert worker.failed_blocks() == set(dst[2 * bad:])
        assert _same(before, _pages(kv, src))
        assert _same([p[: 2 * bad] for p in before], _pages(kv, dst[: 2 * bad]))  # the good prefix loaded
        stats = store.stats()
        assert stats["server"]["get_batches"] == batches + 1 and stats["server"]["leases_open"] == 0
        held = [store.lookup([worker._key(k)]) for k in keys]
        assert held == [int(i != bad) for i in range(3)]  # the wrong-size entry was deleted, only it
    finally:
        worker.close()


def test_the_worker_treats_a_missing_first_chunk_as_a_failed_load_of_everything(make_server):
    server = make_server(tiers=ARENA_8M)
    worker, kv = _server_worker(server.address)
    try:
        keys = _doc_keys(3)
        worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys, list(range(0, 6)))))
        assert worker.store.delete(worker._key(keys[0]))
        dst = list(range(10, 16))
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r2", keys, 0, dst, 0)]))
        assert worker.failed_blocks() == set(dst)
        assert worker.store.lookup([worker._key(k) for k in keys[1:]]) == 2  # a miss deletes nothing
        assert worker.store.stats()["server"]["leases_open"] == 0
    finally:
        worker.close()


def test_a_forged_tier_costs_the_worker_a_recompute_not_a_crash(make_server, monkeypatch):
    server = make_server(tiers=ARENA_8M)
    worker, kv = _server_worker(server.address)
    try:
        keys = _doc_keys(2)
        worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys, list(range(0, 4)))))

        def edit(answer):
            answer["items"][0]["tier"] = ["ram"]
            return answer

        _forge(monkeypatch, worker.store, edit)
        dst = list(range(10, 14))
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r2", keys, 0, dst, 0)]))
        assert worker.failed_blocks() == set(dst)
    finally:
        worker.close()


# ------------------------------------------------------------------------------ the demo


def _serve_setting(tmp_path):
    from kvtier.bench import offload

    (setting,) = offload._settings(["kvtier-serve"], [], 4 << 20, tmp_path, None)
    return offload, setting


def test_the_demo_server_is_stopped_when_the_run_fails(tmp_path):
    offload, setting = _serve_setting(tmp_path)
    with pytest.raises(RuntimeError, match="engine failed"):
        with offload._kvtier_serve(setting) as target:
            pid = target._child.pid
            assert target.client.connected
            raise RuntimeError("engine failed")
    _wait(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z",
          10, "the server process gone")


def test_the_demo_never_runs_against_a_server_it_did_not_start(tmp_path, make_server):
    offload, setting = _serve_setting(tmp_path)
    setting.serve_dir.mkdir(parents=True, exist_ok=True)
    foreign = make_server(tiers=ARENA_8M, listen=f"unix://{setting.serve_dir / 'kvtier.sock'}")
    with ServerStore(foreign.address) as c:
        foreign_id = c._map.server_id
    attached = None
    try:
        with offload._kvtier_serve(setting) as target:
            attached = target.client._map.server_id
    except Exception:
        pass  # refusing to start is fine
    assert attached != foreign_id
