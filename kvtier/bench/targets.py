"""The issues' benchmark targets, in one table, and the one function that checks them.

Each target is one row of ``TARGETS``: the issue that set it, the benchmark that measures it, a
name as printed, a metric (``numerator / denominator - offset`` over named measurements), a
comparison and a limit. A benchmark collects its measurements in a flat mapping
(``{"p50:kvtier-ram/again": 24.8, "engine_hit": 17.1, ...}``) and calls ``evaluate``; it holds no
thresholds of its own. A limit of None reports the ratio without judging it.

Measurement names may hold ``{placeholders}``; a target is checked once for each parameter set
in its ``each`` (or the sets a benchmark passes for it, when they depend on the run, such as the
capacity fractions of ``kvtier demo``). A target whose measurements are missing, not finite, or
whose denominator is zero is left out (not run), never reported as missed.

Imports: ``kvtier.output`` and the standard library only.
"""

from __future__ import annotations

import math
import operator
import statistics
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from kvtier.output import print_table

_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt,
}


@dataclass(frozen=True)
class IssueTarget:
    """One target: ``numerator / denominator - offset`` compared with ``limit``."""

    issue: int
    benchmark: str  # the module that measures it: "offload", "load", "tiers"
    key: str  # unique within the benchmark; names the row when a benchmark passes parameters
    name: str  # as printed; may hold {placeholders}
    numerator: str
    denominator: str | None = None
    offset: float = 0.0
    comparison: str = ">="
    limit: float | None = None  # None: report only
    each: tuple[Mapping[str, Any], ...] = ({},)

    def __post_init__(self) -> None:
        if self.comparison not in _COMPARE:
            raise ValueError(f"target {self.key}: comparison must be one of {', '.join(_COMPARE)}")

    @property
    def metric(self) -> str:
        """The metric as an expression over measurement names."""
        text = self.numerator if self.denominator is None else f"{self.numerator} / {self.denominator}"
        return f"{text} - {self.offset:g}" if self.offset else text

    @property
    def limit_text(self) -> str:
        """``"<= 1.3"``, or ``"report"`` for a target without a limit."""
        return "report" if self.limit is None else f"{self.comparison} {self.limit:g}"

    def bind(self, params: Mapping[str, Any]) -> "IssueTarget":
        """This target with ``params`` filled into its name and measurement names."""
        fill = lambda s: None if s is None else s.format(**params)  # noqa: E731
        return replace(self, name=fill(self.name), numerator=fill(self.numerator),
                       denominator=fill(self.denominator), each=({},))

    def value(self, measured: Mapping[str, float]) -> float | None:
        """The metric from ``measured``, or None when it cannot be computed."""
        top = measured.get(self.numerator)
        bottom = 1.0 if self.denominator is None else measured.get(self.denominator)
        if top is None or bottom is None or not math.isfinite(top) or not math.isfinite(bottom) or bottom == 0:
            return None
        return top / bottom - self.offset

    def check(self, measured: Mapping[str, float]) -> dict | None:
        """The row of a bound target (``issue, target, metric, value, limit, met``), or None."""
        value = self.value(measured)
        return None if value is None else self.judge(value)

    def judge(self, value: float) -> dict:
        """The row of a bound target for the metric's ``value`` (see ``check``)."""
        met = None if self.limit is None else _COMPARE[self.comparison](value, self.limit)
        return {"issue": self.issue, "target": self.name, "metric": self.metric, "value": round(value, 4),
                "limit": self.limit_text, "met": met}


def _t(issue: int, benchmark: str, key: str, name: str, numerator: str, denominator: str | None = None,
       comparison: str = ">=", limit: float | None = None, offset: float = 0.0,
       each: Sequence[Mapping[str, Any]] = ({},)) -> IssueTarget:
    return IssueTarget(issue, benchmark, key, name, numerator, denominator, offset, comparison, limit, tuple(each))


_OPS = [{"op": "put"}, {"op": "get"}]


def _sizes(mibs: Iterable[int], ops: Sequence[Mapping[str, Any]] = _OPS) -> list[dict]:
    return [{**op, "mib": mib} for mib in mibs for op in ops]


def _load_ratio(key: str, name: str, a: str, b: str, limit: float | None) -> IssueTarget:
    return _t(4, "load", key, name, f"gbps:{a}", f"gbps:{b}", ">=", limit)


