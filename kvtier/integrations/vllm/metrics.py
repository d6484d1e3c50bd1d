"""The connector's statistics, as vLLM carries them to its own ``/metrics`` and log lines.

vLLM asks each worker's connector for a ``KVConnectorStats`` every step, sums the workers'
(``aggregate``), ships ``to_dict()`` to the front end, rebuilds it there with the connector's
``build_kv_connector_stats`` and hands the data to the ``KVConnectorPromMetrics`` the connector's
``build_prom_metrics`` made (and a ``reduce()`` summary to the periodic log line). This module
holds both classes; the connector only records into :class:`KVTierConnectorStats`.

Payload (``KVTierConnectorStats.data``; plain dicts, lists and numbers, so any of vLLM's
serialisers carries it): ``counters`` {name: n} of the connector, ``tiers`` {tier name: {name:
n}} per tier, ``load_seconds`` and ``save_seconds`` lists (one duration per step that loaded or
saved). Every value is a delta of one interval: summing is the only aggregation.

Metric names on vLLM's ``/metrics`` (prometheus_client appends ``_total`` to counters; every
metric also carries vLLM's ``model_name`` and ``engine`` labels):

- ``vllm:kvtier_loaded_chunks{tier}``, ``vllm:kvtier_loaded_bytes{tier}``: chunks (bytes) loaded
  into the engine, by the tier that served them;
- ``vllm:kvtier_load_errors``: chunks that could not be loaded (vLLM recomputes them);
- ``vllm:kvtier_saved_chunks``, ``vllm:kvtier_saved_bytes``: chunks (bytes) saved from the engine;
- ``vllm:kvtier_saves_dropped``: chunks the store refused to take from the engine (with
  ``transfer_mode: async`` also a background write that failed);
- ``vllm:kvtier_saves_dropped_backlog``: chunks not saved because every staging slot of the
  background writer was in use (``transfer_mode: async``: saves that could not keep up);
- ``vllm:kvtier_background_loads``: requests loaded in the background (``transfer_mode: async``);
- ``vllm:kvtier_tier_hits{tier}``, ``_tier_misses``, ``_tier_read_bytes``, ``_tier_written_bytes``,
  ``_tier_errors``, ``_tier_corrupt``, ``_tier_dropped`` (writes dropped on a full queue),
  ``_tier_evictions``, ``_tier_coded`` (entries its codec stored coded): the in-process
  store's own per-tier counters, read each step (not
  reported with a cache server, which exposes them on its own ``/metrics`` for every engine of
  the node); background writes to lower tiers show at the next step;
- ``vllm:kvtier_load_seconds``, ``vllm:kvtier_save_seconds``: histograms of the time one step
  spent loading (saving) its chunks.

Names start with ``vllm:`` as vLLM's connector metrics do: vLLM unregisters collectors by that
prefix when it builds its loggers again, and dashboards select by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

# connector counters: stats key -> (metric name, help)
COUNTERS = {
    "load_error_chunks": ("vllm:kvtier_load_errors", "KV chunks kvtier could not load (vLLM recomputes them)."),
    "saved_chunks": ("vllm:kvtier_saved_chunks", "KV chunks kvtier saved from the engine."),
    "saved_bytes": ("vllm:kvtier_saved_bytes", "Bytes of KV kvtier saved from the engine."),
    "save_dropped": ("vllm:kvtier_saves_dropped", "KV chunks the kvtier store refused to take from the engine."),
    "save_backlog_dropped": ("vllm:kvtier_saves_dropped_backlog",
                             "KV chunks kvtier did not save because its background saves could not keep up "
                             "(transfer_mode async)."),
    "background_loads": ("vllm:kvtier_background_loads",
                         "Requests whose KV kvtier loaded in the background (transfer_mode async)."),
}
# per-tier counters: stats key -> (metric name, help); loaded_* come from the connector, the
# others are deltas of the store's own tier counters
TIER_COUNTERS = {
    "loaded_chunks": ("vllm:kvtier_loaded_chunks", "KV chunks kvtier loaded into the engine, by serving tier."),
    "loaded_bytes": ("vllm:kvtier_loaded_bytes", "Bytes of KV kvtier loaded into the engine, by serving tier."),
    "hits": ("vllm:kvtier_tier_hits", "Reads a kvtier tier answered with an entry."),
    "misses": ("vllm:kvtier_tier_misses", "Reads a kvtier tier could not answer."),
    "bytes_read": ("vllm:kvtier_tier_read_bytes", "Payload bytes read from a kvtier tier."),
    "bytes_written": ("vllm:kvtier_tier_written_bytes", "Payload bytes written to a kvtier tier."),
    "errors": ("vllm:kvtier_tier_errors", "Failed operations of a kvtier tier (I/O, connection, timeout)."),
    "corrupt": ("vllm:kvtier_tier_corrupt", "Entries of a kvtier tier that failed their checks (served as misses)."),
    "dropped": ("vllm:kvtier_tier_dropped", "Writes to a kvtier tier dropped because its queue was full."),
    "evictions": ("vllm:kvtier_tier_evictions", "Entries evicted from a kvtier tier."),
    "coded": ("vllm:kvtier_tier_coded", "Entries a kvtier tier's codec stored coded (the rest are raw)."),
}
STORE_TIER_KEYS = tuple(k for k in TIER_COUNTERS if not k.startswith("loaded_"))
HISTOGRAMS = {
    "load_seconds": ("vllm:kvtier_load_seconds", "Seconds one engine step spent loading KV chunks from kvtier."),
    "save_seconds": ("vllm:kvtier_save_seconds", "Seconds one engine step spent saving KV chunks to kvtier."),
}
TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """One interval's deltas (see the module docstring for the payload). Not thread-safe: the
    connector records from the engine's step thread only."""

    def __post_init__(self) -> None:
        data = dict(self.data or {})
        self.data = {
            "counters": dict(data.get("counters") or {}),
            "tiers": {str(t): dict(c) for t, c in (data.get("tiers") or {}).items()},
            **{k: list(data.get(k) or ()) for k in HISTOGRAMS},
        }

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    # ----------------------------------------------------------------------------- recording

    def count(self, **deltas: int | float) -> None:
        """Add to connector counters (keys of ``COUNTERS``)."""
        counters = self.data["counters"]
        for name, delta in deltas.items():
            counters[name] = counters.get(name, 0) + delta

    def count_tier(self, tier: str, **deltas: int | float) -> None:
        """Add to one tier's counters (keys of ``TIER_COUNTERS``)."""
        counters = self.data["tiers"].setdefault(str(tier), {})
        for name, delta in deltas.items():
            if delta:
                counters[name] = counters.get(name, 0) + delta

    def observe(self, name: str, seconds: float) -> None:
        """Record one duration of ``name`` (``load_seconds`` or ``save_seconds``)."""
        self.data[name].append(float(seconds))

    # ----------------------------------------------------------------------------- vLLM's API

    def aggregate(self, other: KVConnectorStats) -> "KVTierConnectorStats":
        """Add ``other``'s deltas (another worker's, or a later step's) to these."""
        incoming = other if isinstance(other, KVTierConnectorStats) else KVTierConnectorStats(data=dict(other.data or {}))
        self.count(**incoming.data["counters"])
        for tier, counters in incoming.data["tiers"].items():
            self.count_tier(tier, **counters)
        for name in HISTOGRAMS:
            self.data[name].extend(incoming.data[name])
        return self

    def reduce(self) -> dict[str, int | float]:
        """A flat summary for vLLM's periodic "KV Transfer metrics" log line."""
        counters, tiers = self.data["counters"], self.data["tiers"]
        out: dict[str, int | float] = {}
        for tier, c in sorted(tiers.items()):
            if c.get("loaded_chunks"):
                out[f"loaded_chunks_{tier}"] = c["loaded_chunks"]
        out["loaded_bytes"] = sum(c.get("loaded_bytes", 0) for c in tiers.values())
        for name in ("load_error_chunks", "saved_chunks", "saved_bytes", "save_dropped", "save_backlog_dropped"):
            out[name] = counters.get(name, 0)
        out["tier_dropped"] = sum(c.get("dropped", 0) for c in tiers.values())
        out["tier_errors"] = sum(c.get("errors", 0) for c in tiers.values())
        for name in HISTOGRAMS:
            values = self.data[name]
            if values:
                out[f"{name[:-len('_seconds')]}_ms_avg"] = round(1000 * sum(values) / len(values), 3)
        return out

    def is_empty(self) -> bool:
        return (not any(self.data["counters"].values())
                and not any(any(c.values()) for c in self.data["tiers"].values())
                and not any(self.data[name] for name in HISTOGRAMS))


