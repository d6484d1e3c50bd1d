"""vLLM integrations: the KV connector (``KVTierConnector``) and the ``kvtier`` load format.

Installed kvtier registers both through vLLM's ``vllm.general_plugins`` entry point
(:mod:`kvtier.integrations.vllm.plugin`), so ``"kv_connector": "KVTierConnector"`` and
``--load-format kvtier`` work by name. ``kv_connector_module_path = "kvtier.integrations.vllm"``
keeps working too. The connector imports vLLM, so it is loaded on first access only.
"""


def __getattr__(name: str):
    if name in ("KVTierConnector", "KVTierMetadata"):
        from kvtier.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(name)
