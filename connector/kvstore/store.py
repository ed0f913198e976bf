"""Dict-keyed KV lookup buffer on the producer, a server that answers pulls, and the consumer client.

Why a buffer: prefill and decode handle requests in different orders and at different times, so
the producer parks each request's packed KV (plus ``cu_seqlens``, hidden states, small metadata)
under the transfer id both sides receive explicitly, until the consumer pulls it.

- :class:`KVBuffer` (producer, in process): ``put`` / ``discard`` / ``match_prefix`` / ``take`` /
  ``stats``. Lookup is a dict (O(1)); prefix lookup walks chained block hashes (O(number of
  blocks)), never the entries.
- :class:`KVServer` (producer): accepts consumer connections (a :class:`~connector.pipe.TensorPipe`
  each, own thread each: one consumer dying never disturbs the others) and answers GET / PUT /
  DISCARD / MATCH requests.
- :class:`KVClient` (consumer): ``get(key)`` pulls one entry; ``put`` pushes one (KV-store style);
  ``discard``, ``match_prefix``. One request at a time per client (thread-safe, serialised).

Request / reply protocol (frames of :mod:`connector.transport.frame`, on one pipe per client)::

    GET key {"wait_ms": w}       → DATA key tensors entry_meta | MISS key {"reason"} | ERROR {"error"}
    PUT key tensors entry_meta   → ACK key {} | ERROR key {"error", "type"}
    DISCARD key                  → ACK key {"existed": bool}
    MATCH tensors {"token_ids"}  → ACK {"num_tokens": n, "key": k | None}   (<= MAX_PREFIX_TOKENS)

``put`` refuses (ValueError/TypeError) an entry whose DATA reply the buffer's ``limits`` refuse; a
consumer announcing stricter limits gets an ERROR reply for it, and the entry stays.

Entry life cycle: ``put`` stores the tensors by reference (do not modify them afterwards). A GET
pins the entry while its payload is sent; when the send completed the entry is *claimed* and removed
(after ``max_reads`` deliveries, default 1; 0 = keep until discarded, evicted or expired). A failed
send unpins it for a retry. Every removal is counted (claimed, discarded, evicted, expired) and
remembered for a while, so a later GET's MISS says why: nothing vanishes silently, and
``puts == entries + claimed + discarded + evicted + expired`` always holds.

Full buffer (``capacity_bytes`` of tensor payload), by ``full_policy``:

- ``"wait"`` (default): ``put`` waits up to ``put_timeout_s`` (10 s) for room (claims, discards,
  TTL expiry), then raises :class:`BufferFullError`.
- ``"evict"``: evict the oldest entries that nobody is receiving or waiting for, each with a warning
  and the ``evictions`` counter; if that is not enough, wait as ``"wait"`` does.
- ``"error"``: raise :class:`BufferFullError` at once.

``ttl_s`` (default 600 s): an entry unclaimed that long expires (counted, warned, remembered),
unless it is being sent. Deadlines: client ``timeout_s`` (30 s) per request, ``connect_timeout_s``
(10 s); server ``max_get_wait_s`` (60 s) caps how long a GET may wait for a key to be put
(``wait_s``, default 0: an absent key is an immediate MISS), ``io_timeout_s`` (60 s) per payload.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..logs import get_logger
from ..transport import PipeListener as _PipeListener
from ..transport import TensorPipe, auth, check_timeout, connect_pipe, send_error_frame
from ..transport.errors import (
    BufferFullError,
    ClientBusyError,
    KeyMissError,
    PeerDeadError,
    PipeClosedError,
    ProtocolError,
    RemoteError,
    TransferError,
    TransferTimeout,
)
from ..transport.frame import DEFAULT_LIMITS, FrameLimits, Kind, encode_header, spec_of
from ..transport.options import PipeOptions, default_transport
from ..transport.threads import transfer_thread
from .protocol import Op, op_name

__all__ = [
    "FULL_POLICIES",
    "MAX_PREFIX_TOKENS",
    "BufferFullError",
    "ClientBusyError",
    "KVBuffer",
    "KVClient",
    "KVServer",
    "KeyMissError",
    "PeerDeadError",
    "PipeClosedError",
    "ProtocolError",
    "RemoteError",
    "TransferError",
    "TransferTimeout",
    "block_hashes",
]

log = get_logger("kvstore")

FULL_POLICIES = ("wait", "evict", "error")
_HASH_SEED = b"tritonkv-prefix-v1\0"
# Longest token list that match_prefix and put(token_ids=...) take (and a MATCH request carries):
# 4 Mi tokens, 32 MiB of int64, well past any context window; it bounds what one request costs.
MAX_PREFIX_TOKENS = 1 << 22


def _now() -> float:
    return time.monotonic()


def _check_key(key) -> str:
    if not isinstance(key, str):
        raise TypeError(f"key: expected str, got {type(key).__name__}")
    if not key or len(key.encode("utf-8")) > DEFAULT_LIMITS.max_key_bytes:
        raise ValueError(
            f"key: expected 1..{DEFAULT_LIMITS.max_key_bytes} UTF-8 bytes, got {len(key)} chars"
        )
    return key


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


@dataclass(frozen=True)
class Part:
    """One slice of one tensor of an entry: ``tensor.narrow(dim, start, stop - start)``.

    A GET may ask for a part (a consumer rank that holds some of the producer rank's KV heads
    pulls only those). The server sends that slice and every other tensor of the entry whole; the
    entry counts as delivered once its parts cover the whole dim.
    """

    tensor: str
    dim: int
    start: int
    stop: int

    def meta(self) -> dict:
        return {"part_tensor": self.tensor, "part_dim": self.dim, "part_start": self.start,
                "part_stop": self.stop}  # fmt: skip

    @staticmethod
    def from_meta(meta: dict) -> Part | None:
        """The part a GET's meta asks for; None for the whole entry; ValueError if malformed."""
        fields = ("part_tensor", "part_dim", "part_start", "part_stop")
        if not any(f in meta for f in fields):
            return None
        name, dim, start, stop = (meta.get(f) for f in fields)
        ints = all(type(v) is int for v in (dim, start, stop))
        if not isinstance(name, str) or not ints or not 0 <= start < stop:
            raise ValueError(
                "GET part: expected part_tensor (str) and ints part_dim, part_start < part_stop, "
                f"got {name!r}, {dim!r}, {start!r}, {stop!r}"
            )
        return Part(name, dim, start, stop)

    def check(self, tensors: dict) -> None:
        t = tensors.get(self.tensor)
        if t is None or not 0 <= self.dim < t.dim() or self.stop > t.shape[self.dim]:
            shape = None if t is None else tuple(t.shape)
            raise ValueError(
                f"GET part: tensor {self.tensor!r} of shape {shape} has no dim {self.dim} range "
                f"[{self.start}, {self.stop})"
            )


