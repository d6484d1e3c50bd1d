"""Miniature simulations: how the adaptive W-TinyLFU picks its window share.

A larger admission window favours recency (re-reads of recent prefixes, bursts, a hot set that
shifts); a smaller one favours frequency (loops, stable popularity, scans). Rather than move its
real window by trial and error, the policy replays a spatial sample of its own requests (the keys
whose hash falls in one of ``rate`` buckets) through small W-TinyLFU caches of ``1/rate`` of its
capacity, one per candidate share, and takes the share whose miniature hit most. A cache of 1/R of
the size fed 1/R of the keys sees every reuse distance divided by R, so its hit ratio estimates
the full cache's (Waldspurger et al., "Cache Modeling and Optimization using Miniature
Simulations", USENIX ATC 2017; applied to W-TinyLFU's window by Einziger et al., "Adaptive
Software Cache Management", Middleware 2018). Every candidate is measured on the same requests
at once: no hits are spent exploring, and a share far from the current one is reached in one
decision, where a hill climber needs a period per step and is thrown back by noise.

Pure bookkeeping: no clock, no randomness, no I/O. The same int keys give the same choices in
every process; bytes and str keys are sampled by Python's salted hash (see ``key_hash``).
"""

from __future__ import annotations

import math
from typing import Sequence

from kvtier.errors import ConfigError
from kvtier.policies.base import Key, Owner
from kvtier.policies.wtinylfu import WTinyLFUPolicy

# Candidate window shares, smallest first (ties go to the smaller window: scan- and loop-resistant).
SHARES = (0.0, 0.01, 0.05, 0.15, 0.3, 0.5, 0.75, 1.0)
MINI_ENTRIES = 128  # entries a miniature aims to hold; fewer sampled keys only on smaller caches
MIN_MINI_ENTRIES = 8  # a miniature never holds fewer (smaller caches keep their window)
COST = 2  # the sample is sparse enough that a request costs at most 1/COST miniature updates on average
BAND = 1.0  # a lead smaller than this many standard deviations of a hit count is a tie
WARMUP_PERIODS = 2  # periods whose hits only warm the miniatures (their sketches and segments)
DECAY = 0.5  # weight of the previous periods' hits in a candidate's score

_MASK = (1 << 64) - 1


def key_hash(key: Key) -> int:
    """A 64-bit hash of ``key``: Python's ``hash`` through splitmix64's finaliser (so that
    sequential ints spread over the buckets). Ints hash the same in every process (the
    simulator's choices are reproducible); bytes and str are hashed with Python's per-process
    salt, so which of the store's keys fall in the sample cannot be known outside the process: a
    client that could choose sampled keys would weigh the choice of window R times over and
    cost R miniature updates per request. Choices for such keys can differ between processes,
    as the frequency sketch's estimates already do."""
    x = hash(key) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def min_entries(candidates: int) -> int:
    """The fewest entries a cache holds for its window to be chosen by miniatures: each holds
    ``MIN_MINI_ENTRIES`` at a sample sparse enough that a request costs at most ``1/COST``
    miniature updates. A smaller cache keeps its window (the miniatures would cost more than
    the cache itself per request and say little)."""
    return COST * candidates * MIN_MINI_ENTRIES


def sample_rate(entries: int, candidates: int) -> int:
    """1 in how many keys the miniatures see, for a cache of ``entries`` entries (at least
    ``min_entries``) and ``candidates`` miniatures: each miniature holds about ``MINI_ENTRIES``,
    and a request costs at most ``1/COST`` miniature updates on average."""
    return max(COST * candidates, entries // MINI_ENTRIES)


def check_shares(shares: Sequence[float]) -> tuple[float, ...]:
    """``shares`` sorted, or ConfigError unless they are a non-empty list of numbers in [0, 1]."""
    try:
        out = tuple(sorted(float(s) for s in shares))
    except (TypeError, ValueError):
        out = ()
    if not out or not all(0.0 <= s <= 1.0 for s in out):
        raise ConfigError(f"window shares must be a non-empty list of numbers in [0, 1], got {shares!r}")
    return out


class MiniSims:
    """Miniature W-TinyLFU caches of one candidate window share each, fed a sample of requests.

    ``capacity``: the real cache's bytes; ``entries``: how many entries it holds when full (its
    count at the first eviction, or the capacity over the first entry's size), which sets the
    sample rate. ``warmup``: periods whose hits are not scored. ``request`` replays one request
    (sampled keys only); ``choose`` closes a period and returns the share to use next.
    """

    def __init__(self, capacity: int, entries: int, shares: Sequence[float] = SHARES,
                 warmup: int = WARMUP_PERIODS):
        shares = check_shares(shares)
        if capacity < 1 or entries < min_entries(len(shares)):
            raise ValueError(f"need a positive capacity and at least {min_entries(len(shares))} entries, "
                             f"got {capacity} bytes, {entries} entries")
        self.shares = shares
        self.capacity = capacity
        self.entries = entries
        self.rate = sample_rate(entries, len(shares))
        mini = max(1, capacity // self.rate)
        self._minis = [Owner(WTinyLFUPolicy(capacity_hint=mini, window=share), mini) for share in shares]
        self._hits = [0] * len(shares)  # this period's, per miniature
        self._scores = [0.0] * len(shares)
        self._warming = max(0, int(warmup))  # periods that only fill the miniatures: their hits favour fast fillers

    def request(self, key: Key, size: int) -> None:
        """Replay a request of ``key`` (``size`` bytes) if the key is in the sample."""
        if key_hash(key) % self.rate:
            return
        for i, mini in enumerate(self._minis):
            if mini.request(key, size):
                self._hits[i] += 1

    def choose(self, current: float) -> float:
        """Close a period: fold each miniature's hits into its score (earlier periods weigh
        ``DECAY`` per period) and return the best candidate's share, or ``current`` when the
        best does not beat the candidate nearest ``current`` by more than one standard deviation
        of a hit count (``sqrt`` of it): a near-tie is noise, and moving costs the real cache
        its warmed segments. A ``current`` that is not a candidate always moves to the best."""
        for i, hits in enumerate(self._hits):
            self._scores[i] = DECAY * self._scores[i] + hits if not self._warming else 0.0
        self._hits = [0] * len(self.shares)
        if self._warming:
            self._warming -= 1
            return current
        best = max(range(len(self.shares)), key=lambda i: (self._scores[i], -i))
        if current not in self.shares:  # a share no miniature measures: the best measured one
            return self.shares[best]
        here = self.shares.index(current)
        if self._scores[best] - self._scores[here] <= BAND * math.sqrt(max(self._scores[best], 1.0)):
            return current
        return self.shares[best]

    @property
    def scores(self) -> list[float]:
        """Each candidate's decayed hit count, in ``shares`` order."""
        return list(self._scores)
