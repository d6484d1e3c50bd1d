"""StoreConfig: the typed configuration of a TieredStore.

Imports: ``kvtier.config``, ``kvtier.errors``, ``kvtier.policies.admission``,
``kvtier.tiers.registry`` (tier specs are parsed through it when the config is built).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.config import Size, ranged, show, validate
from kvtier.errors import ConfigError
from kvtier.policies.admission import AdmissionConfig
from kvtier.tiers.registry import TierSpec, parse_tier_spec

DEFAULT_TIERS = ({"type": "ram", "capacity": "2GiB"},)


@dataclass(frozen=True)
class StoreConfig:
    """Configuration of a TieredStore.

    ``tiers`` is an ordered list of tier specs, fastest first, each given as
    ``{"type": NAME, "policy": POLICY, ...tier config}`` and parsed into a ``TierSpec`` when
    the config is built (an unknown type, key or value is a ConfigError then, before anything
    is opened). ``policy`` is ignored for self-managed (shared) tiers. ``max_entry_bytes``: the
    largest entry the store reads (a chunk's bytes; the connector can set its exact chunk
    size); a stored header announcing more is a corrupt entry, so a forged length never sizes
    an allocation. ``writer_nice``: how much nicer than the thread that builds the store the
    threads that write the lower tiers run (write-through and demotion copies; Linux, per
    thread; 0, the default: the same priority). Threads a lower tier starts from its writer would
    inherit it; the S3 tier starts its pools' threads when it is built, so its reads keep the
    engine's priority. The writer briefly
    holds the store's lock while it snapshots an entry, so a nice writer can slow a lookup on
    saturated cores. Where the engine's compute threads and the store share cores (a CPU
    engine), a nicer writer yields the CPU to the forward pass, and its bounded queue drops what
    it cannot keep up with (counted): under sustained load, lower-tier completeness traded for
    prefill time. Measured by ``kvtier bench serve``'s ``kvtier-writers-nice10`` setting (KV-heavy
    model, one client): first pass 1.07 x vLLM alone's TTFT instead of 1.13 x, nothing lost; not
    the default, as drops under a busier engine were not measured. ``writer_idle``: run those
    threads under Linux's ``SCHED_IDLE`` policy instead (per thread, no privilege needed): they
    get a core only when no other thread wants it and never preempt one, where a nice 19 thread
    still takes its small share of a busy core (and, on a CPU engine, stalls the engine's whole
    OpenMP team at its next barrier). Their queues then fill while every core computes and drop
    what does not fit (counted). A writer preempted while it holds the store lock or Python's GIL
    keeps it until a core is idle: next to a process that keeps every core busy, the engine's
    threads can wait that long (over a second was measured against one busy-looping process), so
    use it where the cores have idle time (a GPU server; a CPU engine between steps). Not with
    ``writer_nice`` (set one). ``writer_step_wait_s``: how long a lower-tier writer may hold a
    copy while the engine's step runs (``TieredStore.engine_step``, called by the vLLM
    connector around each forward pass): it waits for the step's end, but only while its queue
    is under half full and for at most this long after the copy was queued (or twice the
    longest of the last eight steps where that is longer, up to 30 s: a copy queued after one
    long prefill step must not be written during the next), so nothing is dropped for it and a
    busy engine cannot starve the tier, and never for a demotion or while an evicted entry waits
    for its copy (until written, no tier would find that key); copies then go between steps and after
    requests instead of taking a core from a forward pass that runs on the same cores. 0: never
    wait. None (the default): the vLLM connector sets 1.0 where the engine computes on the host
    CPU (vLLM's CPU platform) and 0 elsewhere (a GPU's forward pass leaves the host's cores to
    the writers); a store used on its own never waits. ``auth_key_file`` /
    ``auth_key_env``: where the trust domain's secret is (a file only its owner/group can read,
    or an environment variable; at most one): every entry is then tagged and checked (keyed
    BLAKE3, HMAC-SHA256 where blake3 is missing; an untagged or wrongly tagged entry is a
    counted miss), and ``kvtier.keys`` keys the chunk keys with it. The secret itself is never
    a config value, logged or in a message.
    ``element_dtype``: the element type of the KV the store is given (the engine's KV dtype,
    e.g. ``bfloat16``; default ``uint8``): lower tiers record it in each entry's header, and a
    tier ``codec`` shuffles by its width (``kvtier.codecs``).
    """

    tiers: list[TierSpec] = field(default_factory=lambda: [dict(t) for t in DEFAULT_TIERS])
    write_queue_depth: int = ranged(64, ge=1)
    write_through: bool = True
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    max_entry_bytes: Size = ranged(Size(1024**3), ge=1)
    writer_nice: int = ranged(0, ge=0, le=19)
    writer_idle: bool = False  # the lower tiers' writers under SCHED_IDLE (Linux)
    writer_step_wait_s: float | None = ranged(None, ge=0, le=60)  # hold copies while an engine step runs
    # the trust domain's secret (kvtier.entry.load_auth_secret): tags every entry, keys the chunk keys
    auth_key_file: str | None = None
    auth_key_env: str | None = None
    element_dtype: str = "uint8"  # the KV's element type (e.g. bfloat16): a tier codec's element width

    def __post_init__(self):
        validate(self, "store")  # the declared ranges, also for a config built by hand
        if self.writer_idle and self.writer_nice:
            raise ConfigError(f"store.writer_idle and store.writer_nice {self.writer_nice}: set one (an idle writer "
                              "has no niceness); valid: writer_idle true, or writer_nice 0-19")
        # specs given as mappings (a config built by hand) are parsed here; built ones pass through
        specs = [parse_tier_spec(spec, f"store.tiers[{i}]") for i, spec in enumerate(self.tiers)]
        object.__setattr__(self, "tiers", specs)

    def lossy_codec(self) -> str:
        """The lossy codec (``fp8``) some tier codes its entries with, or "" when every tier
        keeps the KV exact. An engine folds it into its key namespace (``kvtier.keys.Namespace``
        ``kv_codec``), so that engines configured without it never read a lossy entry."""
        from kvtier.codecs import LOSSY_CODECS

        used = sorted({getattr(spec.config, "codec", "none") for spec in self.tiers} & set(LOSSY_CODECS))
        return ",".join(used)

    def auth_secret(self, where: str = "store") -> bytes | None:
        """The secret named by ``auth_key_file``/``auth_key_env`` (None: none configured); read
        each time it is asked for, never kept in the config. ConfigError, one line without the
        secret, when it cannot be had."""
        from kvtier.entry import load_auth_secret

        return load_auth_secret(self.auth_key_file, self.auth_key_env, where)

    def entry_auth(self, where: str = "store"):
        """The ``kvtier.entry.EntryAuth`` of the configured secret, or None."""
        from kvtier.entry import EntryAuth

        secret = self.auth_secret(where)
        return None if secret is None else EntryAuth(secret)

    def check(self, where: str) -> None:
        """What the field declarations cannot say (``validate`` calls it after the ranges)."""
        if not self.tiers:
            raise ConfigError(f"{where}.tiers: at least one tier is needed")
        from kvtier.entry import DTYPES

        if self.element_dtype not in DTYPES:
            raise ConfigError(f"{where}.element_dtype: unknown dtype {show(self.element_dtype)}; "
                              f"valid: {', '.join(DTYPES)}")