@dataclass(eq=False)
class _Entry:
    key: str
    tensors: dict
    meta: dict
    nbytes: int
    created: float
    reads_left: int | None  # None: unlimited
    hashes: list
    pins: int = 0
    part_pins: int = 0  # of the pins, deliveries of parts (they run side by side)
    # Part deliveries (a GET of one slice of one tensor): (tensor, dim) -> indices delivered. A
    # delivery counts once every index of that dim was delivered, by one consumer or several.
    covered: dict = field(default_factory=dict)


class KVBuffer:
    """Producer-side dict-keyed buffer of packed KV entries (thread-safe).

    Args:
        capacity_bytes: total tensor bytes held (default 4 GiB).
        ttl_s: seconds an unclaimed entry lives (None: forever). Default 600.
        full_policy: ``"wait"`` | ``"evict"`` | ``"error"`` (module docstring). Default ``"wait"``.
        put_timeout_s: how long ``put`` waits for room (default 10 s).
        block_size: tokens per block for ``match_prefix`` (default 16).
        max_reads: deliveries before an entry is claimed and removed (default 1; 0 = unlimited).
        tombstones: how many removed keys are remembered for MISS reasons (default 100000).
        limits: the :class:`~connector.wire.FrameLimits` every entry must fit as a DATA reply
            (``put`` checks; default: the wire defaults); also the default of ``serve``.
    """

    def __init__(
        self,
        capacity_bytes: int = 4 << 30,
        *,
        ttl_s: float | None = 600.0,
        full_policy: str = "wait",
        put_timeout_s: float = 10.0,
        block_size: int = 16,
        max_reads: int = 1,
        tombstones: int = 100_000,
        limits: FrameLimits = DEFAULT_LIMITS,
    ):
        if not isinstance(limits, FrameLimits):
            raise TypeError(f"limits: expected a FrameLimits, got {type(limits).__name__}")
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise TypeError(f"capacity_bytes: expected int, got {type(capacity_bytes).__name__}")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: expected > 0, got {capacity_bytes}")
        if full_policy not in FULL_POLICIES:
            raise ValueError(f"full_policy: expected one of {FULL_POLICIES}, got {full_policy!r}")
        for name, v in (("block_size", block_size), ("tombstones", tombstones)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if isinstance(max_reads, bool) or not isinstance(max_reads, int) or max_reads < 0:
            raise ValueError(f"max_reads: expected an int >= 0, got {max_reads!r}")
        self.capacity_bytes = capacity_bytes
        self.ttl_s = check_timeout("ttl_s", ttl_s, allow_none=True)
        self.full_policy = full_policy
        self.put_timeout_s = check_timeout("put_timeout_s", put_timeout_s)
        self.block_size = block_size
        self.max_reads = max_reads
        self.limits = limits
        self._tomb_limit = tombstones
        self._cond = threading.Condition()
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._index: dict[bytes, dict[str, None]] = {}  # block hash → keys (insertion order)
        self._tombs: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._waiting: collections.Counter[str] = collections.Counter()
        self._bytes = 0
        self._closed = False
        self._c = collections.Counter()

    # ----------------------------------------------------------------------------- internals
    def _count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._c[name] += n

    def _remove_locked(self, e: _Entry, reason: str) -> None:
        del self._entries[e.key]
        self._bytes -= e.nbytes
        for h in e.hashes:
            keys = self._index.get(h)
            if keys is not None:
                keys.pop(e.key, None)
                if not keys:
                    del self._index[h]
        self._tombs[e.key] = reason
        self._tombs.move_to_end(e.key)
        while len(self._tombs) > self._tomb_limit:
            self._tombs.popitem(last=False)
        self._cond.notify_all()

    def _expire_locked(self, now: float) -> float | None:
        """Expire unpinned entries past their TTL; return when the next unpinned one expires
        (None: none will; a pinned one is looked at again when its delivery ends)."""
        if self.ttl_s is None:
            return None
        limit = now - self.ttl_s
        expired = []
        for e in self._entries.values():  # insertion order == creation order
            if e.created > limit:
                break
            if e.pins == 0:
                expired.append(e)
        for e in expired:
            log.warning("KVBuffer: entry %r expired unclaimed after %.1f s", e.key, now - e.created)
            self._remove_locked(e, f"expired: unclaimed for {self.ttl_s:g} s (ttl_s)")
            self._c["expirations"] += 1
        nxt = next((e for e in self._entries.values() if e.pins == 0), None)
        return None if nxt is None else nxt.created + self.ttl_s

    def _evict_one_locked(self) -> bool:
        for e in self._entries.values():  # oldest first
            if e.pins == 0 and self._waiting[e.key] == 0:
                log.warning(
                    "KVBuffer full: evicting unclaimed entry %r (%d bytes, age %.1f s)",
                    e.key,
                    e.nbytes,
                    _now() - e.created,
                )
                self._remove_locked(e, "evicted: buffer full (full_policy='evict')")
                self._c["evictions"] += 1
                return True
        return False

    def _miss_reason_locked(self, key: str) -> str:
        e = self._entries.get(key)
        if e is not None:
            return "claimed: being delivered to another consumer"
        return self._tombs.get(key, "never put (or forgotten)")

    def _servable_locked(self, key: str) -> _Entry | None:
        """The entry of ``key`` if one more delivery may start: whole deliveries under way count
        against its reads left; deliveries of parts do not (they add up to one, see Part)."""
        e = self._entries.get(key)
        if e is None:
            return None
        if e.reads_left is not None and e.reads_left - (e.pins - e.part_pins) <= 0:
            return None
        return e

    def _checkout(self, key: str, wait_s: float = 0.0, part: bool = False) -> _Entry:
        """Pin ``key`` for delivery (of a part when ``part``), waiting up to ``wait_s`` for it to
        be put. KeyMissError if absent. Pair with ``_checkin``."""
        t0 = _now()
        deadline = t0 + wait_s
        with self._cond:
            self._expire_locked(t0)
            e = self._servable_locked(key)
            if e is None and wait_s > 0:
                self._waiting[key] += 1
                try:
                    while e is None and not self._closed:
                        left = deadline - _now()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                        e = self._servable_locked(key)
                finally:
                    self._waiting[key] -= 1
                    if self._waiting[key] <= 0:
                        del self._waiting[key]
                if e is None:
                    self._c["timeouts"] += 1
            if e is None:
                self._c["misses"] += 1
                reason = self._miss_reason_locked(key)
                if wait_s > 0 and key not in self._tombs and key not in self._entries:
                    reason = f"not put within wait_s={wait_s:g} s"
                raise KeyMissError(
                    "key not in buffer", reason=reason, key=key, waited_s=_now() - t0
                )
            e.pins += 1
            e.part_pins += part
            return e

    def _checkin(self, e: _Entry, delivered: bool, part: Part | None = None) -> None:
        with self._cond:
            e.pins -= 1
            e.part_pins -= part is not None
            if delivered and part is not None:
                self._c["part_deliveries"] += 1
                done = e.covered.setdefault((part.tensor, part.dim), set())
                done.update(range(part.start, part.stop))
                delivered = len(done) == e.tensors[part.tensor].shape[part.dim]
                if not delivered:
                    self._cond.notify_all()
                    return
                del e.covered[(part.tensor, part.dim)]  # a whole delivery: the next one anew
            if delivered:
                self._c["hits"] += 1
                if e.reads_left is not None:
                    e.reads_left -= 1
                    if e.reads_left <= 0 and self._entries.get(e.key) is e:
                        self._remove_locked(e, "claimed: already delivered")
                        self._c["claimed"] += 1
            else:
                self._c["failed_deliveries"] += 1
            self._cond.notify_all()

    # ---------------------------------------------------------------------------------- public
    def put(
        self,
        key: str,
        tensors: dict[str, torch.Tensor],
        meta: dict | None = None,
        *,
        token_ids=None,
        max_reads: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Store ``tensors`` (by reference) and ``meta`` under ``key``.

        ``token_ids`` (optional) indexes the entry's full blocks for ``match_prefix``.
        ``max_reads`` overrides the buffer default. When full, follows ``full_policy`` waiting at
        most ``timeout_s`` (default ``put_timeout_s``). Raises ValueError for a duplicate key, an
        entry larger than the capacity or one the wire ``limits`` refuse (see KVBuffer), TypeError
        for a dtype the wire cannot carry, BufferFullError when no room was made in time.
        """
        key = _check_key(key)
        if not isinstance(tensors, dict):
            raise TypeError(f"tensors: expected dict[str, Tensor], got {type(tensors).__name__}")
        for name, t in tensors.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"tensor names: expected non-empty str, got {name!r}")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{name!r}]: expected a Tensor, got {type(t).__name__}")
        specs = [spec_of(name, t) for name, t in tensors.items()]
        nbytes = sum(sp.nbytes for sp in specs)
        # the DATA reply this entry becomes must pass every wire limit (rank, names, count, sizes,
        # meta): an entry no consumer can receive is refused here, not at its delivery
        encode_header(Op.DATA, key, meta, specs, limits=self.limits, check=True)
        meta = dict(meta or {})
        if max_reads is None:
            max_reads = self.max_reads
        elif isinstance(max_reads, bool) or not isinstance(max_reads, int) or max_reads < 0:
            raise ValueError(f"max_reads: expected an int >= 0, got {max_reads!r}")
        hashes = [] if token_ids is None else block_hashes(token_ids, self.block_size)
        if nbytes > self.capacity_bytes:
            raise ValueError(
                f"entry {key!r}: {nbytes} bytes can never fit, capacity_bytes={self.capacity_bytes}"
            )
        timeout_s = (
            self.put_timeout_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        )
        t0 = _now()
        deadline = t0 + timeout_s
        with self._cond:
            if self._closed:
                raise PipeClosedError("buffer is closed", key=key)
            if key in self._entries:
                raise ValueError(f"key {key!r} is already in the buffer (discard it first)")
            while True:
                next_expiry = self._expire_locked(_now())
                if self._bytes + nbytes <= self.capacity_bytes:
                    break
                if self.full_policy == "evict" and self._evict_one_locked():
                    continue
                left = deadline - _now()
                if self.full_policy == "error" or left <= 0 or self._closed:
                    self._c["full_errors"] += 1
                    if self.full_policy != "error":
                        self._c["timeouts"] += 1
                    raise BufferFullError(
                        f"buffer full: {self._bytes} of {self.capacity_bytes} bytes used by "
                        f"{len(self._entries)} entries, entry needs {nbytes} "
                        f"(full_policy={self.full_policy!r})",
                        key=key,
                        waited_s=_now() - t0,
                    )
                self._c["full_waits"] += 1
                if next_expiry is not None:  # an expiry makes room too: wake up for it
                    left = min(left, max(0.001, next_expiry - _now()))
                self._cond.wait(left)
                if key in self._entries:
                    raise ValueError(f"key {key!r} is already in the buffer (discard it first)")
            e = _Entry(key, dict(tensors), meta, nbytes, _now(), max_reads or None, hashes)
            self._entries[key] = e
            self._tombs.pop(key, None)
            self._bytes += nbytes
            for h in hashes:
                self._index.setdefault(h, {})[key] = None
            self._c["puts"] += 1
            self._c["bytes_put"] += nbytes
            self._cond.notify_all()

    def take(self, key: str, wait_s: float = 0.0) -> tuple[dict[str, torch.Tensor], dict]:
        """Local get (same process): the entry's tensors and meta, counted as one delivery.
        Raises KeyMissError (with the reason) if absent after ``wait_s`` seconds."""
        key = _check_key(key)
        e = self._checkout(key, wait_s)
        self._checkin(e, delivered=True)
        return dict(e.tensors), dict(e.meta)

    def discard(self, key: str) -> bool:
        """Drop ``key`` (abort). True if it was held. An entry being sent is dropped once sent."""
        key = _check_key(key)
        with self._cond:
            e = self._entries.get(key)
            if e is None:
                return False
            self._remove_locked(e, "discarded")
            self._c["discards"] += 1
            return True

    def match_prefix(self, token_ids) -> tuple[int, str | None]:
        """Longest stored prefix of ``token_ids`` in whole blocks: ``(num_tokens, key)``, or
        ``(0, None)``. O(number of blocks of the query), independent of the number of entries.
        Among entries sharing that prefix, the most recently put one is returned."""
        hashes = block_hashes(token_ids, self.block_size)
        with self._cond:
            self._expire_locked(_now())
            best = None
            n = 0
            for i, h in enumerate(hashes):
                keys = self._index.get(h)
                if not keys:
                    break
                best = next(reversed(keys))
                n = i + 1
            self._c["prefix_hits" if best else "prefix_misses"] += 1
            return n * self.block_size, best

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    def __contains__(self, key: str) -> bool:
        with self._cond:
            return key in self._entries

    def stats(self) -> dict[str, int]:
        """Counters: entries, bytes, capacity_bytes, puts, hits, misses, claimed, discards,
        evictions, expirations, timeouts, full_waits, full_errors, failed_deliveries,
        prefix_hits, prefix_misses, bytes_put, bytes_sent, bytes_received (the last two by the
        servers of this buffer)."""
        with self._cond:
            self._expire_locked(_now())
            out = {
                k: 0
                for k in (
                    "puts", "hits", "part_deliveries", "misses", "claimed", "discards",
                    "evictions", "expirations",
                    "timeouts", "full_waits", "full_errors", "failed_deliveries", "prefix_hits",
                    "prefix_misses", "bytes_put", "bytes_sent", "bytes_received",
                )
            }  # fmt: skip
            out.update(self._c)
            out["entries"] = len(self._entries)
            out["bytes"] = self._bytes
            out["capacity_bytes"] = self.capacity_bytes
            out["pinned"] = sum(1 for e in self._entries.values() if e.pins)
            return out

    def close(self) -> None:
        """Refuse new puts and wake every waiter (idempotent). Held entries stay readable."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def serve(self, host: str = "127.0.0.1", port: int = 0, **kw) -> KVServer:
        """Start a :class:`KVServer` for this buffer (see its arguments)."""
        return KVServer(self, host, port, **kw)


# ----------------------------------------------------------------------------------------------
# Server
# ----------------------------------------------------------------------------------------------
class KVServer:
    """Serves a :class:`KVBuffer` to consumers over tensor pipes (background threads).

    One accept thread; per connection one handler thread (handshake, then request/reply). A
    consumer that dies or misbehaves only loses its own connection. Args: ``transport`` (``"gloo"``
    default, ``"nccl"`` for CUDA), ``allow_socket`` (also accept inline-TCP clients, default True),
    ``device`` (where PUT payloads land), ``max_connections`` (64), ``max_get_wait_s`` (60 s cap
    on a GET's wait for a key), ``connect_timeout_s`` (10 s handshake), ``options``: the
    pipes' :class:`~connector.transport.options.PipeOptions` (default: the defaults, with
    ``limits=buffer.limits``).

    Trust: ``secret`` / ``insecure`` as for :class:`~connector.pipe.PipeListener` (every
    connection authenticates first; a non-loopback address needs a secret or ``insecure=True``).
    Failed authentications are counted (``auth_failures``) and logged at most once per host a
    minute; a host may hold at most ``MAX_PENDING_PER_HOST`` connections that have not finished
    authenticating. ``allow`` names the requests served (default ``GET`` and ``DISCARD``, what a
    producer's consumers need); ``PUT`` and ``MATCH`` are for store-style buffers that clients
    fill. A request not allowed gets an ERROR reply naming it, and the connection stays usable.
    """

    MAX_PENDING_PER_HOST = 4
    ALLOW_DEFAULT = frozenset({"GET", "DISCARD"})
    _ALLOWABLE = ("GET", "DISCARD", "PUT", "MATCH")

    def __init__(
        self,
        buffer: KVBuffer,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        transport: str = "gloo",
        allow_socket: bool = True,
        device: str | torch.device = "cpu",
        max_connections: int = 64,
        max_get_wait_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        secret: bytes | str | None = None,
        insecure: bool = False,
        allow: Sequence[str] | frozenset[str] = ALLOW_DEFAULT,
        options: PipeOptions | None = None,
    ):
        if not isinstance(buffer, KVBuffer):
            raise TypeError(f"buffer: expected a KVBuffer, got {type(buffer).__name__}")
        if isinstance(allow, str) or not set(allow) <= set(self._ALLOWABLE):
            raise ValueError(f"allow: expected a set of {self._ALLOWABLE}, got {allow!r}")
        self.allow = frozenset(allow)
        self.buffer = buffer
        self.max_connections = max_connections
        self.max_get_wait_s = check_timeout("max_get_wait_s", max_get_wait_s)
        options = PipeOptions(limits=buffer.limits) if options is None else options
        self.io_timeout_s = options.io_timeout_s
        self._listener = _PipeListener(
            host,
            port,
            transport=transport,
            allow_socket=allow_socket,
            device=device,
            connect_timeout_s=connect_timeout_s,
            secret=secret,
            insecure=insecure,
            options=options,
        )
        self.host, self.port = self._listener.address
        self._auth_failures = auth.FailureLog()
        self._pending: collections.Counter[str] = collections.Counter()  # host -> handshakes
        self._lock = threading.Lock()
        self._pipes: dict[int, TensorPipe] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._ids = itertools.count()
        self._c = collections.Counter()
        self._closed = False
        self._accept_thread = transfer_thread(self._accept_loop, f"tkv-server[{self.port}]-accept")
        self._accept_thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def stats(self) -> dict[str, int]:
        """Buffer stats plus connections, open_connections, handshake_errors, auth_failures,
        protocol_errors, peer_errors, requests, refused_requests, rejected_connections."""
        out = self.buffer.stats()
        with self._lock:
            for k in ("connections", "handshake_errors", "protocol_errors", "peer_errors",
                      "requests", "refused_requests", "rejected_connections"):  # fmt: skip
                out[k] = self._c[k]
            out["open_connections"] = len(self._pipes)
        out["auth_failures"] = self._auth_failures.count
        return out

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                got = self._listener.accept_socket(None)
            except Exception:
                log.exception("KVServer accept failed")
                continue
            if got is None:
                return
            sock, peer = got
            host = peer.rsplit(":", 1)[0]
            with self._lock:
                busy = len(self._threads) >= self.max_connections
                if busy or self._pending[host] >= self.MAX_PENDING_PER_HOST:
                    # Nothing is read from the peer; it is told why (in place of the challenge).
                    self._c["rejected_connections"] += 1
                    why = "too many connections" if busy else "too many pending handshakes"
                    limit = self.max_connections if busy else self.MAX_PENDING_PER_HOST
                    send_error_frame(sock, f"{why} ({limit})")
                    sock.close()
                    continue
                self._pending[host] += 1
                cid = next(self._ids)
                t = transfer_thread(
                    self._handle, f"tkv-server[{self.port}]-conn{cid}", (cid, sock, peer)
                )
                self._threads[cid] = t
            t.start()

    def _handle(self, cid: int, sock, peer: str) -> None:
        pipe = None
        host = peer.rsplit(":", 1)[0]
        pending = [True]  # this connection holds one of its host's handshake slots

        def free_slot() -> None:
            with self._lock:
                if pending[0]:
                    pending[0] = False
                    self._pending[host] -= 1
                    if not self._pending[host]:
                        del self._pending[host]

        def authenticated(error: auth.AuthError | None) -> None:
            # Before the peer learns the verdict: a refused peer that reconnects at once finds
            # its failure counted and its slot free.
            if error is not None and self._auth_failures.failed(peer):
                log.warning("KVServer: authentication of %s failed: %s", peer, error)
            free_slot()

        try:
            try:
                pipe = self._listener.handshake(sock, peer, on_auth=authenticated)
            except auth.AuthError:
                return  # counted and logged by authenticated()
            except TransferError as e:
                log.warning("KVServer: handshake with %s failed: %s", peer, e)
                with self._lock:
                    self._c["handshake_errors"] += 1
                return
            finally:
                free_slot()  # if the handshake ended before authentication was decided
            with self._lock:
                if self._closed:
                    return
                self._pipes[cid] = pipe
                self._c["connections"] += 1
            self._serve(pipe)
        except ProtocolError as e:
            log.warning("KVServer: dropping %s: protocol error: %s", peer, e)
            with self._lock:
                self._c["protocol_errors"] += 1
        except (PeerDeadError, PipeClosedError) as e:
            log.info("KVServer: connection %s ended: %s", peer, e)
            if isinstance(e, PeerDeadError):
                with self._lock:
                    self._c["peer_errors"] += 1
        except TransferError as e:
            log.warning("KVServer: dropping %s: %s", peer, e)
            with self._lock:
                self._c["peer_errors"] += 1
        except Exception:
            log.exception("KVServer: handler for %s crashed", peer)
        finally:
            if pipe is not None:
                pipe.close()
            with self._lock:
                self._pipes.pop(cid, None)
                self._threads.pop(cid, None)

    def _serve(self, pipe: TensorPipe) -> None:
        buf = self.buffer
        while not self._closed:
            msg = pipe.recv(self.io_timeout_s, idle=True)
            with self._lock:
                self._c["requests"] += 1
            if op_name(msg.kind) in self._ALLOWABLE and op_name(msg.kind) not in self.allow:
                with self._lock:
                    self._c["refused_requests"] += 1
                error = f"{op_name(msg.kind)} is not allowed on this server (allowed: "
                error += f"{', '.join(sorted(self.allow))})"
                pipe.send(
                    msg.key, kind=Kind.ERROR, meta={"error": error, "type": "PermissionError"}
                )
            elif msg.kind == Op.GET:
                self._on_get(pipe, msg)
            elif msg.kind == Op.PUT:
                try:
                    buf.put(msg.key, msg.tensors, msg.meta)
                    buf._count("bytes_received", sum(t.nbytes for t in msg.tensors.values()))
                    pipe.send(msg.key, kind=Op.ACK)
                except (TransferError, ValueError, TypeError) as e:
                    pipe.send(msg.key, kind=Kind.ERROR, meta={"error": str(e)[:2000],
                                                             "type": type(e).__name__})  # fmt: skip
            elif msg.kind == Op.DISCARD:
                try:
                    existed = buf.discard(msg.key)
                    pipe.send(msg.key, kind=Op.ACK, meta={"existed": existed})
                except (ValueError, TypeError) as e:
                    pipe.send(msg.key, kind=Kind.ERROR, meta={"error": str(e)[:2000]})
            elif msg.kind == Op.MATCH:
                ids = msg.tensors.get("token_ids")
                try:
                    if ids is None:
                        raise ValueError("MATCH: expected a tensor 'token_ids'")
                    n, k = buf.match_prefix(ids)
                    pipe.send(msg.key, kind=Op.ACK, meta={"num_tokens": n, "key": k})
                except (ValueError, TypeError) as e:
                    pipe.send(msg.key, kind=Kind.ERROR, meta={"error": str(e)[:2000]})
            else:
                pipe.send(
                    msg.key, kind=Kind.ERROR, meta={"error": f"unexpected {op_name(msg.kind)}"}
                )
                raise ProtocolError(f"unexpected request kind {op_name(msg.kind)}", peer=pipe.peer)

    def _on_get(self, pipe: TensorPipe, msg) -> None:
        wait_ms = msg.meta.get("wait_ms", 0)
        if isinstance(wait_ms, bool) or not isinstance(wait_ms, (int, float)) or wait_ms < 0:
            pipe.send(msg.key, kind=Kind.ERROR, meta={"error": f"bad wait_ms {wait_ms!r}"})
            return
        wait_s = min(wait_ms / 1000.0, self.max_get_wait_s)
        try:
            part = Part.from_meta(msg.meta)
            entry = self.buffer._checkout(msg.key, wait_s, part=part is not None)
        except KeyMissError as e:
            pipe.send(msg.key, kind=Op.MISS, meta={"reason": e.reason})
            return
        except ValueError as e:
            pipe.send(msg.key, kind=Kind.ERROR, meta={"error": str(e)[:2000]})
            return
        buf = self.buffer
        tensors = entry.tensors
        if part is not None:
            try:
                part.check(tensors)
            except ValueError as e:
                buf._checkin(entry, delivered=False, part=part)
                pipe.send(msg.key, kind=Kind.ERROR, meta={"error": str(e)[:2000]})
                return
            tensors = dict(tensors)
            sliced = tensors[part.tensor].narrow(part.dim, part.start, part.stop - part.start)
            tensors[part.tensor] = sliced.contiguous()
        done = threading.Event()

        def on_done(exc, entry=entry):
            if done.is_set():
                return
            done.set()
            buf._checkin(entry, delivered=exc is None, part=part)
            if exc is None:
                buf._count("bytes_sent", sum(t.nbytes for t in tensors.values()))
            else:
                log.warning("KVServer: delivering %r to %s failed: %s", entry.key, pipe.peer, exc)

        try:
            pipe.send(msg.key, tensors, entry.meta, kind=Op.DATA, on_done=on_done)
        except (ValueError, TypeError) as e:  # this consumer's limits refuse the entry: it stays
            on_done(e)
            pipe.send(msg.key, kind=Kind.ERROR, meta={"error": str(e)[:2000]})
        except BaseException as e:
            on_done(e)
            raise

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, close every connection, join threads, all within one ``timeout_s``
        (plus about a second). Idempotent. The buffer stays usable."""
        deadline = _now() + timeout_s
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pipes = list(self._pipes.values())
            threads = list(self._threads.values())
        self._listener.close()
        for p in pipes:  # a consumer that stopped reading takes the budget once, not once each
            p.close(timeout_s=max(0.0, deadline - _now()))
        self._accept_thread.join(max(0.1, deadline - _now()))
        for t in threads:
            t.join(max(0.05, deadline - _now()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------------------------
# Client
# ----------------------------------------------------------------------------------------------
class KVClient:
    """Consumer side: pulls entries from a :class:`KVServer`.

    Args: ``host``, ``port``; ``device`` where tensors land (default ``"cpu"``); ``transport``
    (default ``"nccl"`` for a CUDA device, else ``"gloo"``; ``"socket"`` for inline TCP);
    ``timeout_s`` default deadline per request (30 s); ``connect_timeout_s`` (10 s); ``secret``
    (the server's shared secret, :mod:`connector.transport.auth`); ``options`` (PipeOptions). Connects lazily
    and reconnects after a broken connection (every timeout or transport error closes the
    connection, so a late reply can never answer the wrong request).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        device: str | torch.device = "cpu",
        transport: str | None = None,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        secret: bytes | str | None = None,
        options: PipeOptions | None = None,
    ):
        self.secret = auth.check_secret(secret)
        self.host = host
        self.port = port
        self.peer = f"{host}:{port}"
        self.device = torch.device(device)
        self.transport = default_transport(self.device) if transport is None else transport
        self.timeout_s = check_timeout("timeout_s", timeout_s)
        self.connect_timeout_s = check_timeout("connect_timeout_s", connect_timeout_s)
        self.options = options
        self._lock = threading.Lock()
        self._pipe: TensorPipe | None = None
        self._closed = False
        self._c = collections.Counter()

    def stats(self) -> dict[str, int]:
        """requests, hits, misses, timeouts, errors, reconnects, bytes_sent, bytes_received."""
        out = {k: 0 for k in ("requests", "hits", "misses", "timeouts", "errors", "connects",
                              "bytes_sent", "bytes_received")}  # fmt: skip
        out.update(self._c)
        return out

    def _connect(self, deadline: float, key: str | None) -> TensorPipe:
        if self._pipe is not None and self._pipe.broken is None and not self._pipe.closed:
            return self._pipe
        if self._pipe is not None:
            self._pipe.close(timeout_s=1.0)
            self._pipe = None
        left = deadline - _now()
        if left <= 0:
            raise TransferTimeout("no time left to connect", peer=self.peer, key=key)
        self._pipe = connect_pipe(
            self.host,
            self.port,
            transport=self.transport,
            device=self.device,
            connect_timeout_s=min(self.connect_timeout_s, left),
            secret=self.secret,
            options=self.options,
        )
        self._c["connects"] += 1
        if self._closed:  # close() ran meanwhile and may have missed this pipe
            self._pipe.close(timeout_s=1.0)
            raise PipeClosedError("client is closed", peer=self.peer, key=key)
        return self._pipe

    def _request(self, kind, key, tensors=None, meta=None, timeout_s=None, out=None):
        timeout_s = self.timeout_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        t0 = _now()
        deadline = t0 + timeout_s
        if not self._lock.acquire(timeout=timeout_s):
            self._c["timeouts"] += 1
            raise ClientBusyError(
                "client busy with other requests", peer=self.peer, key=key, waited_s=_now() - t0
            )
        try:
            if self._closed:
                raise PipeClosedError("client is closed", peer=self.peer, key=key)
            self._c["requests"] += 1
            try:
                pipe = self._connect(deadline, key)
                pipe.send(key, tensors, meta, kind=kind, timeout_s=max(0.001, deadline - _now()))
                left = deadline - _now()
                if left <= 0:
                    raise TransferTimeout("deadline passed", peer=self.peer, key=key,
                                          waited_s=_now() - t0)  # fmt: skip
                reply = pipe.recv(left, out=out, expect_key=key)
            except TransferError as e:
                self._c["timeouts" if isinstance(e, TransferTimeout) else "errors"] += 1
                if self._pipe is not None:
                    self._pipe.close(timeout_s=1.0)
                    self._pipe = None
                # name the key the caller asked for and the whole time this request waited
                raise e.with_context(key=e.key or key or None, waited_s=_now() - t0) from e
            if tensors:
                self._c["bytes_sent"] += sum(t.nbytes for t in tensors.values())
            if reply.key != key:
                self._pipe.close(timeout_s=1.0)
                self._pipe = None
                raise ProtocolError(
                    f"reply for key {reply.key!r} ({op_name(reply.kind)})",
                    peer=self.peer,
                    key=key,
                )
            if reply.kind == Kind.ERROR:
                self._c["errors"] += 1
                raise RemoteError(
                    f"server error: {reply.meta.get('error')}",
                    peer=self.peer,
                    key=key,
                    waited_s=_now() - t0,
                )
            return reply, t0
        finally:
            self._lock.release()

    def get(
        self,
        key: str,
        timeout_s: float | None = None,
        *,
        wait_s: float = 0.0,
        out: dict[str, torch.Tensor] | None = None,
        part: Part | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """Pull entry ``key``: ``(tensors on self.device, meta)``.

        ``part``: only that slice of one tensor (the others whole); the entry is claimed once the
        parts pulled, by any consumers, cover the whole dim (:class:`Part`).

        ``wait_s``: how long the server may wait for the key to be put (capped by its
        ``max_get_wait_s``); must be below ``timeout_s`` (default ``self.timeout_s``). ``out``:
        tensors to fill in place (see TensorPipe.recv). Raises KeyMissError (with the server's
        reason), TransferTimeout, PeerDeadError, RemoteError, ProtocolError.
        """
        key = _check_key(key)
        eff = self.timeout_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or wait_s < 0:
            raise ValueError(f"wait_s: expected a number >= 0, got {wait_s!r}")
        if wait_s >= eff:
            raise ValueError(f"wait_s: expected < timeout_s={eff:g}, got {wait_s:g}")
        meta = {"wait_ms": math.ceil(wait_s * 1000), **(part.meta() if part is not None else {})}
        reply, t0 = self._request(Op.GET, key, meta=meta, timeout_s=eff, out=out)
        if reply.kind == Op.MISS:
            self._c["misses"] += 1
            raise KeyMissError(
                "producer does not hold the key",
                reason=str(reply.meta.get("reason", "unknown")),
                peer=self.peer,
                key=key,
                waited_s=_now() - t0,
            )
        if reply.kind != Op.DATA:
            raise ProtocolError(f"expected DATA or MISS, got {op_name(reply.kind)}", peer=self.peer,
                                key=key)  # fmt: skip
        self._c["hits"] += 1
        self._c["bytes_received"] += sum(t.nbytes for t in reply.tensors.values())
        return reply.tensors, reply.meta

    def put(
        self,
        key: str,
        tensors: dict[str, torch.Tensor],
        meta: dict | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Push an entry into the server's buffer (KV-store style). RemoteError if refused (e.g.
        the server's buffer is full)."""
        key = _check_key(key)
        if not isinstance(tensors, dict):
            raise TypeError(f"tensors: expected dict[str, Tensor], got {type(tensors).__name__}")
        reply, _ = self._request(Op.PUT, key, tensors, meta, timeout_s)
        if reply.kind != Op.ACK:
            raise ProtocolError(f"expected ACK, got {op_name(reply.kind)}", peer=self.peer, key=key)

    def discard(self, key: str, timeout_s: float | None = None) -> bool:
        """Ask the server to drop ``key``; True if it held it."""
        key = _check_key(key)
        reply, _ = self._request(Op.DISCARD, key, timeout_s=timeout_s)
        return bool(reply.meta.get("existed"))

    def match_prefix(self, token_ids, timeout_s: float | None = None) -> tuple[int, str | None]:
        """Remote :meth:`KVBuffer.match_prefix`: ``(num_tokens, key or None)``."""
        ids = _token_ids(token_ids)
        reply, _ = self._request(Op.MATCH, "", {"token_ids": ids}, None, timeout_s)
        n = reply.meta.get("num_tokens", 0)
        k = reply.meta.get("key")
        if not isinstance(n, int) or (k is not None and not isinstance(k, str)):
            raise ProtocolError(f"bad MATCH reply {reply.meta}", peer=self.peer)
        return n, k

    def close(self) -> None:
        """Close the connection (goodbye to the server). Idempotent. Does not wait for a request
        another thread has in flight: that request raises PipeClosedError at once."""
        self._closed = True
        pipe = self._pipe  # no lock: a request in flight holds it until its deadline
        if pipe is not None:
            with contextlib.suppress(Exception):
                pipe.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
