"""Batched page copies (``PageLayout.gather`` / ``begin_load``), on CPU, with both copy engines.

The ``torch`` engine is the code CUDA runs (indexed copies into a staging buffer); on CPU its
staging buffer is host memory and there is no device copy, so these tests exercise its plan,
ordering and error paths. The ``host`` engine (the CPU default) must write the same bytes.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvtier.errors import CorruptEntry
from kvtier.integrations.vllm.pages import ENTRY_FORMAT, PageLayout

# aten ops that move bytes (views, reshapes and index-tensor creation move none)
_COPY_OPS = {"copy_", "index_select", "index_copy_", "index_copy", "index_put_", "index_put", "index",
             "_to_copy", "gather", "scatter_", "take", "clone"}


class _CountCopies(TorchDispatchMode):
    """Counts byte-moving aten calls made while active."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in _COPY_OPS:
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def _flash_llama(num_blocks: int, layers: int = 32) -> dict[str, torch.Tensor]:
    """Llama-3-8B per-layer KV in FlashAttention layout: [2, blocks, 16, 8 heads, 128] bf16."""
    gen = torch.Generator().manual_seed(1)
    return {f"model.layers.{i}.self_attn": torch.randint(-2**15, 2**15, (2, num_blocks, 16, 8, 128), generator=gen,
                                                          dtype=torch.int16).view(torch.bfloat16)
            for i in range(layers)}


def _cpu_layout(num_blocks: int = 12, layers: int = 4) -> dict[str, torch.Tensor]:
    """vLLM CPU backend: [blocks, kv_heads 2, block 16, 2*head 64] bf16."""
    gen = torch.Generator().manual_seed(2)
    return {f"l{i}": torch.randint(-2**15, 2**15, (num_blocks, 2, 16, 64), generator=gen,
                                   dtype=torch.int16).view(torch.bfloat16) for i in range(layers)}


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).reshape(-1).numpy()


def test_entry_format_is_versioned():
    assert "block-major" in ENTRY_FORMAT


@pytest.mark.parametrize("engine", ["host", "torch"])
@pytest.mark.parametrize("flash", [False, True], ids=["cpu", "flash"])
def test_entry_is_block_major(engine, flash):
    """Entry bytes = for each block, for each layer, the block's pieces (K then V on flash)."""
    kv = _flash_llama(10, layers=3) if flash else _cpu_layout(num_blocks=10)
    layout = PageLayout(kv, 10, blocks_per_chunk=2, engine=engine)
    entry = np.zeros(layout.chunk_bytes, dtype=np.uint8)
    layout.save([5, 2], [entry])
    expected = []
    for block in (5, 2):
        for t in kv.values():
            expected.append(_bytes(t[:, block] if flash else t[block]))
    assert np.array_equal(entry, np.concatenate(expected))
    layout.close()


def test_engines_agree_on_fragmented_segments():
    """Both engines write identical entries into segments of odd (whole-piece) sizes, and load
    them back bit-exactly."""
    kv = _flash_llama(10, layers=3)
    host = PageLayout(kv, 10, blocks_per_chunk=4, engine="torch")
    piece = host.page_bytes
    sizes = [piece, 3 * piece, host.chunk_bytes - 4 * piece]
    outs = {}
    for engine in ("host", "torch"):
        layout = PageLayout(kv, 10, blocks_per_chunk=4, engine=engine)
        segs = [np.zeros(n, dtype=np.uint8) for n in sizes]
        layout.save([1, 7, 3, 0], segs)
        outs[engine] = np.concatenate(segs)
        layout.close()
    assert np.array_equal(outs["host"], outs["torch"])
    host.close()


