"""A tier from outside the project: a distribution on ``sys.path`` declaring an entry point in
the ``kvtier.tiers`` group is reached by ``{"type": NAME}`` and passes the contract suite; a
broken plugin is one line naming it; a plugin cannot replace a built-in type.

The distribution is written into ``tmp_path`` as an installer would leave it (a package and a
``*.dist-info`` with ``METADATA`` and ``entry_points.txt``); ``importlib.metadata`` finds it
there as it finds any installed one.
"""

from __future__ import annotations

import logging
import re
import sys
import textwrap

import pytest

from kvtier.errors import ConfigError
from kvtier.tiers import registry
from kvtier.tiers.contract import CHECKS, NotApplicable, run_contract
from kvtier.tiers.registry import parse_tier_spec, tier_types

DIST = "kvtier-mytier"

TIER_MODULE = textwrap.dedent('''
    """An out-of-tree tier: payloads in a dict, capacity enforced by the store."""

    import threading
    from dataclasses import dataclass

    from kvtier.config import Size, ranged
    from kvtier.tiers.base import SchedulerView, Tier


    @dataclass
    class MyConfig:
        capacity: Size = ranged(1024**2, ge=0)


    class MyTier(Tier):
        Config = MyConfig
        medium = "MYTIER"
        kv_event_medium = "CPU"
        locality = "LOCAL"
        self_managed = False

        def __init__(self, config, name="mytier"):
            super().__init__(config, name)
            self._data = {}
            self._lock = threading.Lock()

        @classmethod
        def scheduler_view(cls):
            return SchedulerView.MIRRORED

        @property
        def capacity_bytes(self):
            return self.config.capacity

        def used_bytes(self):
            with self._lock:
                return sum(len(v) for v in self._data.values())

        def contains(self, key):
            return bytes(key) in self._data

        def size_of(self, key):
            value = self._data.get(bytes(key))
            return None if value is None else len(value)

        def get_into(self, key, out):
            value = self._data.get(bytes(key))
            if value is None:
                self.stats.add(misses=1)
                return None
            dest = memoryview(out).cast("B")
            if dest.nbytes < len(value):
                self.stats.add(errors=1, misses=1)
                return None
            dest[: len(value)] = value
            self.stats.add(hits=1, bytes_read=len(value))
            return len(value)

        def put(self, key, data, dtype="uint8", shape=None):
            value = bytes(memoryview(data).cast("B"))
            with self._lock:
                old = len(self._data.get(bytes(key), b""))
                if sum(len(v) for v in self._data.values()) - old + len(value) > self.config.capacity:
                    self.stats.add(dropped=1)
                    return False
                self._data[bytes(key)] = value
            self.stats.add(puts=1, bytes_written=len(value))
            return True

        def delete(self, key):
            with self._lock:
                found = self._data.pop(bytes(key), None) is not None
            if found:
                self.stats.add(deletes=1)
            return found

        def keys(self):
            with self._lock:
                return iter(list(self._data))


    class LyingTier(MyTier):
        """Reports twice the bytes it holds: the contract suite must catch it."""

        def used_bytes(self):
            return 2 * super().used_bytes()


    class NotATier:
        Config = MyConfig


    class NoConfig(MyTier):
        Config = None


    class FarAway(MyTier):
        locality = "ELSEWHERE"
''')

