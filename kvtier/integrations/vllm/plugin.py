"""``vllm.general_plugins`` entry point: registers the ``kvtier`` load format.

``register()`` is called in every vLLM process. It must stay cheap and must never break vLLM:
if vLLM's loader API is missing or changed, it logs one warning and returns.
"""

from __future__ import annotations

import logging

LOAD_FORMAT = "kvtier"
_log = logging.getLogger("kvtier.integrations.vllm")


def register() -> None:
    """Register ``--load-format kvtier`` with vLLM (idempotent, never raises)."""
    try:
        from vllm.model_executor import model_loader as ml

        if LOAD_FORMAT in getattr(ml, "_LOAD_FORMAT_TO_MODEL_LOADER", {}):
            return
        from kvtier.integrations.vllm.loader import KVTierModelLoader

        ml.register_model_loader(LOAD_FORMAT)(KVTierModelLoader)
    except Exception as exc:  # a plugin must not take vLLM down; say why and carry on
        _log.warning("kvtier: load format %r not registered (%s: %s)", LOAD_FORMAT, type(exc).__name__, exc)
