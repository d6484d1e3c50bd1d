"""``vllm.general_plugins`` entry point: registers the ``kvtier`` load format and the
``KVTierConnector`` KV connector with vLLM.

vLLM calls ``register()`` in every process it starts (API server, engine core, workers), so it
must stay cheap, be idempotent and never break vLLM: if a vLLM API is missing or changed, it
logs one warning per registration and returns. After it ran:

- ``--load-format kvtier`` selects :class:`kvtier.integrations.vllm.loader.KVTierModelLoader`;
- ``{"kv_connector": "KVTierConnector"}`` resolves through vLLM's ``KVConnectorFactory`` to
  :class:`kvtier.integrations.vllm.connector.KVTierConnector` without
  ``kv_connector_module_path`` (the connector module is imported only when an engine builds it);
- kvtier's log records (the ``kvtier`` logger and its children) go to vLLM's own handlers at
  vLLM's level, as vLLM's own modules' records do (``route_logs_to_vllm``).
"""

from __future__ import annotations

import logging

LOAD_FORMAT = "kvtier"
CONNECTOR_NAME = "KVTierConnector"
CONNECTOR_MODULE = "kvtier.integrations.vllm.connector"
_log = logging.getLogger("kvtier.integrations.vllm")


def register() -> None:
    """Register the load format and the KV connector with vLLM and route kvtier's logs to vLLM's
    handlers (idempotent, never raises)."""
    route_logs_to_vllm()
    register_load_format()
    register_connector()


class _ToVllmHandler(logging.Handler):
    """Hands each record to the ``vllm`` logger's handlers as they are at that moment (vLLM may
    reconfigure them, e.g. in a spawned engine process), if vLLM's level lets it through."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm")
        if record.levelno >= target.getEffectiveLevel():
            target.handle(record)


def route_logs_to_vllm() -> bool:
    """Make the ``kvtier`` logger follow vLLM's logging configuration; True when it does.

    vLLM configures only its ``vllm`` logger (handler, format, ``VLLM_LOGGING_LEVEL``), so
    without this kvtier's INFO lines vanish and its warnings reach stderr unformatted. Done only
    when vLLM configured logging (its logger has handlers) and nobody configured kvtier's or the
    root logger (no handlers there): an application's own logging setup is left alone. The
    ``kvtier`` logger then takes vLLM's current level and stops propagating (as ``vllm`` does).
    Idempotent; never raises.
    """
    try:
        ours, vllm_logger = logging.getLogger("kvtier"), logging.getLogger("vllm")
        if any(isinstance(h, _ToVllmHandler) for h in ours.handlers):
            return True
        if not vllm_logger.handlers or ours.handlers or logging.getLogger().handlers:
            return False
        ours.addHandler(_ToVllmHandler())
        if ours.level == logging.NOTSET:
            ours.setLevel(vllm_logger.getEffectiveLevel())
        ours.propagate = False
        return True
    except Exception:  # logging must never break vLLM's start
        return False


def register_load_format() -> None:
    """Register ``--load-format kvtier`` unless it already is (never raises)."""
    try:
        from vllm.model_executor import model_loader as ml

        if LOAD_FORMAT in getattr(ml, "_LOAD_FORMAT_TO_MODEL_LOADER", {}):
            return
        from kvtier.integrations.vllm.loader import KVTierModelLoader

        ml.register_model_loader(LOAD_FORMAT)(KVTierModelLoader)
    except Exception as exc:  # a plugin must not take vLLM down; say why and carry on
        _log.warning("kvtier: load format %r not registered (%s: %s)", LOAD_FORMAT, type(exc).__name__, exc)


def register_connector() -> None:
    """Register ``KVTierConnector`` with vLLM's ``KVConnectorFactory`` unless a connector of that
    name already is (vLLM raises on a second registration; never raises here).

    The factory stores a lazy loader (module path + class name), so registering imports neither
    the connector nor torch-heavy code.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
            return
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except Exception as exc:  # a plugin must not take vLLM down; say why and carry on
        _log.warning("kvtier: KV connector %r not registered (%s: %s)", CONNECTOR_NAME, type(exc).__name__, exc)
