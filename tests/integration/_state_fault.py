"""Fault injection for the recurrent-state engine test: a kvtier connector that saves every
recurrent state from the wrong block (vLLM's null block 0, never a committed state) instead of the
block vLLM offers for the boundary. Loaded by a spawned vLLM engine through
``kv_connector_module_path: "_state_fault"`` (``scenario.py``'s directory is on its path)."""

from __future__ import annotations

from typing import Any

from kvtier.integrations.vllm.connector import KVTierConnector
from kvtier.integrations.vllm.groups import STATE
from kvtier.integrations.vllm.metadata import KVTierMetadata


class WrongStateConnector(KVTierConnector):
    """``KVTierConnector`` whose scheduler side points every state save at block 0."""

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        meta = super().build_connector_meta(scheduler_output)
        states = {g.index for g in self.groups if g.kind == STATE}
        for save in meta.saves:
            if save.group in states:
                save.block_ids = [0]
        return meta
