"""The harness: starting and supervising the real services and engines that the benchmarks and
the test suite run against.

Not a product surface: only ``kvtier.bench`` and the tests import it (never the tiers, store,
server, router or connector). It exists so that ``kvtier bench ...`` and ``tests/`` start the
same real processes the same way, and so that every one of them ends with whoever started it.

- ``procs``: the one helper for child processes. ``spawn`` starts a child in its own process
  group with ``PR_SET_PDEATHSIG=SIGKILL`` (it dies with its parent, even on SIGKILL) and records
  it in a registry that the next start reaps when its owner died; ``wait_ready`` polls the
  endpoint callers use, ``start_on_ports`` retries a start on fresh ports when one is taken,
  ``run_child`` is ``subprocess.run`` through ``spawn``, ``die_with_parent`` arms the signal in
  a script started by someone else (vLLM's engine processes).
- ``services``: ``redis_server`` and ``seaweedfs`` (``weed mini``, an S3 endpoint) on loopback
  ports, as context managers that yield a small handle and stop the server on exit.
- ``cpu_hog``: ``python -m kvtier.harness.cpu_hog -- COMMAND`` runs a command while every core
  is kept busy (``make test-loaded``, the race check).
- ``cpus``: ``engine_cpu_env(tp)``, the OpenMP thread binding of every vLLM CPU engine they start
  (one thread per rank under ``cpu_hog``).

Every name the benchmarks and tests use is public and documented; anything with a leading
underscore is private to its module.

Imports: the ground floor only (``kvtier.errors``, ``kvtier.s3client``), psutil, and botocore
inside ``services`` (the s3 extra); never ``kvtier.bench`` or the CLI (``tests/test_layout.py``
checks).
"""
