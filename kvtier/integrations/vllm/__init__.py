"""vLLM integrations: the KV connector (``KVTierConnector``) and the ``kvtier`` load format.

vLLM finds the connector by ``kv_connector_module_path = "kvtier.integrations.vllm"``. The
connector imports vLLM, so it is loaded on first access only.
"""


def __getattr__(name: str):
    if name in ("KVTierConnector", "KVTierMetadata"):
        from kvtier.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(name)
