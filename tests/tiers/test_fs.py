"""fs tier beyond the contract: concurrent writers in two processes, corruption, sharing, budget."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from kvtier.tiers.fs import FsTier


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def make(path, **options) -> FsTier:
    return FsTier(FsTier.Config(path=str(path), **options), name="fs")


_WRITER = textwrap.dedent("""
    import sys
    from kvtier.tiers.fs import FsTier
    path, writer, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tier = FsTier(FsTier.Config(path=path), name="fs")
    key = (7).to_bytes(4, "little") * 8
    for r in range(rounds):
        # sizes differ per writer and round, so a torn mix of two entries cannot pass as one
        size = 50_000 + 997 * (writer * rounds + r)
        if not tier.put(key, bytes([writer * 16 + r % 16]) * size):
            sys.exit(f"put refused in round {r}")
""")


def test_two_processes_writing_one_key_leave_one_complete_entry(tmp_path):
    rounds = 60
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(w), str(rounds)], env=env)
             for w in range(2)]
    reader = make(tmp_path)
    out = bytearray(50_000 + 997 * 2 * rounds)
    seen = 0
    while any(p.poll() is None for p in procs):
        n = reader.get_into(key(7), out)
        if n is not None:
            seen += 1
            assert out[:n] == bytes([out[0]]) * n  # one writer's whole payload
    assert [p.wait() for p in procs] == [0, 0]
    n = reader.get_into(key(7), out)
    assert n is not None and out[:n] == bytes([out[0]]) * n
    assert reader.stats.corrupt == 0
    leftovers = [name for sub in os.listdir(tmp_path) for name in os.listdir(tmp_path / sub)
                 if name.endswith(".tmp")]
    assert leftovers == []


def test_corrupt_and_truncated_files_are_counted_misses_and_removed(tmp_path):
    tier = make(tmp_path)
    for i in range(3):
        assert tier.put(key(i), bytes([i]) * 10_000)
    path = lambda i: tmp_path / f"{key(i)[0]:02x}" / key(i).hex()  # noqa: E731
    raw = bytearray(path(0).read_bytes())
    raw[-1] ^= 1
    path(0).write_bytes(raw)  # bit flip in the payload
    path(1).write_bytes(path(1).read_bytes()[:5000])  # truncated copy
    path(2).write_bytes(b"garbage")  # not an entry
    for i in range(3):
        assert tier.get_into(key(i), bytearray(10_000)) is None
        assert not path(i).exists()
    assert tier.stats.corrupt == 3 and tier.stats.misses == 3


def test_another_node_sees_adds_and_removes(tmp_path):
    a, b = make(tmp_path), make(tmp_path)
    assert a.put(key(1), b"x" * 500)
    assert b.contains(key(1)) and b.size_of(key(1)) == 500 and list(b.keys()) == [key(1)]
    assert b.delete(key(1))
    assert not a.contains(key(1)) and a.get(key(1)) is None


def test_budget_scan_evicts_oldest_mtime(tmp_path):
    tier = make(tmp_path, capacity=10_000)
    for i in range(5):
        assert tier.put(key(i), bytes([i]) * 4000)
        os.utime(tmp_path / f"{key(i)[0]:02x}" / key(i).hex(), (1000 + i, 1000 + i))
    assert tier.used_bytes() <= 10_000
    assert tier.stats.evictions >= 3
    assert not tier.contains(key(0)) and tier.contains(key(4))


# ------------------------------------------------------------------------------ hardening (issue 9)


def test_forged_entry_length_is_a_counted_corrupt_miss_and_removed(tmp_path):
    """A header with a valid CRC announcing 2**50 bytes: no allocation, no raise; a miss."""
    from tests.tiers.forge import forged_header

    tier = make(tmp_path, capacity=1 << 20)
    k = key(1)
    tier.put(k, b"x" * 100)
    path = tier._path(k)
    with open(path, "wb") as f:
        f.write(forged_header(k, 2**50) + b"x" * 100)
    assert tier.size_of(k) is None  # what a store sizes its buffer from
    assert not os.path.exists(path) and tier.stats.corrupt == 1
    with open(path, "wb") as f:  # within the capacity but not the file's size: also corrupt
        f.write(forged_header(k, 4096) + b"x" * 100)
    assert tier.get(k) is None and tier.get_into(k, bytearray(1 << 20)) is None
    assert not os.path.exists(path) and tier.stats.corrupt == 2


def test_keys_that_are_not_digests_raise_invalid_key(tmp_path):
    """An empty or 3-byte key is a caller's mistake named as such, not an IndexError."""
    import pytest

    from kvtier.errors import InvalidKey

    tier = make(tmp_path)
    for bad in (b"", b"abc", b"x" * 33):
        for call in (lambda: tier.put(bad, b"data"), lambda: tier.get_into(bad, bytearray(8)),
                     lambda: tier.contains(bad), lambda: tier.size_of(bad), lambda: tier.delete(bad)):
            with pytest.raises(InvalidKey, match="32 bytes"):
                call()
    assert list(tier.keys()) == []
