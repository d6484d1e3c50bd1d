"""Planning calculators: KV bytes per token, the break-even hit rate of offload, fleet cold start.

Pure functions over plain numbers; the CLI (``kvtier kv-size | breakeven | fleet-load``) only
parses and prints. Formulas are those of the source document, section 6-7.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from kvtier.errors import ConfigError

GIB = 1024**3
GB = 1000**3

_DTYPE_BYTES = {
    "fp32": 4, "float32": 4, "float": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "float8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_e4m3fn": 1, "fp8_e4m3fnuz": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "int8": 1,
    "fp8_inc": 1,  # vLLM's --kv-cache-dtype names
}
AUTO_DTYPE = "auto"  # vLLM's --kv-cache-dtype default: the model's dtype


def dtype_bytes(name: str) -> int:
    """Bytes per value of a KV dtype name (``fp16``, ``bfloat16``, ``fp8_e4m3``, ``torch.float16``...)."""
    key = str(name).lower().removeprefix("torch.")
    if key not in _DTYPE_BYTES:
        raise ConfigError(f"unknown KV dtype {name!r}; valid: auto (the model's), fp32, fp16, bf16, fp8 (and "
                          "vLLM's names: float16, bfloat16, fp8_e4m3, fp8_e5m2, fp8_inc)")
    return _DTYPE_BYTES[key]


def parse_tokens(text: str | int, what: str = "--tokens") -> int:
    """A positive token count as vLLM's ``--max-model-len`` reads it: ``4096``, ``128k`` (x1,000),
    ``128K`` (x1,024), ``1.5m`` (x1,000,000), ``1M`` (x2**20). ConfigError otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        raw = str(text).strip()
        factors = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
        number, factor = (raw[:-1], factors[raw[-1]]) if raw[-1:] in factors else (raw, 1)
        try:
            value = int(float(number) * factor) if factor != 1 else int(number)
        except ValueError:
            raise ConfigError(f"{what}: cannot read {text!r} as a token count (e.g. 4096, 128k = 128,000, "
                              "128K = 131,072)") from None
    if value <= 0:
        raise ConfigError(f"{what}: must be positive, got {text!r}")
    return value


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's fields: a multimodal wrapper (Llava, Gemma 3, Qwen2-VL...) keeps
    them under ``text_config``; other configs are returned as they are."""
    inner = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(inner, Mapping):
        return inner
    return config


def max_tokens(config: Mapping[str, Any]) -> int:
    """The model's context length (``max_position_embeddings`` of its text model), else 1."""
    cfg = text_config(config)
    value = cfg.get("max_position_embeddings") or config.get("max_position_embeddings") or 1
    return int(value)


@dataclass(frozen=True)
class KVShape:
    """What one token's KV costs in one model: ``bytes_per_token`` is the figure that matters."""

    attention: str  # "mha" (incl. GQA/MQA) or "mla"
    layers: int
    kv_heads: int  # 0 for MLA
    head_dim: int  # per K or V head; for MLA the latent width (kv_lora_rank + qk_rope_head_dim)
    dtype: str
    dtype_bytes: int
    bytes_per_token: int  # every layer's KV of one token (within the sliding window, if any)
    sliding_layers: int = 0  # layers that keep only the last ``sliding_window`` tokens
    sliding_window: int | None = None

    def bytes_for(self, tokens: int) -> int:
        """KV bytes of a ``tokens``-long sequence: full-attention layers hold every token,
        sliding-window layers at most their window (as vLLM allocates them)."""
        per_layer = self.bytes_per_token // self.layers
        windowed = min(tokens, self.sliding_window or tokens)
        return per_layer * ((self.layers - self.sliding_layers) * tokens + self.sliding_layers * windowed)


