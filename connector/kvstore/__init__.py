"""The KV store: the producer's dict-keyed buffer of packed entries, its server and its client.

What other rooms use is exported here; the modules behind these names may move.
"""

from .store import FULL_POLICIES, KVBuffer, KVClient, KVServer, Part

__all__ = ["FULL_POLICIES", "KVBuffer", "KVClient", "KVServer", "Part"]
