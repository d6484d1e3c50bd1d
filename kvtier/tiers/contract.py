"""The tier contract as checks any tier can be run through, built in or from a plugin.

Each check is a function ``check(make)``: ``make(capacity=64 MiB) -> Tier`` opens a fresh, empty
tier of the kind under test (the caller closes what it made). A check raises ``AssertionError``
naming what broke, or ``NotApplicable`` when the rule does not hold for that kind of tier (a
self-managed tier evicts instead of refusing a put). ``CHECKS`` lists them all by name.

From pytest, one test per check::

    import pytest
    from kvtier.tiers.contract import CHECKS, NotApplicable

    @pytest.mark.parametrize("check", CHECKS.values(), ids=list(CHECKS))
    def test_contract(check, tmp_path):
        made = []
        def make(capacity=64 * 1024**2):
            made.append(MyTier(MyTier.Config(path=str(tmp_path), capacity=capacity), name="mine"))
            return made[-1]
        try:
            check(make)
        except NotApplicable as why:
            pytest.skip(str(why))
        finally:
            for tier in made:
                tier.close()

or, outside pytest, ``run_contract(make)`` (every check; the tiers it made closed).

Imports: ``numpy`` and ``kvtier.tiers.base`` only (no pytest: a plugin's own tests choose their runner).
"""

from __future__ import annotations

import os
import threading
from typing import Callable

import numpy as np

from kvtier.tiers.base import Tier

#: ``make(capacity=...) -> Tier``: a fresh, empty tier of the kind under test
Make = Callable[..., Tier]

#: payload sizes of the round trip: empty, one byte, around a 4 KiB page, several pages, 1 MiB
SIZES = (0, 1, 4095, 4096, 4097, 300_001, 1 << 20)


class NotApplicable(Exception):
    """This rule of the contract does not apply to this kind of tier (the message says why)."""


def _expect(condition: object, message: str) -> None:
    """AssertionError with ``message`` unless ``condition``: the checks' failure, raised
    explicitly so it holds under ``python -O`` too."""
    if not condition:
        raise AssertionError(message)


def key(i: int | None = None) -> bytes:
    """A chunk key: random, or derived from ``i`` (the same ``i``, the same key)."""
    return os.urandom(32) if i is None else i.to_bytes(4, "little") * 8


