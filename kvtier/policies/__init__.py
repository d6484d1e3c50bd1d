"""Eviction and admission policies: one protocol (``base.EvictionPolicy``), one policy per file."""
