"""Subscriber to vLLM's KV event stream (``--kv-events-config`` ZMQ publisher) for one engine.

Wire format (vllm/distributed/kv_events.py): PUB frames ``(topic, seq: 8-byte big-endian,
payload)``; the payload is a msgpack ``KVEventBatch`` = ``[ts, events, dp_rank]`` whose events
are maps tagged ``{"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared", ...}`` (older
array-like encodings ``[tag, field, ...]`` are accepted too). The optional replay endpoint is a
ROUTER: send ``(b"", start_seq)`` from a DEALER, get ``(b"", topic, seq, payload)`` frames and
an end marker with seq -1.

Contracts
---------
* Decoding never imports vLLM and never raises on bad input: a malformed batch, and any
  malformed event inside a good one, is counted and skipped (``stats["malformed"]``, and
  ``on_counts(engine, {"malformed": n})``). The router restarts a subscriber whose ``run`` ends
  with an error anyway (logged, counted).
* On start, and whenever a sequence number is skipped, the subscriber asks the replay endpoint
  (if any) for the missing batches and applies them in order before going on; batches already
  applied are never applied twice. A sequence number going backwards means the publisher
  restarted: the engine's entries are dropped and the stream is taken from there.
* ``resync()`` drops the engine's entries and replays from 0 (used when an engine is re-admitted).
* While ``paused`` (the engine is out), batches are read and their sequence tracked but not applied.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from kvtier.route.index import PrefixIndex, normalize_medium

log = logging.getLogger("kvtier.route.events")
END_SEQ = -1

# positional field order of array-like encodings (vLLM's BlockStored / BlockRemoved)
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                  "kv_cache_spec_sliding_window", "locality", "ownership", "session_id")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")


def _as_event(raw: Any) -> tuple[str, dict[str, Any]] | None:
    """(type, fields) of one encoded event, or None when it is not one we know."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        return (kind, raw) if isinstance(kind, str) else None
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS if kind == "BlockRemoved" else ()
        return kind, dict(zip(names, raw[1:]))
    return None


def decode_batch(payload: bytes) -> list[tuple[str, dict[str, Any]]]:
    """The events of one msgpack ``KVEventBatch`` payload; raises ValueError when malformed."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from exc
    if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KVEventBatch")
    return [e for e in (_as_event(r) for r in batch[1]) if e is not None]


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


_TOKEN_LIMIT = 1 << 32


def _token_ids(value: Any) -> list[int]:
    """An event's token ids: a list of ints in [0, 2**32) (None: no tokens); ValueError else."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError("token_ids is not a list")
    for t in value:
        if type(t) is not int or not 0 <= t < _TOKEN_LIMIT:
            raise ValueError("token id is not an integer in [0, 2**32)")
    return list(value)


def _optional(ev: dict[str, Any], name: str, kind: type) -> Any:
    """Field ``name`` of an event: None or exactly of type ``kind``; ValueError else."""
    value = ev.get(name)
    if value is not None and type(value) is not kind:
        raise ValueError(f"{name} is not {kind.__name__}")
    return value


def _group(ev: dict[str, Any]) -> int | None:
    """An event's ``group_idx``: None or an int >= 0 (vLLM's group list position); ValueError else."""
    group = _optional(ev, "group_idx", int)
    if group is not None and group < 0:
        raise ValueError("group_idx is negative")
    return group


def _apply_one(index: PrefixIndex, engine: str, kind: str, ev: dict[str, Any]) -> None:
    """Apply one decoded event (checked before the index changes); raises on a malformed one.
    Its KV cache group (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``)
    decides how the index counts it (``kvtier.route.index``)."""
    if kind == "BlockStored":
        medium = normalize_medium(ev.get("medium"), ev.get("locality"), ev.get("ownership"))
        tokens = _token_ids(ev.get("token_ids"))
        hashes = [_hashable(h) for h in ev.get("block_hashes") or ()]
        parent = _hashable(ev.get("parent_block_hash"))
        for h in hashes + [parent]:
            hash(h)  # an unhashable block hash is malformed: TypeError before anything is applied
        block_size = ev.get("block_size") or 0
        if type(block_size) is not int:
            raise ValueError("block_size is not an integer")
        lora = ev.get("lora_name") or ""
        if not isinstance(lora, str):
            raise ValueError("lora_name is not a string")
        group = _group(ev)
        spec_kind = _optional(ev, "kv_cache_spec_kind", str)
        window = _optional(ev, "kv_cache_spec_sliding_window", int)
        index.apply_stored(engine, hashes, parent, tokens, block_size, medium, lora, group=group, kind=spec_kind,
                           window=window)
    elif kind == "BlockRemoved":
        medium = normalize_medium(ev.get("medium"), ev.get("locality"), ev.get("ownership"))
        hashes = [_hashable(h) for h in ev.get("block_hashes") or ()]
        for h in hashes:
            hash(h)
        index.apply_removed(engine, hashes, medium, group=_group(ev))
    elif kind == "AllBlocksCleared":
        index.clear_engine(engine)


