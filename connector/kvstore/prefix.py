"""Longest-prefix lookup of the KV store: chained block hashes and the index the buffer owns.

An entry put with ``token_ids`` is indexed by the hash of each of its full blocks; a query
(:meth:`connector.kvstore.KVBuffer.match_prefix`) hashes its own blocks and looks each one up in
a dict, so it costs O(number of blocks of the query), never a scan of the entries. It is a local
lookup in the producer's process (no request on the wire asks for it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

__all__ = ["MAX_PREFIX_TOKENS", "PrefixIndex", "block_hashes"]

_HASH_SEED = b"tritonkv-prefix-v1\0"
# Longest token list that match_prefix and put(token_ids=...) take: 4 Mi tokens, 32 MiB of
# int64, well past any context window; it bounds what one lookup costs.
MAX_PREFIX_TOKENS = 1 << 22


def _token_ids(token_ids) -> torch.Tensor:
    """``token_ids`` (a 1-D integer tensor or a sequence of ints, at most MAX_PREFIX_TOKENS) as a
    contiguous 1-D int64 CPU tensor, without going through a Python list for a tensor."""
    if isinstance(token_ids, torch.Tensor):
        dt = token_ids.dtype
        if token_ids.dim() != 1 or dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise TypeError(
                f"token_ids: expected a 1-D integer tensor, got {dt} {list(token_ids.shape)}"
            )
    elif not isinstance(token_ids, Sequence) or isinstance(token_ids, (str, bytes)):
        raise TypeError(f"token_ids: expected a sequence of ints, got {type(token_ids).__name__}")
    if len(token_ids) > MAX_PREFIX_TOKENS:
        raise ValueError(
            f"token_ids: expected at most {MAX_PREFIX_TOKENS} tokens (MAX_PREFIX_TOKENS), "
            f"got {len(token_ids)}"
        )
    if isinstance(token_ids, torch.Tensor):
        return token_ids.to("cpu", torch.int64).contiguous()
    try:
        return torch.tensor(list(token_ids), dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise TypeError("token_ids: expected ints that fit in int64") from None


def block_hashes(token_ids, block_size: int) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids``: ``h[i] = H(h[i-1] || block i)``.

    ``h[i]`` identifies the whole prefix ``token_ids[: (i + 1) * block_size]``, so a dict lookup per
    block finds the longest stored prefix. Example with ``block_size = 4``: 10 tokens → 2 hashes
    (tokens 0..3, then 0..7); the 2 trailing tokens are not indexed.

    Args:
        token_ids: ``[num_tokens]`` integer tensor or sequence of ints (at most
            :data:`MAX_PREFIX_TOKENS`; TypeError / ValueError otherwise).
        block_size: tokens per block.
    """
    ids = _token_ids(token_ids)
    raw = memoryview(ids.numpy()).cast("B")  # hashed in place: no copies, no Python ints
    step = block_size * 8
    out = []
    h = _HASH_SEED
    for i in range(ids.numel() // block_size):
        hasher = hashlib.blake2b(h, digest_size=16)
        hasher.update(raw[i * step : (i + 1) * step])
        h = hasher.digest()
        out.append(h)
    return out


class PrefixIndex:
    """Block hash → keys of the entries holding that prefix (not thread-safe: the buffer calls it
    under its lock, and hashes outside it with :meth:`hashes`).

    Args:
        block_size: tokens per block (a positive int).
    """

    def __init__(self, block_size: int):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
        self.block_size = block_size
        self._keys: dict[bytes, dict[str, None]] = {}  # block hash → keys (insertion order)
        self._hashes: dict[str, list[bytes]] = {}  # key → its block hashes

    def hashes(self, token_ids) -> list[bytes]:
        """:func:`block_hashes` of ``token_ids`` with this index's block size."""
        return block_hashes(token_ids, self.block_size)

    def add(self, key: str, hashes: list[bytes]) -> None:
        """Index ``key`` under ``hashes`` (from :meth:`hashes`); nothing for an empty list."""
        if not hashes:
            return
        self._hashes[key] = hashes
        for h in hashes:
            self._keys.setdefault(h, {})[key] = None

    def remove(self, key: str) -> None:
        """Forget ``key`` (nothing if it was never indexed)."""
        for h in self._hashes.pop(key, ()):
            keys = self._keys.get(h)
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self._keys[h]

    def longest(self, hashes: list[bytes]) -> tuple[int, str | None]:
        """``(num_tokens, key)`` of the longest indexed prefix of a query's ``hashes``, or
        ``(0, None)``; among keys sharing that prefix, the most recently added one."""
        best = None
        n = 0
        for i, h in enumerate(hashes):
            keys = self._keys.get(h)
            if not keys:
                break
            best = next(reversed(keys))
            n = i + 1
        return n * self.block_size, best
