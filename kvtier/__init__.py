"""kvtier: the storage layer for LLM serving (tiered KV cache and streaming weight loading)."""

__version__ = "0.1.0"
