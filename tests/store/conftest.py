"""Fixtures of the store contract suite: each store implementation, built over real tiers.

``tiered``: a TieredStore over RAM and a disk directory under the test's temp dir.
``server``: a ServerStore talking to a real ``kvtier serve`` process (the server tests'
``make_server`` fixture, reused).
"""

from __future__ import annotations

import pytest

from kvtier.server.client import ServerStore
from kvtier.store import KVStore, TieredStore
from tests.server.conftest import make_server, server_config  # noqa: F401  (fixtures reused)

IMPLEMENTATIONS = ["tiered", "server"]


@pytest.fixture(params=IMPLEMENTATIONS)
def store(request, tmp_path) -> KVStore:
    """One store of each implementation, closed at teardown."""
    if request.param == "tiered":
        made: KVStore = TieredStore.from_config({"tiers": [
            {"type": "ram", "capacity": "8MiB", "page_size": "64KiB"},
            {"type": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB", "drop_cache": False},
        ]})
    else:
        server = request.getfixturevalue("make_server")()
        made = ServerStore(server.address)
    yield made
    made.close()
