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
        except ValueError as exc:
            raise ConfigError(f"{what}: cannot read {text!r} as a token count (e.g. 4096, 128k = 128,000, "
                              "128K = 131,072)") from exc
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


# -- KV shapes -------------------------------------------------------------------------------
# Per-layer kinds this module sizes: attention that holds every token, attention that holds a
# window or the current chunk, and recurrent layers that hold one fixed state per sequence.
FULL, SLIDING, CHUNKED, MLA = "full_attention", "sliding_attention", "chunked_attention", "mla"
MAMBA, MAMBA2, GDN = "mamba", "mamba2", "gated_delta_net"
LINEAR, NO_CACHE = "linear_attention", "none"  # layer-type names before the family is known

# config ``layer_types`` / ``layers_block_type`` names -> the names above (transformers' legacy
# names included: "mamba", "attention"); "mlp" and "moe" layers (Nemotron-H) hold no cache
_LAYER_TYPE_NAMES = {FULL: FULL, SLIDING: SLIDING, CHUNKED: CHUNKED, LINEAR: LINEAR,
                     "attention": FULL, "mamba": LINEAR, "mlp": NO_CACHE, "moe": NO_CACHE}
_PATTERN_CHARS = {"M": LINEAR, "*": FULL, "-": NO_CACHE, "E": NO_CACHE}  # Nemotron-H hybrid_override_pattern
SUPPORTED_LAYER_TYPES = ("full_attention, sliding_attention, chunked_attention, linear_attention (Mamba, Mamba2, "
                         "gated delta net), and the names mamba, attention, mlp, moe")

# transformers' class defaults for the keys a config.json may leave out
_DEFAULT_WINDOW = {"gemma2": 4096, "gemma3_text": 4096, "gpt_oss": 128}
_DEFAULT_WINDOW_PATTERN = {"gemma2": 2, "gpt_oss": 2, "gemma3_text": 6, "cohere2": 4}
_DEFAULT_CHUNK = {"llama4_text": 8192}
# families whose cache kv-size does not model: refused in one line rather than sized wrong
_UNSUPPORTED_MODEL_TYPES = {
    "falcon_h1": "every layer holds attention KV and Mamba2 state side by side",
    "zamba": "shared attention blocks beside Mamba layers", "zamba2": "shared attention blocks beside Mamba2 layers",
    "recurrent_gemma": "RG-LRU recurrent blocks", "minimax": "lightning linear attention state",
    "kimi_linear": "Kimi delta attention state", "lfm2": "short convolution state", "lfm2_moe": "short convolution state",
    "deepseek_v32": "the sparse-attention indexer's cache beside the MLA latent",
    "gemma3n": "KV shared across layers",
}
SUPPORTED_FAMILIES = ("dense/GQA attention, sliding window (Gemma 2/3, gpt-oss, Mistral, Cohere 2, Qwen2), chunked "
                      "local (Llama 4), MLA (DeepSeek V2/V3, Kimi K2), Mamba/Mamba2 hybrids (Jamba, Nemotron-H, "
                      "Granite 4, Bamba, Mamba), gated delta net (Qwen3-Next), and their multimodal text_config")
_WINDOW_OFF_BY_DEFAULT = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")  # use_sliding_window defaults to false
_GDN_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                 "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
_MAMBA2_DEFAULTS = {  # (heads, head_dim or None = expand x hidden / heads, d_state, groups, d_conv, expand)
    "mamba2": (128, 64, 128, 8, 4, 2), "nemotron_h": (128, 64, 128, 8, 4, 2),
    "bamba": (128, None, 256, 1, 4, 2), "granitemoehybrid": (128, None, 256, 1, 4, 2),
}
_MAMBA1_DEFAULTS = {"mamba": (16, 4, 2), "falcon_mamba": (16, 4, 2), "jamba": (16, 4, 2)}  # d_state, d_conv, expand