TARGETS: tuple[IssueTarget, ...] = (
    # issue 2: the RAM and disk tiers beside a plain copy / plain file I/O, 4 MiB entries
    _t(2, "tiers", "ram", "ram {op} {mib} MiB vs memcpy", "gbps:ram/{op}/{mib}MiB", "gbps:memcpy/{op}/{mib}MiB",
       ">=", 0.7, each=_sizes([4])),
    _t(2, "tiers", "disk", "disk {op} {mib} MiB vs file", "gbps:disk/{op}/{mib}MiB", "gbps:file/{op}/{mib}MiB",
       ">=", 0.7, each=_sizes([4])),
    # issue 5: the redis tier beside a plain redis-py loop (1-8 MiB); a get through the server (4-16 MiB)
    _t(5, "tiers", "redis", "redis {op} {mib} MiB vs redis-py loop", "gbps:redis/{op}/{mib}MiB",
       "gbps:redis-py-loop/{op}/{mib}MiB", ">=", 0.9, each=_sizes([1, 2, 4, 8])),
    _t(5, "tiers", "server", "server get {mib} MiB vs memcpy", "gbps:server/get/{mib}MiB", "gbps:memcpy/get/{mib}MiB",
       ">=", 0.5, each=_sizes([4, 8, 16], [{"op": "get"}])),
    # issue 3: kvtier demo (TTFT p50 per setting and pass, the engine's own prefix hit, the capacity curve)
    _t(3, "offload", "ram-vs-hit", "kvtier-ram re-read / engine hit", "p50:kvtier-ram/again", "engine_hit", "<=", 1.3),
    _t(3, "offload", "ram-vs-vllm", "vLLM re-read / kvtier-ram re-read", "p50:vllm/again", "p50:kvtier-ram/again",
       ">=", 10),
    _t(3, "offload", "disk-vs-hit", "kvtier-ram+disk re-read / engine hit", "p50:kvtier-ram+disk/again", "engine_hit",
       "<=", 2),
    _t(3, "offload", "first-overhead", "kvtier-ram first pass overhead", "p50:kvtier-ram/first", "p50:vllm/first",
       "<=", 0.03, offset=1.0),
    _t(3, "offload", "capacity-0.33", "capacity 0.33: hit share", "hit_share@0.33", None, ">=", 0.25),
    _t(3, "offload", "capacity-0.67", "capacity 0.67: hit share", "hit_share@0.67", None, ">=", 0.55),
    _t(3, "offload", "capacity-over", "capacity {fraction:g}: hit share", "hit_share@{fraction:g}", None, ">=", 0.9,
       each=()),  # every fraction above the working set, passed by the benchmark
    # issue 26: the same, each re-read beside the same engine's own hit of the same document asked
    # right after it (the median of the per-document ratios: no drift between engines or passes)
    _t(26, "offload", "ram-vs-own-hit", "kvtier-ram re-read / its engine's own hit, paired per document",
       "own_hit_ratio:kvtier-ram", None, "<=", 1.3),
    _t(26, "offload", "disk-vs-own-hit", "kvtier-ram+disk re-read / its engine's own hit, paired per document",
       "own_hit_ratio:kvtier-ram+disk", None, "<=", 2),
    _t(3, "offload", "ram-vs-example-again", "kvtier-ram re-read / example-connector re-read",
       "p50:kvtier-ram/again", "p50:example-connector/again", "<=", 1),
    _t(3, "offload", "ram-vs-example-first", "kvtier-ram first / example-connector first",
       "p50:kvtier-ram/first", "p50:example-connector/first", "<", 1),
    _t(3, "offload", "ram-vs-lmcache-again", "kvtier-ram re-read / lmcache-mp re-read",
       "p50:kvtier-ram/again", "p50:lmcache-mp/again", "<", 1),
    _t(3, "offload", "ram-vs-lmcache-first", "kvtier-ram first / lmcache-mp first",
       "p50:kvtier-ram/first", "p50:lmcache-mp/first", "<=", 1),
    # issue 10: a RAM re-read beside its physical bound (the engine's own hit + one document's KV
    # bytes at the copy bandwidth measured in the same run); the KV-heavy model's target
    _t(10, "offload", "ram-vs-bound", "kvtier-ram re-read / (engine hit + KV bytes / memcpy)",
       "p50:kvtier-ram/again", "physical_bound", "<=", 1.1),
    # issue 4: kvtier bench load (GB/s per method and mode; peak RSS within its bound)
    _load_ratio("cold-dd", "cold vs dd direct", "kvtier/cold", "dd/cold", 0.9),
    _load_ratio("cold-st", "cold vs safetensors", "kvtier/cold", "safetensors/cold", 1.0),
    _load_ratio("warm-st", "warm vs safetensors", "kvtier/warm", "safetensors/warm", 0.9),
    _load_ratio("s3-runai", "s3 vs runai", "kvtier/s3", "runai/s3", 1.0),
    _load_ratio("lat-single", "s3+latency vs single GET", "kvtier/s3+latency", "single-stream/s3+latency", 3.0),
    _load_ratio("lat-seq", "s3+latency vs sequential GETs", "kvtier/s3+latency", "sequential/s3+latency", 3.0),
    _load_ratio("direct-dd", "cold (direct) vs dd direct", "kvtier-direct/cold", "dd/cold", 0.9),
    _load_ratio("s3-single", "s3 vs single GET (report)", "kvtier/s3", "single-stream/s3", None),
    _load_ratio("lat-runai", "s3+latency vs runai", "kvtier/s3+latency", "runai/s3+latency", None),
    _load_ratio("wan-single", "s3+wan vs single GET", "kvtier/s3+wan", "single-stream/s3+wan", 3.0),
    _load_ratio("wan-seq", "s3+wan vs sequential GETs", "kvtier/s3+wan", "sequential/s3+wan", 3.0),
    _load_ratio("wan-runai", "s3+wan vs runai", "kvtier/s3+wan", "runai/s3+wan", 1.0),
    _t(4, "load", "rss", "{run} peak RSS over baseline / (memory_limit + largest tensor + margin)",
       "rss_over:{run}", "rss_bound", "<=", 1.0, each=()),  # every kvtier run that owns its memory
    # issue 10: kvtier bench serve ("{metric}:{model}/{setting}/{phase}@{concurrency}"), for every
    # model and kvtier setting the run measured (passed by the benchmark)
    _t(10, "serve", "itl-disk-vs-ram", "{model} {setting} c4: decode ITL p99 beside disk loads / beside RAM loads",
       "itl_p99_disk_ms:{model}/{setting}/reread@4", "itl_p99_ram_ms:{model}/{setting}/reread@4", "<=", 1.25,
       each=()),
    _t(10, "serve", "tok-vs-vllm", "{model} {setting} c4 re-read: output tok/s / vLLM's",
       "output_tok_s:{model}/{setting}/reread@4", "output_tok_s:{model}/vllm/reread@4", ">=", 1.5, each=()),
    _t(10, "serve", "async-vs-sync", "{model} c4 re-read: async output tok/s / sync's",
       "output_tok_s:{model}/kvtier-async/reread@4", "output_tok_s:{model}/kvtier/reread@4", ">=", 1.0, each=()),
    _t(10, "serve", "first-tok", "{model} {setting} c4 first pass: output tok/s / vLLM's",
       "output_tok_s:{model}/{setting}/first@4", "output_tok_s:{model}/vllm/first@4", ">=", 0.98, each=()),
    _t(10, "serve", "first-ttft", "{model} {setting} c1 first pass: document TTFT p50 / vLLM's",
       "doc_ttft_p50_ms:{model}/{setting}/first@1", "doc_ttft_p50_ms:{model}/vllm/first@1", "<=", 1.01, each=()),
    # issue 25: the same first pass, stored / not stored (kvtier.skip_save) in one engine, the
    # median of the pairs' ratios (``--first-pairs``)
    _t(25, "serve", "pair-ttft", "{model} {setting} c1 first pass, paired: document TTFT stored / not stored",
       "pair_ttft:{model}/{setting}@1", None, "<=", 1.02, each=()),
    _t(25, "serve", "pair-tok", "{model} {setting} c4 first pass, paired: output tok/s stored / not stored",
       "pair_tok:{model}/{setting}@4", None, ">=", 0.98, each=()),
)


