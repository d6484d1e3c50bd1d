"""``kvtier bench codec``: ratio and one-core encode/decode GB/s of each KV codec, on KV of the
random test model stored through the store.

KV source (``--kv``): ``model`` (default) runs the random-weight Qwen2 test model
(``kvtier.bench.models``, ``--variant``) forward with transformers on ``--tokens`` random token
ids and takes its real K/V (bf16), cut into chunks of ``--chunk-tokens`` tokens laid out as the
connector stores them (per chunk: every layer's K then V); ``synthetic`` is bf16-rounded normal
values (no torch needed; say so when you quote it). This is not the engine's own dump: it is the
same model's KV computed by transformers (random weights: real shapes and value statistics of
such a model, not of a trained one).

Each chunk is written through a ``TieredStore`` (RAM over an ``fs`` tier with ``codec:
lossless``, ``element_dtype`` bfloat16); the ratio is raw bytes over the bytes the tier stored,
read back bit-exactly. Beside it, the coders the choice was made among (when installed), on the
same chunks, one thread: zstd-1 raw, byte planes + zstd-1, Blosc2 byte-shuffle + LZ4.

``fp8`` (lossy) is measured beside them on the same chunks: the stored fraction, one-core
encode/decode GB/s, the largest and mean absolute error of the dequantized KV; and, with
``--kv model``, the agreement of ``--greedy-tokens`` greedy tokens continued from the fp8 KV
with those continued from the exact KV (transformers, the same prompt: random weights have
near-uniform logits, so one flipped token is likelier than in a trained model; the agreement
is a floor, not a quality claim).

Re-read from a shared tier (``--rates``, Gb/s): a real ``redis-server`` behind the project's
delay proxy (``kvtier.bench.delay_proxy``: 2 ms per request, responses paced to the rate), a
``redis`` tier with each codec (``none``, ``lossless``, ``auto``, ``fp8``); per codec the chunks are
put and read ``LEARN_PASSES`` times (``auto`` learns the tier), put again, then re-read
``--repeat`` times: the best
re-read time and its ratio to ``none``. This is the tier's own time, not an engine's TTFT.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile

import numpy as np

from kvtier.bench.timing import best_seconds
from kvtier.output import emit_json, print_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv", choices=("model", "synthetic"), default="model", help="KV source (model)")
    parser.add_argument("--variant", default="small", help="random test model variant (small)")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens run through the model (4096: 16 chunks)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per stored chunk (256)")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes; the best is kept (3)")
    parser.add_argument("--rates", default="1,10", help="shared-tier link rates in Gb/s for the re-read "
                        "measurement through redis-server behind the delay proxy ('' to skip; 1,10)")
    parser.add_argument("--greedy-tokens", type=int, default=64, help="greedy tokens continued from the fp8 KV "
                        "and from the exact KV, compared (--kv model; 0 to skip; 64)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def model_kv(variant: str, tokens: int, chunk_tokens: int) -> list[np.ndarray]:
    """Chunks (uint16 views of bf16) of the random model's K/V for ``tokens`` random ids."""
    return model_docs(variant, 1, tokens, chunk_tokens)[0]