def payload(n: int, seed: int = 0) -> bytes:
    """``n`` pseudo-random bytes, the same for the same ``seed``."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def check_round_trip_is_bit_exact(make: Make) -> None:
    """What is put is read back bit for bit, by ``get`` and ``get_into``, at every size."""
    tier = make()
    for size in SIZES:
        k, data = key(), payload(size, size)
        _expect(tier.put(k, data), f"put of {size} bytes refused")
        _expect(tier.contains(k), f"{size} bytes: not contained after put")
        got = tier.size_of(k)
        _expect(got == size, f"{size} bytes: size_of says {got}")
        _expect(tier.get(k) == data, f"{size} bytes: get returned other bytes")
        out = bytearray(size + 10)
        _expect(tier.get_into(k, out) == size, f"{size} bytes: get_into did not return the size")
        _expect(bytes(out[:size]) == data, f"{size} bytes: get_into filled other bytes")


def check_put_accepts_numpy_with_dtype_and_shape(make: Make) -> None:
    """An array put with its dtype and shape reads back into an array of that shape."""
    tier = make()
    k = key()
    arr = np.arange(2 * 3 * 128, dtype=np.float16).reshape(2, 3, 128)
    _expect(tier.put(k, arr, dtype="float16", shape=arr.shape), 'expected tier.put(k, arr, dtype="float16", shape=arr.shape)')
    out = np.empty_like(arr)
    _expect(tier.get_into(k, out) == arr.nbytes, 'expected tier.get_into(k, out) == arr.nbytes')
    _expect(np.array_equal(out, arr), 'expected np.array_equal(out, arr)')


def check_miss_is_none(make: Make) -> None:
    """An absent key is a miss: False, None, None, None; nothing raises."""
    tier = make()
    k = key()
    _expect(not tier.contains(k), 'expected not tier.contains(k)')
    _expect(tier.size_of(k) is None, 'expected tier.size_of(k) is None')
    _expect(tier.get(k) is None, 'expected tier.get(k) is None')
    _expect(tier.get_into(k, bytearray(16)) is None, 'expected tier.get_into(k, bytearray(16)) is None')


def check_overwrite_leaves_one_complete_entry(make: Make) -> None:
    """Putting a key again leaves one entry, the newer, counted once in ``used_bytes``."""
    tier = make()
    k = key()
    _expect(tier.put(k, payload(5000, 1)), 'expected tier.put(k, payload(5000, 1))')
    _expect(tier.put(k, payload(7000, 2)), 'expected tier.put(k, payload(7000, 2))')
    _expect(tier.get(k) == payload(7000, 2), 'expected tier.get(k) == payload(7000, 2)')
    _expect(list(tier.keys()).count(k) == 1, 'expected list(tier.keys()).count(k) == 1')
    used = tier.used_bytes()
    _expect(used == 7000, f"used_bytes {used} after overwriting 5000 with 7000")


def check_delete(make: Make) -> None:
    """A deleted key is a miss; deleting it again returns False."""
    tier = make()
    k = key()
    _expect(tier.put(k, b"x" * 100), 'expected tier.put(k, b"x" * 100)')
    _expect(tier.delete(k), 'expected tier.delete(k)')
    _expect(not tier.contains(k), 'expected not tier.contains(k)')
    _expect(tier.get(k) is None, 'expected tier.get(k) is None')
    _expect(not tier.delete(k), 'expected not tier.delete(k)')


def check_keys_and_contains_many(make: Make) -> None:
    """``keys`` lists what was put; ``contains_many`` answers in the order asked."""
    tier = make()
    ks = [key() for _ in range(5)]
    for i, k in enumerate(ks[:3]):
        _expect(tier.put(k, payload(100 + i, i)), 'expected tier.put(k, payload(100 + i, i))')
    _expect(set(tier.keys()) == set(ks[:3]), 'expected set(tier.keys()) == set(ks[:3])')
    _expect(tier.contains_many(ks) == [True, True, True, False, False], 'expected tier.contains_many(ks) == [True, True, True, False, False]')


def check_used_bytes_accounting(make: Make) -> None:
    """``used_bytes`` is the sum of the payloads held (0 when empty)."""
    tier = make()
    _expect(tier.used_bytes() == 0, 'expected tier.used_bytes() == 0')
    a, b = key(), key()
    tier.put(a, payload(1000))
    tier.put(b, payload(3000))
    _expect(tier.used_bytes() == 4000, 'expected tier.used_bytes() == 4000')
    tier.delete(a)
    _expect(tier.used_bytes() == 3000, 'expected tier.used_bytes() == 3000')
    tier.delete(b)
    _expect(tier.used_bytes() == 0, 'expected tier.used_bytes() == 0')


def check_put_beyond_capacity_is_refused_and_counted(make: Make) -> None:
    """A store-managed tier refuses a put it has no room for (False, ``stats.dropped``)."""
    tier = make(capacity=64 * 1024)
    if tier.self_managed:
        raise NotApplicable("self-managed tiers evict instead of refusing")
    _expect(tier.put(key(), payload(40 * 1024)), 'expected tier.put(key(), payload(40 * 1024))')
    _expect(not tier.put(key(), payload(40 * 1024)), 'expected not tier.put(key(), payload(40 * 1024))')
    _expect(tier.stats.dropped == 1, 'expected tier.stats.dropped == 1')
    _expect(tier.used_bytes() <= tier.capacity_bytes, 'expected tier.used_bytes() <= tier.capacity_bytes')


def check_too_small_buffer_is_a_counted_miss(make: Make) -> None:
    """``get_into`` a buffer smaller than the entry: None, ``stats.errors`` + 1, entry unharmed."""
    tier = make()
    k = key()
    tier.put(k, payload(1000))
    errors = tier.stats.errors
    _expect(tier.get_into(k, bytearray(999)) is None, 'expected tier.get_into(k, bytearray(999)) is None')
    _expect(tier.stats.errors == errors + 1, 'expected tier.stats.errors == errors + 1')
    _expect(tier.get(k) == payload(1000), 'expected tier.get(k) == payload(1000)')


def check_stats_count_operations(make: Make) -> None:
    """One put, hit, miss and delete are counted once each, with their bytes."""
    tier = make()
    k = key()
    tier.put(k, payload(100))
    tier.get_into(k, bytearray(100))
    tier.get_into(key(), bytearray(100))
    tier.delete(k)
    stats = tier.stats.as_dict()
    _expect((stats["puts"], stats["hits"], stats["misses"], stats["deletes"]) == (1, 1, 1, 1), stats)
    _expect(stats["bytes_written"] == 100 and stats["bytes_read"] == 100, stats)


def check_concurrent_put_get_without_lost_or_mixed_entries(make: Make) -> None:
    """Four writers and two readers at once: no read returns mixed or foreign bytes, and the
    last version of every key is what remains."""
    tier = make()
    # every payload is derived from (key, version): a reader tells a mixed or foreign payload
    # from a legitimate older or newer version
    writers, per_writer, versions, size = 4, 8, 3, 20_000
    errors: list[str] = []

    def expected(k: bytes, version: int) -> bytes:
        return payload(size, int.from_bytes(k[:4], "little") * 10 + version)

    def write(w: int) -> None:
        for version in range(versions):
            for i in range(per_writer):
                k = key(w * 1000 + i)
                if not tier.put(k, expected(k, version)):
                    errors.append(f"put refused {w}/{i}")

    def read() -> None:
        out = bytearray(size)
        for _ in range(versions):
            for w in range(writers):
                for i in range(per_writer):
                    k = key(w * 1000 + i)
                    n = tier.get_into(k, out)
                    if n is not None and bytes(out) not in {expected(k, v) for v in range(versions)}:
                        errors.append(f"mixed bytes for {w}/{i}")

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _expect(errors == [], errors[:5])
    for w in range(writers):
        for i in range(per_writer):
            k = key(w * 1000 + i)
            _expect(tier.get(k) == expected(k, versions - 1), 'expected tier.get(k) == expected(k, versions - 1)')
    held = writers * per_writer * size
    used = tier.used_bytes()
    _expect(used == held, f"used_bytes {used}, expected {held}")
    _expect(tier.stats.corrupt == 0, f"{tier.stats.corrupt} entries counted corrupt")


#: every check of the contract, by name
CHECKS: dict[str, Callable[[Make], None]] = {
    name[len("check_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("check_")
}


def run_contract(make: Make) -> dict[str, str]:
    """Run every check against ``make``'s tiers, closing each tier after its check. Returns
    ``{check: why}`` for the checks that did not apply; the first failure raises
    ``AssertionError`` prefixed with the check's name."""
    skipped: dict[str, str] = {}
    for name, check in CHECKS.items():
        made: list[Tier] = []

        def tracked(*args, **kwargs) -> Tier:
            made.append(make(*args, **kwargs))
            return made[-1]

        try:
            check(tracked)
        except NotApplicable as why:
            skipped[name] = str(why)
        except AssertionError as exc:
            raise AssertionError(f"tier contract {name}: {exc}") from exc
        finally:
            for tier in made:
                tier.close()
    return skipped


__all__ = ["CHECKS", "Make", "NotApplicable", "SIZES", "key", "payload", "run_contract"]
