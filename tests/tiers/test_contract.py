"""The tier contract (``kvtier.tiers.contract``), every check run against every factory in
``conftest.FACTORIES``. An out-of-tree tier runs the same checks: ``test_plugin_tier.py``."""

from __future__ import annotations

import pytest

from kvtier.tiers.contract import CHECKS, NotApplicable


@pytest.mark.parametrize("check", list(CHECKS.values()), ids=list(CHECKS))
def test_tier_contract(check, tier_factory):
    try:
        check(tier_factory)
    except NotApplicable as why:
        pytest.skip(str(why))
