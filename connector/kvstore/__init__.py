"""The KV store: the producer's dict-keyed buffer of packed entries, its server and its client.

- ``store.py``: :class:`KVBuffer` and the :class:`Lease` a delivery holds;
- ``prefix.py``: the longest-prefix index the buffer owns (local, no request on the wire);
- ``protocol.py``: request and reply kinds (:class:`~.protocol.Op`), meta keys, :class:`Part`,
  the digest check, and how keys go into log lines (:func:`~.protocol.short_id`);
- ``server.py``: :class:`KVServer` (producer); ``client.py``: :class:`KVClient` (consumer);
- ``admission.py``: the server's :class:`ConnectionCaps` (pending and open connections apart);
- ``errors.py``: the KV store's own errors (:class:`KeyMissError`, :class:`BufferFullError`,
  :class:`ClientBusyError`), transport errors by descent.

What other rooms use is exported here; the modules behind these names may move.
"""

from .admission import ConnectionCaps
from .client import KVClient
from .errors import BufferFullError, ClientBusyError, KeyMissError
from .prefix import MAX_PREFIX_TOKENS, block_hashes
from .protocol import CHUNK_SEP, Part, chunk_key, group_of, hide_ids, short_id
from .server import KVServer
from .store import FULL_POLICIES, KVBuffer, Lease

__all__ = [
    "CHUNK_SEP",
    "FULL_POLICIES",
    "MAX_PREFIX_TOKENS",
    "BufferFullError",
    "ClientBusyError",
    "ConnectionCaps",
    "KVBuffer",
    "KVClient",
    "KVServer",
    "KeyMissError",
    "Lease",
    "Part",
    "block_hashes",
    "chunk_key",
    "group_of",
    "hide_ids",
    "short_id",
]
