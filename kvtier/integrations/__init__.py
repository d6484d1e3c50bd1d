"""Integrations with serving engines: ``vllm/`` (the KV connector, its page layout and the
``kvtier`` load format, registered through vLLM's plugin entry point).

Imports: ``kvtier.server`` (its client), ``kvtier.store``, ``kvtier.tiers``, ``kvtier.loader``
and the ground floor; vLLM only inside ``vllm/``; never route, bench or the CLI.
"""
