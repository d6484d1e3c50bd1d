"""Eviction and admission policies: bookkeeping only, no I/O.

- ``base.py``: ``EvictionPolicy``, the protocol (``admit``, ``miss``, ``insert``, ``access``,
  ``remove``, ``victim``) and ``Owner``, the loop that drives one over a cache; one policy per file (``lru``, ``fifo``, ``s3fifo``, ``wtinylfu`` with
  ``_sketch``, its frequency sketch, ``wtinylfu_adaptive`` with ``_minisim``, the miniature
  simulations that choose its window share); ``registry.py``: ``POLICIES`` and ``make_policy``.
- ``admission.py``: break-even admission (``Admission``), asked by the store before a write.

Imports: ``kvtier.registry``, ``kvtier.config``, ``kvtier.errors`` only; never tiers, the store
or anything above.
"""
