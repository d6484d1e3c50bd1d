"""Attacks on ``kvtier.skip_save`` (``scheduler._skips_save``) from a hostile client: params
that are no dict, odd keys and values, and many requests with a bad value (the log)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm import scheduler  # noqa: E402

LOGGER = "kvtier.integrations.vllm.scheduler"


def _req(params, rid="r"):
    return SimpleNamespace(request_id=rid, kv_transfer_params=params)


def _skips(request, bad=None) -> bool:
    return scheduler._skips_save(request, bad or scheduler.BadValueLog())


@pytest.mark.parametrize("params", [None, [], ["kvtier.skip_save"], "kvtier.skip_save", 1, {},
                                    {"kvtier.skip_save ": True}, {"KVTIER.SKIP_SAVE": True}, {1: True},
                                    {("kvtier.skip_save",): True}, {f"k{i}": i for i in range(100_000)}])
def test_params_that_do_not_name_the_key_store_as_usual_without_a_word(params, caplog):
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert _skips(_req(params)) is False
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_only_a_bool_decides():
    assert _skips(_req({"kvtier.skip_save": True, "other": [1]})) is True
    assert _skips(_req({"kvtier.skip_save": False})) is False
    assert _skips(SimpleNamespace(request_id="x")) is False  # no attribute at all


def test_a_flood_of_bad_values_logs_one_short_warning(caplog):
    """Every request of a client sending ``"kvtier.skip_save": "<10 MB>"`` used to log a warning
    holding the whole value: the log grew by the value's size per request. Now the first bad
    value warns once per scheduler, its value cut short; the rest are logged at debug."""
    huge = "y" * (10 << 20)
    bad = scheduler.BadValueLog()  # one scheduler's
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(1000):
            assert _skips(_req({"kvtier.skip_save": huge if i == 0 else i}, f"r{i}"), bad) is False
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert len(text) < 500 and "kvtier.skip_save" in text and "valid: true or false" in text