ENTRY_POINTS = textwrap.dedent("""
    [kvtier.tiers]
    mytier = kvtier_mytier:MyTier
    lying = kvtier_mytier:LyingTier
    broken-import = kvtier_mytier_missing:MyTier
    not-a-tier = kvtier_mytier:NotATier
    no-config = kvtier_mytier:NoConfig
    far-away = kvtier_mytier:FarAway
    ram = kvtier_mytier:MyTier
""")


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The plugin distribution installed into a directory on ``sys.path`` (removed after)."""
    site = tmp_path / "site"
    (site / "kvtier_mytier").mkdir(parents=True)
    (site / "kvtier_mytier" / "__init__.py").write_text(TIER_MODULE)
    info = site / "kvtier_mytier-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(site))  # also invalidates the import caches
    yield site
    for name in [m for m in sys.modules if m.startswith("kvtier_mytier")]:
        del sys.modules[name]


def _maker(kind: str, made: list):
    def make(capacity: int = 64 * 1024**2):
        tier = parse_tier_spec({"type": kind, "capacity": capacity}, "store.tiers[0]").build()
        made.append(tier)
        return tier

    return make


@pytest.mark.parametrize("check", list(CHECKS.values()), ids=list(CHECKS))
def test_an_out_of_tree_tier_passes_the_tier_contract(plugin, check):
    made: list = []
    try:
        check(_maker("mytier", made))
    except NotApplicable as why:  # a store-managed tier: every rule applies
        pytest.fail(f"a store-managed tier skipped a check: {why}")
    finally:
        for tier in made:
            tier.close()
    assert made and type(made[0]).__module__ == "kvtier_mytier"


def test_an_out_of_tree_tier_is_reached_by_its_type_name_and_declares_its_traits(plugin):
    assert "mytier" in tier_types() and tier_types()[:5] == ["disk", "fs", "ram", "redis", "s3"]
    spec = parse_tier_spec({"type": "mytier", "capacity": "2MiB", "name": "mine"}, "store.tiers[0]")
    assert spec.config.capacity == 2 * 1024**2 and spec.medium == "MYTIER" and spec.name == "mine"
    assert spec.tier_class.locality == "LOCAL" and spec.tier_class.kv_event_medium == "CPU"
    with pytest.raises(ConfigError, match=r"^store\.tiers\[0\]\(mytier\): unknown key 'size'; valid keys: "
                                          r"capacity, name, policy, type$"):
        parse_tier_spec({"type": "mytier", "size": 1}, "store.tiers[0]")
    from kvtier.store.tiered import TieredStore

    store = TieredStore.from_config({"tiers": [{"type": "ram", "capacity": "1MiB"},
                                               {"type": "mytier", "name": "mine"}]})
    try:
        assert store.tier_names == ["ram", "mine"]
        assert type(store.tiers[1]).__name__ == "MyTier"
    finally:
        store.close()


def test_run_contract_fails_a_tier_that_breaks_the_contract(plugin):
    """The suite can fail: a tier whose ``used_bytes`` lies is caught, named by the check."""
    made: list = []
    assert run_contract(_maker("mytier", made)) == {}
    assert len(made) >= len(CHECKS)  # every check opened its own tier
    with pytest.raises(AssertionError, match=r"^tier contract concurrent_put_get_without_lost_or_mixed_entries: "
                                             r"used_bytes 1280000, expected 640000$"):
        run_contract(_maker("lying", []))


@pytest.mark.parametrize("kind, problem", [
    ("broken-import", r"failed to import: ModuleNotFoundError: No module named 'kvtier_mytier_missing'"),
    ("not-a-tier", r"is not a kvtier\.tiers\.base\.Tier subclass \(got <class 'kvtier_mytier\.NotATier'>\)"),
    ("no-config", r"declares no Config dataclass \(class attribute 'Config', got None\)"),
    ("far-away", r": locality must be 'LOCAL' or 'REMOTE', got 'ELSEWHERE'"),
])
def test_a_broken_plugin_is_one_line_naming_the_plugin_and_the_problem(plugin, kind, problem):
    with pytest.raises(ConfigError) as err:
        parse_tier_spec({"type": kind}, "store.tiers[1]")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"store.tiers[1]: tier plugin {kind!r} (kvtier_mytier")
    assert f"from {DIST} 0.1)" in message
    assert re.search(problem, message), message


def test_a_plugin_cannot_replace_a_built_in_tier(plugin, caplog, monkeypatch):
    from kvtier.tiers.ram import RamTier

    monkeypatch.setattr(registry, "_WARNED", set())  # warned once per process: forget earlier tests'

    with caplog.at_level(logging.WARNING, logger=registry.__name__):
        assert parse_tier_spec({"type": "ram"}).tier_class is RamTier
        assert tier_types().count("ram") == 1
    warned = [r.getMessage() for r in caplog.records if "tier plugin 'ram'" in r.getMessage()]
    assert warned == ["tier plugin 'ram' (kvtier_mytier:MyTier, from kvtier-mytier 0.1) ignored: 'ram' is a "
                      "built-in tier type, which a plugin cannot replace"]  # once, not per parse


def test_an_unknown_type_lists_the_plugins_types_too(plugin):
    with pytest.raises(ConfigError, match=r"^store\.tiers\[0\]: unknown tier type 'nope'; valid types: "
                                          r"disk, fs, ram, redis, s3, broken-import, far-away, lying, mytier, "
                                          r"no-config, not-a-tier$"):
        parse_tier_spec({"type": "nope"}, "store.tiers[0]")


def test_a_plugin_tiers_kv_events_carry_its_declared_medium_and_locality(plugin):
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.events import ChunkEvents

    cls = parse_tier_spec({"type": "mytier"}).tier_class
    key = bytes(range(32))
    declared = ChunkEvents(block_size=4, blocks_per_chunk=1, tiers=[cls])
    unknown = ChunkEvents(block_size=4, blocks_per_chunk=1)
    for events in (declared, unknown):
        events.record(None, [key], 0, [1, 2, 3, 4])
    (stored,) = declared.events([("stored", key, "MYTIER")])
    assert (stored.medium, stored.locality, stored.ownership) == ("CPU", "LOCAL", None)
    (guessed,) = unknown.events([("stored", key, "MYTIER")])  # a medium no class declares: a shared pool
    assert (guessed.medium, guessed.locality, guessed.ownership) == ("STORAGE", "REMOTE", "kvtier:mytier")


def test_two_plugins_under_one_name_are_refused_naming_both(plugin):
    other = plugin / "kvtier_mytier_fork-0.2.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtier-mytier-fork\nVersion: 0.2\n")
    (other / "entry_points.txt").write_text("[kvtier.tiers]\nmytier = kvtier_mytier:LyingTier\n")
    with pytest.raises(ConfigError, match=r"^store\.tiers\[0\]: tier type 'mytier' is declared by several plugins "
                                          r"\(.*kvtier_mytier:(MyTier|LyingTier).*, .*kvtier_mytier:(MyTier|LyingTier)"
                                          r".*\); uninstall all but one$"):
        parse_tier_spec({"type": "mytier"}, "store.tiers[0]")
