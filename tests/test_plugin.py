"""The ``vllm.general_plugins`` entry point registers the connector and the load format by name."""

from __future__ import annotations

import importlib.metadata

import pytest

pytest.importorskip("vllm")


def _entry_point() -> importlib.metadata.EntryPoint:
    (ep,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "kvtier"]
    return ep


def test_entry_point_resolves_the_connector_by_name_without_module_path():
    """What vLLM does in every process: load the general plugins, then resolve the configured
    connector. No ``kv_connector_module_path``: the name alone must reach kvtier's class."""
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtier.integrations.vllm.connector import KVTierConnector

    register = _entry_point().load()
    register()
    register()  # vLLM may load plugins more than once per process: idempotent, no ValueError
    config = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both")
    assert config.kv_connector_module_path is None
    assert KVConnectorFactory.get_connector_class(config) is KVTierConnector
    assert KVConnectorFactory.supports_hma_config(config) is True  # it declares SupportsHMA, by name too


def test_entry_point_registers_the_load_format():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from kvtier.integrations.vllm.loader import KVTierModelLoader

    _entry_point().load()()
    assert isinstance(get_model_loader(LoadConfig(load_format="kvtier")), KVTierModelLoader)


def test_module_path_form_still_works():
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtier.integrations.vllm.connector import KVTierConnector

    config = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both",
                              kv_connector_module_path="kvtier.integrations.vllm")
    assert KVConnectorFactory.get_connector_class(config) is KVTierConnector


def test_registration_never_raises_when_the_name_is_taken():
    """Another package registered the name first: kvtier keeps theirs and does not break vLLM."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtier.integrations.vllm import plugin

    plugin.register_connector()
    before = KVConnectorFactory._registry["KVTierConnector"]
    plugin.register_connector()
    assert KVConnectorFactory._registry["KVTierConnector"] is before
