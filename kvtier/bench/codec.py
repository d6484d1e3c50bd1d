"""``kvtier bench codec``: ratio and one-core encode/decode GB/s of each KV codec, on KV of the
random test models stored through the store, and the re-read time of each tier codec.

KV source (``--kv``): ``engine`` runs a real vLLM engine per model family (``--families``:
small, swa, mla, hybrid; ``kvtier.bench.codec_engine``) with kvtier's connector over an fs
tier in a temp dir and takes the entries it stored, read back from that tier: the connector's
own bytes and layout. Per family: the coders on its bf16 entries, fp8's stored fraction and
error, the lossless ratio of entries of other dtypes, and the issue's targets (lossless >= 1.3 x,
fp8 <= 0.55 x the bytes); the rest of the report runs on the first family's entries.
``model`` (default) runs the random-weight Qwen2 test model (``kvtier.bench.models``,
``--variant``) forward with transformers on ``--tokens`` random token ids and takes its K/V
(bf16), cut into chunks of ``--chunk-tokens`` tokens laid out as the connector stores them (per
chunk: every layer's K then V); ``synthetic`` is bf16-rounded normal values (no torch needed; say
so when you quote it). Random weights: real shapes and value statistics of such a model, not of
a trained one.

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

Re-read (``--rates``, Gb/s): a real ``redis-server`` behind the project's delay proxy (in a
process of its own; 2 ms per request, the responses of all connections paced together at the
rate, one link: ``DelayProxy(link_rate=)``), one ``redis`` tier per codec (``none``,
``lossless``, ``auto``, ``fp8``) and a second ``none`` tier, ``control`` (the run's own A/A
spread); and (``--local``) an ``fs`` tier on tmpfs per codec (``none``, ``control``,
``lossless``, ``auto``): the memory-speed tier, where each round times ``LOCAL_REPEAT`` whole
re-reads (one takes a few ms). The chunks are read by ``--readers`` threads at
once, as the connector's ``load_threads`` read a request's chunks (4 by default; 1: one chunk
after another, each chunk's decode then never overlapping the next one's transfer). The
codecs are interleaved: each tier learns (``LEARN_PASSES`` put-and-read passes, taking turns),
gets the chunks put once more, then ``--rounds`` rounds re-read every tier once, the order
reversed every other round. Reported per codec: the median re-read time, its ratio to ``none``
of the same round (median, min, max), for ``auto`` also to the better of ``none`` and
``lossless`` of the same round, and how many of the re-read chunks each stored coded. This is the
tier's own time, not an engine's TTFT.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import tempfile
import time

import numpy as np

from kvtier.bench.timing import best_seconds
from kvtier.output import emit_json, print_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv", choices=("model", "engine", "synthetic"), default="model",
                        help="KV source: model (transformers' forward pass), engine (a vLLM engine's KV dumped "
                        "through kvtier's connector to an fs tier, per --families), synthetic (model)")
    parser.add_argument("--families", default="small,swa,mla,hybrid",
                        help="--kv engine: model families (small,swa,mla,hybrid)")
    parser.add_argument("--variant", default="small", help="random test model variant (small)")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens run through the model (4096: 16 chunks)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per stored chunk (256)")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes; the best is kept (3)")
    parser.add_argument("--rates", default="1,10", help="shared-tier link rates in Gb/s for the re-read "
                        "measurement through redis-server behind the delay proxy ('' to skip; 1,10)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved re-read rounds per tier, the codecs "
                        "taking turns (order reversed every other round): median and spread of the ratios (7)")
    parser.add_argument("--local", action=argparse.BooleanOptionalAction, default=True,
                        help="also re-read from a memory-speed tier (fs on tmpfs) with none, lossless, auto (on)")
    parser.add_argument("--greedy-tokens", type=int, default=64, help="greedy tokens continued from the fp8 KV "
                        "and from the exact KV, compared (--kv model; 0 to skip; 64)")
    parser.add_argument("--readers", type=int, default=4, help="threads re-reading the chunks at once, as the "
                        "connector's load_threads do (4, its default)")
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
    # a chunk fp8 declines (under 4 KiB, a non-finite value) is stored raw, as the tier would
    coded = [fp8.quantize(r, "bfloat16") or (bytes(r), bytes(r)) for r in raw]
    declined = sum(1 for c, r in zip(coded, raw) if len(c[0]) == r.nbytes)
    t_enc = best_seconds(lambda: [fp8.quantize(r, "bfloat16") for r in raw], repeat)
    outs = [bytearray(r.nbytes) for r in raw]

    def dequantize():
        for c, o, r in zip(coded, outs, raw):
            if len(c[0]) == r.nbytes:
                o[:] = c[0]
            else:
                fp8.dequantize_into(memoryview(c[0]), memoryview(o), "bfloat16")

    t_dec = best_seconds(dequantize, repeat)
    exact = np.concatenate([(c.astype(np.uint32) << 16).view(np.float32) for c in chunks])
    got = np.concatenate([(np.frombuffer(o, np.uint16).astype(np.uint32) << 16).view(np.float32) for o in outs])
    finite = np.isfinite(exact)
    err = np.abs(got[finite] - exact[finite])
    exact = exact[finite]
    nbytes = sum(r.nbytes for r in raw)
    return {"stored_fraction": round(sum(len(c[0]) for c in coded) / nbytes, 4),
            "encode_gbps": round(nbytes / t_enc / 1e9, 3), "decode_gbps": round(nbytes / t_dec / 1e9, 3),
            "max_abs_error": float(err.max()), "mean_abs_error": float(err.mean()),
            "mean_abs_value": float(np.abs(exact).mean()), "declined_chunks": declined}


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

    out["lossless (blosc2 bit-shuffle+zstd-1, 256 KiB split)"] = (lambda b: lossless.encode(memoryview(b), 2), ll_decode)
    try:
        import blosc2

        out["blosc2 byte-shuffle+zstd-1 (lossless before)"] = (
            lambda b: blosc2.compress2(b, typesize=2, codec=blosc2.Codec.ZSTD, filters=[blosc2.Filter.SHUFFLE],
                                       clevel=1, nthreads=1),
            lambda c, n: blosc2.decompress2(c, nthreads=1))

        out["blosc2 bitshuffle+lz4"] = (
            lambda b: blosc2.compress2(b, typesize=2, codec=blosc2.Codec.LZ4, filters=[blosc2.Filter.BITSHUFFLE],
                                       clevel=5, nthreads=1),
            lambda c, n: blosc2.decompress2(c, nthreads=1))
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

    for name in ("tokens", "chunk_tokens", "repeat", "rounds", "readers"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if args.tokens < args.chunk_tokens:
        raise ConfigError(f"--tokens ({args.tokens}) must be at least --chunk-tokens ({args.chunk_tokens})")
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(f"--rates: not a comma-separated list of Gb/s: {args.rates!r}") from None
    if any(not 0 < r < 1e4 for r in rates):
        raise ConfigError(f"--rates: each rate must be above 0 and below 10000 Gb/s, not {args.rates!r}")
    families = []
    if args.kv == "engine":
        families = engine_families([f.strip() for f in args.families.split(",") if f.strip()], args.tokens,
                                   args.repeat)
        chunks = families[0].pop("_chunks")
        for fam in families[1:]:
            fam.pop("_chunks")
        source = (f"vLLM engine ({', '.join(f['family'] for f in families)}) through kvtier's connector to an fs "
                  f"tier, {args.tokens} tokens; the rest of this report on the {families[0]['family']} entries")
    elif args.kv == "model":
        try:
            chunks = model_kv(args.variant, args.tokens, args.chunk_tokens)
            source = f"random Qwen2 '{args.variant}' via transformers, {args.tokens} tokens"
        except ImportError as exc:
            raise ConfigError(f"--kv model needs torch and transformers ({exc.name}); valid: --kv synthetic") from exc
    else:
        chunks = synthetic_kv()
        source = "synthetic (bf16-rounded normal values)"
    results = coder_rows(chunks, args.repeat)
    lossy = fp8_error(chunks, args.repeat)
    if args.kv == "model" and args.greedy_tokens > 0:  # (engine: the entries' own model is not rerun)
        lossy["greedy"] = fp8_greedy_agreement(args.variant, args.tokens, args.greedy_tokens)
    store = through_store(chunks)
    reread = shared_rereads(chunks, rates, args.rounds, args.readers) if rates else []
    if args.local:
        reread += local_rereads(chunks, args.rounds, args.readers)
    report = {"kv_source": source, "chunk_bytes": chunks[0].nbytes, "chunks": len(chunks), "threads": 1,
              "readers": args.readers,
              "codecs": results, "fp8": lossy, "through_store": store, "shared_reread": reread}
    if families:
        report["families"] = families
        report["targets"] = {"lossless_ratio_ge_1_3_every_family": all(f["targets"]["lossless_ratio_ge_1_3"]
                                                                        for f in families),
                             "fp8_stored_le_0_55_every_family": all(f["targets"]["fp8_stored_le_0_55"]
                                                                    for f in families
                                                                    if f["targets"]["fp8_stored_le_0_55"] is not None)}
    if args.json:
        emit_json(report)
    else:
        for fam in families:
            print_table(["codec", "ratio", "encode GB/s", "decode GB/s"],
                        [[r["codec"], r["ratio"], r["encode_gbps"], r["decode_gbps"]] for r in fam["codecs"]]
                        + [["fp8 (stored fraction)", fam["fp8"]["stored_fraction"], fam["fp8"]["encode_gbps"],
                            fam["fp8"]["decode_gbps"]]],
                        title=f"{fam['family']}: {fam['bf16_entries']} bf16 entries, {fam['bf16_bytes']} bytes "
                              f"from the engine (other dtypes: {fam['other_dtypes'] or 'none'})")
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
            print_table(["tier", "codec", "re-read s (median)", "x none: median (min-max)", "auto x best (min-max)",
                         "coded chunks"],
                        [[r["tier"], r["codec"], r["reread_s"], _spread(r["vs_none"]),
                          _spread(r["vs_best"]) if "vs_best" in r else "", f"{r['coded_chunks']}/{r['chunks']}"]
                         for r in reread], title=f"re-read by {args.readers} readers, {args.rounds} interleaved rounds")
    return 0 if store["bit_exact"] else 1


def coder_rows(chunks: list[np.ndarray], repeat: int) -> list[dict]:
    """Per installed coder (``_coders``): ratio and one-core encode/decode GB/s on ``chunks``
    (bf16 bit patterns), each coded chunk checked to decode to its bytes."""
    blob_bytes = sum(c.nbytes for c in chunks)
    results = []
    for name, (encode, decode) in _coders().items():
        coded = [encode(c.tobytes()) or c.tobytes() for c in chunks]
        t_enc = best_seconds(lambda: [encode(c.tobytes()) for c in chunks], repeat)
        t_dec = best_seconds(lambda: [decode(k, c.nbytes) for k, c in zip(coded, chunks)], repeat)
        if not all(bytes(decode(k, c.nbytes)) == c.tobytes() for k, c in zip(coded, chunks) if k != c.tobytes()):
            raise RuntimeError(f"codec {name} did not round-trip")
        results.append({"codec": name, "ratio": round(blob_bytes / sum(len(k) for k in coded), 3),
                        "encode_gbps": round(blob_bytes / t_enc / 1e9, 3),
                        "decode_gbps": round(blob_bytes / t_dec / 1e9, 3)})
    return results


def engine_families(names: list[str], tokens: int, repeat: int) -> list[dict]:
    """Per family (``kvtier.bench.codec_engine.FAMILIES``): its engine's entries, dumped through
    the store; the coders on its bf16 entries, fp8's stored fraction and error on them, the
    lossless ratio of entries of other dtypes (recurrent state), and the issue's targets. Each
    dict keeps its bf16 chunks under ``_chunks`` for the caller."""
    from kvtier import codecs
    from kvtier.bench import codec_engine
    from kvtier.errors import ConfigError

    if not names:
        raise ConfigError(f"--families: name at least one of {', '.join(codec_engine.FAMILIES)}")
    unknown = [n for n in names if n not in codec_engine.FAMILIES]
    if unknown:
        raise ConfigError(f"--families: unknown {', '.join(unknown)}; valid: {', '.join(codec_engine.FAMILIES)}")
    out = []
    for name in names:
        got = codec_engine.engine_entries(name, tokens)
        bf16 = [payload.view(np.uint16) for dtype, _, payload in got["entries"] if dtype == "bfloat16"]
        if not bf16:
            raise RuntimeError(f"the {name} engine stored no bfloat16 entry")
        others: dict[str, dict] = {}
        for dtype, _, payload in got["entries"]:
            if dtype == "bfloat16":
                continue
            from kvtier.entry import DTYPES

            itemsize = DTYPES[dtype][1]
            row = others.setdefault(dtype, {"entries": 0, "bytes": 0, "coded_bytes": 0})
            coded = codecs.LOSSLESS.encode(memoryview(payload), itemsize)
            row["entries"] += 1
            row["bytes"] += payload.nbytes
            row["coded_bytes"] += payload.nbytes if coded is None else len(coded)
        for row in others.values():
            row["lossless_ratio"] = round(row["bytes"] / row["coded_bytes"], 3)
        rows = coder_rows(bf16, repeat)
        lossy = fp8_error(bf16, repeat)
        lossless = next(r for r in rows if r["codec"].startswith("lossless"))
        sizes = sorted({c.nbytes for c in bf16})
        # fp8 is refused at engine start for a model with recurrent state (its state would be
        # quantized as KV elements): no fp8 target for such a family
        fp8_target = None if _has_state(got["model"]) else lossy["stored_fraction"] <= 0.55
        out.append({"family": name, "model": os.path.basename(got["model"]), "engine_s": got["engine_s"],
                    "bf16_entries": len(bf16), "bf16_bytes": int(sum(c.nbytes for c in bf16)),
                    "entry_bytes": sizes if len(sizes) <= 4 else [sizes[0], sizes[-1]],
                    "other_dtypes": others, "codecs": rows, "fp8": lossy,
                    "targets": {"lossless_ratio_ge_1_3": lossless["ratio"] >= 1.3,
                                "fp8_stored_le_0_55": fp8_target},
                    "_chunks": bf16})
    return out


def _has_state(model_dir: str) -> bool:
    """Whether the model in ``model_dir`` holds recurrent state (Mamba2, gated delta net)."""
    from kvtier.plan import kv_shape

    with open(os.path.join(model_dir, "config.json")) as f:
        return any(kind.state_bytes for kind in kv_shape(json.load(f)).kinds)


def _spread(s: dict) -> str:
    return f"{s['median']} ({s['min']}-{s['max']})"


PROXY_DELAY_S = 0.002
LEARN_PASSES = 8  # put-and-read passes before the measured ones: ~30 transfers, the auto fit's memory
# re-read tiers: name -> codec. "control" is a second raw tier read like the others, so each run
# states its own A/A spread (on a memory-speed tier a whole re-read takes a few ms, where this
# machine's noise alone moves a round by 10-20%)
REREAD_TIERS = {"none": "none", "control": "none", "lossless": "lossless", "auto": "auto", "fp8": "fp8"}
LOCAL_TIERS = {"none": "none", "control": "none", "lossless": "lossless", "auto": "auto"}  # fp8: another KV
LOCAL_REPEAT = 8  # whole re-reads per timed round on the memory-speed tier (a few ms each alone)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def interleaved_rereads(tiers: dict, keys: list[bytes], chunks: list[np.ndarray], rounds: int,
                        readers: int = 1, repeat: int = 1) -> dict:
    """Re-read ``chunks`` from each of ``tiers`` ({name: open tier}; ``none`` among them) by
    ``readers`` threads at once, interleaved: every tier learns (``LEARN_PASSES`` put-and-read
    passes, the tiers taking turns), gets the chunks put once more, then each of ``rounds``
    rounds re-reads every tier ``repeat`` times (timed together), the order reversed every other
    round. Per tier: the median re-read seconds (of one whole re-read), its ratio to ``none`` of
    the same round (median, min, max); ``auto`` also against the better of ``none`` and
    ``lossless`` of the same round, and how many of the re-read chunks each had stored coded."""
    from concurrent.futures import ThreadPoolExecutor

    size = max(c.nbytes for c in chunks)
    buffers = [np.empty(size, dtype=np.uint8) for _ in range(readers)]
    pool = ThreadPoolExecutor(readers, thread_name_prefix="bench-reread")

    def read_all(tier) -> bool:
        """Every key read once, ``readers`` at a time (reader j takes keys j, j + readers, ...
        into its own buffer); whether all of them hit."""
        def part(j: int) -> bool:
            return all([tier.get_into(k, buffers[j]) is not None for k in keys[j::readers]])

        return all(pool.map(part, range(readers)))

    def read_repeated(tier) -> bool:
        return all([read_all(tier) for _ in range(repeat)])

    with pool:
        rows = _timed_rereads(tiers, keys, chunks, rounds, read_repeated)
    for row in rows.values():
        row["reread_s"] = round(row["reread_s"] / repeat, 6)
        row["repeat"] = repeat
    return rows


def _timed_rereads(tiers: dict, keys: list[bytes], chunks: list[np.ndarray], rounds: int, read_all) -> dict:
    """``interleaved_rereads``'s passes and report, reading through ``read_all(tier) -> all hit``."""
    names = list(tiers)
    for _ in range(LEARN_PASSES):  # put, read: auto learns the tier (its fit's memory)
        for name in names:
            tier = tiers[name]
            for k, c in zip(keys, chunks):
                tier.put(k, c, "bfloat16")
            read_all(tier)
    coded_before = {name: tiers[name].stats.as_dict().get("coded", 0) for name in names}
    for name in names:
        for k, c in zip(keys, chunks):
            if not tiers[name].put(k, c, "bfloat16"):
                raise RuntimeError(f"the {name} tier refused a chunk")
    coded = {name: tiers[name].stats.as_dict().get("coded", 0) - coded_before[name] for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            tier = tiers[name]
            start = time.perf_counter()
            if not read_all(tier):
                raise RuntimeError(f"the {name} tier missed a chunk it was given")
            times[name].append(time.perf_counter() - start)
    rows = {}
    for name in names:
        ratios = [t / b for t, b in zip(times[name], times["none"])]
        row = {"codec": name, "tier_codec": tiers[name].config.codec, "reread_s": round(_median(times[name]), 5),
               "vs_none": {"median": round(_median(ratios), 3), "min": round(min(ratios), 3),
                           "max": round(max(ratios), 3)},
               "coded_chunks": coded[name], "chunks": len(keys)}
        if name == "auto" and "lossless" in times:
            best = [t / min(a, b) for t, a, b in zip(times[name], times["none"], times["lossless"])]
            row["vs_best"] = {"median": round(_median(best), 3), "min": round(min(best), 3), "max": round(max(best), 3)}
            row["auto"] = {k: (float(f"{v:.4g}") if isinstance(v, float) else v)  # 4 significant digits:
                           for k, v in tiers[name].codec_state().items()}  # seconds per byte are ~1e-9
        rows[name] = row
    return rows


def shared_rereads(chunks: list[np.ndarray], rates_gbps: list[float], rounds: int, readers: int = 1) -> list[dict]:
    """Re-read times of ``chunks`` by ``readers`` threads from a redis tier behind the delay
    proxy (one link of each rate), per codec, interleaved (``interleaved_rereads``); [] with a
    note on stderr when redis-server is missing."""
    import hashlib
    import sys

    from kvtier.bench.delay_proxy import proxy_process
    from kvtier.harness.services import BinaryMissing, redis_server
    from kvtier.tiers.redis import RedisConfig, RedisTier

    keys = [hashlib.sha256(b"bench-codec-reread-%d" % i).digest() for i in range(len(chunks))]
    rows: list[dict] = []
    try:
        server_cm = redis_server()
        server = server_cm.__enter__()
    except BinaryMissing as exc:
        print(f"kvtier bench codec: shared-tier re-read skipped: {exc}", file=sys.stderr)
        return []
    try:
        for gbps in rates_gbps:
            with proxy_process(server.port, PROXY_DELAY_S, gbps * 1e9 / 8) as proxy_port, \
                    contextlib.ExitStack() as stack:
                tiers = {}
                for name, codec in REREAD_TIERS.items():
                    config = RedisConfig(url=f"redis://127.0.0.1:{proxy_port}/0", prefix=f"bench-{name}-{gbps}:",
                                         capacity=1 << 30, codec=codec, timeout_s=30.0)
                    tiers[name] = stack.enter_context(RedisTier(config, name="redis"))
                try:
                    got = interleaved_rereads(tiers, keys, chunks, rounds, readers)
                finally:
                    for tier in tiers.values():
                        for k in keys:
                            tier.delete(k)
                rows += [{"tier": f"redis behind the delay proxy at {gbps:g} Gb/s", "gbps": gbps, **row}
                         for row in got.values()]
    finally:
        server_cm.__exit__(None, None, None)
    return rows


def local_rereads(chunks: list[np.ndarray], rounds: int, readers: int = 1) -> list[dict]:
    """The same interleaved re-reads from a memory-speed tier: an ``fs`` tier on tmpfs
    (/dev/shm where there is one, else the temp dir, read back from the page cache); ``none``,
    its control, ``lossless``, ``auto``; each round reads every chunk ``LOCAL_REPEAT`` times."""
    import hashlib

    from kvtier.tiers.fs import FsConfig, FsTier

    keys = [hashlib.sha256(b"bench-codec-local-%d" % i).digest() for i in range(len(chunks))]
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-codec-", dir=base) as tmp, contextlib.ExitStack() as stack:
        tiers = {name: stack.enter_context(FsTier(FsConfig(path=os.path.join(tmp, name), capacity=1 << 32,
                                                           codec=codec), name="fs"))
                 for name, codec in LOCAL_TIERS.items()}
        got = interleaved_rereads(tiers, keys, chunks, rounds, readers, LOCAL_REPEAT)
    where = "tmpfs" if base else "the temp dir (page cache)"
    return [{"tier": f"fs on {where}", "gbps": None, **row} for row in got.values()]
