"""What the connector's scheduler side hands its worker side each step, and what comes back.

The scheduler side (``kvtier.integrations.vllm.scheduler``) plans; the worker side
(``kvtier.integrations.vllm.worker``) carries the plan out. Both see the engine's chunk
geometry the same way (``ChunkGeometry``). Everything here is plain data: vLLM moves it
between processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvtier.store import StoreEvent


@dataclass(frozen=True)
class ChunkGeometry:
    """How a request's tokens map to chunks and blocks: ``chunk_tokens`` is a whole number of
    the engine's ``block_size`` blocks (``blocks_per_chunk``)."""

    block_size: int
    chunk_tokens: int

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    def chunk_blocks(self, block_ids: list[int], chunk: int) -> list[int]:
        """The block ids of chunk ``chunk`` in a request's block table (fewer at its end)."""
        bpc = self.blocks_per_chunk
        return block_ids[chunk * bpc : (chunk + 1) * bpc]


@dataclass
class LoadSpec:
    """Load chunks ``first_chunk .. first_chunk+len(keys)-1`` of a request into its blocks.

    ``background``: the worker loads it off the step (vLLM's asynchronous load protocol: the
    request waits in ``WAITING_FOR_REMOTE_KVS`` until the worker reports it in
    ``get_finished``); otherwise the load completes in ``start_load_kv``."""

    req_id: str
    keys: list[bytes]
    first_chunk: int
    block_ids: list[int]  # the request's whole block table
    skip_blocks: int  # blocks at the start of the first chunk that are already computed (or null)
    background: bool = False
    group: int = 0  # the KV cache group (vLLM's hybrid KV cache groups); block_ids are that group's


@dataclass
class SaveSpec:
    """Save one full chunk of a request from its blocks."""

    req_id: str
    key: bytes
    parent: bytes | None
    chunk_index: int
    block_ids: list[int]  # the chunk's blocks (of the group's block table)
    group: int = 0  # the KV cache group


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """What the worker does this step (one LoadSpec/SaveSpec per KV cache group involved).
    ``step``: the scheduler's count of the metadata it built (the worker reports the last it
    carried out in ``KVTierWorkerMetadata.step``)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    step: int = 0


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the store's events of this step and, where the scheduler needs it
    (see ``room.RoomLedger``), the room of the workers' top tiers after step ``step``:
    how many more entries (of the largest the connector stores) each takes without evicting
    anything, the least over the workers (None: not known)."""

    events: list[StoreEvent] = field(default_factory=list)
    step: int = -1
    room: int | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVTierWorkerMetadata":
        if isinstance(other, KVTierWorkerMetadata):
            self.events.extend(other.events)
            if self.step != other.step or self.room is None or other.room is None:
                self.room = None  # every worker must vouch for the same step
            else:
                self.room = min(self.room, other.room)
        return self
