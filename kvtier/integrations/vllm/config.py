"""Configuration of the vLLM KV connector, read from ``kv_connector_extra_config``.

Keys (all optional)::

    chunk_tokens       tokens per stored chunk, a multiple of the engine's block size (default:
                       128 rounded up to the block size; the tail of a prompt short of a whole
                       chunk is recomputed, so smaller chunks lose less of each prompt)
    tiers              ordered tier list, fastest first (default: one 4 GiB RAM tier)
    load_threads       chunks of one request read at once, overlapping lower tiers' I/O (4)
    write_queue_depth  bounded queue per lower tier (64); a full queue drops the write
    write_through      copy every new chunk to the lower tiers too (true)
    admission          {"min_prefix_chunks": N, "doorkeeper": bool} (off)
    config_file        a YAML/JSON file with these same keys; keys given inline win
    server             use a per-node kvtier cache server instead of in-process tiers
                       ("unix:///path.sock" or "tcp://host:port")
    server_token       the token a TCP server requires
    weights_id         a string naming the model's weights (a release tag, a checksum); it
                       replaces the sampled weights digest in the key namespace (see
                       kvtier.keys.weights_digest). Set it when the model is not a local
                       directory, or to share entries between differently laid out copies
    transfer_mode      "sync" (default) or "async". sync: every load completes in the step that
                       needs it. async: a hit that lies (partly) below the RAM tier is loaded
                       in the background while the engine runs other requests (vLLM's
                       asynchronous load protocol: the request waits in WAITING_FOR_REMOTE_KVS);
                       RAM-tier hits and hits through a cache server stay inline. Saves:
                       sync writes the step's chunks into the store in the step; async copies
                       their pages in the step and writes them on a background thread (a
                       bounded backlog: what does not fit is dropped and counted), except on a
                       CPU engine over an in-process RAM tier, where the step's copy into the
                       RAM tier is the whole save (as in sync: one copy, not two)
    async_ram_loads    with transfer_mode "async": load RAM-tier hits in the background too
                       (false). The step then never copies a load, but each such request waits
                       at least one step longer for its first token (measured by kvtier bench
                       serve's "kvtier-async-ram" setting). Refused in "sync" mode
    auth_key_file      a file (mode 600/640) holding this trust domain's secret; or
    auth_key_env       the environment variable holding it (at most one of the two). With it the
                       chunk keys are keyed by the secret (tenants without it cannot compute,
                       probe or overwrite them) and every lower-tier entry carries a tag checked
                       before a byte is loaded (an untagged or wrongly tagged entry is a counted
                       miss). The secret is never logged or shown. Every engine of the domain
                       (scheduler and workers) needs the same secret
    element_dtype      the KV's element type (e.g. "bfloat16"; default "uint8"): a tier's
                       ``codec: lossless`` shuffles by its width
    require_recompute  refuse to start unless vLLM's kv_load_failure_policy is "recompute"
                       (false: start with a one-line warning). vLLM's default, "fail", fails a
                       request whenever a chunk cannot be loaded (a tier down, a corrupt entry);
                       "recompute" recomputes it instead, as kvtier intends

With tensor or pipeline parallelism the ``capacity`` of a ``ram`` or ``disk`` tier is the total
over all workers (TP x PP), as vLLM's own ``kv_offloading_size`` is: each worker's store gets its
share, and each worker's disk tier its own subdirectory of ``path``: ``tp{TP}-rank{r}``, or
``pp{PP}-stage{s}-tp{TP}-rank{r}`` with several pipeline stages (see ``for_rank``).

Every tier spec is checked when the config is built (its ``type`` is a known tier type, its keys
are that tier's keys): a mistake fails the engine with one ConfigError line naming it and the
valid choices, on the scheduler side too, instead of a tier silently left out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, get_args

from kvtier.config import build, load_mapping, ranged, secret, show, validate
from kvtier.errors import ConfigError
from kvtier.store import StoreConfig

DEFAULT_CONNECTOR_TIERS = ({"type": "ram", "capacity": "4GiB"},)
TransferMode = Literal["sync", "async"]
TRANSFER_MODES = get_args(TransferMode)
WHERE = "kv_connector_extra_config"
# writer_step_wait_s where the forward pass runs on the host CPU: longer than a prefill step of a
# few thousand tokens on a small CPU engine, short enough that a stuck step costs little
STEP_WAIT_ON_CPU_S = 1.0


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector reads from ``kv_connector_extra_config`` (the keys are the
    module docstring's). Ranges are declared on the fields, ``transfer_mode`` is a Literal, and
    rules across fields are in ``check``: one ConfigError line ``kv_connector_extra_config.KEY``."""

    chunk_tokens: int | None = ranged(None, ge=1)
    load_threads: int = ranged(4, ge=1)
    store: StoreConfig = field(default_factory=lambda: StoreConfig(tiers=[dict(t) for t in DEFAULT_CONNECTOR_TIERS]))
    server: str | None = None
    server_token: str | None = secret(None)
    weights_id: str | None = None
    require_recompute: bool = False
    transfer_mode: TransferMode = "sync"
    async_ram_loads: bool = False

    def __post_init__(self):
        validate(self, WHERE)  # a config built by hand is checked as one built from a dict

    def check(self, where: str) -> None:
        """The checks across fields (``validate`` calls it after the declared ranges)."""
        if self.async_ram_loads and self.transfer_mode != "async":
            raise ConfigError(f"{where}.async_ram_loads: needs transfer_mode \"async\" "
                              f"(got {self.transfer_mode!r}); valid: remove it, or set transfer_mode async")
        for i, spec in enumerate(self.store.tiers):
            check_tier_spec(spec, f"{where}.tiers[{i}]")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "ConnectorConfig":
        """Build from vLLM's ``kv_connector_extra_config`` dict (flat store keys allowed)."""
        extra = dict(extra or {})
        path = extra.pop("config_file", None)
        merged = {**(load_mapping(path) if path else {}), **extra}
        own = {f.name for f in dataclasses.fields(cls)} - {"store"}
        store_keys = {f.name for f in dataclasses.fields(StoreConfig)}
        unknown = sorted((k for k in merged if k not in own | store_keys | {"store"}), key=str)
        if unknown:
            valid = sorted(own | store_keys | {"config_file"})
            raise ConfigError(f"{WHERE}: unknown key {show(unknown[0])}; valid keys: {', '.join(valid)}")
        store = dict(merged.pop("store", {}) or {})
        for key in store_keys & set(merged):
            store[key] = merged.pop(key)
        store.setdefault("tiers", [dict(t) for t in DEFAULT_CONNECTOR_TIERS])
        merged["store"] = build(StoreConfig, store, WHERE)
        return build(cls, merged, WHERE)

    def with_page_size(self, page_bytes: int) -> "ConnectorConfig":
        """The same config with RAM tiers sized for the engine: page size = the engine's page
        size, and the arena touched at start.

        One arena page per engine (layer, block) page makes every page copy a single memcpy.
        Touching the arena at start moves its page faults out of the first requests (measured:
        +6% TTFT on a first pass with an untouched arena, +1% with it touched). Explicit
        ``page_size``/``prefault`` settings are kept.
        """
        tiers = [spec.for_engine_pages(page_bytes) for spec in self.store.tiers]  # each tier fits itself
        return dataclasses.replace(self, store=dataclasses.replace(self.store, tiers=tiers))

    def with_kv_dtype(self, cache_dtype: Any, model_dtype: Any) -> "ConnectorConfig":
        """The same config with the store's ``element_dtype`` set from the engine's KV dtype
        (vLLM's ``cache_dtype``; ``auto``: the model's dtype), so a tier codec shuffles by the
        right width; an ``element_dtype`` the user gave (other than the default) is kept, except
        that with a lossy tier codec (which reads the elements as numbers) it must be the
        engine's own KV dtype: ConfigError (one line) otherwise."""
        dtype = kv_element_dtype(cache_dtype, model_dtype)
        given = self.store.element_dtype
        if given != "uint8":
            lossy = self.store.lossy_codec()
            if lossy and dtype != "uint8" and given != dtype:
                raise ConfigError(f"kv_connector_extra_config.element_dtype: {given!r}, but the engine's KV is "
                                  f"{dtype!r} and codec {lossy!r} quantizes the elements as numbers; valid: "
                                  f"{dtype!r} (or leave it out)")
            return self
        return dataclasses.replace(self, store=dataclasses.replace(self.store, element_dtype=dtype))

    def with_step_wait(self, forward_on_host_cpu: bool) -> "ConnectorConfig":
        """The same config with the store's ``writer_step_wait_s`` resolved where it was left
        unset: ``STEP_WAIT_ON_CPU_S`` when the engine's forward pass runs on the host's cores
        (its lower-tier writers would take a core from it), else 0. A value the user gave is kept."""
        if self.store.writer_step_wait_s is not None:
            return self
        wait = STEP_WAIT_ON_CPU_S if forward_on_host_cpu else 0.0
        return dataclasses.replace(self, store=dataclasses.replace(self.store, writer_step_wait_s=wait))

    def lossy_codec_warning(self) -> str | None:
        """One line when a lossy tier codec is configured but cannot code this engine's KV (its
        element dtype is not bfloat16, float16 or float32: the entries stay raw, exact), else None."""
        from kvtier.fp8 import SOURCE_DTYPES

        lossy = self.store.lossy_codec()
        if lossy and self.store.element_dtype not in SOURCE_DTYPES:
            return (f"kvtier: codec {lossy!r} stores this engine's KV raw: its KV dtype is "
                    f"{self.store.element_dtype!r} (fp8 codes bfloat16, float16 and float32 KV)")
        return None

    def for_rank(self, rank: int, world: int, stage: int = 0, stages: int = 1) -> "ConnectorConfig":
        """The config of tensor-parallel rank ``rank`` of ``world`` in pipeline stage ``stage``
        of ``stages`` (itself when there is one worker).

        Each worker owns a store of its own, holding its share of every chunk (its TP slice of
        its stage's layers). A ``ram`` or ``disk`` tier's ``capacity`` (given, or the tier's
        default) is split evenly over the ``world * stages`` workers, and a disk tier moves to
        ``path/tp{world}-rank{rank}`` (one stage) or ``path/pp{stages}-stage{stage}-tp{world}-
        rank{rank}``, so no two stores manage one directory. Shared tiers (redis, s3, fs) are
        shared anyway: workers use different keys there (``kvtier.keys.worker_key``).
        """
        if world == 1 and stages == 1:
            return self
        from kvtier.tiers.base import RankShare

        share = RankShare(rank, world, stage, stages)
        tiers = [spec.for_rank(share) for spec in self.store.tiers]  # each tier splits itself
        return dataclasses.replace(self, store=dataclasses.replace(self.store, tiers=tiers))


