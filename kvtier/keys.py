"""Chunking of token ids, prefix-chained chunk keys, and the identity of what produced the KV.

Chunk ``i``'s key is ``sha256(key[i-1] || namespace digest || token ids of chunk i || mm)``
with the token ids as little-endian uint32 and ``mm`` the canonical bytes of the multimodal
items whose placeholder span overlaps chunk ``i`` (empty for a text-only chunk, so text-only
keys are unchanged by the multimodal support). Because keys chain, an item changes the key of
the first chunk that holds any of it and of every chunk after it; chunks before it keep their
keys. The key depends on nothing but its inputs: two processes or two machines that see the same
prefix under the same namespace compute the same keys (unlike Python's ``hash``, which
PYTHONHASHSEED changes per process). A trailing partial chunk has no key.
"""

from __future__ import annotations

import array
import hashlib
import hmac
import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NewType, Sequence

import numpy as np

from kvtier.errors import ConfigError

ChunkKey = NewType("ChunkKey", bytes)
# The one key type of every layer that stores chunks (tiers, store, server): a chunk key digest.
Key = ChunkKey
KEY_BYTES = 32
ROOT = ChunkKey(b"\x00" * KEY_BYTES)  # the "previous key" of chunk 0
DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class Namespace:
    """Everything that makes the KV bytes of the same tokens differ.

    Same namespace -> entries are shared; any field different -> never a hit. String fields
    are empty when unknown; an unknown field never makes two different engines share, only
    the fields that are known can tell them apart (see ``weights_digest`` for the weights).
    """

    model: str
    revision: str = ""  # the model's revision (hub branch/tag/commit) as the engine was given it
    config_digest: str = ""  # sha256 of the model's config (config.json / hf_config)
    weights_digest: str = ""  # see weights_digest(), or an operator-given weights id
    quantization: str = ""  # e.g. "fp8": weights quantized at load time change every KV byte
    dtype: str = ""  # the model's compute dtype
    kv_dtype: str = ""
    kv_layout: str = ""
    tp_world_size: int = 1
    tp_rank: int = 0
    pp_world_size: int = 1
    pp_partition: str = ""  # the layer split over pipeline stages, when set explicitly
    lora: str = ""  # the adapter's identity: name, path and weights digest (lora_identity())
    cache_salt: str = ""
    # each KV cache group's spec (attention type, window, chunk size, MLA sizes, layers) when the
    # engine has more than one plain full-attention group (see integrations.vllm.groups)
    kv_groups: str = ""
    # a lossy tier codec ("fp8") of the store the engine writes through: its entries are another KV
    kv_codec: str = ""

    def digest(self) -> bytes:
        """A 32-byte digest of all fields (canonical JSON, sorted keys). An empty ``kv_groups``
        or ``kv_codec`` is left out, so a namespace's digest is what it was before the field."""
        fields = asdict(self)
        for optional in ("kv_groups", "kv_codec"):
            if not fields[optional]:
                del fields[optional]
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).digest()

    def with_salt(self, cache_salt: str | None) -> "Namespace":
        """The same namespace with a per-request cache salt (``None`` keeps it unsalted)."""
        return replace(self, cache_salt=cache_salt or "")

    def with_lora(self, lora: str | None) -> "Namespace":
        """The same namespace for a LoRA adapter identity (``None`` is the base model)."""
        return replace(self, lora=lora or "")


@dataclass(frozen=True)
class MMItem:
    """One multimodal input (an image, an audio clip) of a prompt.

    ``identifier`` is a content hash of the item (vLLM's ``MultiModalFeatureSpec.identifier``);
    ``offset``/``length`` its placeholder span in the prompt's token ids.
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self):
        if not self.identifier:
            raise ValueError("a multimodal item needs a non-empty identifier")
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"bad multimodal placeholder span offset={self.offset} length={self.length}")

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of the item's placeholder tokens lies in ``[start, end)``."""
        return self.offset < end and start < self.offset + self.length

    def key_bytes(self, chunk_start: int) -> bytes:
        """Canonical bytes of the item as seen from a chunk starting at token ``chunk_start``:
        a tag, the identifier (length-prefixed), its offset relative to the chunk (signed: an
        item may start in an earlier chunk) and its length."""
        ident = self.identifier.encode()
        return (b"mm" + len(ident).to_bytes(4, "little") + ident
                + (self.offset - chunk_start).to_bytes(8, "little", signed=True)
                + self.length.to_bytes(8, "little"))


