"""``kvtier route``: a KV-cache-aware OpenAI-compatible router in front of N vLLM servers.

What lives here (imports run downward; nothing here imports vLLM, the CLI or the store):

* ``config``  - ``RouteConfig`` (frozen dataclass from flags or YAML, one-line ``ConfigError``s).
* ``index``   - content keys (``chunk_keys``: chained blake2b over token ids, so no engine hash
  seed must match) and ``PrefixIndex``, a bounded LRU of key -> {engine: media}.
* ``events``  - ``EventSubscriber``: vLLM's ZMQ KV event stream (msgpack ``KVEventBatch`` of
  ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``) into the index, with replay catch-up.
* ``score``   - ``Scorer``: longest consecutive prefix per engine weighted by tier + load,
  speculative entries with a TTL, a request-share guard against piling onto one engine.
* ``tokens``  - ``PromptTokenizer``: request body -> token ids as vLLM would tokenize it.
* ``body``    - ``parse_body``: a request body's routing fields, checked (a 400 line, never a 500).
* ``guard``   - ``ConnectionGuard``: the connection cap and the request-head deadline.
* ``proxy``   - ``Router``: the aiohttp application (completions, chat with streaming, models,
  health, Prometheus metrics), health checks, ejection, retries before the first byte, the
  upstream deadlines, the front door's limits (``serve``).

Third-party imports: aiohttp, pyzmq, msgspec, prometheus_client (all shipped with vLLM),
transformers (only to load a tokenizer), PyYAML (config files).
"""

from kvtier.route.config import EngineSpec, RouteConfig
from kvtier.route.index import PrefixIndex, chunk_keys

__all__ = ["EngineSpec", "RouteConfig", "PrefixIndex", "chunk_keys"]