def tier_counters(tiers: Iterable[Any]) -> dict[str, Any]:
    """``{"tiers": [{"name", counters...}]}`` of tiers' own counters (``tier.stats``), for
    ``TierDeltas.take``. Unlike the store's ``stats()`` it does no I/O (no directory walk, no
    remote call), so the engine's step thread may read it every step."""
    out = []
    for tier in tiers:
        counters = getattr(tier, "stats", None)
        if counters is not None and hasattr(counters, "as_dict"):
            out.append({"name": getattr(tier, "name", ""), **counters.as_dict()})
    return {"tiers": out}


class TierDeltas:
    """Turns cumulative per-tier counters into per-interval deltas.

    ``take(stats)`` (a store ``stats()`` dict or ``tier_counters(...)``) returns {tier name:
    {counter: delta}} since the previous call (the first call reports everything counted so far).
    A counter that went down (a tier rebuilt) counts from 0.
    """

    def __init__(self) -> None:
        self._last: dict[str, dict[str, int]] = {}

    def take(self, stats: Mapping[str, Any]) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for tier in stats.get("tiers") or ():
            name = str(tier.get("name", ""))
            last = self._last.setdefault(name, {})
            deltas = {}
            for key in STORE_TIER_KEYS:
                value = tier.get(key)
                if not isinstance(value, int) or isinstance(value, bool):
                    continue
                before = last.get(key, 0)
                deltas[key] = value - before if value >= before else value
                last[key] = value
            if any(deltas.values()):
                out[name] = deltas
        return out


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Registers kvtier's metrics with vLLM's Prometheus metric classes (so they land in the
    registry vLLM's ``/metrics`` serves, multiprocess mode included) and records each stats
    payload into them. Children per (engine, tier) are made on first use."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {key: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
                          for key, (name, doc) in COUNTERS.items()}
        self._tier_counters = {key: self._counter_cls(name=name, documentation=doc, labelnames=labelnames + ["tier"])
                               for key, (name, doc) in TIER_COUNTERS.items()}
        self._histograms = {key: self._histogram_cls(name=name, documentation=doc, labelnames=labelnames,
                                                     buckets=TIME_BUCKETS)
                            for key, (name, doc) in HISTOGRAMS.items()}
        self._children: dict[tuple, Any] = {}

    def _child(self, metric: Any, engine_idx: int, *extra: str) -> Any:
        key = (id(metric), engine_idx, extra)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*self.per_engine_labelvalues[engine_idx], *extra)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one payload (``KVTierConnectorStats.data``) to the metrics of engine ``engine_idx``."""
        stats = KVTierConnectorStats(data=dict(transfer_stats_data or {}))
        for key, value in stats.data["counters"].items():
            if key in self._counters and value > 0:
                self._child(self._counters[key], engine_idx).inc(value)
        for tier, counters in stats.data["tiers"].items():
            for key, value in counters.items():
                if key in self._tier_counters and value > 0:
                    self._child(self._tier_counters[key], engine_idx, tier).inc(value)
        for key, histogram in self._histograms.items():
            for seconds in stats.data[key]:
                self._child(histogram, engine_idx).observe(seconds)
