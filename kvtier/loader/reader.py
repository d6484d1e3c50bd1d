"""The streaming reader: many large concurrent reads, tensors yielded as they complete.

Plan: every wanted byte range (a whole tensor, or a rank's slice of one) is cut into pieces of
at most ``block_size``; neighbouring pieces are merged into one request of at most
``block_size`` (small tensors share a request; a gap up to ``max_gap`` is read and dropped).
A pool of ``concurrency`` threads runs the requests in file order.

Buffers and ownership: ``local_mode="auto"`` (the default) maps whole tensors of local files
on CPU, and first reads the file into the page cache with large concurrent readaheads unless
it is already there (sampled with ``RWF_NOWAIT``): on a CPU host that is the cheapest path,
since the page cache pages become the tensors with no copy and no zeroed allocation.
``local_mode="direct"`` reads past the page cache instead (as ``dd iflag=direct`` does, so a
node does not hold a model twice), and ``read`` uses buffered reads into owned tensors; both
stay within ``memory_limit``, while a mapping's pages are page cache, not reader memory. For a whole tensor of a local
file on CPU in ``local_mode="mmap"`` the tensor is a private copy-on-write mapping of the file and each request is a
large readahead into the page cache (``posix_fadvise(WILLNEED)``): no copy at all, and no
shared buffer. ``local_mode="direct"`` reads aligned supersets of each range with ``O_DIRECT``
into the staging pool (past the page cache, like ``dd iflag=direct``) and copies out.
Otherwise on CPU each request reads straight into the destination tensors
(``preadv``/socket ``readinto``: no copy). Requests with gaps, and every request on CUDA, read
into one of a bounded pool of reusable staging buffers (pinned on CUDA) and copy out; a
staging buffer is reused only after its copies have finished. A yielded tensor is never a view
of a staging buffer: the caller owns it. ``memory_limit`` bounds the bytes of tensors that the
reader has allocated but not yet yielded; one tensor larger than the limit is still admitted,
alone. Peak reader memory is therefore about ``memory_limit`` + the largest tensor + the pool.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from kvtier.config import Size, parse_size
from kvtier.errors import ConfigError, LoaderError
from kvtier.loader.header import DTYPES, INDEX_NAME, MAX_INDEX_BYTES, Header, TensorInfo, index_files, parse_header
from kvtier.loader.sources import Source, open_source, scheme_of, source_class

MiB = 1024 * 1024
LOCAL_MODES = ("auto", "mmap", "read", "direct")
_ALIGN = 4096
_MAX_SEGMENTS = 512  # below IOV_MAX (1024) for preadv


@dataclass(frozen=True)
class ReaderConfig:
    """Streaming reader settings. ``concurrency`` 0 means the source's default (16).

    ``max_object_size``: an ``s3://`` object whose HEAD reports more is refused before any read.
    Each S3 object is read at the version (ETag) its first HEAD pinned: an object replaced while
    it is streamed ends the stream with a LoaderError ("changed while it was read"), never a
    tensor of mixed versions; a ranged GET not answered 206 with its exact Content-Range is refused."""

    concurrency: int = 0
    block_size: Size = Size(16 * MiB)
    memory_limit: Size = Size(1024 * MiB)
    max_gap: Size = Size(1 * MiB)
    check_values: bool = False
    device: str = "cpu"
    endpoint_url: str | None = None
    local_mode: str = "auto"
    max_object_size: Size = Size(1024 ** 4)  # S3 objects larger than this are refused at their HEAD

    def __post_init__(self):
        for name in ("block_size", "memory_limit", "max_gap", "max_object_size"):
            value = getattr(self, name)
            if not isinstance(value, int):
                object.__setattr__(self, name, parse_size(value, name))
        if self.concurrency < 0 or self.concurrency > 1024:
            raise ConfigError(f"concurrency must be 0 (source default) to 1024, got {self.concurrency}")
        if self.block_size < 4096:
            raise ConfigError(f"block_size must be at least 4 KiB, got {self.block_size}")
        if self.memory_limit < self.block_size:
            raise ConfigError(f"memory_limit ({self.memory_limit}) must be at least block_size ({self.block_size})")
        if self.max_object_size < 1:
            raise ConfigError(f"max_object_size must be at least 1 byte, got {self.max_object_size}")
        if self.local_mode not in LOCAL_MODES:
            raise ConfigError(f"local_mode must be one of {', '.join(LOCAL_MODES)}, got {self.local_mode!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")


# A slice request for one tensor: (dim, start, stop) along ``dim``.
SliceSpec = tuple[int, int, int]


@dataclass(eq=False)
class _Target:
    """One tensor to produce."""

    name: str
    info: TensorInfo
    shape: tuple[int, ...]
    nbytes: int
    pieces: int = 0
    flat: object = None  # torch uint8 tensor once allocated
    mapped: bool = False  # whole tensor of a local file, handed out as a private mapping


@dataclass(eq=False)
class _Request:
    """One contiguous read ``[start, end)`` of ``source``, copied into ``segments``."""

    source: Source
    start: int
    end: int
    segments: list = field(default_factory=list)  # (file_offset, length, target, dst_offset)
    mapped: bool = False  # readahead into the page cache, no copy
    direct: bool = False  # O_DIRECT into an aligned staging buffer, then copies

    @property
    def dense(self) -> bool:
        """True when the segments tile the range exactly (no gap to read and drop)."""
        return sum(s[1] for s in self.segments) == self.end - self.start


class _BufferPool:
    """``count`` reusable byte buffers of ``size`` (pinned when ``pin``), allocated on first use."""

    def __init__(self, count: int, size: int, pin: bool):
        self._free: queue.Queue = queue.Queue()
        self._made = 0
        self._count, self._size, self._pin = count, size, pin
        self._lock = threading.Lock()

    def get(self):
        import torch

        with self._lock:
            if self._free.empty() and self._made < self._count:
                self._made += 1
                return torch.empty(self._size, dtype=torch.uint8, pin_memory=self._pin)
        return self._free.get()

    def put(self, buf) -> None:
        self._free.put(buf)


def slice_ranges(info: TensorInfo, dim: int, start: int, stop: int) -> list[tuple[int, int]]:
    """File byte ranges ``(offset, length)`` of ``info[..., start:stop, ...]`` along ``dim``, in order.

    A slice along dim 0 (or along a dim whose outer dims are all 1) is one contiguous range;
    otherwise one range per index of the outer dims (strided).
    """
    shape = info.shape
    if not 0 <= dim < len(shape):
        raise LoaderError(f"{info.name}: cannot slice dim {dim} of a {len(shape)}-d tensor")
    if not 0 <= start <= stop <= shape[dim]:
        raise LoaderError(f"{info.name}: slice [{start}:{stop}] outside dim {dim} of size {shape[dim]}")
    inner = info.itemsize
    for d in shape[dim + 1:]:
        inner *= d
    outer = 1
    for d in shape[:dim]:
        outer *= d
    row = shape[dim] * inner
    length = (stop - start) * inner
    if length == 0:
        return []
    if length == row:  # the whole dim: outer rows are contiguous
        return [(info.start, outer * row)]
    return [(info.start + o * row + start * inner, length) for o in range(outer)]


class StreamReader:
    """Reads safetensors objects (local paths or URIs such as ``s3://b/k``) concurrently.

    Headers of every object are read and validated on construction. ``stream()`` yields
    ``(name, tensor)`` in completion order. Not reentrant: one ``stream()`` at a time.
    Close it (or use ``with``) to release sources.
    """

    def __init__(self, uris: Sequence[str], config: ReaderConfig | None = None,
                 sources: Mapping[str, Source] | None = None):
        self.config = config or ReaderConfig()
        self._sources: dict[str, Source] = {}
        self._owned: list[Source] = []
        self.headers: dict[str, Header] = {}
        try:
            for uri in uris:
                src = (sources or {}).get(uri)
                if src is None:
                    src = _open(uri, self.config)
                    self._owned.append(src)
                self._sources[uri] = src
                self.headers[uri] = parse_header(src.read, src.size(), uri)
            self.index = tensor_index(self.headers)
        except BaseException:
            self.close()
            raise
        self._cold: dict[str, bool] = {}  # auto mode: uri -> not in the page cache

    @property
    def concurrency(self) -> int:
        if self.config.concurrency:
            return self.config.concurrency
        return max((s.default_concurrency for s in self._sources.values()), default=16)

    def total_bytes(self) -> int:
        """Bytes of tensor data in every object."""
        return sum(info.nbytes for _, info in self.index.values())

    def stream(self, tensor_names: Iterable[str] | None = None,
               slices: Mapping[str, SliceSpec] | Callable[[TensorInfo], SliceSpec | None] | None = None,
               on_bytes: Callable[[int], None] | None = None) -> Iterator[tuple[str, object]]:
        """Yield ``(name, tensor)`` for the wanted tensors as each completes.

        ``tensor_names`` filters (an unknown name is a LoaderError); ``slices`` maps a name (or
        a function of the TensorInfo) to ``(dim, start, stop)`` to read only that slice.
        ``on_bytes(n)`` is called from the consuming thread as data arrives (progress bars).
        """
        targets = self._targets(tensor_names, slices)
        requests = self._plan(targets, slices)
        yield from self._run(targets, requests, on_bytes)

    # -- planning ---------------------------------------------------------------------------

    def _targets(self, tensor_names, slices) -> list[_Target]:
        if tensor_names is None:
            names = list(self.index)
        else:
            names = list(dict.fromkeys(tensor_names))
            missing = [n for n in names if n not in self.index]
            if missing:
                raise LoaderError(f"tensor {missing[0]!r} is in none of {', '.join(self.headers)}")
        out = []
        for name in names:
            info = self.index[name][1]
            spec = _slice_for(slices, info)
            shape = info.shape
            if spec is not None:
                dim, start, stop = spec
                slice_ranges(info, dim, start, stop)  # validates
                shape = shape[:dim] + (stop - start,) + shape[dim + 1:]
            nbytes = info.itemsize
            for d in shape:
                nbytes *= d
            out.append(_Target(name, info, shape, nbytes))
        return out

    def _plan(self, targets: list[_Target], slices) -> list[_Request]:
        block, gap = self.config.block_size, self.config.max_gap
        pieces = []  # (uri, file_offset, length, target, dst_offset)
        map_ok, prefetch = self._map_plan()
        for t in targets:
            uri = self.index[t.name][0]
            spec = _slice_for(slices, t.info)
            t.mapped = map_ok[uri] and spec is None
            if t.mapped and not prefetch[uri]:
                continue  # already in the page cache: no I/O to do, the mapping is the tensor
            ranges = [(t.info.start, t.info.nbytes)] if spec is None else slice_ranges(t.info, *spec)
            dst = 0
            for off, length in ranges:
                for cut in range(0, length, block):
                    n = min(block, length - cut)
                    pieces.append((uri, off + cut, n, t, dst + cut))
                    t.pieces += 1
                dst += length
        pieces.sort(key=lambda p: (p[0], p[1]))
        requests: list[_Request] = []
        cur: _Request | None = None
        cur_uri = None
        for uri, off, n, t, dst in pieces:
            if (cur is None or uri != cur_uri or off - cur.end > gap or off + n - cur.start > block
                    or len(cur.segments) >= _MAX_SEGMENTS or cur.mapped != t.mapped):
                src = self._sources[uri]
                cur = _Request(src, off, off + n, mapped=t.mapped, direct=not t.mapped and self._direct(src))
                cur_uri = uri
                requests.append(cur)
            cur.segments.append((off, n, t, dst))
            cur.end = max(cur.end, off + n)
        return requests

    def _map_plan(self) -> tuple[dict[str, bool], dict[str, bool]]:
        """Per source: whether whole tensors are mapped, and whether a readahead is needed first."""
        mode = self.config.local_mode
        mapped, prefetch = {}, {}
        for uri, src in self._sources.items():
            can = self.config.device == "cpu" and hasattr(src, "mapping")
            mapped[uri] = can and mode in ("auto", "mmap")
            cached = False
            if mapped[uri] and mode == "auto":
                cached = src.is_cached()
                self._cold[uri] = not cached
            prefetch[uri] = mapped[uri] and not cached
        return mapped, prefetch

    def _direct(self, src: Source) -> bool:
        """O_DIRECT reads for a local file in ``direct`` mode."""
        return self.config.local_mode == "direct" and hasattr(src, "read_direct") and self.config.device == "cpu"

    # -- execution --------------------------------------------------------------------------

    def _run(self, targets: list[_Target], requests: list[_Request], on_bytes) -> Iterator[tuple[str, object]]:
        import torch

        device = torch.device(self.config.device)
        cuda = device.type == "cuda"
        limit = self.config.memory_limit
        staging_count = max(1, min(self.concurrency, limit // (2 * self.config.block_size)))
        pool = _BufferPool(staging_count, self.config.block_size + 2 * _ALIGN, pin=cuda)
        events: queue.Queue = queue.Queue()
        abort = threading.Event()
        lock = threading.Lock()

        for t in targets:  # empty tensors and cached mapped ones need no I/O
            if t.pieces == 0:
                if t.mapped and t.nbytes:
                    src = self._sources[self.index[t.name][0]]
                    t.flat = torch.frombuffer(src.mapping(), dtype=torch.uint8, count=t.nbytes, offset=t.info.start)
                else:
                    t.flat = torch.empty(0, dtype=torch.uint8, device=device)
                yield t.name, self._finish(t)

        def work(req: _Request) -> None:
            if abort.is_set():
                events.put((req, [], None))
                return
            try:
                self._execute(req, pool, cuda)
                done = []
                with lock:
                    for _, _, t, _ in req.segments:
                        t.pieces -= 1
                        if t.pieces == 0:
                            done.append(t)
                events.put((req, done, None))
            except BaseException as exc:  # delivered to the consumer thread, raised there
                events.put((req, [], exc))

        in_flight = 0
        outstanding = 0
        i = 0
        error: BaseException | None = None
        executor = ThreadPoolExecutor(self.concurrency, thread_name_prefix="kvtier-load")
        try:
            while i < len(requests) or outstanding:
                while i < len(requests) and error is None:
                    req = requests[i]
                    new = list({id(s[2]): s[2] for s in req.segments if s[2].flat is None}.values())
                    need = sum(t.nbytes for t in new if not t.mapped)  # mapped: page cache, not ours
                    if need and in_flight + need > limit and outstanding:
                        break  # wait for completions to free budget
                    for t in new:
                        t.flat = (torch.frombuffer(req.source.mapping(), dtype=torch.uint8, count=t.nbytes,
                                                   offset=t.info.start) if t.mapped
                                  else torch.empty(t.nbytes, dtype=torch.uint8, device=device))
                    in_flight += need
                    executor.submit(work, req)
                    outstanding += 1
                    i += 1
                if not outstanding:
                    break
                req, done, exc = events.get()
                outstanding -= 1
                if exc is not None and error is None:
                    error = exc
                    abort.set()
                    i = len(requests)
                if error is not None:
                    continue
                if on_bytes is not None:
                    on_bytes(sum(s[1] for s in req.segments))
                for t in done:
                    tensor = self._finish(t)
                    in_flight -= 0 if t.mapped else t.nbytes
                    t.flat = None
                    yield t.name, tensor
            if error is not None:
                if isinstance(error, LoaderError):
                    raise LoaderError(str(error)) from error
                raise LoaderError(f"read failed: {type(error).__name__}: {error}") from error
        finally:
            abort.set()
            executor.shutdown(wait=True, cancel_futures=True)

    def _execute(self, req: _Request, pool: _BufferPool, cuda: bool) -> None:
        """Read one request into its destinations (directly when dense on CPU, else via staging)."""
        if req.mapped:
            req.source.prefetch(req.start, req.end - req.start)
            return
        if req.dense and not cuda and not req.direct:
            views = [memoryview(t.flat[dst:dst + n].numpy()) for _, n, t, dst in req.segments]
            req.source.read_into(req.start, views)
            return
        buf = whole = pool.get()
        try:
            base = req.start
            if req.direct:  # aligned superset of the range, read past the page cache
                base = req.start - req.start % _ALIGN
                first = (-buf.data_ptr()) % _ALIGN
                span = -(-(req.end - base) // _ALIGN) * _ALIGN
                got = req.source.read_direct(base, memoryview(buf[first:first + span].numpy()))
                if got < req.end - base:
                    raise LoaderError(f"{req.source.uri}: short read at offset {base} ({got} of {req.end - base} bytes)")
                buf = buf[first:]
            else:
                span = req.end - req.start
                req.source.read_into(req.start, [memoryview(buf[:span].numpy())])
            if cuda:
                import torch

                stream = _thread_stream(req.segments[0][2].flat.device)
                with torch.cuda.stream(stream):
                    for off, n, t, dst in req.segments:
                        rel = off - base
                        t.flat[dst:dst + n].copy_(buf[rel:rel + n], non_blocking=True)
                stream.synchronize()  # the staging buffer is reused only after its copies finish
            else:
                for off, n, t, dst in req.segments:
                    rel = off - base
                    t.flat[dst:dst + n].copy_(buf[rel:rel + n])
        finally:
            pool.put(whole)

    def _finish(self, t: _Target):
        """The owned tensor of a completed target, with its dtype and shape (values checked if asked)."""
        import torch

        dtype = getattr(torch, DTYPES[t.info.dtype][1])
        tensor = t.flat.view(dtype).reshape(t.shape)
        if self.config.check_values and tensor.is_floating_point() and tensor.numel():
            if not bool(torch.isfinite(tensor.float() if tensor.element_size() == 1 else tensor).all()):
                raise LoaderError(f"{self.index[t.name][0]}: tensor {t.name!r} holds NaN or Inf")
        return tensor

    def close(self) -> None:
        """Close the sources this reader opened."""
        for src in self._owned:
            src.close()
        self._owned = []

    def __enter__(self) -> "StreamReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_streams = threading.local()


def _thread_stream(device):
    """One CUDA stream per reader thread (copies of different threads overlap)."""
    import torch

    stream = getattr(_streams, "stream", None)
    if stream is None:
        stream = _streams.stream = torch.cuda.Stream(device=device)
    return stream


def tensor_index(headers: Mapping[str, Header]) -> dict[str, tuple[str, TensorInfo]]:
    """``{tensor name: (uri, info)}`` over the files of one checkpoint; LoaderError naming both
    files when a tensor name appears in two of them."""
    index: dict[str, tuple[str, TensorInfo]] = {}
    for uri, header in headers.items():
        for name, info in header.tensors.items():
            if name in index:
                raise LoaderError(f"{uri}: tensor {name[:80]!r} also appears in {index[name][0]}")
            index[name] = (uri, info)
    return index


def check_model(uri: str, endpoint_url: str | None = None, unique_names: bool = True) -> dict[str, Header]:
    """Validate every safetensors header of a model (a file, a directory or an ``s3://`` prefix,
    as ``model_files`` finds them) without reading any tensor data and without importing torch.

    Returns ``{file uri: Header}``. Raises LoaderError("<file>: <problem>") for the first file
    that is missing, unreadable or malformed, and, when ``unique_names``, for a tensor name found
    in two files. Reads only headers: at most 8 + ``MAX_HEADER_BYTES`` bytes per file.
    """
    config = ReaderConfig(endpoint_url=endpoint_url)
    headers: dict[str, Header] = {}
    for file_uri in model_files(uri, endpoint_url):
        with _open(file_uri, config) as src:
            headers[file_uri] = parse_header(src.read, src.size(), file_uri)
    if unique_names:
        tensor_index(headers)
    return headers


def _slice_for(slices, info: TensorInfo) -> SliceSpec | None:
    if slices is None:
        return None
    if callable(slices):
        return slices(info)
    return slices.get(info.name)


def _open(uri: str, config: ReaderConfig) -> Source:
    if scheme_of(uri) == "s3":
        from kvtier.loader.sources.s3 import S3Config

        conc = max(config.concurrency or 16, 10)
        return open_source(uri, config=S3Config(endpoint_url=config.endpoint_url, max_pool_connections=conc + 4,
                                                max_object_size=config.max_object_size))
    return open_source(uri)


def model_files(uri: str, endpoint_url: str | None = None) -> list[str]:
    """The safetensors objects of a model: ``uri`` itself if it names one, else the files of its
    ``model.safetensors.index.json``, else every ``*.safetensors`` under it, sorted."""
    if uri.endswith(".safetensors"):
        return [uri]
    listing = list_dir(uri, endpoint_url)
    base = uri.rstrip("/")
    if INDEX_NAME in listing:
        index = join_uri(uri, INDEX_NAME)
        with _open(index, ReaderConfig(endpoint_url=endpoint_url)) as src:
            size = src.size()
            if size > MAX_INDEX_BYTES:
                raise LoaderError(f"{index}: index of {size} bytes exceeds the {MAX_INDEX_BYTES}-byte limit")
            text = src.read(0, size).decode("utf-8", errors="replace")
        names = index_files(text, index)
        missing = [n for n in names if n not in listing]
        if missing:
            raise LoaderError(f"{base}: index names {missing[0]!r}, which is not there")
    else:
        names = sorted(n for n in listing if n.endswith(".safetensors"))
    if not names:
        raise LoaderError(f"{uri}: no .safetensors files found")
    return [join_uri(uri, n) for n in names]


def list_dir(uri: str, endpoint_url: str | None = None) -> dict[str, int]:
    """``{name: size}`` of the objects directly under a local directory or an ``s3://`` prefix."""
    kwargs = {}
    if scheme_of(uri) == "s3":
        from kvtier.loader.sources.s3 import S3Config

        kwargs["config"] = S3Config(endpoint_url=endpoint_url)
    return dict(source_class(uri).list_dir(uri, **kwargs))


def join_uri(base: str, name: str) -> str:
    """``name`` under the directory or prefix ``base`` (a path join for local files)."""
    if scheme_of(base) == "file":
        return os.path.join(base, name)
    return f"{base.rstrip('/')}/{name}"


def load_tensors(uri: str, config: ReaderConfig | None = None, **stream_kwargs) -> dict[str, object]:
    """Read every tensor of a file or model directory into a dict (convenience for small models)."""
    config = config or ReaderConfig()
    with StreamReader(model_files(uri, config.endpoint_url), config) as reader:
        return dict(reader.stream(**stream_kwargs))