def apply_events(index: PrefixIndex, engine: str, events: list[tuple[str, dict[str, Any]]]) -> dict[str, int]:
    """Apply decoded events to ``index`` for ``engine``; returns counts per event type.

    Never raises on bad input: an event that is malformed in any way (a token id out of range,
    a field of the wrong type, an unhashable hash) is skipped and counted as ``malformed``,
    and the events after it are still applied."""
    counts: dict[str, int] = {}
    for kind, ev in events:
        counts[kind] = counts.get(kind, 0) + 1
        try:
            _apply_one(index, engine, kind, ev)
        except Exception as exc:  # noqa: BLE001  (any malformed event: counted, skipped, never fatal)
            counts["malformed"] = counts.get("malformed", 0) + 1
            log.debug("malformed %s event from %s skipped: %s", kind, engine, exc)
    return counts


@dataclass
class EventSubscriber:
    """Feeds one engine's KV events into the index (run ``run()`` as a task; ``close()`` to stop)."""

    engine: str
    endpoint: str
    index: PrefixIndex
    replay_endpoint: str | None = None
    topic: str = ""
    replay_timeout_s: float = 2.0
    on_counts: Callable[[str, dict[str, int]], None] | None = None
    paused: bool = False
    last_seq: int = -1
    stats: dict[str, int] = field(default_factory=lambda: {"batches": 0, "replays": 0, "gaps": 0,
                                                            "restarts": 0, "malformed": 0})
    _ctx: zmq.asyncio.Context | None = None
    _sub: Any = None
    _resync: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        """Subscribe, catch up from replay, then apply live batches until cancelled."""
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._sub.connect(self.endpoint)
        try:
            await self._replay_from(0)
            while True:
                if self._resync.is_set():
                    self._resync.clear()
                    self.index.clear_engine(self.engine)
                    self.last_seq = -1
                    await self._replay_from(0)
                if not await self._sub.poll(200):
                    continue
                frames = await self._sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._malformed()
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                await self._on_batch(seq, frames[2], live=True)
        finally:
            self.close()

    def resync(self) -> None:
        """Drop this engine's entries and rebuild them from replay (asynchronously)."""
        self._resync.set()

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _on_batch(self, seq: int, payload: bytes, live: bool) -> None:
        if live and self.last_seq >= 0 and seq < self.last_seq:
            self.stats["restarts"] += 1  # the publisher restarted: its blocks are gone
            self.index.clear_engine(self.engine)
            self.last_seq = -1
            if seq > 0:
                await self._replay_from(0, upto=seq)
        elif seq <= self.last_seq:
            return  # already applied (a replay overlapped the live stream)
        elif live and seq > self.last_seq + 1:
            self.stats["gaps"] += 1
            await self._replay_from(self.last_seq + 1, upto=seq)
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            return
        self.last_seq = seq
        self.stats["batches"] += 1
        if self.paused:
            return
        try:
            events = decode_batch(payload)
        except ValueError:
            self._malformed()
            return
        counts = apply_events(self.index, self.engine, events)
        self.stats["malformed"] += counts.get("malformed", 0)
        if self.on_counts is not None:
            self.on_counts(self.engine, counts)

    def _malformed(self) -> None:
        """Count one malformed message (frames or batch) here and in ``on_counts``."""
        self.stats["malformed"] += 1
        if self.on_counts is not None:
            self.on_counts(self.engine, {"malformed": 1})

    async def _replay_from(self, start: int, upto: int | None = None) -> None:
        """Apply batches [start, upto) from the replay endpoint; no-op without one or on timeout."""
        if self.replay_endpoint is None or self._ctx is None:
            return
        self.stats["replays"] += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart([b"", max(start, 0).to_bytes(8, "big")])
            while True:
                if not await sock.poll(int(self.replay_timeout_s * 1000)):
                    log.warning("kv replay from %s timed out", self.replay_endpoint)
                    return
                frames = await sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self._malformed()
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return
                if upto is None or seq < upto:
                    self._apply(seq, frames[3])
        finally:
            sock.close(linger=0)
