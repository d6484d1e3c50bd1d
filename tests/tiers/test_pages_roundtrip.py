"""vLLM KV pages round trip bit-exactly through every tier (the connector's data path).

The engine's per-layer tensors are laid out as on the CPU backend (``[num_blocks, kv_heads,
block_size, 2 * head_size]``, bf16) and as on CUDA FlashAttention (``[2, num_blocks, ...]``); a
chunk is saved from some blocks through a one-tier store, the pages are wiped, and the chunk is
loaded back into other blocks.
"""

import pytest
import torch

from kvtier.integrations.vllm.pages import PageLayout
from kvtier.policies.registry import make_policy
from kvtier.store import TieredStore

LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 4, 12, 2, 16, 32


def _kv(shape_prefix: tuple[int, ...]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"layer.{i}": torch.randn(*shape_prefix, BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=gen).to(torch.bfloat16)
            for i in range(LAYERS)}


@pytest.mark.parametrize("prefix", [(), (2,)], ids=["cpu-layout", "kv-first-layout"])
def test_pages_round_trip_bit_exact(tier_factory, prefix):
    kv = _kv(prefix)
    layout = PageLayout(kv, BLOCKS, blocks_per_chunk=2)
    tier = tier_factory(capacity=64 << 20)
    policy = None if tier.self_managed else make_policy("lru", capacity_hint=tier.capacity_bytes)
    store = TieredStore([(tier, policy)])
    src_blocks, dst_blocks = [3, 7], [10, 1]
    expected = {name: t.select(len(prefix), 3).clone() for name, t in kv.items()}, \
               {name: t.select(len(prefix), 7).clone() for name, t in kv.items()}
    key = b"k" * 32
    assert store.write(key, layout.chunk_bytes, lambda segs: layout.save(src_blocks, segs))
    store.flush()
    for t in kv.values():
        t.select(len(prefix), 10).zero_()
        t.select(len(prefix), 1).zero_()
    assert store.read(key, lambda segs: layout.load(segs, dst_blocks)) is not None
    for name, t in kv.items():
        assert torch.equal(t.select(len(prefix), 10).view(torch.int16), expected[0][name].view(torch.int16))
        assert torch.equal(t.select(len(prefix), 1).view(torch.int16), expected[1][name].view(torch.int16))
    store.close()


def test_load_skips_blocks_already_computed(tier_factory):
    kv = _kv(())
    layout = PageLayout(kv, BLOCKS, blocks_per_chunk=2)
    tier = tier_factory(capacity=64 << 20)
    policy = None if tier.self_managed else make_policy("lru", capacity_hint=tier.capacity_bytes)
    store = TieredStore([(tier, policy)])
    key = b"s" * 32
    assert store.write(key, layout.chunk_bytes, lambda segs: layout.save([0, 1], segs))
    store.flush()
    sentinel = {name: t[4].clone() for name, t in kv.items()}
    assert store.read(key, lambda segs: layout.load(segs, [4, 5], first=1)) is not None
    for name, t in kv.items():
        assert torch.equal(t[4].view(torch.int16), sentinel[name].view(torch.int16))  # untouched
        assert torch.equal(t[5].view(torch.int16), t[1].view(torch.int16))  # loaded
    store.close()
