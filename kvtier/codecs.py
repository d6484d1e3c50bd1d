"""KV codecs for the entries of slower tiers (``codec: none | lossless | fp8 | auto`` per tier).

``lossless``: Blosc2's bit-shuffle filter at the element width of the KV dtype (2 bytes for
bf16/fp16: the sixteen bit planes of a block lined up, so the sign and exponent planes, nearly
constant, become long runs), then zstd level 1 on the bit planes of each byte of an element as
a stream of their own (Blosc2's ``ALWAYS_SPLIT``), in blocks of 256 KiB, on one thread. Chosen
by measurement on the KV that a vLLM CPU engine stores through the connector (``kvtier bench
codec --kv engine``, random weights, one core, four families): 1.36-1.45 x at 0.9-1.1 GB/s
encode and 1.0-1.7 GB/s decode. The codec before it, byte-shuffle + zstd-1 in Blosc2's default
blocks, reached 1.41-1.45 x but encoded at 0.44-0.52 GB/s: on a CPU engine its writers took
twice the core time from the prefill for 3-7% more ratio. Blosc2 bit-shuffle + LZ4 is faster
(1.1-2.0 / 3.0-4.9 GB/s) but 1.25 x on the MLA latent and 1.28 x on the hybrid model;
bit-shuffle + zstd-1 in the default blocks 1.32-1.41 x at 0.7-0.9 GB/s. ``lossless`` pays on
tiers slower than about 1 GB/s (shared tiers across machines), where the ratio is what saves
time and capacity; encoding runs on the lower-tier writers, off the engine's step, and ``auto``
weighs both speeds. Entries coded with other Blosc2 filters, blocks or coders (as this codec
wrote before) still decode: a Blosc2 frame names its own. The library is optional (``pip
install 'kvtier[codec]'``): configuring ``lossless`` without it is a ConfigError, and reading a
coded entry without it is a miss.

Safety: ``decode_into`` writes into the caller's buffer, whose size is the entry's declared raw
length (already bounded by the reader's ``max_length`` and equal to shape x itemsize); Blosc2's
own declared size must equal it before a byte is decoded, so a forged entry can neither
allocate nor write more. Any failure is CorruptEntry (a counted miss upstream).

``fp8`` (``FP8``, lossy, opt-in): bf16/fp16/float32 KV quantized to E4M3 with one power-of-two
scale per 32 elements (``kvtier.fp8``, the MXFP8 layout): 0.516 x the bytes of 16-bit KV. An
fp8 entry is a different KV, so a store with an fp8 tier says so in its key namespace
(``StoreConfig.lossy_codec``; the connector folds it in), and an engine configured without it
never reads a lossy entry. The entry's checksum covers the dequantized bytes (what a reader
gets). Other dtypes, non-finite values and payloads under 4 KiB are stored raw. ``auto`` never
picks ``fp8``.

``auto`` (``AutoChoice``): per tier, a chunk is coded only when a re-read of it pays, ``S/(r B) +
S/D < S/B`` (move the coded bytes and decode them, against moving the raw bytes): the document's
break-even rule applied to the bytes of a load, which is what an engine waits on (a chunk is
encoded once, on a lower-tier writer off the engine's step, and may be re-read many times). Where
the rule codes, the link is slower than ``D (1 - 1/r)``, about 3-4 Gb/s for ``lossless`` on bf16
KV, and the encoder (about 1 GB/s a core) keeps up with it. ``B`` is the tier's bandwidth as
fitted from its own transfers (``LinkFit``: time = latency + bytes / B over its recent reads, decode time
excluded; before the first read, over its puts, encode time excluded), so a fixed cost per
request, paid coded or raw, does not count as slowness. (An earlier form of the rule, ``S/E
+ S/(r B) + S/D < S/B``, charged every re-read with the one encode: with the zstd coder it stores
raw at 1 Gb/s, where a coded re-read takes about 0.8 x a raw one.) ``E``/``D``/``r`` are measured
on this machine at start (one 1 MiB bf16-like sample) and refreshed from real chunks; once coded
reads are timed, ``D`` is their decode speed, as the tier's readers see it: readers that decode at
once share the cores (four on two cores each decode at half speed), and ``B``, from the same
reads, is what one reader gets of a link they share, so the rule weighs like with like. Now and then
one chunk is stored the other way, which keeps the inputs fresh and gives the fit two sizes: every
``PROBE_EVERY`` puts until the fit has told latency from bandwidth (it then keeps that latency
while the tier sees one size), then every 32 while coding, and while storing raw as rarely as
keeps the coded probes' extra read time under 1% (up to 256 puts apart: on a memory-speed tier a
coded chunk reads 2-3 x slower). Before its first decision the tier times reads of two probe
entries of its own (the chunk's size and a sixteenth of it, ``Tier._probe_reads``), so the first
chunks are decided by how the tier reads, with latency and bandwidth told apart, not by its puts:
an engine writes each chunk before anything is read back, on cores its own step keeps busy, where
a put's time is mostly waiting for a core. Chunks put while it runs, or when it fails, are stored
raw. Once both kinds of entry have been re-read ``MEASURED_MIN`` times, the rule's two sides are
measured instead of modelled: coded iff the tier's coded re-reads (move and decode) took less time
per raw byte than its raw ones (medians of the last ``MEASURED_WINDOW`` of each kind; every
re-read of the kind the tier does not store now is timed).
The model misses what a shared host adds: on this project's 2-core VM, four readers of a Redis
tier behind a 10 Gb/s proxy fit a per-read link of ~105 MB/s (the rule codes) while the coded
re-reads took 1.17 x the raw ones (the proxy, the server and the decoders share the cores).

Imports: ``kvtier.errors`` and, lazily, ``blosc2`` and ``kvtier.fp8`` (numpy).
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from kvtier.errors import ConfigError, CorruptEntry

_log = logging.getLogger(__name__)

CodecName = Literal["none", "lossless", "fp8", "auto"]
CODEC_NAMES = get_args(CodecName)
LOSSLESS_ID = 1  # codec ids are part of the entry format: never renumber
FP8_ID = 2
_MIN_BYTES = 4096  # smaller payloads are stored raw: the frame costs more than it saves
_BLOCK_BYTES = 256 * 1024  # Blosc2 block: bit planes this long give zstd its runs (smaller blocks code slower)
_lock = threading.Lock()
_blosc2 = None


def _lib():
    """The blosc2 module, imported once; ConfigError (one line) when it is not installed."""
    global _blosc2
    if _blosc2 is None:
        with _lock:
            if _blosc2 is None:
                try:
                    import blosc2
                except ImportError as exc:
                    raise ConfigError("codec 'lossless' needs the blosc2 package (pip install 'kvtier[codec]'); "
                                      "valid codecs without it: none") from exc
                # Blosc2 holds the GIL while it codes unless told otherwise: an encoder on a
                # writer thread (at any niceness) or a decoder on a load thread then stalls the
                # engine's own Python threads in the same process for the whole chunk
                blosc2.set_releasegil(True)
                _blosc2 = blosc2
    return _blosc2


@dataclass(frozen=True)
class Codec:
    """A lossless codec: ``encode`` returns the coded bytes (None when not worth it)."""

    name: str
    id: int
    lossy = False

    def encode(self, raw: memoryview, itemsize: int) -> bytes | None:
        """Coded bytes of ``raw`` with elements of ``itemsize`` bytes, or None (store raw) when
        ``raw`` is too small to pay or the result is not smaller."""
        if raw.nbytes < _MIN_BYTES:
            return None
        lib = _lib()
        coded = lib.compress2(raw, typesize=max(1, min(itemsize, 255)), codec=lib.Codec.ZSTD,
                              filters=[lib.Filter.BITSHUFFLE], clevel=1, blocksize=_BLOCK_BYTES,
                              splitmode=lib.SplitMode.ALWAYS_SPLIT, nthreads=1)
        return coded if len(coded) < raw.nbytes else None


LOSSLESS = Codec("lossless", LOSSLESS_ID)


@dataclass(frozen=True)
class LossyCodec:
    """A lossy codec: ``encode_lossy`` returns the coded bytes and the raw bytes a reader will
    decode them to (the entry's checksum covers those), or None (store raw, exact)."""

    name: str
    id: int
    lossy = True

    def encode_lossy(self, raw: memoryview, dtype: str) -> tuple[bytes, bytes] | None:
        """(coded, dequantized) for ``raw`` of element type ``dtype``; None when ``raw`` is under
        4 KiB, of a dtype the codec does not take, holds a non-finite value, or does not shrink."""
        if raw.nbytes < _MIN_BYTES:
            return None
        from kvtier import fp8

        coded = fp8.quantize(raw, dtype)
        if coded is None or len(coded[0]) >= raw.nbytes:
            return None
        return coded


FP8 = LossyCodec("fp8", FP8_ID)
# lossy codecs' entries are a different KV: their names go in the key namespace, and only a tier
# configured with one serves entries of their ids
LOSSY_CODECS = (FP8.name,)
LOSSY_IDS = frozenset({FP8.id})


def get_codec(name: str, where: str = "codec") -> Codec | None:
    """The codec a tier's ``codec`` setting names (None for ``none``); ConfigError (one line,
    the valid choices) for another name or a missing library."""
    if name == "none":
        return None
    if name == "fp8":
        return FP8
    if name in ("lossless", "auto"):  # auto codes with lossless when it pays (AutoChoice)
        try:
            _lib()
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
        return LOSSLESS
    raise ConfigError(f"{where}: unknown codec {name!r}; valid: {', '.join(CODEC_NAMES)}")


def decode_into(codec_id: int, stored: memoryview, out: memoryview, itemsize: int,
                dtype: str | None = None) -> None:
    """Decode ``stored`` (codec ``codec_id``) into exactly ``out`` (raw elements of ``dtype``,
    ``itemsize`` bytes each); CorruptEntry for an unknown codec, a missing library, a declared
    size other than ``out.nbytes`` or a bad stream."""
    if codec_id == FP8_ID:
        _decode_fp8(stored, out, dtype)
        return
    if codec_id != LOSSLESS_ID:
        raise CorruptEntry(f"entry of unknown codec id {codec_id}")
    try:
        lib = _lib()
    except ConfigError as exc:
        raise CorruptEntry("lossless entry, but blosc2 is not installed here") from exc
    try:
        declared, cbytes, _ = lib.get_cbuffer_sizes(stored)
    except Exception as exc:  # a header blosc2 cannot parse
        raise CorruptEntry(f"codec frame does not parse ({type(exc).__name__})") from exc
    if declared != out.nbytes or cbytes != stored.nbytes:
        raise CorruptEntry(f"codec frame declares {declared} bytes, the entry {out.nbytes}")
    start = time.perf_counter()
    try:
        lib.decompress2(stored, dst=out, nthreads=1)
    except Exception as exc:  # blosc2 raises ValueError/RuntimeError for bad streams
        raise CorruptEntry(f"codec stream does not decode ({type(exc).__name__})") from exc
    finally:
        CLOCK.decode_s = getattr(CLOCK, "decode_s", 0.0) + time.perf_counter() - start


def _decode_fp8(stored: memoryview, out: memoryview, dtype: str | None) -> None:
    """``kvtier.fp8.dequantize_into``, its ValueError a CorruptEntry (timed like lossless)."""
    from kvtier import fp8

    start = time.perf_counter()
    try:
        fp8.dequantize_into(stored, out, dtype)
    except ValueError as exc:
        raise CorruptEntry(f"fp8 entry does not decode: {exc}") from exc
    finally:
        CLOCK.decode_s = getattr(CLOCK, "decode_s", 0.0) + time.perf_counter() - start


CLOCK = threading.local()  # decode_s: seconds this thread spent decoding (an auto tier's read timing)


# puts between two probes of an auto tier (one chunk stored the other way): often until the tier's
# fit has told its latency from its bandwidth; while it codes, rarely (a raw probe gives back the
# saving); while it stores raw, as rarely as keeps the coded probes' extra read time under
# PROBE_BUDGET of the reads (a coded chunk costs B/D + 1/r of a raw one: on a memory-speed tier
# 2-3 x, so a probe every 8 puts cost ~5% of every re-read), between PROBE_EVERY and PROBE_EVERY_MAX
PROBE_EVERY = 8
PROBE_EVERY_CODING = 32
PROBE_EVERY_MAX = 256
PROBE_BUDGET = 0.01
_EWMA = 0.2  # weight of the newest observation in the moving averages of the codec's speeds
_FIT_EWMA = 0.03  # weight of the newest transfer in a tier's latency/bandwidth fit (~30 transfers)
_READ_QUEUE = 256  # reads queued for the fit between two decisions (an older one would weigh < 0.0005)
# the measured sides of the rule: each kind of re-read (coded: move and decode; raw: move) as the
# median seconds per raw byte of its last reads; they decide once both kinds have MEASURED_MIN reads
MEASURED_MIN = 4
MEASURED_WINDOW = 15  # each side is the median of its last MEASURED_WINDOW reads (one slow read moves neither)
PROBE_MIN_BYTES = 64 * 1024  # the read probe waits for a chunk of at least this size (sizes 16 x apart)


class LinkFit:
    """The time of one transfer of a tier as ``latency + bytes / bandwidth``, fitted by
    exponentially weighted least squares over its recent transfers (not thread-safe: the owner
    locks). A fixed per-request cost (a round trip, a proxy's delay) is paid coded or raw, so
    only the bandwidth decides whether fewer bytes pay. Until the transfers differ enough in
    size to tell the two apart, the estimate is bytes over seconds (latency counted as
    bandwidth: the side that codes). A slope within two standard errors of zero (timing noise
    larger than what the size explains) is no bandwidth limit when a fixed cost per request
    (the intercept) stands two standard errors clear of zero, else bytes over seconds."""

    def __init__(self, alpha: float = _FIT_EWMA):
        self.alpha = alpha
        self._n = 0
        self._w = self._w2 = self._x = self._y = self._xx = self._xy = self._yy = 0.0
        self.latency: float | None = None  # the fixed cost of the last fit that told sizes apart

    def add(self, nbytes: float, seconds: float) -> None:
        """One transfer of ``nbytes`` that took ``seconds``. While the sizes seen are about to
        fade to one (their spread within 100 x of the one-size threshold), the fit is estimated
        first, so the latency it tells apart is kept (``latency``) whoever asks for it later."""
        if self._n >= 4:
            w = self._w
            mx = self._x / w
            var = self._xx / w - mx * mx
            if (1e-3 * mx) ** 2 < var < 100 * (1e-3 * mx) ** 2:
                self.estimate()
        keep = 1.0 - self.alpha if self._n else 0.0
        self._n += 1
        self._w = keep * self._w + 1.0
        self._w2 = keep * keep * self._w2 + 1.0  # for the effective number of transfers
        self._x = keep * self._x + nbytes
        self._y = keep * self._y + seconds
        self._xx = keep * self._xx + nbytes * nbytes
        self._xy = keep * self._xy + nbytes * seconds
        self._yy = keep * self._yy + seconds * seconds

    def estimate(self) -> tuple[float, float, bool] | None:
        """(bandwidth in bytes/s, latency in s, whether the sizes told them apart), or None
        before any transfer. A fit whose time does not grow with size (beyond its noise) is
        infinite bandwidth."""
        if not self._n:
            return None
        w = self._w
        mx, my = self._x / w, self._y / w
        var = self._xx / w - mx * mx
        if my <= 0:
            return None
        if self._n < 4 or var <= (1e-3 * mx) ** 2:  # one size (or too few)
            return self._one_size(mx, my)
        slope = (self._xy / w - mx * my) / var
        var_y = max(0.0, self._yy / w - my * my)
        resid = max(0.0, var_y - slope * slope * var)
        n_eff = w * w / self._w2
        stderr = math.sqrt(resid / (max(n_eff - 2.0, 1.0) * var))
        if slope > 2.0 * stderr:
            latency = my - slope * mx
            if latency <= 0:  # no fixed cost seen: through the origin
                self.latency = 0.0
                return mx / my, 0.0, True
            self.latency = latency
            return 1.0 / slope, latency, True
        # the size does not explain the time beyond its noise: a fixed cost per request when the
        # intercept stands clear of zero (two standard errors), else a bandwidth seen through
        # noise: bytes over seconds
        intercept = my - slope * mx
        intercept_err = math.sqrt(resid / max(n_eff - 2.0, 1.0) * (1.0 + mx * mx / var))
        if intercept > 2.0 * intercept_err:
            self.latency = intercept
            return float("inf"), intercept, True
        return self._one_size(mx, my)

    def _one_size(self, mx: float, my: float) -> tuple[float, float, bool]:
        """The estimate when the sizes do not tell latency from bandwidth: the mean size over the
        mean time less the fixed cost an earlier fit found (a tier that stores one size for a
        while keeps its latency; without it, a latency-bound tier would look slow and flip to
        coding until the next probe), else bytes over seconds (latency counted as bandwidth)."""
        latency = self.latency
        if latency is None:
            return mx / my, 0.0, False
        if my <= latency:  # no slower than the fixed cost alone: no bandwidth limit seen
            return float("inf"), latency, False
        return mx / (my - latency), latency, False


class AutoChoice:
    """The break-even rule of one ``auto`` tier (thread-safe). ``observe_put``/``observe_get``
    feed the tier's transfer fits (``LinkFit``); ``encode`` decides per chunk and returns the
    coded bytes or None (store raw); ``state()`` is the choice and its inputs (for metrics).

    Now and then (``_probe_every``) one chunk goes the other
    way (coded while the rule says raw, raw while it says coded): it refreshes the codec's speeds
    and ratio, and gives the fits two sizes to separate the tier's fixed cost per request from
    its bandwidth."""

    def __init__(self, codec: Codec, itemsize: int = 2):
        self.codec = codec
        self._lock = threading.Lock()
        self.tier_bps: float | None = None  # what the rule uses: the read bandwidth once known
        self.write_bps: float | None = None
        self.read_bps: float | None = None
        self.latency_s: float | None = None  # the fitted fixed cost per request of that bandwidth
        self._reads, self._writes = LinkFit(), LinkFit()
        self.reads = 0  # reads of the tier (the tier times one in kvtier.tiers.base.READ_SAMPLE)
        self._read_queue: collections.deque = collections.deque(maxlen=_READ_QUEUE)  # reads not yet fitted (observe_get)
        self.encode_bps, self.decode_bps, self.ratio = _measure(codec, itemsize)
        self.read_decode_bps: float | None = None  # as the tier's readers decode (``observe_get``)
        self.coding = False
        self.coded = 0
        self.raw = 0
        self._since_probe = 0
        # s per raw byte of the last MEASURED_WINDOW timed re-reads of each kind (``_measured``)
        self._read_costs: dict[str, collections.deque] = {k: collections.deque(maxlen=MEASURED_WINDOW)
                                                          for k in ("coded", "raw")}
        self.read_count = {"coded": 0, "raw": 0}
        # set by the tier: timed reads of two probe entries, [(stored bytes, seconds)] (``probe_link``)
        self.link_probe: Callable[[int], list[tuple[int, float]]] | None = None
        self._probed = False
        self._probing = 0  # the thread id of the probe in flight, else 0

    def pays(self) -> bool:
        """Whether coding pays at the current inputs (False until the tier is measured): once
        both kinds of entry have been re-read ``MEASURED_MIN`` times, whether a coded re-read
        took less time per raw byte than a raw one (``measured``); before, the rule on the
        fitted bandwidth and the decode speed."""
        with self._lock:
            self._take_reads()
            measured = self._measured()
            if measured is not None:
                return measured
            b = self.tier_bps
            if not b or self.ratio <= 1.0:
                return False
            return 1.0 / self._decode_speed() + 1.0 / (self.ratio * b) < 1.0 / b

    def _measured(self) -> bool | None:
        """The rule with both sides measured (lock held): whether the tier's coded re-reads
        (move the coded bytes, decode them) took less time per raw byte than its raw re-reads
        (move the raw bytes), or None until each kind has ``MEASURED_MIN`` timed reads. Both
        kinds are read by the same readers over the same link and cores, so whatever the fit
        does not model (a link whose speed is the CPU's, readers that queue behind each other, a
        proxy or server sharing the cores) is in both; a fixed cost per request is too, and
        cancels for chunks of one size (the connector's)."""
        if min(self.read_count.values()) < MEASURED_MIN:
            return None
        return self._read_cost("coded") < self._read_cost("raw")

    def _read_cost(self, kind: str) -> float | None:
        """The median seconds per raw byte of the last ``MEASURED_WINDOW`` timed re-reads of
        ``kind`` (lock held), or None before one: a median, so one read slowed by a cold cache
        or a descheduled reader moves neither side (with a moving average it kept a tier raw for
        thousands of puts where coding paid)."""
        costs = self._read_costs[kind]
        return statistics.median(costs) if costs else None

    def _decode_speed(self) -> float:
        """``D`` of the rule (lock held): as the readers decode once a coded read was timed, else
        as measured alone (at start, and on the writers' probes)."""
        return self.read_decode_bps or self.decode_bps

    def encode(self, raw: memoryview, itemsize: int) -> bytes | None:
        """The coded bytes when the chunk is to be stored coded (or None: store raw): coded
        when the rule pays, but for one probe chunk now and then, which goes the other way. A
        probe that is coded is also decoded, to refresh ``D``. The first call times the tier's
        reads first (``probe_link``); chunks put meanwhile, and the probe's own, are stored raw."""
        if self.probe_link(raw.nbytes):
            if self._probing != threading.get_ident():  # another writer's chunk, not the probe's own
                with self._lock:
                    self.raw += 1
            return None
        code = self.pays()
        with self._lock:
            self.coding = code
            probe = self._since_probe >= self._probe_every(code)
            self._since_probe = 0 if probe else self._since_probe + 1
        store_coded = code != probe
        if not (code or probe):
            with self._lock:
                self.raw += 1
            return None
        start = time.perf_counter()
        coded = self.codec.encode(raw, itemsize)
        took = time.perf_counter() - start
        if coded is None:  # declined: not smaller (or too small to pay): a ratio of 1 for the rule
            with self._lock:
                self.raw += 1
                if raw.nbytes >= _MIN_BYTES:
                    self.ratio = _avg(self.ratio, 1.0)
            return None
        decode_s = None
        if probe and store_coded:
            start = time.perf_counter()
            decode_into(self.codec.id, memoryview(coded), memoryview(bytearray(raw.nbytes)), itemsize)
            decode_s = time.perf_counter() - start
        with self._lock:
            self.encode_bps = _avg(self.encode_bps, raw.nbytes / max(took, 1e-9))
            self.ratio = _avg(self.ratio, raw.nbytes / len(coded))
            if decode_s is not None:
                self.decode_bps = _avg(self.decode_bps, raw.nbytes / max(decode_s, 1e-9))
            if store_coded:
                self.coded += 1
            else:
                self.raw += 1
        return coded if store_coded else None

    def probe_link(self, nbytes: int) -> bool:
        """Once per tier, before its first decision: time its reads with ``link_probe`` (entries
        of ``nbytes`` and of a sixteenth of it, far enough apart in size for the read fit to tell
        the tier's fixed cost per request from its bandwidth) and seed the read fit with them,
        so the first chunks are decided by how the tier reads, not by how it takes writes (an
        engine writes each chunk before anything is read back, on cores its own step keeps
        busy: its puts look like a slow link). True while a probe is in flight (its own puts, or
        another writer's chunk: the caller stores it raw); False once the probe is done, or when
        there is none to run (the caller decides). A probe that fails is logged and leaves the
        fit to the tier's transfers."""
        if self._probed and not self._probing:  # the usual case, without the lock
            return False
        with self._lock:
            if self._probing:
                return True
            if self._probed or self.link_probe is None or nbytes < PROBE_MIN_BYTES:
                return False  # a chunk too small to tell sizes apart leaves the probe to a later one
            self._probed = True
            self._probing = threading.get_ident()  # the probe's own puts come from this thread
        points: list[tuple[int, float]] = []
        try:
            points = self.link_probe(nbytes)
            if not points:
                _log.info("auto codec: no read probe of the tier (no room, or an entry refused); "
                          "deciding from its transfers")
        except Exception as exc:  # noqa: BLE001 - a tier's failure: the fit learns from transfers instead
            _log.warning("auto codec: the read probe of the tier failed (%s); deciding from its transfers", exc)
        finally:
            with self._lock:
                for stored, seconds in points:
                    if stored > 0 and seconds > 0:
                        self._reads.add(stored, seconds)
                self._update()
                self._probing = 0
        return False

    def _probe_every(self, code: bool) -> int:
        """Puts between two probes (lock held): ``PROBE_EVERY`` until a fit has told the tier's
        latency from its bandwidth, or the measured re-reads decide; then ``PROBE_EVERY_CODING``
        while coding, and while storing raw as many as keep a coded probe's extra read time
        under ``PROBE_BUDGET``, at most ``PROBE_EVERY_MAX``: the extra is measured once the
        re-reads decide (coded over raw, less one), else the model's ``B/D + 1/r - 1``."""
        measured = self._measured() is not None
        if not measured and self._reads.latency is None and self._writes.latency is None:
            return PROBE_EVERY
        if code:
            return PROBE_EVERY_CODING
        if measured:
            extra = self._read_cost("coded") / self._read_cost("raw") - 1.0
        else:
            b = self.tier_bps
            if b is None or math.isinf(b):
                return PROBE_EVERY_MAX
            extra = b / self._decode_speed() + 1.0 / max(self.ratio, 1.0) - 1.0
        return max(PROBE_EVERY, min(PROBE_EVERY_MAX, math.ceil(extra / PROBE_BUDGET)))

    def observe_put(self, stored_bytes: int, seconds: float) -> None:
        """One put of the tier moved ``stored_bytes`` in ``seconds`` (codec time excluded)."""
        if stored_bytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._writes.add(stored_bytes, seconds)
            self._update()

    def observe_get(self, stored_bytes: int, seconds: float, raw_bytes: int = 0, decode_s: float = 0.0) -> None:
        """One read of the tier moved ``stored_bytes`` in ``seconds`` (decode time excluded) and,
        for a coded entry, decoded ``raw_bytes`` in ``decode_s``. Once reads are seen, the rule
        uses their bandwidth: a re-read is what an engine waits on; and a decode timed on the
        read path is the decode speed the rule uses, as the readers see it (several readers at
        once share the cores: four decoding on two cores each take twice as long, which a probe
        decoded alone on a writer never shows). On the read path, so it only queues (no lock,
        no fit): the fit takes the queued reads when the rule is next asked (``pays``,
        ``state``). Updating the fit on every read cost ~20 us a read after the read's own copy
        had evicted the caches: 10% of a 1 MiB read from a memory-speed tier."""
        if stored_bytes > 0 and seconds > 0:
            self._read_queue.append((stored_bytes, seconds, raw_bytes, decode_s))  # deque.append: atomic, bounded

    def _take_reads(self) -> None:
        """Fold the queued reads into the read fit, the decode speed and the measured cost of
        each kind of re-read (a read that reports its raw bytes: coded when it decoded), then
        ``_update`` (lock held)."""
        queue = self._read_queue
        if queue:
            while queue:
                stored, seconds, raw, decode_s = queue.popleft()
                self._reads.add(stored, seconds)
                if raw > 0 and decode_s > 0:
                    self.read_decode_bps = _avg(self.read_decode_bps, raw / decode_s)
                if raw >= _MIN_BYTES:  # smaller ones are never coded: not a side of the rule
                    kind = "coded" if decode_s > 0 else "raw"
                    self._read_costs[kind].append((seconds + decode_s) / raw)
                    self.read_count[kind] += 1
            self._update()

    def _update(self) -> None:
        """The bandwidths from the fits (lock held)."""
        reads, writes = self._reads.estimate(), self._writes.estimate()
        self.read_bps = reads[0] if reads else None
        self.write_bps = writes[0] if writes else None
        use = reads or writes
        self.tier_bps, self.latency_s = (use[0], use[1]) if use else (None, None)

    def state(self) -> dict:
        """The current choice and its inputs (bytes per second, seconds; counts of coded/raw puts).
        A bandwidth the fit found unbounded (time independent of size) is None, with
        ``size_independent`` true: the state stays valid JSON."""
        with self._lock:
            self._take_reads()
            bandwidths = (("tier_bps", self.tier_bps), ("read_bps", self.read_bps), ("write_bps", self.write_bps))
            finite = {k: (v if v is None or math.isfinite(v) else None) for k, v in bandwidths}
            measured = self._measured()
            return {"coding": self.coding, "decided_by": "rule" if measured is None else "measured reads",
                    **finite, "latency_s": self.latency_s,
                    "size_independent": self.tier_bps is not None and math.isinf(self.tier_bps),
                    "encode_bps": self.encode_bps,
                    "decode_bps": self.decode_bps, "read_decode_bps": self.read_decode_bps,
                    "ratio": self.ratio, "coded_puts": self.coded,
                    "raw_puts": self.raw,
                    "coded_read_s_per_byte": self._read_cost("coded"), "raw_read_s_per_byte": self._read_cost("raw"),
                    "coded_reads_timed": self.read_count["coded"], "raw_reads_timed": self.read_count["raw"]}


def _avg(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EWMA) * old + _EWMA * new


_MEASURED: dict[tuple[str, int], tuple[float, float, float]] = {}
_MEASURE_RUNS = 3


def _measure(codec: Codec, itemsize: int) -> tuple[float, float, float]:
    """(encode B/s, decode B/s, ratio) of ``codec`` on one thread over a 1 MiB sample of
    bf16-like values (normal, upper 16 bits of float32), the fastest of ``_MEASURE_RUNS`` runs
    (one run on a loaded host can be descheduled for longer than it takes: a decoder measured
    at a tenth of its speed would make ``auto`` store raw on a slow link); once per process."""
    key = (codec.name, itemsize)
    if key not in _MEASURED:
        import numpy as np

        x = np.random.default_rng(0).normal(0, 1, 1 << 19).astype(np.float32)
        raw = memoryview((x.view(np.uint32) >> 16).astype(np.uint16)).cast("B")
        codec.encode(raw, itemsize)  # warm up
        out = memoryview(bytearray(raw.nbytes))
        enc = dec = math.inf
        for _ in range(_MEASURE_RUNS):
            start = time.perf_counter()
            coded = codec.encode(raw, itemsize) or bytes(raw)
            enc = min(enc, time.perf_counter() - start)
            start = time.perf_counter()
            if len(coded) < raw.nbytes:
                decode_into(codec.id, memoryview(coded), out, itemsize)
            dec = min(dec, time.perf_counter() - start)
        _MEASURED[key] = (raw.nbytes / max(enc, 1e-9), raw.nbytes / max(dec, 1e-9), raw.nbytes / len(coded))
    return _MEASURED[key]