@pytest.mark.parametrize("engine", ["host", "torch"])
def test_step_round_trip_with_skips_threads_and_a_failed_chunk(engine):
    """A step's chunks saved with one gather and loaded with one scatter: skipped blocks and the
    slots of chunks that failed are never written; the rest is bit-exact."""
    kv = _cpu_layout(num_blocks=24)
    layout = PageLayout(kv, 24, blocks_per_chunk=2, engine=engine)
    src_chunks = [[0, 1], [2, 3], [4, 5]]
    step = layout.gather(src_chunks)
    entries = []
    for i in range(3):
        entry = np.zeros(layout.chunk_bytes, dtype=np.uint8)
        step.copy_to(i, [entry[: layout.page_bytes], entry[layout.page_bytes :]])
        entries.append(entry)
    step.release()
    before = {name: t.clone() for name, t in kv.items()}
    dst_chunks = [[10, 11], [12, 13], [14, 15]]
    load = layout.begin_load(3)
    with pytest.raises(CorruptEntry):  # chunk 2's entry is short: a miss, nothing copied
        load.fill(2, [entries[2][:-1]], dst_chunks[2])
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: load.fill(i, [entries[i]], dst_chunks[i], first=1 if i == 0 else 0), [0, 1]))
    load.scatter()
    load.release()
    for name, t in kv.items():
        assert torch.equal(t[10].view(torch.int16), before[name][10].view(torch.int16))  # skipped
        assert torch.equal(t[11].view(torch.int16), t[1].view(torch.int16))
        assert torch.equal(t[12:14].view(torch.int16), t[2:4].view(torch.int16))
        assert torch.equal(t[14:16].view(torch.int16), before[name][14:16].view(torch.int16))  # failed slot
    layout.close()


def test_gather_copy_calls_are_o_layers():
    """The CUDA path (torch engine) of a step's saves of four 128-token chunks of a
    Llama-3-8B-shaped FlashAttention cache (32 layers, 16-token blocks, K and V pieces) makes
    one indexed copy per layer (+ one for the device-to-host crossing on CUDA), not the
    32 x 8 x 2 x 4 = 2,048 page copies of a per-page path; loads likewise."""
    layers, bpc, chunks = 32, 8, 4
    kv = _flash_llama(64, layers=layers)
    layout = PageLayout(kv, 64, blocks_per_chunk=bpc, engine="torch")
    blocks = [[c * bpc + j for j in range(bpc)] for c in range(chunks)]
    with _CountCopies() as gather_count:
        step = layout.gather(blocks)
    entries = [np.zeros(layout.chunk_bytes, dtype=np.uint8) for _ in range(chunks)]
    for i, entry in enumerate(entries):
        step.copy_to(i, [entry])
    step.release()
    assert gather_count.calls == {"index_select": layers}, gather_count.calls

    load = layout.begin_load(chunks)
    for i, entry in enumerate(entries):
        load.fill(i, [entry], [63 - b for b in blocks[i]], first=0)
    with _CountCopies() as scatter_count:
        load.scatter()
    load.release()
    assert scatter_count.calls == {"index_copy_": layers}, scatter_count.calls
    for t in kv.values():
        assert torch.equal(t[:, 32:64].flip(1).view(torch.int16), t[:, :32].view(torch.int16))

    load = layout.begin_load(chunks)  # with a skipped block: one extra compaction, still O(layers)
    load.fill(0, [entries[0]], blocks[0], first=3)
    with _CountCopies() as skip_count:
        load.scatter()
    load.release()
    assert skip_count.total <= layers + 1, skip_count.calls
    layout.close()


def test_host_engine_is_rejected_for_device_tensors_and_unknown_engines():
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError):
        PageLayout(_cpu_layout(), 12, 2, engine="dma")


def test_bad_block_ids_raise_before_copying():
    kv = _cpu_layout()
    layout = PageLayout(kv, 12, 2, engine="torch")
    with pytest.raises(ValueError):
        layout.gather([[0, 12]])
    with pytest.raises(ValueError):
        layout.gather([[0]])
    layout.close()