@dataclass(frozen=True)
class LayerKind:
    """One kind of cache layer of a model, sized for one tensor-parallel rank.

    Attention kinds cost ``bytes_per_token`` per layer for each token they hold: every token
    (full, MLA), at most ``window`` (sliding), or the tokens of the current ``window``-long
    chunk (chunked local). Recurrent kinds (Mamba, Mamba2, gated delta net) cost
    ``state_bytes`` per layer per sequence, whatever its length.
    """

    kind: str
    layers: int
    bytes_per_token: int = 0  # one layer, one rank, one token (attention kinds)
    window: int | None = None  # sliding window or attention chunk size, in tokens
    state_bytes: int = 0  # one layer, one rank, one sequence (recurrent kinds)
    state_shapes: tuple[tuple[int, ...], ...] = ()  # per rank: (conv state, recurrent state)
    tp_split: bool = True  # False: every TP rank holds the whole of it (MLA's latent)
    formula: str = ""  # bytes of this kind for ``tokens``, in words and numbers

    def tokens_held(self, tokens: int) -> int:
        """Tokens of a ``tokens``-long sequence each layer of this kind keeps (0 for recurrent)."""
        if self.kind in (FULL, MLA):
            return tokens
        if self.kind == SLIDING:
            return min(tokens, self.window)
        if self.kind == CHUNKED:  # the current chunk only: its first token is at floor((T-1)/C) x C
            return tokens - (tokens - 1) // self.window * self.window
        return 0

    def bytes_for(self, tokens: int) -> int:
        """This kind's bytes (all its layers, one rank) for one ``tokens``-long sequence."""
        return self.layers * (self.tokens_held(tokens) * self.bytes_per_token + self.state_bytes)

    @property
    def max_bytes_per_sequence(self) -> int | None:
        """The cap on this kind's bytes per sequence (window or chunk full, or the state); None
        for kinds that grow with every token."""
        if self.kind in (FULL, MLA):
            return None
        return self.layers * ((self.window or 0) * self.bytes_per_token + self.state_bytes)


@dataclass(frozen=True)
class KVShape:
    """What one model's KV cache costs on one tensor-parallel rank.

    ``bytes_per_token`` is every attention layer's KV of one token (within the windows, if
    any); ``full_bytes_per_token`` only the layers that keep every token; windowed and
    recurrent layers add a per-sequence amount (``fixed_bytes_for``).
    """

    attention: str  # "mha" (incl. GQA/MQA), "mla", or "none" (recurrent layers only)
    layers: int
    kv_heads: int  # the model's, before TP; 0 for MLA
    head_dim: int  # per K or V head; for MLA the latent width (kv_lora_rank + qk_rope_head_dim)
    dtype: str
    dtype_bytes: int
    bytes_per_token: int
    sliding_layers: int = 0  # layers that keep only the last ``sliding_window`` tokens
    sliding_window: int | None = None
    kinds: tuple[LayerKind, ...] = ()
    tp: int = 1

    @property
    def full_bytes_per_token(self) -> int:
        """Per-token bytes of the layers that keep every token (full attention, MLA)."""
        return sum(k.layers * k.bytes_per_token for k in self.kinds if k.kind in (FULL, MLA))

    def fixed_bytes_for(self, tokens: int) -> int:
        """Per-sequence bytes beside the full layers: windowed layers at ``tokens`` tokens (at
        most their window or chunk) plus recurrent state."""
        return sum(k.bytes_for(tokens) for k in self.kinds if k.kind not in (FULL, MLA))

    @property
    def max_fixed_bytes(self) -> int:
        """The cap of ``fixed_bytes_for``: every window and chunk full, plus the state."""
        return sum(k.max_bytes_per_sequence or 0 for k in self.kinds)

    def bytes_for(self, tokens: int) -> int:
        """KV bytes of one ``tokens``-long sequence on one rank, as vLLM's hybrid allocator
        holds them: full layers x tokens + windowed layers x min(tokens, window) + state."""
        if not self.kinds:  # a shape built by hand, as before kinds existed
            per_layer = self.bytes_per_token // self.layers
            windowed = min(tokens, self.sliding_window or tokens)
            return per_layer * ((self.layers - self.sliding_layers) * tokens + self.sliding_layers * windowed)
        return self.full_bytes_per_token * tokens + self.fixed_bytes_for(tokens)


