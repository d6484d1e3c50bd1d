"""Configuration attacked once more (issue 24 follow-up): YAML forms the first pass did not
reach, through the real ``kvtier serve --config`` and ``kvtier route --config`` processes."""

from __future__ import annotations

import sys

import pytest

from kvtier.config import MAX_INT_CHARS, parse_yaml
from kvtier.errors import ConfigError

from tests.test_config_hostile import _run_measured

#: YAML 1.1 reads ``1:59:59`` as a base-60 integer; PyYAML's loop is quadratic in its length.
SEXAGESIMAL = "max_connections: 1" + ":59" * 330_000 + "\n"  # just under 1 MiB


@pytest.mark.parametrize("command", ["serve", "route"])
def test_a_base_60_integer_of_a_megabyte_is_refused_at_once(tmp_path, command):
    """Bound: exit 2 with one line within 20 s (it computed for minutes before)."""
    path = tmp_path / "sexagesimal.yaml"
    path.write_text(SEXAGESIMAL)
    code, out, elapsed, _ = _run_measured([sys.executable, "-m", "kvtier.cli", command, "--config", str(path)],
                                          timeout=60)
    assert elapsed < 20, f"{elapsed:.0f} s"
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and str(path) in lines[0] and "refused" in lines[0], out[-2000:]


def test_integers_up_to_the_bound_still_read():
    assert parse_yaml("x: 1:30\ny: " + "7" * MAX_INT_CHARS + "\n", "c") == {"x": 90, "y": int("7" * MAX_INT_CHARS)}
    with pytest.raises(ConfigError, match="refused"):
        parse_yaml("y: 0b" + "1" * MAX_INT_CHARS + "\n", "c")
