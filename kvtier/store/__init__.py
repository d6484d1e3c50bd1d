"""The KV chunk store: one interface (``KVStore``) and its in-process implementation.

- ``base.py``: ``KVStore``, the abstract store the connector and the server speak to.
- ``events.py``: ``StoreEvent`` (stored/removed, key, medium) and its bounded log.
- ``index.py``: bookkeeping and decisions (sizes, prefix chains, policies, admission, what to
  evict and where it goes); no I/O, no threads.
- ``ledger.py``: ``CopyLedger``, the copies and removals under way (queued, in flight, delete
  generations, orphan bytes) as pure state; no I/O, no threads.
- ``writeback.py``: queues and writer threads for the lower tiers, flush/close; the bounded
  prefetch worker.
- ``config.py``: ``StoreConfig`` (tier specs typed through the tier registry).
- ``tiered.py``: ``TieredStore``, the facade that carries the index's decisions out with tiers.

Imports: ``kvtier.tiers``, ``kvtier.policies``, ``kvtier.buffers``, ``kvtier.keys``,
``kvtier.entry``, ``kvtier.config``, ``kvtier.errors``; never the server, integrations or CLI.
"""

from kvtier.store.base import KVStore, WriteItem
from kvtier.store.config import StoreConfig
from kvtier.store.events import StoreEvent
from kvtier.store.tiered import TieredStore

__all__ = ["KVStore", "StoreConfig", "StoreEvent", "TieredStore", "WriteItem"]