def load_model_config(path: str) -> dict:
    """Read ``config.json`` from a model directory or a JSON file path; ConfigError otherwise."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read model config ({exc.strerror})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: not a JSON model config ({exc})".splitlines()[0]) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return data


def kv_shape(config: Mapping[str, Any], dtype: str | None = None, where: str = "config", tp: int = 1,
             ssm_dtype: str | None = None) -> KVShape:
    """The KV shape of a Hugging Face config (its ``text_config`` for a multimodal one) on one
    of ``tp`` tensor-parallel ranks.

    Attention layers: 2 x KV heads per rank x head_dim x dtype bytes per token and layer (MLA:
    (kv_lora_rank + qk_rope_head_dim) x dtype bytes, the same on every rank). Recurrent layers:
    their conv and recurrent state per sequence, in the model's dtype (the recurrent state in
    ``ssm_dtype``, else the config's ``mamba_ssm_cache_dtype``, as vLLM's
    ``--mamba-ssm-cache-dtype``); ``dtype`` (vLLM's ``--kv-cache-dtype``) applies to attention.
    ConfigError names a missing key, a layer type it cannot size, or a TP size that does not fit.
    """
    cfg = text_config(config)
    if cfg.get("model_type") in _UNSUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {cfg['model_type']!r} is not supported ("
                          f"{_UNSUPPORTED_MODEL_TYPES[cfg['model_type']]}); supported: {SUPPORTED_FAMILIES}")
    model_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or config.get("dtype") or "fp16"
    if dtype is None or str(dtype).lower() == AUTO_DTYPE:
        dtype = model_dtype
    nbytes = dtype_bytes(dtype)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ConfigError(f"tp must be a positive integer, got {tp!r}")
    types_ = layer_types(cfg, where)
    layers = len(types_)
    counts = {name: types_.count(name) for name in (FULL, SLIDING, CHUNKED, LINEAR)}
    kinds: list[LayerKind] = []
    attention, kv_heads, head_dim = "none", 0, 0
    if counts[FULL] + counts[SLIDING] + counts[CHUNKED]:
        if cfg.get("kv_lora_rank"):
            attention, head_dim = "mla", _int(cfg, where, "kv_lora_rank") + _int(cfg, where, "qk_rope_head_dim")
            if counts[SLIDING] or counts[CHUNKED]:
                raise ConfigError(f"{where}: MLA with sliding or chunked layers is not supported; supported: "
                                  "MLA on every attention layer (DeepSeek V2/V3, Kimi K2)")
            kinds.append(LayerKind(MLA, counts[FULL], head_dim * nbytes, tp_split=False, formula=(
                f"{counts[FULL]} MLA layers x tokens x ({cfg['kv_lora_rank']} kv_lora_rank + "
                f"{cfg['qk_rope_head_dim']} qk_rope_head_dim) x {nbytes} B, not split by TP")))
        else:
            attention = "mha"
            kv_heads, head_dim, per_rank = _attention_heads(cfg, where, tp)
            per_token = 2 * per_rank * head_dim * nbytes
            unit = f"(2 x {per_rank} KV heads{'/rank' if tp > 1 else ''} x {head_dim} head_dim x {nbytes} B)"
            if counts[FULL]:
                kinds.append(LayerKind(FULL, counts[FULL], per_token,
                                       formula=f"{counts[FULL]} full layers x tokens x {unit}"))
            if counts[SLIDING]:
                window = _window(cfg, where, "sliding_window", _DEFAULT_WINDOW, "sliding_attention")
                kinds.append(LayerKind(SLIDING, counts[SLIDING], per_token, window, formula=(
                    f"{counts[SLIDING]} sliding layers x min(tokens, {window:,}) x {unit}")))
            if counts[CHUNKED]:
                chunk = _window(cfg, where, "attention_chunk_size", _DEFAULT_CHUNK, "chunked_attention")
                kinds.append(LayerKind(CHUNKED, counts[CHUNKED], per_token, chunk, formula=(
                    f"{counts[CHUNKED]} chunked layers x (tokens of the current {chunk:,}-token chunk: "
                    f"tokens - floor((tokens - 1) / {chunk:,}) x {chunk:,}) x {unit}")))
    if counts[LINEAR]:
        state_nbytes = dtype_bytes(model_dtype)
        kinds.append(_recurrent_kind(cfg, where, counts[LINEAR], tp, state_nbytes, _ssm_bytes(cfg, ssm_dtype, state_nbytes)))
    sliding = next(((k.layers, k.window) for k in kinds if k.kind == SLIDING), (0, None))
    per_token = sum(k.layers * k.bytes_per_token for k in kinds)
    return KVShape(attention, layers, kv_heads, head_dim, str(dtype), nbytes, per_token, *sliding,
                   kinds=tuple(kinds), tp=tp)


def _attention_heads(cfg: Mapping[str, Any], where: str, tp: int) -> tuple[int, int, int]:
    """(KV heads, head_dim, KV heads per rank): vLLM splits KV heads across TP ranks and
    replicates them when there are fewer heads than ranks (at least one per rank)."""
    heads = _field(cfg, where, "num_attention_heads", "n_head")
    kv_heads = _int(cfg, where, "num_key_value_heads") if cfg.get("num_key_value_heads") else heads
    if cfg.get("head_dim"):
        head_dim = _int(cfg, where, "head_dim")
    else:
        hidden = _field(cfg, where, "hidden_size", "n_embd")
        if hidden % heads:
            raise ConfigError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    if (kv_heads >= tp and kv_heads % tp) or (kv_heads < tp and tp % kv_heads):
        raise ConfigError(f"{where}: tp {tp} does not fit {kv_heads} KV heads (vLLM needs tp to divide the KV "
                          "heads, or the KV heads to divide tp)")
    return kv_heads, head_dim, max(1, kv_heads // tp)


def _window(cfg: Mapping[str, Any], where: str, key: str, defaults: Mapping[str, int], kind: str) -> int:
    """The window (or chunk) of ``kind`` layers: the config's ``key``, else the family's default."""
    if cfg.get(key) is not None:
        return _int(cfg, where, key)
    if key not in cfg and cfg.get("model_type") in defaults:
        return defaults[cfg["model_type"]]
    raise ConfigError(f"{where}: {kind} layers but no {key!r} (needed for the KV size)")


def layer_types(cfg: Mapping[str, Any], where: str = "config") -> list[str]:
    """Each layer's cache kind (full_attention, sliding_attention, chunked_attention,
    linear_attention, or none) from a text config, as transformers derives it.

    Read in this order: ``layer_types`` or ``layers_block_type`` (Gemma 2/3, gpt-oss, Qwen3-Next,
    Granite 4, newer configs); Nemotron-H's ``hybrid_override_pattern``; Bamba's
    ``attn_layer_indices``; Jamba's ``attn_layer_period``/``attn_layer_offset``; pure Mamba
    models; Qwen3-Next's ``full_attention_interval``; Llama 4's ``attention_chunk_size`` with
    ``no_rope_layers`` (NoPE layers are global); else the sliding-window rules of
    ``sliding_layers``. An unknown layer type is one ConfigError naming it and the supported ones.
    """
    model_type = cfg.get("model_type")
    listed = cfg.get("layer_types") or cfg.get("layers_block_type")
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(listed, list) and listed:
        types_ = [_layer_type_name(t, f"layer_types[{i}]", where) for i, t in enumerate(listed)]
    elif isinstance(pattern, str) and pattern:
        for i, char in enumerate(pattern):
            if char not in _PATTERN_CHARS:
                raise ConfigError(f"{where}: hybrid_override_pattern[{i}] {char!r} is not a supported layer; "
                                  "supported: M (mamba), * (attention), - (mlp), E (moe)")
        types_ = [_PATTERN_CHARS[c] for c in pattern]
    else:
        layers = _field(cfg, where, "num_hidden_layers", "n_layer", "num_layers")
        types_ = _derived_layer_types(cfg, model_type, layers, where)
    declared = cfg.get("num_hidden_layers")
    if isinstance(declared, int) and not isinstance(declared, bool) and declared != len(types_) \
            and model_type != "nemotron_h":  # Nemotron-H ignores num_hidden_layers beside its pattern
        raise ConfigError(f"{where}: num_hidden_layers {declared} but {len(types_)} layer types are listed")
    return types_


def _layer_type_name(value: Any, what: str, where: str) -> str:
    if value not in _LAYER_TYPE_NAMES:
        raise ConfigError(f"{where}: {what} {value!r} is not a supported layer type; supported: {SUPPORTED_LAYER_TYPES}")
    return _LAYER_TYPE_NAMES[value]


def _derived_layer_types(cfg: Mapping[str, Any], model_type: Any, layers: int, where: str) -> list[str]:
    """Layer kinds of a config that does not list them (see ``layer_types``)."""
    if isinstance(cfg.get("attn_layer_indices"), list):  # Bamba
        indices = set(cfg["attn_layer_indices"])
        return [FULL if i in indices else LINEAR for i in range(layers)]
    if "attn_layer_period" in cfg or model_type == "jamba":
        period = _int(cfg, where, "attn_layer_period") if "attn_layer_period" in cfg else 8
        offset = cfg.get("attn_layer_offset", 4)
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
            raise ConfigError(f"{where}: attn_layer_offset must be an integer in [0, {period}), got {offset!r}")
        return [FULL if i % period == offset else LINEAR for i in range(layers)]
    if model_type in ("mamba", "mamba2", "falcon_mamba"):
        return [LINEAR] * layers
    if model_type == "qwen3_next" or "full_attention_interval" in cfg:
        interval = _int(cfg, where, "full_attention_interval") if "full_attention_interval" in cfg else 4
        return [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
    chunk = cfg.get("attention_chunk_size", _DEFAULT_CHUNK.get(model_type))
    if chunk:
        rope = cfg.get("no_rope_layers") or [int((i + 1) % cfg.get("no_rope_layer_interval", 4) != 0)
                                             for i in range(layers)]
        return [CHUNKED if i < len(rope) and rope[i] else FULL for i in range(layers)]
    count, _ = sliding_layers(cfg, layers, where)
    flags = _sliding_flags(cfg, layers) if count else [False] * layers
    return [SLIDING if f else FULL for f in flags]


def sliding_layers(cfg: Mapping[str, Any], layers: int, where: str = "config") -> tuple[int, int | None]:
    """(layers with sliding-window attention, the window) from a text config; (0, None) if none.

    Read in this order: ``layer_types`` (``"sliding_attention"`` entries; Gemma 2/3, newer
    configs), ``use_sliding_window: false`` (Qwen2/Qwen3: the window is declared but off, also
    when the key is absent), Qwen2's
    ``max_window_layers`` (layers from it on slide), ``sliding_window_pattern`` N (every Nth
    layer is global; Gemma 3's default 6, Cohere 2's 4), Gemma 2 and gpt-oss (every other layer), and
    otherwise a ``sliding_window`` on every layer (Mistral 7B v0.1).
    """
    window = cfg.get("sliding_window")
    if not window:
        return 0, None
    window = _int(cfg, where, "sliding_window")
    types_ = cfg.get("layer_types")
    if isinstance(types_, list) and types_:
        count = sum(1 for t in types_[:layers] if t == SLIDING)
        return (count, window) if count else (0, None)
    if cfg.get("use_sliding_window", cfg.get("model_type") not in _WINDOW_OFF_BY_DEFAULT) is False:
        return 0, None
    return sum(_sliding_flags(cfg, layers)), window


def _sliding_flags(cfg: Mapping[str, Any], layers: int) -> list[bool]:
    """Which layers slide, for a config with a window on and no ``layer_types``."""
    if cfg.get("use_sliding_window") is True and isinstance(cfg.get("max_window_layers"), int):
        return [i >= cfg["max_window_layers"] for i in range(layers)]  # Qwen2
    pattern = cfg.get("sliding_window_pattern", _DEFAULT_WINDOW_PATTERN.get(cfg.get("model_type")))
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        return [bool((i + 1) % pattern) for i in range(layers)]
    return [True] * layers


def _ssm_bytes(cfg: Mapping[str, Any], ssm_dtype: str | None, state_nbytes: int) -> int:
    """Bytes per value of the recurrent (SSM) state: ``ssm_dtype``, else the config's
    ``mamba_ssm_cache_dtype`` (Nemotron-H: float32 when absent, as vLLM), else the model's."""
    name = ssm_dtype if ssm_dtype not in (None, AUTO_DTYPE) else cfg.get("mamba_ssm_cache_dtype")
    if name in (None, AUTO_DTYPE) and cfg.get("model_type") == "nemotron_h":
        name = "float32"
    return state_nbytes if name in (None, AUTO_DTYPE) else dtype_bytes(name)


