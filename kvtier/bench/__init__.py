"""Benchmark programs: each measures kvtier and the baselines a user would otherwise pick side by
side in one run, and takes ``--json``.

- One benchmark per module, run as ``kvtier bench NAME`` (``kvtier.cli.bench`` registers them):
  ``tiers`` (with its contestants in ``shared_targets`` and ``server``), ``load``, ``seed``
  (``seed_*``), ``route`` (``route_*``), ``gpu``, ``serve``; ``offload`` is ``kvtier demo``,
  whose settings run in ``engine_run`` processes; ``lmcache_mp`` is the LMCache baseline.
- ``targets``: the issues' targets, one table, checked by ``evaluate`` (no benchmark holds a
  threshold of its own).
- ``models``: the random test models; ``delay_proxy``: fault injection; ``timing``: the best-of-N
  timer the micro-benchmarks share.

Child processes and real servers (redis-server, SeaweedFS, engines) are started through
``kvtier.harness`` (``procs``, ``services``), which the test suite shares.

Imports: ``kvtier.harness`` and anything below it (``route``, ``integrations``, ``server``,
``store``, ``tiers``, ``policies``, ``loader``, ``plan`` and the ground floor, ``kvtier.output``
for printing); never the CLI (``tests/test_layout.py`` checks).
"""