def model_docs(variant: str, docs: int, tokens: int, chunk_tokens: int) -> list[list[np.ndarray]]:
    """``docs`` documents of ``tokens`` random ids each (document d seeded ``1 + d``), run
    through the random model one at a time (loaded once); per document its K/V chunks (uint16
    views of bf16), laid out as the connector stores them (per chunk: every layer's K then V)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvtier.bench.models import make_random_model

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(make_random_model(variant), dtype=torch.bfloat16)
    out = []
    for d in range(docs):
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1 + d))
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
        layers = [(layer.keys, layer.values) for layer in cache.layers]  # [1, kv_heads, tokens, head_dim]
        chunks = []
        for lo in range(0, tokens - chunk_tokens + 1, chunk_tokens):
            parts = [t[:, :, lo:lo + chunk_tokens].contiguous().view(torch.uint16).numpy().ravel()
                     for kv in layers for t in kv]
            chunks.append(np.concatenate(parts))
        out.append(chunks)
    return out


def fp8_error(chunks: list[np.ndarray], repeat: int) -> dict:
    """fp8 on ``chunks`` (bf16 bit patterns): stored fraction, one-core encode/decode GB/s (the
    encode includes the dequantized copy a writer checksums), largest and mean absolute error."""
    from kvtier import fp8

    raw = [memoryview(c).cast("B") for c in chunks]
    coded = [fp8.quantize(r, "bfloat16") for r in raw]
    t_enc = best_seconds(lambda: [fp8.quantize(r, "bfloat16") for r in raw], repeat)
    outs = [bytearray(r.nbytes) for r in raw]
    t_dec = best_seconds(lambda: [fp8.dequantize_into(memoryview(c[0]), memoryview(o), "bfloat16")
                                  for c, o in zip(coded, outs)], repeat)
    exact = np.concatenate([(c.astype(np.uint32) << 16).view(np.float32) for c in chunks])
    got = np.concatenate([(np.frombuffer(o, np.uint16).astype(np.uint32) << 16).view(np.float32) for o in outs])
    err = np.abs(got - exact)
    nbytes = sum(r.nbytes for r in raw)
    return {"stored_fraction": round(sum(len(c[0]) for c in coded) / nbytes, 4),
            "encode_gbps": round(nbytes / t_enc / 1e9, 3), "decode_gbps": round(nbytes / t_dec / 1e9, 3),
            "max_abs_error": float(err.max()), "mean_abs_error": float(err.mean()),
            "mean_abs_value": float(np.abs(exact).mean())}


def fp8_greedy_agreement(variant: str, tokens: int, steps: int) -> dict:
    """Greedy tokens continued ``steps`` times from the exact KV of a ``tokens``-token random
    prompt and from the same KV quantized to fp8 and back (per layer, K and V, groups along
    the head dimension); how many agree, and the first step where they part (None: never)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvtier import fp8
    from kvtier.bench.models import make_random_model

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(make_random_model(variant), dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2))

    def lossy(t: torch.Tensor) -> torch.Tensor:
        """``t`` as an fp8 tier would give it back (``quantize``'s dequantized bytes)."""
        coded = fp8.quantize(memoryview(t.contiguous().view(torch.uint16).numpy()).cast("B"), "bfloat16")
        return t if coded is None else torch.frombuffer(bytearray(coded[1]), dtype=torch.bfloat16).view(t.shape)

    def continue_greedy(cache) -> list[int]:
        nxt, got = ids[:, -1:], []
        with torch.no_grad():
            for _ in range(steps):
                out = model(nxt, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                nxt = out.logits[:, -1:].argmax(-1)
                got.append(int(nxt))
        return got

    with torch.no_grad():  # the prompt's prefill once; the fp8 run continues from a copy of its KV
        prefix = model(ids[:, :-1], use_cache=True).past_key_values
    quantized_prefix = copy.deepcopy(prefix)
    for layer in quantized_prefix.layers:
        layer.keys, layer.values = lossy(layer.keys), lossy(layer.values)

    exact, quantized = continue_greedy(prefix), continue_greedy(quantized_prefix)
    parted = next((i for i, (x, y) in enumerate(zip(exact, quantized)) if x != y), None)
    return {"steps": steps, "prompt_tokens": tokens, "agree": sum(x == y for x, y in zip(exact, quantized)),
            "first_divergence": parted}


def synthetic_kv(chunks: int = 4, elements: int = 1 << 20) -> list[np.ndarray]:
    """bf16-rounded N(0, 1) values (upper 16 bits of float32)."""
    rng = np.random.default_rng(0)
    return [(rng.normal(0, 1, elements).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            for _ in range(chunks)]


def _coders() -> dict:
    """name -> (encode(bytes) -> bytes, decode(coded, n) -> bytes) of the installed coders."""
    from kvtier import codecs

    out = {}
    lossless = codecs.LOSSLESS

    def ll_decode(coded: bytes, n: int) -> bytes:
        buf = bytearray(n)
        codecs.decode_into(codecs.LOSSLESS_ID, memoryview(coded), memoryview(buf), 2)
        return bytes(buf)

    out["lossless (blosc2 bitshuffle+lz4)"] = (lambda b: lossless.encode(memoryview(b), 2), ll_decode)
    try:
        import blosc2

        out["blosc2 shuffle+lz4"] = (
            lambda b: blosc2.compress2(b, typesize=2, codec=blosc2.Codec.LZ4, filters=[blosc2.Filter.SHUFFLE],
                                       clevel=5, nthreads=1),
            lambda c, n: blosc2.decompress2(c, nthreads=1))
    except ImportError:
        pass
    try:
        import zstandard

        def planes(b: bytes) -> bytes:
            return np.ascontiguousarray(np.frombuffer(b, np.uint8).reshape(-1, 2).T).tobytes()

        out["zstd-1 raw"] = (lambda b: zstandard.ZstdCompressor(level=1).compress(b),
                             lambda c, n: zstandard.ZstdDecompressor().decompress(c, max_output_size=n))
        def unplanes(b: bytes) -> bytes:
            return np.ascontiguousarray(np.frombuffer(b, np.uint8).reshape(2, -1).T).tobytes()

        out["byte planes+zstd-1"] = (lambda b: zstandard.ZstdCompressor(level=1).compress(planes(b)),
                                     lambda c, n: unplanes(zstandard.ZstdDecompressor().decompress(c, max_output_size=n)))
    except ImportError:
        pass
    return out


def through_store(chunks: list[np.ndarray]) -> dict:
    """Write ``chunks`` through a TieredStore (RAM over fs with ``codec: lossless``); the ratio
    of raw to stored bytes and whether each read back bit-exactly from the fs tier."""
    import hashlib

    from kvtier.store import TieredStore

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-codec-") as tmp:
        ram = max(c.nbytes for c in chunks) * 2  # the top tier takes each chunk, then writes it through
        config = {"tiers": [{"type": "ram", "capacity": ram},
                            {"type": "fs", "path": os.path.join(tmp, "fs"), "capacity": "4GiB", "codec": "lossless"}],
                  "element_dtype": "bfloat16"}
        raw = stored = 0
        exact = True
        with TieredStore.from_config(config) as store:
            fs = store.tiers[-1]
            for i, chunk in enumerate(chunks):
                key = hashlib.sha256(b"bench-codec-%d" % i).digest()
                if not store.put(key, chunk):
                    raise RuntimeError(f"the store refused chunk {i} ({chunk.nbytes} bytes)")
            store.flush()
            for i, chunk in enumerate(chunks):
                key = hashlib.sha256(b"bench-codec-%d" % i).digest()
                name = os.path.join(tmp, "fs", f"{key[0]:02x}", key.hex())
                stored += os.path.getsize(name)
                raw += chunk.nbytes
                got = fs.get(key)
                exact = exact and got is not None and got == chunk.tobytes()
    return {"raw_bytes": raw, "stored_bytes": stored, "ratio": raw / stored if stored else 0.0, "bit_exact": exact}


def run(args: argparse.Namespace) -> int:
    from kvtier.errors import ConfigError

    if args.kv == "model":
        try:
            chunks = model_kv(args.variant, args.tokens, args.chunk_tokens)
            source = f"random Qwen2 '{args.variant}' via transformers, {args.tokens} tokens"
        except ImportError as exc:
            raise ConfigError(f"--kv model needs torch and transformers ({exc.name}); valid: --kv synthetic") from exc
    else:
        chunks = synthetic_kv()
        source = "synthetic (bf16-rounded normal values)"
    blob = b"".join(c.tobytes() for c in chunks)
    results = []
    for name, (encode, decode) in _coders().items():
        coded = [encode(c.tobytes()) or c.tobytes() for c in chunks]
        t_enc = best_seconds(lambda: [encode(c.tobytes()) for c in chunks], args.repeat)
        t_dec = best_seconds(lambda: [decode(k, c.nbytes) for k, c in zip(coded, chunks)], args.repeat)
        if not all(bytes(decode(k, c.nbytes)) == c.tobytes() for k, c in zip(coded, chunks) if k != c.tobytes()):
            raise RuntimeError(f"codec {name} did not round-trip")
        results.append({"codec": name, "ratio": round(len(blob) / sum(len(k) for k in coded), 3),
                        "encode_gbps": round(len(blob) / t_enc / 1e9, 3), "decode_gbps": round(len(blob) / t_dec / 1e9, 3)})
    lossy = fp8_error(chunks, args.repeat)
    if args.kv == "model" and args.greedy_tokens > 0:
        lossy["greedy"] = fp8_greedy_agreement(args.variant, args.tokens, args.greedy_tokens)
    store = through_store(chunks)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    reread = shared_rereads(chunks, rates, args.repeat) if rates else []
    report = {"kv_source": source, "chunk_bytes": chunks[0].nbytes, "chunks": len(chunks), "threads": 1,
              "codecs": results, "fp8": lossy, "through_store": store, "shared_reread": reread}
    if args.json:
        emit_json(report)
    else:
        print_table(["codec", "ratio", "encode GB/s", "decode GB/s"],
                    [[r["codec"], r["ratio"], r["encode_gbps"], r["decode_gbps"]] for r in results],
                    title=f"KV codecs, one core: {source}, {len(chunks)} chunks of {chunks[0].nbytes} bytes")
        print(f"through the store (fs tier, codec lossless): ratio {store['ratio']:.3f}, bit-exact {store['bit_exact']}")
        greedy = lossy.get("greedy")
        print(f"fp8 (lossy): {lossy['stored_fraction']:.3f} x the bytes, encode {lossy['encode_gbps']} GB/s, "
              f"decode {lossy['decode_gbps']} GB/s, abs error max {lossy['max_abs_error']:.4g} mean "
              f"{lossy['mean_abs_error']:.4g} (mean |KV| {lossy['mean_abs_value']:.4g})"
              + (f"; greedy {greedy['agree']}/{greedy['steps']} tokens agree" if greedy else ""))
        if reread:
            print_table(["Gb/s", "codec", "re-read s", "x none", "auto coding"],
                        [[r["gbps"], r["codec"], r["reread_s"], r["vs_none"], r.get("auto", {}).get("coding", "")]
                         for r in reread], title="re-read from redis behind the delay proxy")
    return 0 if store["bit_exact"] else 1


PROXY_DELAY_S = 0.002
LEARN_PASSES = 8  # put-and-read passes before the measured one: ~30 transfers, the auto fit's memory


def shared_rereads(chunks: list[np.ndarray], rates_gbps: list[float], repeat: int) -> list[dict]:
    """Re-read times of ``chunks`` from a redis tier behind the delay proxy at each rate, per
    codec (see the module docstring); [] with a note on stderr when redis-server is missing."""
    import hashlib
    import sys

    from kvtier.bench.delay_proxy import DelayProxy
    from kvtier.harness.services import BinaryMissing, redis_server
    from kvtier.tiers.redis import RedisConfig, RedisTier

    keys = [hashlib.sha256(b"bench-codec-reread-%d" % i).digest() for i in range(len(chunks))]
    out = np.empty(chunks[0].nbytes, dtype=np.uint8)
    rows: list[dict] = []
    try:
        server_cm = redis_server()
        server = server_cm.__enter__()
    except BinaryMissing as exc:
        print(f"kvtier bench codec: shared-tier re-read skipped: {exc}", file=sys.stderr)
        return []
    try:
        for gbps in rates_gbps:
            window = max(1, int(gbps * 1e9 / 8 * PROXY_DELAY_S))
            with DelayProxy(("127.0.0.1", server.port), PROXY_DELAY_S, window=window) as proxy:
                base = None
                for codec in ("none", "lossless", "auto", "fp8"):
                    config = RedisConfig(url=f"redis://127.0.0.1:{proxy.port}/0", prefix=f"bench-{codec}-{gbps}:",
                                         capacity=1 << 30, codec=codec, timeout_s=30.0)
                    with RedisTier(config, name="redis") as tier:
                        for _ in range(LEARN_PASSES):  # put, read: auto learns the tier (its fit's memory)
                            for k, c in zip(keys, chunks):
                                tier.put(k, c, "bfloat16")
                            for k in keys:
                                tier.get_into(k, out)
                        for k, c in zip(keys, chunks):
                            tier.put(k, c, "bfloat16")
                        seconds = best_seconds(lambda: [tier.get_into(k, out) for k in keys], repeat)
                        stored = tier.stats.as_dict()["bytes_written"]
                        row = {"gbps": gbps, "codec": codec, "reread_s": round(seconds, 4)}
                        if codec == "auto":
                            row["auto"] = {k: (round(v, 1) if isinstance(v, float) else v)
                                           for k, v in tier.codec_state().items()}
                        for k in keys:
                            tier.delete(k)
                    base = seconds if base is None else base
                    row["vs_none"] = round(seconds / base, 3)
                    rows.append(row)
    finally:
        server_cm.__exit__(None, None, None)
    return rows