def _recurrent_kind(cfg: Mapping[str, Any], where: str, layers: int, tp: int, conv_b: int, ssm_b: int) -> LayerKind:
    """The state of ``layers`` linear-attention layers per sequence on one rank, as vLLM's
    ``MambaStateShapeCalculator`` shapes it: a conv state of (kernel - 1) x conv channels and a
    recurrent state; channels and heads split across TP ranks."""
    model_type = cfg.get("model_type")
    if any(k in cfg for k in _GDN_DEFAULTS) or model_type == "qwen3_next":
        nk, nv, dk, dv, kernel = (_opt(cfg, where, k, d) for k, d in _GDN_DEFAULTS.items())
        conv_dim = 2 * nk * dk + nv * dv
        shapes = ((_split(conv_dim, tp, "gated delta net conv channels", where), kernel - 1),
                  (_split(nv, tp, "linear_num_value_heads", where), dv, dk))
        text = (f"{layers} gated delta net layers x (conv ({kernel} - 1) x (2 x {nk} x {dk} + {nv} x {dv})"
                f"{'/' + str(tp) if tp > 1 else ''} x {conv_b} B + state {nv}{'/' + str(tp) if tp > 1 else ''} "
                f"x {dv} x {dk} x {ssm_b} B) per sequence")
        return _state_kind(GDN, layers, shapes, conv_b, ssm_b, text)
    mamba1 = model_type in _MAMBA1_DEFAULTS
    if mamba1:
        d_state0, d_conv0, expand0 = _MAMBA1_DEFAULTS[model_type]
        d_state = _opt(cfg, where, "mamba_d_state", None) or _opt(cfg, where, "state_size", d_state0)
        d_conv = _opt(cfg, where, "mamba_d_conv", None) or _opt(cfg, where, "conv_kernel", d_conv0)
        expand = _opt(cfg, where, "mamba_expand", None) or _opt(cfg, where, "expand", expand0)
        inner = (_opt(cfg, where, "intermediate_size", None) if model_type != "jamba" else None) \
            or expand * _field(cfg, where, "hidden_size")
        inner_tp = _split(inner, tp, "mamba intermediate size", where)
        shapes = ((inner_tp, d_conv - 1), (inner_tp, d_state))
        text = (f"{layers} Mamba layers x (conv ({d_conv} - 1) x {inner_tp} channels x {conv_b} B + state "
                f"{inner_tp} x {d_state} x {ssm_b} B) per sequence")
        return _state_kind(MAMBA, layers, shapes, conv_b, ssm_b, text)
    keys = ("mamba_d_state", "ssm_state_size", "state_size", "mamba_n_heads", "mamba_num_heads")
    if model_type in _MAMBA2_DEFAULTS or any(k in cfg for k in keys):
        return _mamba2_kind(cfg, where, layers, tp, conv_b, ssm_b)
    raise ConfigError(f"{where}: linear_attention layers of model_type {model_type!r}: cannot size their state; "
                      "supported: gated delta net (Qwen3-Next: linear_num_key_heads...), Mamba2 (Nemotron-H, "
                      "Granite 4, Bamba, mamba2: mamba_d_state / ssm_state_size...), Mamba (Jamba, mamba)")


