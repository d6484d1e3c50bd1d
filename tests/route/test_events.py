"""The KV event subscriber against real ZMQ sockets carrying real vLLM event objects.

vLLM's own ``ZmqEventPublisher`` (PUB + replay ROUTER) publishes ``KVEventBatch``es; a hand-made
PUB/ROUTER pair (same wire format, the same vLLM objects msgspec-encoded) injects a sequence gap
and a publisher restart, which vLLM's publisher cannot be told to produce.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq

from kvtier.harness.services import free_port
from kvtier.route.events import EventSubscriber, decode_batch
from kvtier.route.index import PrefixIndex, chunk_keys

kv = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM not installed")
BS = 4
ENGINE = "http://e"


def _stored(hashes, parent, tokens, medium="GPU"):
    return kv.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                          lora_id=None, medium=medium, lora_name=None)


def _batch(*events):
    return kv.KVEventBatch(ts=time.time(), events=list(events))


async def _until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def _held(index, tokens):
    return [bool(index.holders(k)) for k in chunk_keys(tokens, BS)]


def test_real_vllm_publisher_replay_catch_up_live_updates_and_clear():
    pub_port, replay_port = free_port(), free_port()
    publisher = kv.ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{pub_port}".replace("127.0.0.1", "*"),
                                     replay_endpoint=f"tcp://*:{replay_port}")
    doc = list(range(100, 116))
    try:
        # published before the router exists: only replay can bring these in
        publisher.publish(_batch(_stored([1, 2], None, doc[:8])))
        publisher.publish(_batch(_stored([3], 2, doc[8:12], medium=None), _stored([b"k" * 32], None, doc[:4], "DISK")))
        time.sleep(0.3)

        async def scenario():
            index = PrefixIndex(1000)
            sub = EventSubscriber(ENGINE, f"tcp://127.0.0.1:{pub_port}", index, f"tcp://127.0.0.1:{replay_port}")
            task = asyncio.create_task(sub.run())
            await _until(lambda: sub.last_seq == 1)
            assert _held(index, doc) == [True, True, True, False]
            assert index.holders(chunk_keys(doc, BS)[0]) == {ENGINE: {"GPU", "DISK"}}
            await asyncio.sleep(0.3)  # the SUB socket's subscription reaches the publisher
            publisher.publish(_batch(_stored([4], 3, doc[12:16]), kv.BlockRemoved(block_hashes=[1], medium="GPU")))
            await _until(lambda: sub.last_seq == 2)
            assert _held(index, doc) == [True, True, True, True]
            assert index.holders(chunk_keys(doc, BS)[0]) == {ENGINE: {"DISK"}}
            publisher.publish(_batch(kv.AllBlocksCleared()))
            await _until(lambda: sub.last_seq == 3)
            assert len(index) == 0 and sub.stats["replays"] >= 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(scenario())
    finally:
        publisher.shutdown()


class _FakePublisher:
    """PUB + replay ROUTER with vLLM's wire format; ``send(seq, batch, live)`` controls what goes out."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []

    def send(self, seq: int, batch, live: bool = True) -> None:
        payload = msgspec.msgpack.encode(batch)
        self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def serve_replay(self) -> bool:
        if not self.router.poll(0):
            return False
        client, _, start = self.router.recv_multipart()
        for seq, payload in self.buffer:
            if seq >= int.from_bytes(start, "big"):
                self.router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
        self.router.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))
        return True

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


def test_sequence_gap_is_filled_from_replay_and_restart_drops_the_engine():
    fake = _FakePublisher()
    doc = list(range(16))

    async def scenario():
        index = PrefixIndex(1000)
        sub = EventSubscriber(ENGINE, f"tcp://127.0.0.1:{fake.port}", index, f"tcp://127.0.0.1:{fake.replay_port}")
        task = asyncio.create_task(sub.run())
        await _until(fake.serve_replay)  # the start-up catch-up (nothing yet)
        await asyncio.sleep(0.3)
        fake.send(0, _batch(_stored([1], None, doc[:4])))
        await _until(lambda: sub.last_seq == 0)
        fake.send(1, _batch(_stored([2], 1, doc[4:8])), live=False)  # lost on the PUB socket
        fake.send(2, _batch(_stored([3], 2, doc[8:12])))
        await _until(fake.serve_replay)
        await _until(lambda: sub.last_seq == 2)
        assert sub.stats["gaps"] == 1 and _held(index, doc) == [True, True, True, False]
        # the publisher restarts: sequence numbers start again at 0 and the old blocks are gone
        fake.buffer.clear()
        fake.send(0, _batch(_stored([9], None, doc[:4])))
        await _until(lambda: sub.stats["restarts"] == 1)
        assert _held(index, doc) == [True, False, False, False]
        # garbage takes its sequence number, is counted, and is never fatal
        fake.pub.send_multipart((b"", (1).to_bytes(8, "big"), b"\xc1not msgpack"))
        await _until(lambda: sub.stats["malformed"] == 1)
        fake.send(2, _batch(_stored([10], 9, doc[4:8])))
        await _until(lambda: sub.last_seq == 2)
        assert _held(index, doc) == [True, True, False, False]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(scenario())
    finally:
        fake.close()


def test_decode_accepts_array_like_events_and_rejects_garbage():
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", [7], None, [1, 2, 3, 4], 4, None, "CPU"],
                                           ["BlockRemoved", [7], "CPU"], ["AllBlocksCleared"], 5], None])
    kinds = [k for k, _ in decode_batch(payload)]
    assert kinds == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    with pytest.raises(ValueError):
        decode_batch(msgspec.msgpack.encode({"not": "a batch"}))


def test_kvtier_media_are_read_from_locality_and_ownership():
    """The connector's events name kvtier's pools in vLLM's vocabulary; the router maps them back
    to tiers it weighs (and treats shared pools as loadable by every engine)."""
    from kvtier.route.config import EngineSpec, RouteConfig
    from kvtier.route.index import normalize_medium

    assert normalize_medium("CPU", "LOCAL", None) == "CPU"
    assert normalize_medium("STORAGE", "LOCAL", None) == "STORAGE"
    assert normalize_medium("STORAGE", "REMOTE", "kvtier:redis") == "REDIS"
    assert normalize_medium("CPU", "LOCAL", "kvtier:server/cpu") == "SERVER"
    assert normalize_medium("STORAGE", "REMOTE", "someone-elses-pool") == "STORAGE_REMOTE"
    assert normalize_medium(None) == "GPU"
    cfg = RouteConfig(engines=(EngineSpec("http://127.0.0.1:1"),))
    assert "STORAGE_REMOTE" in cfg.shared_media and cfg.weight_of("STORAGE_REMOTE") < cfg.weight_of("STORAGE")
