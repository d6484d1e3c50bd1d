"""fs tier on a directory tenants write, attacked once more (issue 24 follow-up)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

JUNK = 60_000
_SCAN = """
import sys, tracemalloc
from kvtier.tiers.fs import FsConfig, FsTier
tracemalloc.start()
tier = FsTier(FsConfig(path=sys.argv[1], usage_refresh_s=0), name="fs")
print(tier.used_bytes(), tracemalloc.get_traced_memory()[1])
"""


def test_a_fanout_directory_of_junk_names_is_walked_in_bounded_memory(tmp_path):
    """A fan-out directory of 60,000 names that are no entry (252 characters, ending .tmp) was
    listed whole into memory at every scan (~18 MiB; millions of names, gigabytes). Now
    the walk streams the directory. Bound: the scan allocates < 8 MiB at its peak (tracemalloc),
    and the real entry beside the junk is still counted."""
    root = tmp_path / "fs"
    root.mkdir(mode=0o700)
    from kvtier.tiers.fs import FsConfig, FsTier

    tier = FsTier(FsConfig(path=str(root), usage_refresh_s=0), name="fs")
    assert tier.put(bytes([0xAB]) + bytes(31), b"x" * 1000)
    tier.close()
    fan = root / "ab"
    pad = "j" * 240
    try:
        dfd = os.open(fan, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i in range(JUNK):
                os.close(os.open(f"{pad}{i:08d}.tmp", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=dfd))
        finally:
            os.close(dfd)
        out = subprocess.run([sys.executable, "-c", _SCAN, str(root)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        used, grown = map(int, out.stdout.split())
        assert used == 1000, used
        assert grown < 8 * 2**20, f"the scan allocated {grown / 2**20:.0f} MiB at its peak"
    finally:
        shutil.rmtree(fan, ignore_errors=True)