def config_digest(config: str | Path | dict) -> str:
    """Hex sha256 of a model's config.json content (canonicalised), or of a dict.

    A directory is taken to contain ``config.json``. ConfigError if it cannot be read.
    """
    if isinstance(config, dict):
        data = config
    else:
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: cannot read model config ({exc})") from exc
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def num_full_chunks(num_tokens: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> int:
    """How many complete chunks ``num_tokens`` tokens make."""
    return num_tokens // chunk_tokens


def chunk_keys(
    tokens: Sequence[int] | np.ndarray,
    namespace: Namespace | bytes,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    start: int = 0,
    prev: ChunkKey = ROOT,
    mm: Sequence[MMItem] = (),
    auth_key: bytes | None = None,
) -> list[ChunkKey]:
    """Keys of the full chunks of ``tokens``; the trailing partial chunk is not keyed.

    ``auth_key``: the trust domain's secret (``StoreConfig.auth_secret``). With it the namespace
    digest is replaced by ``keyed_namespace(digest, auth_key)`` in every chunk, so whoever lacks
    the secret can neither compute, probe nor overwrite these keys; without it (None) the keys
    are what they always were.

    ``start``/``prev`` resume a chain: keys for chunks ``start, start+1, ...`` given the key of
    chunk ``start-1`` (ROOT when ``start == 0``), so a growing sequence is hashed once. ``mm``
    lists the multimodal items of the prompt (any order, any number, spans may cross chunk
    boundaries): each is folded into every chunk its span overlaps, in (offset, identifier)
    order, and through the chain into every later chunk.
    """
    if chunk_tokens <= 0:
        raise ConfigError(f"chunk_tokens must be positive, got {chunk_tokens}")
    ns = namespace if isinstance(namespace, bytes) else namespace.digest()
    if auth_key is not None:
        ns = keyed_namespace(ns, auth_key)
    data = _token_bytes(tokens)
    items = sorted(mm, key=lambda m: (m.offset, m.identifier, m.length))
    width = chunk_tokens * 4
    keys: list[ChunkKey] = []
    for i in range(start, len(data) // width):
        lo, hi = i * chunk_tokens, (i + 1) * chunk_tokens
        h = hashlib.sha256(prev)
        h.update(ns)
        h.update(data[i * width : (i + 1) * width])
        for item in items:
            if item.overlaps(lo, hi):
                h.update(item.key_bytes(lo))
        prev = ChunkKey(h.digest())
        keys.append(prev)
    return keys


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes; ConfigError for an id outside [0, 2**32). A list
    or tuple of ints is packed by ``array`` (several times faster than numpy on a Python list)."""
    if isinstance(tokens, (list, tuple)):
        try:
            packed = array.array("I", tokens)
        except OverflowError as exc:
            raise ConfigError("token ids must be in [0, 2**32)") from exc
        except TypeError:  # not all ints (numpy scalars of other kinds): numpy decides below
            packed = None
        if packed is not None and packed.itemsize == 4:
            if sys.byteorder != "little":
                packed.byteswap()
            return packed.tobytes()
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ConfigError("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def keyed_namespace(namespace_digest: bytes, auth_key: bytes) -> bytes:
    """HMAC-SHA256 of a namespace digest under the trust domain's secret: the first input of
    every keyed chunk key (domain-separated from the entry tags of ``kvtier.entry.EntryAuth``).
    ValueError for an empty secret."""
    if not auth_key:
        raise ValueError("an auth key must not be empty")
    return hmac.new(bytes(auth_key), b"kvtier-chunk-keys-v1\x00" + bytes(namespace_digest), hashlib.sha256).digest()


def worker_key(key: bytes, tp_rank: int = 0, tp_size: int = 1, pp_stage: int = 0, pp_size: int = 1) -> bytes:
    """The key of one worker's share of a chunk: tensor-parallel rank ``tp_rank`` of pipeline
    stage ``pp_stage``.

    The chunk key itself with one worker (TP=PP=1); ``sha256(key || "rank" || tp_rank)`` with
    tensor parallelism only (as before pipeline stages were keyed); and with ``"stage" ||
    pp_stage`` appended when there are several stages, since a stage holds other layers.
    Ranks and stages are little-endian uint32.
    """
    if tp_size == 1 and pp_size == 1:
        return key
    blob = key + b"rank" + tp_rank.to_bytes(4, "little")
    if pp_size > 1:
        blob += b"stage" + pp_stage.to_bytes(4, "little")
    return hashlib.sha256(blob).digest()


def group_key(key: bytes, group: int) -> bytes:
    """The key of KV cache group ``group``'s part of a chunk (vLLM's hybrid KV cache groups):
    ``key`` itself for group 0, ``sha256(key || "group" || group)`` (little-endian uint32) for
    the others. Applied after ``worker_key``."""
    if group == 0:
        return key
    return hashlib.sha256(key + b"group" + group.to_bytes(4, "little")).digest()


@dataclass(frozen=True)
class WorkerShare:
    """One worker's place in the engine: TP rank ``tp_rank`` of ``tp_size`` in pipeline stage
    ``pp_stage`` of ``pp_size``. Each worker stores its share of a chunk under ``key(chunk)``
    (``worker_key``); a single worker (TP=PP=1) uses the chunk key itself."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_stage: int = 0
    pp_size: int = 1

    def key(self, chunk_key: bytes) -> bytes:
        """The key of this worker's share of the chunk ``chunk_key``."""
        return worker_key(chunk_key, self.tp_rank, self.tp_size, self.pp_stage, self.pp_size)

    def keys(self, chunk_keys: Sequence[bytes]) -> list[bytes]:
        """``key`` of each chunk key, in order."""
        return [self.key(k) for k in chunk_keys]

    def of(self, tp_rank: int, pp_stage: int) -> "WorkerShare":
        """The share of another worker of the same engine (same TP and PP sizes)."""
        return replace(self, tp_rank=tp_rank, pp_stage=pp_stage)


# ------------------------------------------------------------------------------- weights identity

WEIGHTS_WINDOW = 256  # bytes hashed at the start and at the end of each sampled tensor
WEIGHTS_MAX_TENSORS = 1024  # tensors sampled per file (evenly spread), bounding the cost
_MAX_HEADER = 100 << 20


def weights_digest(model_dir: str | Path) -> str:
    """A cheap hex sha256 that tells apart different weights in a local model directory.

    Contract: the same files (by content) give the same digest in any process or machine;
    file times, owners and the directory's path play no part, so a copy of a model (a node
    cache, another machine) shares entries with the original. Cost: for each weight file, its
    name, its size, its safetensors header (names, dtypes, shapes, offsets) and the first and
    last ``WEIGHTS_WINDOW`` bytes of up to ``WEIGHTS_MAX_TENSORS`` tensors (a few hundred KiB
    of small reads per file), not the whole file: a full fine-tune, a merged adapter, a
    re-quantized or replaced file all change those bytes; an edit confined to unsampled bytes
    is not seen (give the connector an explicit ``weights_id`` then).

    Weight files are those named in ``model.safetensors.index.json`` if present, else every
    ``*.safetensors``, else ``*.bin``/``*.pt``/``*.pth`` (sampled evenly). Returns "" when
    ``model_dir`` is not a local directory or holds no weight files (e.g. a hub id not yet
    downloaded): the weights are then known only by name, revision and config.
    """
    root = Path(model_dir)
    if not root.is_dir():
        return ""
    files = _weight_files(root)
    if not files:
        return ""
    h = hashlib.sha256(b"kvtier-weights-v1")
    for path in files:
        name = path.relative_to(root).as_posix().encode()
        h.update(len(name).to_bytes(4, "little") + name)
        try:
            with open(path, "rb") as f:
                _sample_file(f.fileno(), os.fstat(f.fileno()).st_size, h, safetensors=path.suffix == ".safetensors")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read model weights ({exc.strerror})") from exc
    return h.hexdigest()


def _weight_files(root: Path) -> list[Path]:
    """The weight files vLLM would load from ``root``, in a canonical order."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            return [root / name for name in sorted(set(weight_map.values()))]
        except (OSError, ValueError, AttributeError):
            pass  # a broken index: fall back to the files present
    for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth"):
        files = sorted(p for p in root.glob(pattern) if p.is_file())
        if files:
            return files
    return []


def _sample_file(fd: int, size: int, h: "hashlib._Hash", safetensors: bool) -> None:
    """Fold ``size`` and sampled bytes of one open weight file into ``h``."""
    h.update(size.to_bytes(8, "little"))
    spans = _tensor_spans(fd, size, h) if safetensors else None
    if spans is None:  # not safetensors (or not parseable as such): 64 evenly spaced windows
        step = max(size // 64, 1)
        spans = [(off, min(off + step, size)) for off in range(0, size, step)]
    if len(spans) > WEIGHTS_MAX_TENSORS:
        stride = len(spans) / WEIGHTS_MAX_TENSORS
        spans = [spans[int(i * stride)] for i in range(WEIGHTS_MAX_TENSORS - 1)] + [spans[-1]]
    for lo, hi in spans:
        head = os.pread(fd, min(WEIGHTS_WINDOW, hi - lo), lo)
        tail_at = max(lo, hi - WEIGHTS_WINDOW)
        tail = os.pread(fd, hi - tail_at, tail_at)
        h.update(head)
        h.update(tail)


def _tensor_spans(fd: int, size: int, h: "hashlib._Hash") -> list[tuple[int, int]] | None:
    """Fold a safetensors header into ``h``; the tensors' absolute byte spans in data order.

    None when the file does not parse as safetensors (the caller samples it evenly instead).
    """
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        return None
    n = int.from_bytes(raw, "little")
    if n > min(_MAX_HEADER, size - 8):
        return None
    header = os.pread(fd, n, 8)
    try:
        meta = json.loads(header)
        spans = sorted((8 + n + int(v["data_offsets"][0]), 8 + n + int(v["data_offsets"][1]))
                       for k, v in meta.items() if k != "__metadata__")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    if any(lo < 8 + n or hi > size or hi < lo for lo, hi in spans):
        return None
    h.update(header)
    return [(lo, hi) for lo, hi in spans if hi > lo]


def lora_identity(name: str, path: str, digest: str = "") -> str:
    """A LoRA adapter's identity for ``Namespace.lora``: its name, path and weights digest.

    vLLM keys its own prefix cache by name and path (a name re-pointed at another adapter must
    not reuse KV); the digest (``weights_digest`` of the adapter directory) also separates
    different adapter files placed at one path.
    """
    return json.dumps([name, path, digest], separators=(",", ":"))
