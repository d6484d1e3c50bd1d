"""The data of ``kvtier bench seed``: the document's figures (section 7), the sizes of one run
(``Scale``), what one run measured (``Run``) and the statistics over it. ``seed`` measures into a
``Run``; ``seed_report`` renders it; both import this module, neither imports the other at
import time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

EXPERIMENTS = ("zipf", "length", "disk", "chunk", "concurrency", "breakeven")
BLOCK = 128

# The document's figures (section 7). Working set of its capacity experiments: 10 documents,
# 52,025 tokens, 28,672 KV bytes/token = 1.49 GB; vLLM pool 21,520 tokens.
DOC_WORKING_SET_GB = 1.49
DOC_POOL_SHARE = 21520 / 52025
DOC_ZIPF = {"vllm": (278.0, None), 0.5: (289.0, 0.0), 1.0: (174.0, 0.44), 1.5: (121.0, 0.64),
            2.0: (63.0, 0.87), "disk": (47.0, 0.98)}
DOC_LENGTH = {554: (66.0, 21.0, 3.1), 1077: (119.0, 24.0, 5.0), 2144: (231.0, 29.0, 8.0),
              4273: (481.0, 45.0, 10.7), 6414: (768.0, 41.0, 19.0)}
DOC_DISK = {"recompute": (600.0, None), "ram": (39.0, None), "warm": (57.0, 255.0), "cold": (None, None)}
DOC_CHUNK = {64: 2048, 256: 2048, 1024: 2048}  # hit tokens; TTFT 140-144 ms each, vLLM alone 138 ms
DOC_CHUNK_TTFT, DOC_CHUNK_VLLM = 142.0, 138.0
DOC_BREAKEVEN = (22.3, 527.6, 22.3 / (22.3 + 527.6))  # miss cost, hit gain, p*


@dataclass(frozen=True)
class Scale:
    """The sizes of one run (``--quick`` shrinks them). Token counts are per document."""

    zipf_docs: int = 60
    zipf_tokens: int = 1000
    zipf_requests: int = 60
    zipf_gb: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0)
    zipf_lru_gb: tuple[float, ...] = (0.5, 1.0)  # the sizes below the working set
    zipf_disk_gb: float = 0.2
    lengths: tuple[int, ...] = (554, 1077, 2144, 4273, 6414)
    length_reps: int = 3
    disk_docs: int = 8
    disk_tokens: int = 4273
    disk_rounds: int = 2
    chunk_sizes: tuple[int, ...] = (128, 256, 512, 1024)
    chunk_prefix: int = 2000
    chunk_tail: int = 1000
    chunk_reps: int = 6
    conc_levels: tuple[int, ...] = (1, 2, 4, 8)
    conc_docs: int = 16
    conc_tokens: int = 1000
    conc_max_tokens: int = 16
    variants: tuple[str, ...] = ("small", "kv-heavy")
    heavy_length_reps: int = 2
    heavy_disk_docs: int = 5

    @staticmethod
    def quick() -> "Scale":
        """Under 5 minutes on two cores: the small model, 7 engines, fewer and shorter prompts."""
        return Scale(zipf_docs=24, zipf_tokens=540, zipf_requests=24, zipf_gb=(0.5, 2.0), zipf_lru_gb=(0.5,),
                     lengths=(554, 2144, 5000), length_reps=2, disk_docs=3, disk_tokens=2144, disk_rounds=2,
                     chunk_sizes=(128, 1024), chunk_reps=2, conc_levels=(1, 4), conc_docs=8, conc_tokens=500,
                     conc_max_tokens=8, variants=("small",))

    def zipf_working_tokens(self) -> int:
        return self.zipf_docs * self.zipf_tokens

    def pool_tokens(self, longest: int) -> int:
        """vLLM's pool: the document's share of the zipf working set, at least the longest
        prompt plus two blocks (vLLM keeps one back), in whole blocks."""
        want = max(int(DOC_POOL_SHARE * self.zipf_working_tokens()), longest + 2 * BLOCK)
        return -(-want // BLOCK) * BLOCK


@dataclass
class Run:
    """Everything one invocation measured (raw answers by experiment, model and setting)."""

    experiments: tuple[str, ...]
    scale: Scale
    bytes_per_token: dict[str, int] = field(default_factory=dict)
    raw: dict = field(default_factory=dict)
    started: float = 0.0
    seconds: float = 0.0
    pools: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # engine groups that failed (their rows are missing)
    load_start: tuple[float, ...] = ()  # the machine's load average when the run began (others' work shows here)


# --------------------------------------------------------------------------------------------
# statistics shared by the report


def p50(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def p95(values: list[float]) -> float:
    """The 95th percentile (linear interpolation between order statistics)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = 0.95 * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def mean(values: list[float]) -> float:
    return float(statistics.fmean(values)) if values else float("nan")