def _mamba2_kind(cfg: Mapping[str, Any], where: str, layers: int, tp: int, conv_b: int, ssm_b: int) -> LayerKind:
    """Mamba2 state per rank: conv (d_conv - 1) x (heads x head_dim + 2 x groups x d_state) / tp,
    SSM heads / tp x head_dim x d_state; groups that do not divide tp are replicated to tp (vLLM)."""
    model_type = cfg.get("model_type")
    own = model_type == "mamba2"  # only Mamba2's own config names its SSM heads num_heads / head_dim
    heads0, head_dim0, d_state0, groups0, d_conv0, expand0 = _MAMBA2_DEFAULTS.get(model_type, (None,) * 6)
    heads = _first(cfg, where, ("mamba_n_heads", "mamba_num_heads") + (("num_heads",) if own else ()), heads0)
    d_state = _first(cfg, where, ("mamba_d_state", "ssm_state_size", "state_size"), d_state0)
    groups = _first(cfg, where, ("mamba_n_groups", "n_groups"), groups0 if groups0 else 1)
    d_conv = _first(cfg, where, ("mamba_d_conv", "conv_kernel"), d_conv0 or 4)
    head_names = ("mamba_d_head", "mamba_head_dim") + (("head_dim",) if own else ())
    explicit = [k for k in head_names if cfg.get(k) not in (None, "auto")]
    if explicit:
        head_dim = _int(cfg, where, explicit[0])
    elif head_dim0 is not None and not any(cfg.get(k) == "auto" for k in head_names):
        head_dim = head_dim0
    else:  # "auto": expand x hidden / heads
        expand = _first(cfg, where, ("mamba_expand", "expand"), expand0 or 2)
        head_dim = expand * _field(cfg, where, "hidden_size") // heads
    groups_tp = groups if groups % tp == 0 else tp  # vLLM's extra_groups_for_head_shards
    conv_dim = heads * head_dim + 2 * groups_tp * d_state
    shapes = ((_split(conv_dim, tp, "mamba2 conv channels", where), d_conv - 1),
              (_split(heads, tp, "mamba heads", where), head_dim, d_state))
    per = f"/{tp}" if tp > 1 else ""
    text = (f"{layers} Mamba2 layers x (conv ({d_conv} - 1) x ({heads} x {head_dim} + 2 x {groups_tp} x {d_state})"
            f"{per} x {conv_b} B + state {heads}{per} x {head_dim} x {d_state} x {ssm_b} B) per sequence")
    return _state_kind(MAMBA2, layers, shapes, conv_b, ssm_b, text)