_KV_DTYPE_ALIASES = {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32",
                     "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def kv_element_dtype(cache_dtype: Any, model_dtype: Any) -> str:
    """The ``kvtier.entry.DTYPES`` name of the engine's KV elements: ``cache_dtype`` unless it is
    ``auto``/empty, then ``model_dtype`` (a torch dtype or its name); ``uint8`` when unknown."""
    from kvtier.entry import DTYPES

    source = model_dtype if str(cache_dtype or "auto") == "auto" else cache_dtype
    name = str(source or "").removeprefix("torch.")
    name = _KV_DTYPE_ALIASES.get(name, name)
    return name if name in DTYPES else "uint8"


def check_load_failure_policy(policy: str, require_recompute: bool) -> str | None:
    """None when vLLM's ``kv_load_failure_policy`` is ``"recompute"``; otherwise a one-line
    warning to log, or ConfigError (one line) when ``require_recompute`` is set."""
    if policy == "recompute":
        return None
    message = (f"kv_load_failure_policy is {policy!r}: a KV chunk kvtier cannot load (tier down, corrupt "
               f"entry) fails its request instead of being recomputed; set "
               f"\"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config")
    if require_recompute:
        raise ConfigError(f"kv_connector_extra_config.require_recompute: {message}")
    return f"kvtier: {message} (or \"require_recompute\": true to refuse to start)"


def check_tier_spec(spec: Mapping[str, Any], where: str) -> None:
    """ConfigError (one line: the tier, the bad key or type, the valid choices) unless ``spec``
    names a known tier type, a known policy, and only that tier's keys (plus ``type``, ``name``,
    ``policy``) with values of the right types (sizes parse).

    Nothing is opened or connected, so the scheduler side can reject a bad config at once.
    (``StoreConfig`` parses its tiers this same way, through the tier registry.)
    """
    from kvtier.tiers.registry import parse_tier_spec

    parse_tier_spec(spec, where)
