"""Scoring: which engine a request goes to.

score(e) = prefix_weight * prefix(e) + load_weight * load(e), both terms in [0, 1]:

* ``prefix(e)``: the longest run of the prompt's leading blocks that engine e can load, each block
  weighted by the best place it is in for e (its own pool > its kvtier RAM > its disk > a shared
  medium, which counts for every engine), divided by the prompt's block count. A block the router
  sent to e moments ago (a speculative entry, alive ``speculative_ttl_s``) counts as in e's pool.
  On a hybrid model the run ends where some sliding-window group of e no longer holds its window
  (``PrefixIndex.window_run``): every group must load the prefix at the same token count. An
  engine whose every group is a sliding window (no group names the prefix) is scored by its
  windows alone: the longest prefix whose windows it holds, each block at the weight of where
  the window is (its pool, or the window's worst block in kvtier's tiers).
* ``load(e)``: 1 - min(1, (L(e) - min L) / P), with L = requests in flight + queued prefill
  tokens / ``prefill_norm_tokens`` (both tracked by the router), min L over the candidates, and
  P = the prompt's tokens / ``prefill_norm_tokens``: how much longer e's queue is than the
  shortest, measured against this request's own prefill. 1 for the least busy engine (every
  engine when they are equally busy), 0 for one whose queue is longer by at least the prompt (a
  prompt of unknown length counts as one token: any difference is long). Measured against the
  request, not against the busiest candidate: relative load made any difference, however
  short, worth as much as half a long prompt's blocks, so a partly evicted document left the
  busy engine that still held most of it for an idle one that recomputed it all, where it
  crowded out that engine's own documents (seen in ``kvtier bench route --kvtier-ram-docs 0.4``).

A request-share guard keeps prefix affinity from piling a hot prefix onto one engine: among the
last ``balance_window`` decisions, an engine whose count would exceed ``balance_ratio`` x the
least-used candidate's count, and that count by more than ``balance_slack``, is over its share
(measured once the window holds at least half of ``balance_window`` decisions: a ratio over a
handful of decisions is noise, and acting on it splits a burst that speculative entries keep
together).
An over-share engine is passed over (while another candidate is not) for a request that loses
nothing by moving (no other candidate has a shorter weighted prefix than it), and for a request
of the prefix that dominates the engine's share (the deepest block the engine holds of it is the
most frequent among the engine's decisions in the window); a request of any other prefix it holds
stays. Moving a held prefix costs a recompute and leaves a second copy: copying the dominant one
is what spreads a hot prefix, while copying a lukewarm one costs the same and relieves little.
Ties go to the lowest-load engine, then to the one with the
fewest decisions in the window (so a prefix no engine holds is placed where it evens out the
shares instead of moving a held prefix later), then to the one listed first.

Placement by working set. A request whose prompt no candidate holds beyond what every candidate
holds (say, only a shared system prompt) is a *placement*: wherever it lands becomes its
prefix's home, and affinity keeps it there. Placed by load alone, homes pile up on whichever
engine happened to be idle, and an engine with more distinct prefixes than its caches hold
thrashes while the other's capacity idles (seen in ``kvtier bench route``: 5 documents on one
engine, 3 on the other, one engine recomputing its own documents). So a placement passes over
a candidate whose working set (the distinct blocks of the prompts routed to it in the window)
exceeds the smallest by more than half of the new prompt's unshared blocks, unless every
candidate left is busier than the least busy one by more than ``balance_slack`` plus the new
prompt's own prefill (in the load term's units: requests in flight + queued prefill tokens /
``prefill_norm_tokens``: a placement already costs a full prefill, and waiting about as long
again buys a home that does not crowd out others); among those left, the score decides. The
working sets are counted as decisions enter and leave the window, so a decision costs
O(prompt blocks), not O(window x prompt blocks).
Everything here is synchronous bookkeeping.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from kvtier.route.config import RouteConfig
from kvtier.route.index import GPU, PrefixIndex


class Speculative:
    """Short-lived entries "engine e will hold key k" for requests just routed (bounded, TTL)."""

    def __init__(self, ttl_s: float, max_keys: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._keys: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def add(self, engine: str, keys: Iterable[bytes]) -> None:
        """Mark ``keys`` as about to be held by ``engine`` until now + TTL."""
        if self.ttl_s <= 0:
            return
        expiry = self._clock() + self.ttl_s
        for key in keys:
            entry = self._keys.get(key)
            if entry is None:
                entry = self._keys[key] = {}
            else:
                self._keys.move_to_end(key)
            entry[engine] = expiry
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def engines(self, key: bytes) -> set[str]:
        """Engines with a live speculative entry for ``key`` (expired ones are dropped)."""
        entry = self._keys.get(key)
        if not entry:
            return set()
        now = self._clock()
        for engine in [e for e, t in entry.items() if t <= now]:
            del entry[engine]
        if not entry:
            del self._keys[key]
        return set(entry)

    def clear_engine(self, engine: str) -> None:
        """Forget every entry of ``engine``."""
        for key in list(self._keys):
            entry = self._keys[key]
            entry.pop(engine, None)
            if not entry:
                del self._keys[key]


@dataclass
class _Load:
    in_flight: int = 0
    queued_prefill: int = 0


@dataclass
class Ticket:
    """One routed request's share of an engine's load (``LoadTracker.start`` hands it out)."""

    engine: str
    prefill_tokens: int
    prefilled: bool = False
    done: bool = False


class LoadTracker:
    """Per-engine requests in flight and prefill tokens not yet answered (first byte pending)."""

    def __init__(self) -> None:
        self._load: dict[str, _Load] = {}

    def start(self, engine: str, prefill_tokens: int) -> Ticket:
        load = self._load.setdefault(engine, _Load())
        load.in_flight += 1
        load.queued_prefill += prefill_tokens
        return Ticket(engine, prefill_tokens)

    def first_byte(self, ticket: Ticket) -> None:
        """The engine answered: the request's prefill is done."""
        if not ticket.prefilled and not ticket.done:
            ticket.prefilled = True
            self._load[ticket.engine].queued_prefill -= ticket.prefill_tokens

    def finish(self, ticket: Ticket) -> None:
        """The request ended (any outcome); idempotent."""
        if ticket.done:
            return
        self.first_byte(ticket)
        ticket.done = True
        self._load[ticket.engine].in_flight -= 1

    def in_flight(self, engine: str) -> int:
        return self._load.get(engine, _Load()).in_flight

    def queued_prefill(self, engine: str) -> int:
        return self._load.get(engine, _Load()).queued_prefill