def _state_kind(kind: str, layers: int, shapes: tuple, conv_b: int, ssm_b: int, text: str) -> LayerKind:
    conv, state = shapes
    return LayerKind(kind, layers, state_bytes=math.prod(conv) * conv_b + math.prod(state) * ssm_b,
                     state_shapes=shapes, formula=text)


def _split(value: int, tp: int, what: str, where: str) -> int:
    if value % tp:
        raise ConfigError(f"{where}: tp {tp} does not divide the {value} {what}")
    return value // tp


def _opt(cfg: Mapping[str, Any], where: str, name: str, default: int | None) -> int | None:
    """``cfg[name]`` as a positive integer, or ``default`` when it is absent or null."""
    return _int(cfg, where, name) if cfg.get(name) is not None else default


def _first(cfg: Mapping[str, Any], where: str, names: tuple[str, ...], default: int | None) -> int:
    """The first of ``names`` the config sets, else ``default``; ConfigError naming the first."""
    for name in names:
        if cfg.get(name) is not None:
            return _int(cfg, where, name)
    if default is None:
        raise ConfigError(f"{where}: missing {names[0]!r} (needed for the recurrent state size)")
    return default


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
    """The stable ``kv-size --json`` document for one ``tokens``-long sequence on one TP rank.

    ``total_bytes`` = ``full_bytes_per_token`` x tokens + ``fixed_bytes_per_sequence``
    (windowed layers at min(tokens, window), the current chunk, recurrent state);
    ``layer_kinds`` breaks it down per kind with each kind's formula.
    """
    if tokens <= 0:
        raise ConfigError(f"tokens must be positive, got {tokens}")
    total = shape.bytes_for(tokens)
    scalars = {k: v for k, v in asdict(shape).items() if k != "kinds"}
    kinds = [{"kind": k.kind, "layers": k.layers, "bytes_per_token_per_layer": k.bytes_per_token,
              "window": k.window, "tokens_held": k.tokens_held(tokens), "state_bytes_per_layer": k.state_bytes,
              "state_shapes": [list(s) for s in k.state_shapes], "tp_split": k.tp_split,
              "bytes": k.bytes_for(tokens), "max_bytes_per_sequence": k.max_bytes_per_sequence,
              "formula": k.formula} for k in shape.kinds]
    out = {"bytes_per_token": shape.bytes_per_token, "full_bytes_per_token": shape.full_bytes_per_token,
           "fixed_bytes_per_sequence": shape.fixed_bytes_for(tokens),
           "max_fixed_bytes_per_sequence": shape.max_fixed_bytes,
           "tokens": tokens, "total_bytes": total, "total_gib": total / GIB, "total_gb": total / GB,
           "all_ranks_total_bytes": total * shape.tp, **scalars, "layer_kinds": kinds,
           "formula": "total = " + " + ".join(k.formula for k in shape.kinds), "note": _note(shape)}
    return out