def load_model_config(path: str) -> dict:
    """Read ``config.json`` from a model directory or a JSON file path; ConfigError otherwise."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read model config ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: not a JSON model config ({exc})".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return data


def kv_shape(config: Mapping[str, Any], dtype: str | None = None, where: str = "config") -> KVShape:
    """KV bytes per token = 2 x layers x KV heads x head_dim x dtype bytes (MLA: layers x latent)."""
    cfg = text_config(config)
    if dtype is None or str(dtype).lower() == AUTO_DTYPE:
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or config.get("dtype") or "fp16"
    nbytes = dtype_bytes(dtype)
    layers = _field(cfg, where, "num_hidden_layers", "n_layer", "num_layers")
    if cfg.get("kv_lora_rank"):  # DeepSeek-style MLA: one compressed latent + rope key per layer
        latent = _int(cfg, where, "kv_lora_rank") + _int(cfg, where, "qk_rope_head_dim")
        return KVShape("mla", layers, 0, latent, str(dtype), nbytes, layers * latent * nbytes)
    heads = _field(cfg, where, "num_attention_heads", "n_head")
    kv_heads = _int(cfg, where, "num_key_value_heads") if cfg.get("num_key_value_heads") else heads
    if cfg.get("head_dim"):
        head_dim = _int(cfg, where, "head_dim")
    else:
        hidden = _field(cfg, where, "hidden_size", "n_embd")
        if hidden % heads:
            raise ConfigError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    per_token = 2 * layers * kv_heads * head_dim * nbytes
    sliding, window = sliding_layers(cfg, layers, where)
    return KVShape("mha", layers, kv_heads, head_dim, str(dtype), nbytes, per_token, sliding, window)


def sliding_layers(cfg: Mapping[str, Any], layers: int, where: str = "config") -> tuple[int, int | None]:
    """(layers with sliding-window attention, the window) from a text config; (0, None) if none.

    Read in this order: ``layer_types`` (``"sliding_attention"`` entries; Gemma 2/3, newer
    configs), ``use_sliding_window: false`` (Qwen2: the window is declared but off), Gemma 3's
    ``sliding_window_pattern`` N (every Nth layer is global), Gemma 2 (every other layer), and
    otherwise a ``sliding_window`` on every layer (Mistral 7B v0.1).
    """
    window = cfg.get("sliding_window")
    if not window:
        return 0, None
    window = _int(cfg, where, "sliding_window")
    types_ = cfg.get("layer_types")
    if isinstance(types_, list) and types_:
        count = sum(1 for t in types_[:layers] if t == "sliding_attention")
        return (count, window) if count else (0, None)
    if cfg.get("use_sliding_window") is False:
        return 0, None
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        return layers - layers // pattern, window
    if cfg.get("model_type") == "gemma2":
        return layers - layers // 2, window
    return layers, window


def _field(cfg: Mapping[str, Any], where: str, *names: str) -> int:
    for name in names:
        if cfg.get(name) is not None:
            return _int(cfg, where, name)
    raise ConfigError(f"{where}: missing {names[0]!r} (needed for the KV size)")


def _int(cfg: Mapping[str, Any], where: str, name: str) -> int:
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}: {name} must be a positive integer, got {value!r}")
    return value


def kv_size(shape: KVShape, tokens: int) -> dict:
    """The stable ``kv-size --json`` document for ``tokens`` tokens."""
    if tokens <= 0:
        raise ConfigError(f"tokens must be positive, got {tokens}")
    total = shape.bytes_for(tokens)
    out = {"bytes_per_token": shape.bytes_per_token, "tokens": tokens, "total_bytes": total,
           "total_gib": total / GIB, "total_gb": total / GB, **asdict(shape), "note": None}
    if shape.sliding_layers:
        out["note"] = (f"{shape.sliding_layers} of {shape.layers} layers use a {shape.sliding_window:,}-token "
                       f"sliding window and hold at most that many tokens; bytes_per_token counts every layer")
    return out


# -- break-even ------------------------------------------------------------------------------
def breakeven(miss_cost_ms: float, hit_gain_ms: float) -> float | None:
    """p* = miss cost / (miss cost + hit gain): the hit rate above which offload pays.

    Expected gain per request is p x gain - (1 - p) x cost, zero at p*. None when a hit saves
    nothing (gain <= 0): no hit rate pays then. 0 when storing is free.
    """
    if hit_gain_ms <= 0:
        return None
    miss_cost_ms = max(0.0, miss_cost_ms)
    return miss_cost_ms / (miss_cost_ms + hit_gain_ms)


def breakeven_from_ttft(recompute_ms: float, hit_ms: float, store_ms: float) -> dict:
    """From measured TTFTs: recompute (no offload), hit (loaded), first pass with storing."""
    miss, gain = store_ms - recompute_ms, recompute_ms - hit_ms
    return {"breakeven_hit_rate": breakeven(miss, gain), "miss_cost_ms": miss, "hit_gain_ms": gain}


def breakeven_first_principles(kv_bytes: int, bandwidth: float, latency_ms: float, recompute_ms: float,
                               miss_cost_ms: float | None = None,
                               write_bandwidth: float | None = None) -> dict:
    """A hit costs S/B + latency instead of the recompute; a miss costs the store's write.

    The write cost defaults to S / write bandwidth (or the read bandwidth): a synchronous store,
    the pessimistic case. An asynchronous write path makes it close to 0.
    """
    if bandwidth <= 0:
        raise ConfigError("bandwidth must be positive")
    load_ms = kv_bytes / bandwidth * 1000 + latency_ms
    if miss_cost_ms is None:
        miss_cost_ms = kv_bytes / (write_bandwidth or bandwidth) * 1000
    gain = recompute_ms - load_ms
    return {"breakeven_hit_rate": breakeven(miss_cost_ms, gain), "miss_cost_ms": miss_cost_ms,
            "hit_gain_ms": gain, "load_ms": load_ms}


# -- fleet cold start ------------------------------------------------------------------------
def fleet_load(model_bytes: int, pods: int, bandwidth: float, pods_per_node: int = 1, tp: int = 1) -> dict:
    """Bytes the shared storage serves when ``pods`` replicas start at once, and the read time.

    The headline figure is every pod reading the model once (the document: 140 GB x 100 pods =
    14 TB, 1,400 s at 10 GB/s). Scenarios show what changes it: ranks that each read the whole
    checkpoint instead of their shard (x tp), and a node-local cache that one pod per node fills.
    ``pods_per_node`` above ``pods`` is clamped to ``pods`` and said so in ``notes``.
    """
    if pods <= 0 or pods_per_node <= 0 or tp <= 0:
        raise ConfigError("pods, pods-per-node and tp must be positive")
    if bandwidth <= 0:
        raise ConfigError("bandwidth must be positive")
    notes = []
    if pods_per_node > pods:
        notes.append(f"pods-per-node {pods_per_node} is more than the {pods} pods: counted as {pods} (one node)")
        pods_per_node = pods
    total = model_bytes * pods
    nodes = math.ceil(pods / pods_per_node)
    scenarios = [("every pod reads the model (sharded per rank)", total)]
    if tp > 1:
        scenarios.insert(0, (f"every rank reads the whole model (tp={tp}, no sharding)", total * tp))
    if pods_per_node > 1:
        scenarios.append((f"node-local cache ({nodes} nodes x {pods_per_node} pods)", model_bytes * nodes))
    return {
        "total_bytes": total, "seconds": total / bandwidth, "model_bytes": model_bytes, "pods": pods,
        "bandwidth_bytes_per_s": bandwidth, "pods_per_node": pods_per_node, "tp": tp, "nodes": nodes,
        "per_rank_bytes": model_bytes // tp,
        "scenarios": [{"scenario": name, "total_bytes": b, "seconds": b / bandwidth} for name, b in scenarios],
        "notes": notes,
    }
