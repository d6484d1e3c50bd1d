"""The race check's shuffled order (``--shuffle SEED``) keeps files and classes together."""

from __future__ import annotations

import random
from dataclasses import dataclass

from conftest import shuffled


@dataclass(frozen=True)
class _Item:
    nodeid: str


def _items() -> list[_Item]:
    ids = [f"tests/test_a.py::test_{i}" for i in range(5)]
    ids += [f"tests/test_b.py::TestX::test_{i}" for i in range(4)]
    ids += [f"tests/test_b.py::test_free_{i}" for i in range(3)]
    ids += [f"tests/test_b.py::TestY::test_{i}[p{j}]" for i in range(2) for j in range(2)]
    ids += [f"tests/test_c.py::test_{i}" for i in range(6)]
    return [_Item(i) for i in ids]


def _runs(keys: list[str]) -> int:
    """How many contiguous runs of equal keys ``keys`` has."""
    return sum(1 for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k)


def test_each_file_and_class_stays_contiguous() -> None:
    items = _items()
    for seed in range(20):
        out = shuffled(items, random.Random(seed))
        assert sorted(i.nodeid for i in out) == sorted(i.nodeid for i in items)  # nothing lost or doubled
        files = [i.nodeid.split("::")[0] for i in out]
        assert _runs(files) == 3
        classes = [i.nodeid.rsplit("::", 1)[0] for i in out if i.nodeid.count("::") == 2]
        assert _runs(classes) == 2


def test_the_order_changes_with_the_seed_at_every_level() -> None:
    items = _items()
    orders = {tuple(i.nodeid for i in shuffled(items, random.Random(seed))) for seed in range(20)}
    assert len(orders) > 15
    file_orders = {tuple(dict.fromkeys(n.split("::")[0] for n in o)) for o in orders}
    assert len(file_orders) > 1
    firsts_in_a = {next(n for n in o if n.startswith("tests/test_a.py")) for o in orders}
    assert len(firsts_in_a) > 1


def test_the_same_seed_repeats_the_order() -> None:
    items = _items()
    assert shuffled(items, random.Random(7)) == shuffled(items, random.Random(7))