def _note(shape: KVShape) -> str | None:
    """What a reader of bytes_per_token alone would get wrong about this shape; None if nothing."""
    notes = []
    for k in shape.kinds:
        if k.kind == SLIDING:
            notes.append(f"{k.layers} of {shape.layers} layers use a {k.window:,}-token sliding window and hold "
                         "at most that many tokens")
        elif k.kind == CHUNKED:
            notes.append(f"{k.layers} of {shape.layers} layers use {k.window:,}-token chunked local attention "
                         "and hold only the current chunk")
        elif k.state_bytes:
            notes.append(f"{k.layers} of {shape.layers} layers are recurrent ({k.kind}): "
                         f"{k.layers * k.state_bytes:,} B per sequence, whatever its length")
        elif k.kind == MLA and shape.tp > 1:
            notes.append(f"MLA's latent is the same on each of the {shape.tp} TP ranks (not split)")
    if not notes:
        return None
    return "; ".join(notes) + ("; bytes_per_token counts every attention layer" if shape.sliding_layers or any(
        k.kind == CHUNKED for k in shape.kinds) else "")


def model_kv_bytes(path: str, tokens: int | str, dtype: str | None = None, tp: int = 1,
                   ssm_dtype: str | None = None) -> dict:
    """``kv_size`` of one ``tokens``-long prompt of the model at ``path`` (a directory holding
    config.json, or the file): what ``breakeven`` and ``fleet-load`` read from ``--model``."""
    config = load_model_config(path)
    shape = kv_shape(config, dtype, where=path, tp=tp, ssm_dtype=ssm_dtype)
    return kv_size(shape, parse_tokens(tokens))


def checkpoint_bytes(path: str) -> int:
    """Bytes of a model directory's ``*.safetensors`` files (what each pod reads at start); a
    config.json path stands for its directory. ConfigError when there are none."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
        total = sum(os.path.getsize(os.path.join(folder, n)) for n in names)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot list the model directory ({exc.strerror})") from exc
    if not names:
        raise ConfigError(f"{folder}: no *.safetensors files; give --model-size instead (e.g. 140GB)")
    return total


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
