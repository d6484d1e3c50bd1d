"""kvtier.server imports its modules on first use only."""

from __future__ import annotations

import subprocess
import sys


def test_package_import_loads_no_submodule_until_a_name_is_used():
    code = ("import sys, kvtier.server as s; "
            "assert not [m for m in sys.modules if m.startswith('kvtier.server.')], sorted(sys.modules); "
            "s.ServerStore; assert 'kvtier.server.client' in sys.modules; "
            "assert 'kvtier.server.server' not in sys.modules; "
            "from kvtier.server import ServeConfig, VERSION; assert isinstance(VERSION, int)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_unknown_name_is_an_attribute_error():
    import kvtier.server

    try:
        kvtier.server.Nope
    except AttributeError as exc:
        assert "Nope" in str(exc)
    else:
        raise AssertionError("no AttributeError")