def for_benchmark(benchmark: str) -> list[IssueTarget]:
    """The targets ``benchmark`` measures, in table order."""
    return [t for t in TARGETS if t.benchmark == benchmark]


def evaluate(benchmark: str, measured: Mapping[str, float],
             params: Mapping[str, Sequence[Mapping[str, Any]]] | None = None) -> list[dict]:
    """Check every target of ``benchmark`` against ``measured``; one row per computable
    instance (see ``IssueTarget.check``). ``params`` overrides a target's ``each`` by key."""
    rows = []
    for target in for_benchmark(benchmark):
        for p in (params or {}).get(target.key, target.each):
            row = target.bind(p).check(measured)
            if row is not None:
                rows.append(row)
    return rows


def evaluate_rounds(benchmark: str, rounds: Sequence[Mapping[str, float]],
                    params: Mapping[str, Sequence[Mapping[str, Any]]] | None = None) -> list[dict]:
    """``evaluate`` over repeated rounds (one measurement mapping each, every ratio taken within
    its round): a target's value is the median of its per-round values and is judged against the
    limit; its row adds ``rounds`` (the per-round values, None where a round could not compute
    it), ``min`` and ``max``. A target no round computes is left out."""
    rows = []
    for target in for_benchmark(benchmark):
        for p in (params or {}).get(target.key, target.each):
            bound = target.bind(p)
            per_round = [bound.value(m) for m in rounds]
            values = [v for v in per_round if v is not None]
            if values:
                rows.append(bound.judge(statistics.median(values)) | {
                    "rounds": [None if v is None else round(v, 4) for v in per_round],
                    "min": round(min(values), 4), "max": round(max(values), 4)})
    return rows


def print_targets(rows: Sequence[dict]) -> None:
    """The checked targets as a table (nothing when there are none); a target judged over
    rounds shows its median with the rounds' min-max."""
    def measured(r: dict) -> str:
        spread = f" ({r['min']:.3f}-{r['max']:.3f})" if "min" in r else ""
        return f"{r['value']:.3f}{spread}"

    if rows:
        print_table(["issue", "target", "measured", "limit", "met"],
                    [[r["issue"], r["target"], measured(r), r["limit"],
                      {True: "yes", False: "NO", None: "-"}[r["met"]]] for r in rows])


__all__ = ["IssueTarget", "TARGETS", "evaluate", "evaluate_rounds", "for_benchmark", "print_targets"]