@pytest.mark.parametrize("group_chunks", [1, 2, 3])
def test_staging_is_bounded_steps_move_in_groups(group_chunks):
    """With staging for fewer chunks than a step holds, the step moves in groups (each one
    indexed copy per layer) and still round trips bit-exactly, skipped blocks untouched."""
    kv = _cpu_layout(num_blocks=24)
    probe = PageLayout(kv, 24, blocks_per_chunk=2, engine="torch")
    layout = PageLayout(kv, 24, blocks_per_chunk=2, engine="torch",
                        max_staging_bytes=group_chunks * probe.chunk_bytes)
    probe.close()
    assert layout.group_chunks == group_chunks
    src = [[0, 1], [2, 3], [4, 5], [6, 7]]
    with _CountCopies() as count:
        step = layout.gather(src)
    groups = -(-4 // group_chunks)
    assert count.calls == {"index_select": 4 * groups}
    entries = [np.zeros(layout.chunk_bytes, dtype=np.uint8) for _ in src]
    for i, entry in enumerate(entries):
        step.copy_to(i, [entry])
    step.release()
    before = {name: t.clone() for name, t in kv.items()}
    load = layout.begin_load(4)
    dst = [[12, 13], [14, 15], [16, 17], [18, 19]]
    for i in (3, 0, 2):  # slot 1 never filled (a miss)
        load.fill(i, [entries[i]], dst[i], first=1 if i == 2 else 0)
    load.scatter()
    load.release()
    for name, t in kv.items():
        assert torch.equal(t[12:14].view(torch.int16), t[0:2].view(torch.int16))
        assert torch.equal(t[14:17].view(torch.int16), before[name][14:17].view(torch.int16))  # miss, skip
        assert torch.equal(t[17].view(torch.int16), t[5].view(torch.int16))
        assert torch.equal(t[18:20].view(torch.int16), t[6:8].view(torch.int16))
    layout.close()


def test_load_staging_holds_the_step_not_a_full_group():
    """A one-chunk load takes staging for one chunk, not for a whole group (with background
    loads every request in flight holds its own staging: a full group each, 256 MiB of device
    and pinned memory on CUDA, would run the device out of memory)."""
    kv = _cpu_layout(num_blocks=24)
    layout = PageLayout(kv, 24, blocks_per_chunk=2, engine="torch")
    assert layout.group_chunks > 3
    entry = np.zeros(layout.chunk_bytes, dtype=np.uint8)
    for n in (1, 3):
        load = layout.begin_load(n)
        load.fill(0, [entry], [20, 21])
        assert load._groups[0].staging.blocks == n * layout.blocks_per_chunk
        load.release()
        layout._buffers.clear()  # the next take must size a new buffer
    layout.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a thread affinity of two CPUs or more")
def test_copy_threads_only_where_the_building_thread_may_run_on_several_cores():
    """A CPU engine may bind its thread to one core (vLLM's CPU worker with libiomp or libgomp
    preloaded) and the copy threads would inherit it: then there are none (taking turns on one
    core splits nothing); with two cores or more there are."""
    def build(cpus):
        os.sched_setaffinity(0, cpus)  # this (pool) thread only
        return PageLayout(_cpu_layout(), 12, blocks_per_chunk=2, engine="host")

    cpus = sorted(os.sched_getaffinity(0))
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(build, {cpus[0]}).result()._pool is None
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(build, set(cpus[:2])).result()._pool is not None


def test_unsplit_copies_keep_the_gil_on_the_engines_thread_and_release_it_on_others(monkeypatch):
    """The engine's thread (the one that built the layout) must not let go of the GIL for a
    copy: a writer thread could take it, and the engine would wait to get it back. Any other
    thread (a load or write-back thread) lets go of it, so the engine's thread can run."""
    import kvtier.integrations.vllm.pages as pages

    seen = []
    real = pages.copy_pairs
    monkeypatch.setattr(pages, "copy_pairs", lambda pairs, release_gil=True: (seen.append(release_gil),
                                                                             real(pairs, release_gil))[1])
    kv = _cpu_layout()
    layout = PageLayout(kv, 12, blocks_per_chunk=2, engine="host", copy_threads=2)
    entry = np.zeros(layout.chunk_bytes, dtype=np.uint8)
    layout.save([0, 1], [entry])  # small: unsplit
    with ThreadPoolExecutor(1) as pool:
        out = np.zeros_like(entry)
        pool.submit(layout.save, [0, 1], [out]).result()
    assert seen == [False, True]
    assert np.array_equal(entry, out) and entry.any()