@dataclass(frozen=True)
class EngineScore:
    """One candidate's terms in a decision."""

    engine: str
    prefix: float
    matched_blocks: int
    load: float
    score: float
    held_back: bool = False
    crowded: bool = False  # a placement passed it over: its working set too far above the smallest

    def as_dict(self) -> dict:
        return {"engine": self.engine, "prefix": round(self.prefix, 4), "matched_blocks": self.matched_blocks,
                "load": round(self.load, 4), "score": round(self.score, 4), "held_back": self.held_back,
                "crowded": self.crowded}


@dataclass(frozen=True)
class Decision:
    """The chosen engine and every candidate's score (for the decision log); ``placement``: no
    candidate holds the whole prompt and every candidate's tier-weighted prefix is the same (no
    engine has an edge for it, so wherever it goes becomes its home)."""

    engine: str
    blocks: int
    scores: tuple[EngineScore, ...]
    placement: bool = False

    def matched_blocks(self) -> int:
        return next(s.matched_blocks for s in self.scores if s.engine == self.engine)


def prefix_matches(keys: Sequence[bytes], engines: Sequence[str], index: PrefixIndex,
                   speculative: Speculative | None, weight_of: Callable[[str], float],
                   shared_media: frozenset[str]) -> dict[str, tuple[float, int]]:
    """Per engine: (sum of tier weights over its longest consecutive run of ``keys``, run length).

    On an engine with sliding-window KV cache groups (a hybrid model) the run is what every
    group can load at the same token count: the naming (full-attention) groups' run, cut back
    to where every window group holds its window (``PrefixIndex.window_run``); an engine with
    no naming group at all, by its windows alone (``PrefixIndex.window_hit``)."""
    result = {e: (0.0, 0) for e in engines}
    free = [e for e in engines if index.naming_free(e)]  # scored by their windows alone (below)
    hybrid = {e: [] for e in engines if index.windows(e) and e not in free}  # per-block weights, to cut back
    alive = set(engines) - set(free)
    for i, key in enumerate(keys):
        holders = index.holders(key) or {}
        spec = speculative.engines(key) if speculative is not None else set()
        shared = max((weight_of(m) for media in holders.values() for m in media if m in shared_media), default=0.0)
        for engine in list(alive):
            w = max((weight_of(m) for m in holders.get(engine, ())), default=0.0)
            if engine in spec:
                w = max(w, weight_of(GPU))
            w = max(w, shared)
            if w <= 0:
                alive.discard(engine)
                continue
            total, _ = result[engine]
            result[engine] = (total + w, i + 1)
            if engine in hybrid:
                hybrid[engine].append(w)
        if not alive:
            break
    for engine, weights in hybrid.items():
        def routed(i: int, engine: str = engine) -> bool:
            return speculative is not None and engine in speculative.engines(keys[i])

        run = index.window_run(engine, keys, result[engine][1], shared_media, routed)
        if run < result[engine][1]:
            result[engine] = (sum(weights[:run]), run)
    for engine in free:
        def routed(i: int, engine: str = engine) -> bool:
            return speculative is not None and engine in speculative.engines(keys[i])

        run, source = index.window_hit(engine, keys, len(keys), shared_media, routed)
        if run <= 0:
            continue
        if source == "pool":
            weight = weight_of(GPU)
        else:  # the window's worst block, each at its best tier
            bs = index.block_size
            weight = min((max((weight_of(m) for m in index.window_media(engine, g, keys[i], shared_media)),
                              default=0.0)
                          for g, w in index.windows(engine).items()
                          for i in range(max(0, run * bs - w + 1) // bs, run)), default=0.0)
        result[engine] = (weight * run, run) if weight > 0 else (0.0, 0)
    return result


@dataclass
class Scorer:
    """Chooses an engine per request from the index, speculative entries and load."""

    config: RouteConfig
    index: PrefixIndex
    load: LoadTracker
    speculative: Speculative
    _recent: deque = field(default_factory=deque)  # (engine, affinity identity, prompt keys)
    _working: dict = field(default_factory=dict)  # engine -> Counter of its window's prompt blocks

    def choose(self, candidates: Sequence[str], keys: Sequence[bytes], prompt_tokens: int) -> Decision | None:
        """Score ``candidates`` (in preference order for ties) for a prompt with ``keys``; None when
        there is no candidate. Does not record the decision (``commit`` does)."""
        if not candidates:
            return None
        cfg = self.config
        matches = prefix_matches(keys, candidates, self.index, self.speculative, cfg.weight_of,
                                 frozenset(cfg.shared_media))
        raw = {e: self.load.in_flight(e) + self.load.queued_prefill(e) / cfg.prefill_norm_tokens for e in candidates}
        least = min(raw.values())
        own = max(1, prompt_tokens) / cfg.prefill_norm_tokens  # this request's prefill, in the load's units
        held = self._held_back(candidates)
        if held:
            elsewhere = max((matches[e][0] for e in candidates if e not in held), default=0.0)
            held = {e for e in held
                    if matches[e][0] <= elsewhere + 1e-9 or self._dominant(e, _identity(keys, matches[e][1]))}
        common = min(run for _, run in matches.values())
        weights = [w for w, _ in matches.values()]
        placement = common < len(keys) and max(weights) - min(weights) <= 1e-9
        if placement and cfg.balance_ratio > 0:
            block = self.index.block_size or cfg.block_size
            own = max(0, prompt_tokens - common * block) / cfg.prefill_norm_tokens  # its own prefill
            crowded = self._crowded(candidates, raw, (len(keys) - common) / 2, cfg.balance_slack + own)
        else:
            crowded = set()
        scores = []
        for e in candidates:
            weighted, run = matches[e]
            prefix = weighted / len(keys) if keys else 0.0
            load = 1.0 - min(1.0, (raw[e] - least) / own)
            score = cfg.prefix_weight * prefix + cfg.load_weight * load
            scores.append(EngineScore(e, prefix, run, load, score, e in held, e in crowded))
        eligible = ([s for s in scores if not s.held_back and not s.crowded]
                    or [s for s in scores if not s.held_back] or scores)
        shares = self.shares()
        best = max(eligible, key=lambda s: (round(s.score, 9), -raw[s.engine], -shares.get(s.engine, 0)))
        return Decision(best.engine, len(keys), tuple(scores), placement)

    def _crowded(self, candidates: Sequence[str], load: Mapping[str, float], tolerance: float,
                 patience: float) -> set[str]:
        """Candidates a placement passes over: a working set in the window (distinct blocks of
        the prompts routed there) more than ``tolerance`` blocks above the smallest, unless every
        candidate not passed over is busier (``load``: the load term's raw values) than the least
        busy by more than ``patience`` (then none is passed over: load decides)."""
        size = {e: len(self._working.get(e, ())) for e in candidates}
        smallest = min(size.values())
        crowded = {e for e in candidates if size[e] - smallest > tolerance}
        least_busy = min(load[e] for e in candidates)
        roomy = [e for e in candidates if e not in crowded]
        if all(load[e] - least_busy > patience for e in roomy):
            return set()
        return crowded

    def forget(self, engine: str) -> None:
        """Drop ``engine``'s decisions from the window (it left: its caches are gone)."""
        self._recent = deque(entry for entry in self._recent if entry[0] != engine)
        self._working.pop(engine, None)

    def commit(self, decision: Decision, keys: Sequence[bytes]) -> None:
        """Record that the request went to ``decision.engine`` (share window, speculative keys).

        The window also keeps the request's prefix identity on that engine when the engine won
        it by affinity (its prefix longer than every other candidate's); a placement (no such
        advantage) has none."""
        chosen = next(s for s in decision.scores if s.engine == decision.engine)
        others = max((s.prefix for s in decision.scores if s.engine != decision.engine), default=0.0)
        identity = _identity(keys, chosen.matched_blocks) if chosen.prefix > others + 1e-9 else None
        self._recent.append((decision.engine, identity, tuple(keys)))
        self._working.setdefault(decision.engine, Counter()).update(keys)
        while len(self._recent) > self.config.balance_window:
            engine, _, old = self._recent.popleft()
            working = self._working.get(engine)
            if working is not None:
                working.subtract(old)
                for key in old:
                    if working.get(key, 0) <= 0:
                        working.pop(key, None)
        self.speculative.add(decision.engine, keys)

    def uncached_tokens(self, decision: Decision, prompt_tokens: int) -> int:
        """Prompt tokens the chosen engine still has to prefill (by the index's estimate)."""
        return max(0, prompt_tokens - decision.matched_blocks() * max(self.index.block_size, 0))

    def _held_back(self, candidates: Sequence[str]) -> set[str]:
        ratio = self.config.balance_ratio
        if ratio <= 0 or len(candidates) < 2 or 2 * len(self._recent) < self.config.balance_window:
            return set()
        counts = {e: 0 for e in candidates}
        for e, _, _ in self._recent:
            if e in counts:
                counts[e] += 1
        low = min(counts.values())
        slack = self.config.balance_slack
        held = {e for e, c in counts.items() if c > low and c + 1 - low > slack and c + 1 > ratio * low}
        return held if len(held) < len(candidates) else set()

    def _dominant(self, engine: str, identity: bytes | None) -> bool:
        """Whether ``identity`` is (one of) the most frequent prefix identities among ``engine``'s
        affinity decisions in the window (None, a prompt the engine held nothing of, never is)."""
        if identity is None:
            return False
        counts: dict[bytes, int] = {}
        for e, ident, _ in self._recent:
            if e == engine and ident is not None:
                counts[ident] = counts.get(ident, 0) + 1
        return counts.get(identity, 0) >= max(counts.values(), default=0) > 0

    def shares(self) -> Mapping[str, int]:
        """Decisions per engine in the current window."""
        out: dict[str, int] = {}
        for e, _, _ in self._recent:
            out[e] = out.get(e, 0) + 1
        return out


def _identity(keys: Sequence[bytes], matched: int) -> bytes | None:
    """A prompt's prefix identity on an engine: the deepest of its blocks the engine holds."""
    return keys[matched - 1] if matched > 0 else None
