"""Per-node cache server: one TieredStore shared by every engine on a node.

``CacheServer`` (``kvtier serve``) owns the tiers; ``ServerStore`` is the client a vLLM
connector uses instead of an in-process TieredStore. Payloads travel through shared memory,
control messages through a unix (or token-protected TCP) socket; see ``protocol``.
"""

from kvtier.server.client import ServerStore, UntrustedServer
from kvtier.server.protocol import VERSION, ServerRejected
from kvtier.server.server import CacheServer, ServeConfig

__all__ = ["CacheServer", "ServeConfig", "ServerStore", "ServerRejected", "UntrustedServer", "VERSION"]
