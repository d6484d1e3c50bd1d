"""``kvtier bench gpu``: the KV page data path (``PageLayout``) beside a pinned memcpy, in one run.

Torch only, no vLLM: runs on a machine that has PyTorch and a GPU but nothing else. KV tensors
are shaped as vLLM allocates them (per layer): FlashAttention ``[2, num_blocks, block_size,
kv_heads, head_dim]`` with Llama-3-8B's shape (32 layers, 8 KV heads, head_dim 128, bf16, 16-token
blocks), an MLA layout ``[num_blocks, block_size, 576]`` (DeepSeek-V3: 61 layers, kv_lora_rank 512
+ rope 64), and on CPU also vLLM's CPU layout ``[num_blocks, kv_heads, 128, 2*head_dim]`` of the
project's ``small`` and ``kv-heavy`` random models.

For each layout and chunk size (128 and 256 tokens), a step of several chunks is

- saved through the real ``PageLayout`` into a kvtier RAM tier (``TieredStore``) and loaded back
  into other blocks; the round trip is checked bit-exactly;
- timed per path: ``per-page`` (the pre-batching algorithm, one copy per (layer, block, piece),
  re-implemented here as the reference), ``batched`` (``PageLayout``'s default engine for the
  device) and on CPU also ``batched-torch`` (the CUDA code path run on CPU tensors); each with
  the number of copy calls it issues per step;
- compared with one large copy of the same bytes: a pinned ``cudaMemcpy`` device-to-host and
  host-to-device on CUDA, one ``memcpy`` on CPU (the bound).

On CUDA it also measures the overlap of saves with compute: a bf16 matmul loop on the compute
stream, timed alone and with a step's save issued on the side stream every iteration.

One JSON document (``--json``) or tables. ``--quick`` shrinks everything (the tests run it on
CPU). Absolute figures are noisy on a shared machine; read the ratios within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from kvtier.output import emit_json, print_table

if TYPE_CHECKING:  # torch (and PageLayout, which needs it) are imported where used: --help needs neither
    import torch

    from kvtier.integrations.vllm.pages import PageLayout


@dataclass(frozen=True)
class Shape:
    """A per-layer KV tensor shape as vLLM allocates it: ``dims(num_blocks)``."""

    name: str
    layers: int
    block_size: int
    kind: str  # "flash" | "mla" | "cpu"
    heads: int = 0
    head_dim: int = 0
    width: int = 0  # mla: latent width

    def dims(self, num_blocks: int) -> tuple[int, ...]:
        if self.kind == "flash":
            return (2, num_blocks, self.block_size, self.heads, self.head_dim)
        if self.kind == "mla":
            return (num_blocks, self.block_size, self.width)
        return (num_blocks, self.heads, self.block_size, 2 * self.head_dim)

    def bytes_per_token(self) -> int:
        per = 2 * self.heads * self.head_dim if self.kind != "mla" else self.width
        return per * 2 * self.layers  # bf16


SHAPES = {
    "llama3-8b-flash": Shape("llama3-8b-flash", 32, 16, "flash", heads=8, head_dim=128),
    "mla-deepseek-v3": Shape("mla-deepseek-v3", 61, 16, "mla", width=576),
    "small-cpu": Shape("small-cpu", 8, 128, "cpu", heads=2, head_dim=64),
    "kv-heavy-cpu": Shape("kv-heavy-cpu", 16, 128, "cpu", heads=16, head_dim=64),
}
GPU_SHAPES = ("llama3-8b-flash", "mla-deepseek-v3")
CPU_SHAPES = ("small-cpu", "kv-heavy-cpu", "llama3-8b-flash")
CHUNK_TOKENS = (128, 256)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier bench gpu``."""
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                        help="where the KV tensors live (auto: cuda when available)")
    parser.add_argument("--shapes", default=None,
                        help=f"comma-separated layouts (default: {','.join(GPU_SHAPES)} on cuda, "
                             f"{','.join(CPU_SHAPES)} on cpu; all: {','.join(SHAPES)})")
    parser.add_argument("--step-tokens", type=int, default=None,
                        help="tokens saved/loaded per step (chunks of one step move together; "
                             "default 2048 on cuda, 1024 on cpu)")
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions per measurement (median)")
    parser.add_argument("--quick", action="store_true", help="a small run (the tests' CPU mode)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def run(args: argparse.Namespace) -> int:
    """Run the check; print JSON or tables. 0 when every round trip was bit-exact."""
    report = check(device=args.device, shapes=args.shapes, step_tokens=args.step_tokens,
                   repeat=args.repeat, quick=args.quick)
    if args.json:
        emit_json(report)
    else:
        _print(report)
    return 0 if report["bit_exact"] else 1


def check(device: str = "auto", shapes: str | None = None, step_tokens: int | None = None, repeat: int = 5,
          quick: bool = False) -> dict:
    """The whole check as one JSON-ready dict (see the module docstring)."""
    import torch

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    step_tokens = step_tokens or (2048 if dev.type == "cuda" else 1024)
    names = [s for s in (shapes or ",".join(GPU_SHAPES if dev.type == "cuda" else CPU_SHAPES)).split(",") if s]
    if quick:
        step_tokens, repeat = min(step_tokens, 512), min(repeat, 2)
    t0 = time.perf_counter()
    rows, bounds = [], {}
    for name in names:
        shape = SHAPES[name]
        for chunk in CHUNK_TOKENS:
            if chunk % shape.block_size:
                continue
            layers = 4 if quick else shape.layers
            rows.extend(_measure(dataclass_replace(shape, layers=layers), chunk, step_tokens, dev, repeat, bounds))
    report = {
        "device": _device_name(dev),
        "torch": torch.__version__,
        "step_tokens": step_tokens,
        "quick": quick,
        "bound_gbps": bounds,
        "rows": rows,
        "bit_exact": all(r["bit_exact"] for r in rows if r["op"] == "round_trip"),
    }
    if dev.type == "cuda":
        report["overlap"] = _overlap(SHAPES[names[0]], step_tokens, dev, quick)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def dataclass_replace(shape: Shape, **changes) -> Shape:
    import dataclasses

    return dataclasses.replace(shape, **changes)


def _device_name(dev: torch.device) -> str:
    import torch

    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({torch.get_num_threads()} torch threads)"


def _make_kv(shape: Shape, num_blocks: int, dev: torch.device) -> dict[str, torch.Tensor]:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    kv = {}
    for i in range(shape.layers):
        t = torch.randint(-2**15, 2**15, shape.dims(num_blocks), generator=gen, dtype=torch.int16)
        kv[f"layers.{i}"] = t.view(torch.bfloat16).to(dev)
    return kv


def _measure(shape: Shape, chunk_tokens: int, step_tokens: int, dev: torch.device, repeat: int,
             bounds: dict) -> list[dict]:
    """Rows for one (layout, chunk size): round trip check, then save/load timings per path."""
    from kvtier.integrations.vllm.pages import PageLayout
    from kvtier.store import TieredStore

    bpc = chunk_tokens // shape.block_size
    chunks = max(1, step_tokens // chunk_tokens)
    num_blocks = 2 * chunks * bpc + 1  # the step's blocks, then as many to load into
    kv = _make_kv(shape, num_blocks, dev)
    src = [[c * bpc + j for j in range(bpc)] for c in range(chunks)]
    dst = [[chunks * bpc + c * bpc + j for j in range(bpc)] for c in range(chunks)]
    engines = ["host", "torch"] if dev.type == "cpu" else ["torch"]
    layouts = {e: PageLayout(kv, num_blocks, bpc, engine=e) for e in engines}
    default = layouts[engines[0]]
    step_bytes = default.chunk_bytes * chunks
    pieces = default.pieces
    store = TieredStore.from_config({"tiers": [{"type": "ram", "capacity": 2 * step_bytes + (64 << 20),
                                                "page_size": default.page_bytes}]})
    keys = [bytes([c % 256, c // 256]) * 16 for c in range(chunks)]
    base = {"layout": shape.name, "chunk_tokens": chunk_tokens, "chunks_per_step": chunks, "step_bytes": step_bytes}
    rows = [dict(base, op="round_trip", path="batched", bit_exact=_round_trip(default, kv, store, keys, src, dst))]
    bound = _bound(step_bytes, dev, repeat)
    bounds[f"{shape.name}/{chunk_tokens}"] = bound
    entries = [np.empty(default.chunk_bytes, dtype=np.uint8) for _ in range(chunks)]
    paths: dict[str, tuple[Callable[[], None], Callable[[], None], int]] = {
        "per-page": (lambda: _per_page_save(default, src, entries), lambda: _per_page_load(default, entries, dst),
                     shape.layers * bpc * pieces * chunks),
    }
    for engine, layout in layouts.items():
        name = "batched" if engine == engines[0] else f"batched-{engine}"
        calls = shape.layers * bpc * pieces * chunks if engine == "host" else shape.layers + (dev.type == "cuda")
        paths[name] = (lambda l=layout: _batched_save(l, src, entries),
                       lambda l=layout: _batched_load(l, entries, dst), calls)
    for path, (save, load, calls) in paths.items():
        for op, fn, b in (("save", save, bound["d2h"]), ("load", load, bound["h2d"])):
            seconds = _time(fn, repeat, dev)
            gbps = step_bytes / seconds / 1e9
            rows.append(dict(base, op=op, path=path, ms_per_step=round(seconds * 1e3, 3), gbps=round(gbps, 2),
                             vs_bound=round(gbps / b, 2), copy_calls=calls))
    store_save = _time(lambda: _store_save(default, store, keys, src), repeat, dev)
    store_load = _time(lambda: _store_load(default, store, keys, dst), repeat, dev)
    tier_ops = (("save_to_ram_tier", store_save, bound["d2h"]), ("load_from_ram_tier", store_load, bound["h2d"]))
    for op, seconds, b in tier_ops:
        gbps = step_bytes / seconds / 1e9
        rows.append(dict(base, op=op, path="batched", ms_per_step=round(seconds * 1e3, 3), gbps=round(gbps, 2),
                         vs_bound=round(gbps / b, 2)))
    for layout in layouts.values():
        layout.close()
    store.close()
    return rows


def _round_trip(layout: PageLayout, kv: dict, store, keys: list[bytes], src, dst) -> bool:
    """Save the step through the store, wipe the destination blocks, load; bit-exact?"""
    import torch

    _store_save(layout, store, keys, src)
    for t in kv.values():
        view = t if layout.pieces == 1 else t.transpose(0, 1)
        view[dst[0][0] : dst[-1][-1] + 1].zero_()
    if not _store_load(layout, store, keys, dst):
        return False
    _sync(layout.device)
    for t in kv.values():
        view = t if layout.pieces == 1 else t.transpose(0, 1)
        a = view[src[0][0] : src[-1][-1] + 1].reshape(-1).view(torch.int16)
        b = view[dst[0][0] : dst[-1][-1] + 1].reshape(-1).view(torch.int16)
        if not torch.equal(a, b):
            return False
    return True


def _store_save(layout: PageLayout, store, keys: list[bytes], chunks) -> None:
    """What the connector's ``wait_for_save`` does: one gather for the step, one write per chunk."""
    step = layout.gather(chunks)
    try:
        for i, key in enumerate(keys):
            store.delete(key)
            store.write(key, layout.chunk_bytes, lambda segs, i=i: step.copy_to(i, segs))
    finally:
        step.release()


def _store_load(layout: PageLayout, store, keys: list[bytes], chunks) -> bool:
    """Read every chunk from the store's RAM tier and scatter the step once; all found?"""
    step = layout.begin_load(len(chunks))
    try:
        found = [store.read(key, lambda segs, i=i: step.fill(i, segs, chunks[i])) for i, key in enumerate(keys)]
        step.scatter()
    finally:
        step.release()
    return all(found)


def _batched_save(layout: PageLayout, chunks, entries) -> None:
    step = layout.gather(chunks)
    for i, entry in enumerate(entries):
        step.copy_to(i, [entry])
    step.release()


def _batched_load(layout: PageLayout, entries, chunks) -> None:
    step = layout.begin_load(len(chunks))
    for i, entry in enumerate(entries):
        step.fill(i, [entry], chunks[i])
    step.scatter()
    step.release()


def _per_page_save(layout: PageLayout, chunks, entries) -> None:
    """The pre-batching algorithm: one copy per (layer, block, piece), layer-major entries; on
    CPU split over the layout's copy threads as the old code did, on CUDA ``non_blocking``
    copies on a side stream, then a synchronize."""
    import torch

    for blocks, entry in zip(chunks, entries):
        pieces = iter(_split(entry, layout.piece_bytes))
        if layout.on_cpu:  # as the old code: the page pairs, split over the copy threads
            layout._copy([(next(pieces), layer.array[p, block])
                          for layer in layout.layers for block in blocks for p in range(layout.pieces)])
            continue
        with torch.cuda.stream(layout._stream):
            for layer in layout.layers:
                for block in blocks:
                    for p in range(layout.pieces):
                        torch.from_numpy(next(pieces)).copy_(layer.tensor[p, block], non_blocking=True)
        layout._stream.synchronize()


def _per_page_load(layout: PageLayout, entries, chunks) -> None:
    import torch

    for blocks, entry in zip(chunks, entries):
        pieces = iter(_split(entry, layout.piece_bytes))
        if layout.on_cpu:
            layout._copy([(layer.array[p, block], next(pieces))
                          for layer in layout.layers for block in blocks for p in range(layout.pieces)])
            continue
        with torch.cuda.stream(layout._stream):
            for layer in layout.layers:
                for block in blocks:
                    for p in range(layout.pieces):
                        layer.tensor[p, block].copy_(torch.from_numpy(next(pieces)), non_blocking=True)
        layout._stream.synchronize()


def _split(entry: np.ndarray, size: int) -> list[np.ndarray]:
    return [entry[off : off + size] for off in range(0, entry.size, size)]


def _bound(nbytes: int, dev: torch.device, repeat: int) -> dict:
    """GB/s of one large copy of ``nbytes``: pinned D2H/H2D on CUDA, memcpy on CPU."""
    import torch

    if dev.type == "cuda":
        d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        d2h = _time(lambda: h.copy_(d, non_blocking=True), repeat, dev)
        h2d = _time(lambda: d.copy_(h, non_blocking=True), repeat, dev)
        return {"d2h": round(nbytes / d2h / 1e9, 2), "h2d": round(nbytes / h2d / 1e9, 2)}
    a, b = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    seconds = _time(lambda: np.copyto(b, a), repeat, dev)
    gbps = round(nbytes / seconds / 1e9, 2)
    return {"d2h": gbps, "h2d": gbps}


def _sync(dev: torch.device) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn: Callable[[], object], repeat: int, dev: torch.device) -> float:
    """Median seconds of ``fn`` (after one warm-up), synchronizing the device around each call."""
    fn()
    _sync(dev)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _overlap(shape: Shape, step_tokens: int, dev: torch.device, quick: bool) -> dict:
    """A bf16 matmul loop on the compute stream alone, then with a step's save (gather +
    device-to-host copy, the save's device work) issued on the side stream after every
    iteration; each save is released one iteration later, so at most two are in flight.
    Slowdown = loop time with saves / alone (the target: < 1.05)."""
    import torch

    from kvtier.integrations.vllm.pages import PageLayout

    bpc = 128 // shape.block_size
    chunks = max(1, step_tokens // 128)
    num_blocks = chunks * bpc
    kv = _make_kv(dataclass_replace(shape, layers=4 if quick else shape.layers), num_blocks, dev)
    layout = PageLayout(kv, num_blocks, bpc)
    blocks = [[c * bpc + j for j in range(bpc)] for c in range(chunks)]
    n, per_iteration, iters = (1024, 2, 10) if quick else (8192, 8, 30)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)

    def loop(with_saves: bool) -> float:
        pending = None
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            for _ in range(per_iteration):
                a.matmul(a)
            if with_saves:
                step = layout.gather(blocks)
                if pending is not None:
                    pending.release()
                pending = step
        torch.cuda.current_stream(dev).synchronize()
        seconds = time.perf_counter() - t0
        if pending is not None:
            pending.release()
        return seconds

    loop(False), loop(True)
    alone = statistics.median(loop(False) for _ in range(3))
    with_saves = statistics.median(loop(True) for _ in range(3))
    saved = layout.chunk_bytes * chunks
    layout.close()
    return {"matmul_n": n, "matmuls_per_iteration": per_iteration, "iterations": iters,
            "saved_bytes_per_iteration": saved, "alone_ms": round(alone * 1e3, 2),
            "with_saves_ms": round(with_saves * 1e3, 2), "slowdown": round(with_saves / alone, 3),
            "save_gbps_while_computing": round(saved * iters / with_saves / 1e9, 2)}


def _print(report: dict) -> None:
    print(f"device: {report['device']}  torch {report['torch']}  step {report['step_tokens']} tokens  "
          f"bit-exact: {report['bit_exact']}  ({report['seconds']} s)")
    rows = [(r["layout"], r["chunk_tokens"], r["op"], r["path"], r.get("ms_per_step", ""), r.get("gbps", ""),
             r.get("vs_bound", ""), r.get("copy_calls", ""))
            for r in report["rows"] if r["op"] != "round_trip"]
    print_table(["layout", "chunk", "op", "path", "ms/step", "GB/s", "x bound", "copy calls"], rows)
    print(f"bound (one large copy) GB/s: {report['bound_gbps']}")
    if "overlap" in report:
        print(f"overlap: {report['overlap']}")
