"""Policy simulator: replay a trace through each eviction policy and through Belady's OPT.

A trace is one key per line with an optional second column, the entry's size in bytes
(whitespace separated); ``#`` starts a comment. Without sizes every entry weighs 1 and a
capacity counts entries. The owner loop below is the one ``policies.base`` documents, so a
policy behaves here exactly as it does under the store.

Synthetic traces (deterministic for a given seed) come from :func:`synthetic`:
``loop:KEYSxREPEATS``, ``zipf:ALPHA,KEYS,REQUESTS[,SEED]`` and
``mix:HOT,ALPHA,LOOPKEYS,REQUESTS[,SEED]`` (Zipf over HOT keys interleaved one-for-one with a
loop over LOOPKEYS other keys) and ``scan:HOT,ALPHA,SCANLEN,REQUESTS[,SEED]`` (Zipf over HOT
keys, every SCANLEN of its requests followed by a scan of SCANLEN keys never requested again) and
``recency:NEW,SPAN,REQUESTS[,SEED]`` (a NEW share of requests for keys never seen before, the
rest re-reads of recent keys, their age in keys exponential with mean SPAN: the pattern of
conversations that re-read their own recent turns, where recency, not frequency, predicts reuse).

A policy with a ``window_history`` (the adaptive W-TinyLFU) reports its window share over the
run in :attr:`SimResult.window`.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from dataclasses import dataclass
from typing import Iterable, Sequence

from kvtier.errors import ConfigError
from kvtier.policies.base import Owner
from kvtier.policies.registry import make_policy

OPT = "opt"


@dataclass(frozen=True)
class Trace:
    """Requests as dense integer keys (first appearance order) and their sizes (None: all 1)."""

    keys: Sequence[int]
    sizes: Sequence[int] | None = None

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class SimResult:
    policy: str
    capacity: int
    requests: int
    hits: int
    hit_bytes: int
    total_bytes: int
    window: tuple[tuple[int, float], ...] | None = None  # (requests seen, window share) per period

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def byte_hit_ratio(self) -> float:
        return self.hit_bytes / self.total_bytes if self.total_bytes else 0.0

    def as_dict(self) -> dict:
        out = {"policy": self.policy, "capacity": self.capacity, "hit_ratio": self.hit_ratio,
               "byte_hit_ratio": self.byte_hit_ratio, "requests": self.requests, "hits": self.hits}
        if self.window is not None:
            out["window_share"] = [[seen, share] for seen, share in self.window]
        return out


# -- traces ----------------------------------------------------------------------------------
def read_trace(path: str) -> Trace:
    """Parse a trace file; ConfigError naming the file and line on anything unreadable."""
    ids: dict[str, int] = {}
    keys: list[int] = []
    sizes: list[int] = []
    sized = None
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                fields = line.split("#", 1)[0].split()
                if not fields:
                    continue
                if len(fields) > 2 or (sized is not None and sized != (len(fields) == 2)):
                    raise ConfigError(f"{path}:{lineno}: expected 'KEY' or 'KEY SIZE' on every line")
                sized = len(fields) == 2
                keys.append(ids.setdefault(fields[0], len(ids)))
                if sized:
                    if not fields[1].isdigit() or int(fields[1]) == 0:
                        raise ConfigError(f"{path}:{lineno}: size {fields[1]!r} is not a positive integer")
                    sizes.append(int(fields[1]))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read trace ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text trace file") from exc
    if not keys:
        raise ConfigError(f"{path}: trace has no requests")
    return Trace(keys, sizes if sized else None)


def loop_trace(n_keys: int, repeats: int) -> list[int]:
    """Keys 0..n_keys-1 in order, ``repeats`` times (the cyclic re-read that breaks LRU)."""
    return list(range(n_keys)) * repeats


def zipf_trace(alpha: float, n_keys: int, n_requests: int, seed: int = 0) -> list[int]:
    """``n_requests`` keys drawn with P(rank k) proportional to 1/k**alpha, ranks shuffled to ids."""
    weights = [1.0 / (k**alpha) for k in range(1, n_keys + 1)]
    rng = random.Random(seed)
    ids = list(range(n_keys))
    rng.shuffle(ids)  # popularity not correlated with key value
    return rng.choices(ids, cum_weights=list(itertools.accumulate(weights)), k=n_requests)


def mixed_trace(hot_keys: int, alpha: float, loop_keys: int, n_requests: int, seed: int = 0) -> list[int]:
    """Zipf over ``hot_keys`` interleaved one-for-one with a loop over ``loop_keys`` other keys."""
    half = n_requests // 2
    zipf = zipf_trace(alpha, hot_keys, n_requests - half, seed)
    loop = [hot_keys + (i % loop_keys) for i in range(half)]
    out: list[int] = []
    for z, lk in itertools.zip_longest(zipf, loop):
        out.append(z)
        if lk is not None:
            out.append(lk)
    return out


def scan_trace(hot_keys: int, alpha: float, scan_len: int, n_requests: int, seed: int = 0) -> list[int]:
    """Zipf over ``hot_keys``; after every ``scan_len`` of its requests, a scan of ``scan_len`` keys
    never requested before or after (about half the requests are one-off scan keys)."""
    zipf = zipf_trace(alpha, hot_keys, n_requests - n_requests // 2, seed)
    out: list[int] = []
    fresh, scan_end = hot_keys, hot_keys + n_requests // 2  # the scan keys, in order
    for start in range(0, len(zipf), scan_len):
        out.extend(zipf[start:start + scan_len])
        take = min(scan_len, scan_end - fresh)
        out.extend(range(fresh, fresh + take))
        fresh += take
    return out


def recency_trace(new: float, span: int, n_requests: int, seed: int = 0) -> list[int]:
    """A share ``new`` of requests for new keys (0, 1, 2, ... in order), the rest re-reads of a
    recent key: ``age`` keys back from the newest, ``age`` exponential with mean ``span``
    truncated to the keys that exist (no key is hot for being the oldest)."""
    rng = random.Random(seed)
    out: list[int] = []
    fresh = 0
    for _ in range(n_requests):
        if fresh == 0 or rng.random() < new:
            out.append(fresh)
            fresh += 1
            continue
        below = -math.expm1(-fresh / span)  # P(age < fresh): the inverse CDF, truncated there
        age = int(-span * math.log1p(-rng.random() * below))
        out.append(fresh - 1 - min(age, fresh - 1))
    return out


def synthetic(spec: str) -> Trace:
    """A trace from ``loop:1000x30``, ``zipf:0.8,50000,500000[,SEED]``,
    ``mix:2000,0.8,20000,400000[,SEED]``, ``scan:2000,0.8,5000,400000[,SEED]`` or
    ``recency:0.3,800,100000[,SEED]``."""
    kind, _, args = spec.partition(":")
    try:
        if kind == "loop":
            n, _, r = args.lower().partition("x")
            return Trace(loop_trace(_pos_int(n), _pos_int(r)))
        parts = args.split(",")
        if kind == "zipf" and len(parts) in (3, 4):
            seed = int(parts[3]) if len(parts) == 4 else 0
            return Trace(zipf_trace(float(parts[0]), _pos_int(parts[1]), _pos_int(parts[2]), seed))
        if kind == "mix" and len(parts) in (4, 5):
            seed = int(parts[4]) if len(parts) == 5 else 0
            return Trace(mixed_trace(_pos_int(parts[0]), float(parts[1]), _pos_int(parts[2]),
                                     _pos_int(parts[3]), seed))
        if kind == "scan" and len(parts) in (4, 5):
            seed = int(parts[4]) if len(parts) == 5 else 0
            return Trace(scan_trace(_pos_int(parts[0]), float(parts[1]), _pos_int(parts[2]),
                                    _pos_int(parts[3]), seed))
        if kind == "recency" and len(parts) in (3, 4) and 0.0 < float(parts[0]) <= 1.0:
            seed = int(parts[3]) if len(parts) == 4 else 0
            return Trace(recency_trace(float(parts[0]), _pos_int(parts[1]), _pos_int(parts[2]), seed))
    except (ValueError, OverflowError):
        pass
    raise ConfigError(f"bad synthetic trace {spec!r}; use loop:KEYSxREPEATS, zipf:ALPHA,KEYS,REQUESTS[,SEED], "
                      "mix:HOT,ALPHA,LOOPKEYS,REQUESTS[,SEED], scan:HOT,ALPHA,SCANLEN,REQUESTS[,SEED] or "
                      "recency:NEW,SPAN,REQUESTS[,SEED] (NEW in (0, 1])")


def online_bound(spec: str, trace: Trace, capacity: int) -> float | None:
    """The most hits any online policy can expect, as a share of the requests, on ``trace``
    made from the synthetic ``zipf`` or ``scan`` spec ``spec``, at ``capacity`` entries; None
    for the other families.

    Their Zipf requests are drawn independently of each other (the independent reference model),
    so whatever a policy holds when a request comes, that request hits with at most the
    probability mass of the ``capacity`` most probable keys (the static policy that holds exactly
    those, Aho, Denning and Ullman's A0, is the best online one there); a scan's one-off keys
    never hit. Every policy also misses each key's first request, so the bound is never above the
    trace's share of later requests. Belady's OPT sees the future and, on a trace long enough to
    fill the cache many times, beats this bound. A capacity of 0 or less holds nothing (0.0)."""
    kind, _, args = spec.partition(":")
    parts = args.split(",")
    if kind == "zipf" and len(parts) in (3, 4):
        alpha, keys, drawn = float(parts[0]), int(parts[1]), int(parts[2])
    elif kind == "scan" and len(parts) in (4, 5):
        alpha, keys, drawn = float(parts[1]), int(parts[0]), int(parts[3]) - int(parts[3]) // 2
    else:
        return None
    if capacity <= 0 or not trace.keys:
        return 0.0
    weights = sorted((k ** -alpha for k in range(1, keys + 1)), reverse=True)  # any alpha: the most probable first
    held = math.fsum(weights[:capacity]) / math.fsum(weights)
    repeats = 1.0 - len(set(trace.keys)) / len(trace)  # the requests that are not a key's first
    return min(held * drawn / len(trace), repeats)


def _pos_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


# -- replay ----------------------------------------------------------------------------------
def simulate(trace: Trace, policy: str, capacity: int, **options) -> SimResult:
    """Hit counts of ``policy`` (a registered name, or ``"opt"``) with ``capacity`` bytes/entries."""
    if policy == OPT:
        return simulate_opt(trace, capacity)
    pol = make_policy(policy, capacity_hint=capacity, **options)
    request = Owner(pol, capacity).request
    hits = hit_bytes = 0
    sizes = trace.sizes if trace.sizes is not None else itertools.repeat(1)
    for key, size in zip(trace.keys, sizes):
        if request(key, size):
            hits += 1
            hit_bytes += size
    result = _result(policy, capacity, trace, hits, hit_bytes)
    history = getattr(pol, "window_history", None)
    if history is not None:
        result = dataclasses.replace(result, window=tuple(history))
    return result


def simulate_opt(trace: Trace, capacity: int) -> SimResult:
    """Belady's OPT: evict the resident key used farthest in the future; never store a key whose
    next use is farther than that (optimal for equal sizes, a strong heuristic with sizes)."""
    keys = trace.keys
    n = len(keys)
    sizes = trace.sizes if trace.sizes is not None else [1] * n
    never = n  # "no further use", later than any index
    next_use = [never] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        next_use[i] = last.get(keys[i], never)
        last[keys[i]] = i
    resident: dict[int, int] = {}  # key -> index of its next use
    stored: dict[int, int] = {}  # key -> size
    heap: list[tuple[int, int]] = []  # (-next use, key), stale entries skipped lazily
    used = hits = hit_bytes = 0
    for i in range(n):
        key, size, nu = keys[i], sizes[i], next_use[i]
        if key in resident:
            hits += 1
            hit_bytes += size
            resident[key] = nu
            heapq.heappush(heap, (-nu, key))
            continue
        if nu == never or size > capacity:
            continue
        while used + size > capacity:
            far, far_key = heap[0]
            if resident.get(far_key) != -far:
                heapq.heappop(heap)
                continue
            if -far <= nu:
                break  # everything resident is needed sooner: bypass this key
            heapq.heappop(heap)
            del resident[far_key]
            used -= stored.pop(far_key)
        if used + size > capacity:
            continue
        resident[key] = nu
        stored[key] = size
        used += size
        heapq.heappush(heap, (-nu, key))
    return _result(OPT, capacity, trace, hits, hit_bytes)


def _result(policy: str, capacity: int, trace: Trace, hits: int, hit_bytes: int) -> SimResult:
    total = sum(trace.sizes) if trace.sizes is not None else len(trace.keys)
    return SimResult(policy, capacity, len(trace.keys), hits, hit_bytes, total)


def capacity_hints(trace: Trace, capacities: Iterable[int]) -> list[str]:
    """One line per capacity that cannot mean what was probably meant: with a sized trace a
    capacity is bytes, so one below the mean entry size holds (almost) nothing."""
    if trace.sizes is None or not trace.sizes:
        return []
    mean = sum(trace.sizes) / len(trace.sizes)
    return [f"capacity {c:,} is in bytes (the trace gives entry sizes) and holds less than one entry of the "
            f"mean size {mean:,.0f} B; give bytes, e.g. --capacity {_suggest(mean)}"
            for c in capacities if c < mean]


def _suggest(mean: float) -> str:
    """A round byte size holding about a thousand mean-sized entries, e.g. ``4GiB``."""
    gib = mean * 1000 / 1024**3
    return f"{max(1, round(gib))}GiB" if gib >= 1 else f"{max(1, round(gib * 1024))}MiB"


def run(trace: Trace, policies: Iterable[str], capacities: Iterable[int]) -> list[SimResult]:
    """Every policy (``"opt"`` allowed) at every capacity, policies outermost."""
    capacities = list(capacities)
    for c in capacities:
        if c <= 0:
            raise ConfigError(f"capacity must be positive, got {c}")
    return [simulate(trace, p, c) for p in policies for c in capacities]
