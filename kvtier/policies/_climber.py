"""Hill climbing on the hit rate: the adaptive W-TinyLFU's choice of its window share.

A larger admission window favours recency (bursts, a hot set that shifts); a smaller one favours
frequency (loops, stable popularity, scans). No share suits every trace, so the climber measures
the hit rate over a sample period, moves the share by a step, and judges the move by the next
period's hit rate: kept direction when it did no worse, reversed (with a smaller step) when it
did worse. Steps also decay slowly when nothing changes, so the share settles; a large jump of
the hit rate (a new workload) restarts the search with the first, large step.

Pure bookkeeping: no clock, no randomness, no I/O; the same sequence of hits and misses gives
the same shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtier.errors import ConfigError


@dataclass
class HillClimber:
    """The window share in ``[min_share, max_share]`` and the climb that moves it.

    ``step`` is the first move (a share of the capacity; positive: the window grows first).
    A change of the hit rate within ``noise`` binomial standard deviations of zero is no
    evidence either way: the next move then shrinks the window (the small window is the safe
    side: scan- and loop-resistant). ``shrink`` multiplies the step's size on every reversal,
    ``decay`` on every other move; neither takes it below ``min_step``. A period whose hit rate
    differs from the previous one's by ``restart`` or more starts over with ``step``'s size.
    """

    share: float = 0.01
    step: float = 0.05
    min_share: float = 0.0
    max_share: float = 0.8
    shrink: float = 1.0
    decay: float = 0.98
    min_step: float = 0.005
    restart: float = 0.05
    noise: float = 1.0
    previous: float | None = field(default=None, init=False)  # hit rate of the last period
    _direction_step: float = field(default=0.0, init=False)  # the signed step to take next

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_share <= self.share <= self.max_share <= 1.0:
            raise ConfigError("window shares must satisfy 0 <= min_share <= share <= max_share <= 1, got "
                              f"{self.min_share}, {self.share}, {self.max_share}")
        if not 0.0 < self.min_step <= abs(self.step) <= 1.0:
            raise ConfigError(f"window step must satisfy 0 < min_step <= |step| <= 1, got {self.min_step}, {self.step}")
        if not (0.0 < self.shrink <= 1.0 and 0.0 < self.decay <= 1.0 and self.restart > 0.0 and self.noise >= 0.0):
            raise ConfigError("window climb: need 0 < shrink <= 1, 0 < decay <= 1, restart > 0 and noise >= 0, "
                              f"got {self.shrink}, {self.decay}, {self.restart}, {self.noise}")
        self._direction_step = self.step

    def climb(self, hit_rate: float, requests: int) -> float:
        """Take one period's ``hit_rate`` (0..1, over ``requests`` requests); return the next share.

        The first period only moves by ``step``. Afterwards the move just made is judged by the
        change of the hit rate against the noise band ``noise * sqrt(2 p (1 - p) / requests)``:
        better keeps the direction, worse reverses it (size x ``shrink``), inside the band the
        window shrinks; a change of ``restart`` or more resets the size to ``|step|``.
        """
        if not 0.0 <= hit_rate <= 1.0 or requests <= 0:
            raise ValueError(f"need a hit rate in [0, 1] over > 0 requests, got {hit_rate} over {requests}")
        move = self._direction_step
        if self.previous is not None:
            change = hit_rate - self.previous
            band = self.noise * math.sqrt(2.0 * hit_rate * (1.0 - hit_rate) / requests)
            size = abs(move)
            if change > band:
                move = math.copysign(size * self.decay, move)
            elif change < -band:
                move = math.copysign(size * self.shrink, -move)
            else:
                move = -size * self.decay
            if abs(change) >= self.restart:
                move = math.copysign(abs(self.step), move)
            move = math.copysign(max(abs(move), self.min_step), move)
        self.previous = hit_rate
        self._direction_step = move
        self.share = min(self.max_share, max(self.min_share, self.share + move))
        return self.share

    @property
    def next_step(self) -> float:
        """The signed step the last ``climb`` took (or the first one will take)."""
        return self._direction_step
