"""The producer's dict-keyed KV buffer: entries parked under a transfer id until a consumer loads them.

Why a buffer: prefill and decode handle requests in different orders and at different times, so
the producer parks each request's entry (named tensors: the connector stores its packed KV as ``kv``;
plus small metadata) under the transfer id both sides receive explicitly, until the consumer loads it.

:class:`KVBuffer` (thread-safe, in process): ``put`` / ``discard`` / ``discard_any`` / ``stats``
/ ``close``, ``len`` / ``in``, ``match_prefix`` (the longest stored prefix of a token list,
:mod:`connector.kvstore.prefix`), and the lease API a server delivers through: ``checkout`` a
:class:`Lease`, send its tensors, ``checkin`` the lease. Lookup is a dict (O(1)).

Entry life cycle: ``put`` stores the tensors by reference (do not modify them afterwards), bound
to a ``digest`` when given (the connector binds each entry to its prompt's digest): then only a
checkout or discard presenting the same digest (compared in constant time) finds it; to any other
the entry does not exist (the miss reason of a key never put, ``discard`` False). A lease
pins the entry while its payload is sent; checked in as delivered, the entry is *claimed* and
removed (for a :class:`~connector.kvstore.protocol.Part`: once the parts delivered cover the
dim). Checked in as not delivered, it is unpinned for a retry. Every removal is counted (claimed,
discarded, evicted, expired) and remembered for a while, so a later checkout's miss says why:
nothing vanishes silently, and ``puts == entries + claimed + discards + evictions + expirations``
always holds.

Only its owner discards an entry whatever its digest (``discard_any``: a producer aborting its own
save). A transfer may be stored in parts under keys of one group (``<transfer id>#<index>``, the
overlapped flow's chunks): ``discard`` / ``discard_any`` with ``seal`` discard the whole group and
refuse its later parts, so a transfer discarded while its producer still computes it leaves nothing.

Full buffer (``capacity_bytes`` of tensor payload), by ``full_policy``:

- ``"wait"`` (default): ``put`` waits up to ``put_timeout_s`` (10 s) for room (claims, discards,
  TTL expiry), then raises :class:`BufferFullError`.
- ``"evict"``: evict the oldest entries that nobody is receiving or waiting for, each with a warning
  and the ``evictions`` counter; if that is not enough, wait as ``"wait"`` does.
- ``"error"``: raise :class:`BufferFullError` at once.

``ttl_s`` (default 600 s): an entry unclaimed that long expires (counted, warned, remembered),
unless it is being sent. ``put`` refuses (ValueError / TypeError) an entry whose DATA reply the
buffer's ``limits`` refuse.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

import torch

from ..logs import get_logger
from ..transport import (
    DEFAULT_LIMITS,
    FrameLimits,
    PipeClosedError,
    check_timeout,
    encode_header,
    spec_of,
)
from .errors import BufferFullError, KeyMissError
from .protocol import Op, Part, check_key, group_of, short_id
from .table import ANY, Entry, Table

__all__ = ["FULL_POLICIES", "KVBuffer", "Lease"]

log = get_logger("kvstore")

FULL_POLICIES = ("wait", "evict", "error")

# Counters of stats(), in the order they are listed there.
_COUNTERS = (
    "puts", "hits", "part_deliveries", "misses", "claimed", "discards", "evictions",
    "expirations", "timeouts", "full_waits", "full_errors", "failed_deliveries", "prefix_hits",
    "prefix_misses", "bytes_put", "bytes_sent", "sealed_puts",
)  # fmt: skip


def _check_config(capacity_bytes, full_policy, limits, clock) -> None:
    """TypeError / ValueError for a bad KVBuffer argument, saying what was given."""
    if not isinstance(limits, FrameLimits):
        raise TypeError(f"limits: expected a FrameLimits, got {type(limits).__name__}")
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise TypeError(f"capacity_bytes: expected int, got {type(capacity_bytes).__name__}")
    if capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes: expected > 0, got {capacity_bytes}")
    if full_policy not in FULL_POLICIES:
        raise ValueError(f"full_policy: expected one of {FULL_POLICIES}, got {full_policy!r}")
    if not callable(clock):
        raise TypeError(f"clock: expected a callable, got {type(clock).__name__}")


def _check_digest(digest, *, put: bool = False) -> str | None:
    """``digest`` if it is None or a str (non-empty for ``put``); TypeError / ValueError."""
    if digest is not None and not isinstance(digest, str):
        raise TypeError(f"digest: expected str or None, got {type(digest).__name__}")
    if put and digest == "":
        raise ValueError("digest: expected a non-empty str or None, got ''")
    return digest


def _check_checkout(key, wait_s, part, digest) -> str | None:
    """``digest`` if the arguments of ``checkout`` are valid; TypeError / ValueError otherwise."""
    if not isinstance(key, str):
        raise TypeError(f"key: expected str, got {type(key).__name__}")
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or wait_s < 0:
        raise ValueError(f"wait_s: expected a number >= 0, got {wait_s!r}")
    if part is not None and not isinstance(part, Part):
        raise TypeError(f"part: expected a Part or None, got {type(part).__name__}")
    return _check_digest(digest)


def _entry_bytes(key: str, tensors, meta, limits: FrameLimits, capacity_bytes: int) -> int:
    """The tensor bytes of an entry that ``put`` may store; TypeError / ValueError otherwise."""
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
    encode_header(Op.DATA, key, meta, specs, limits=limits, check=True)
    if nbytes > capacity_bytes:
        raise ValueError(
            f"entry {key!r}: {nbytes} bytes can never fit, capacity_bytes={capacity_bytes}"
        )
    return nbytes


class Lease:
    """One delivery of one entry under way: from :meth:`KVBuffer.checkout` to
    :meth:`KVBuffer.checkin` (or the end of a ``with lease:`` block, which checks it in as
    delivered unless the block raised).

    What a lease guarantees until it is checked in:

    - its entry is neither evicted nor expired (a ``discard`` still removes it from the buffer;
      the lease's tensors stay valid, they are held by reference);
    - a whole lease is the only whole delivery of its key: another checkout of the key misses
      ("claimed: being delivered to another consumer") until it is checked in undelivered;
      leases of parts run side by side with each other, and start only while no whole one runs.

    Checked in as delivered, a whole lease claims (removes) the entry; a part's lease records its
    indices, and the entry is claimed once the parts delivered cover the whole dim. Checked in as
    not delivered, the entry stays for a retry (``failed_deliveries``). A lease is checked in once.

    Attributes:
        key: the entry's key.
        tensors: what to send: the entry's tensors, the part's tensor cut to the part (a copy).
        meta: the entry's meta (a copy).
        part: the :class:`~connector.kvstore.protocol.Part` delivered, or None for the entry.
        nbytes: bytes of ``tensors`` (added to ``bytes_sent`` when delivered).
        entry_nh: the NH outputs of ``tensors`` under the entry's key that were made when it
            was put (``put(nh=)``): all of them for a whole delivery; a part's sliced tensor is
            other bytes, hashed when it is sent (``rehash``), its others as put. None: none.
        rehash: the name of a part's sliced tensor whose whole the entry was put with NH outputs
            for (the sender hashes the slice under the entry's key), else None.
    """

    def __init__(self, buffer: KVBuffer, entry: Entry, part: Part | None):
        self.key = entry.key
        self.part = part
        self.tensors = dict(entry.tensors) if part is None else part.cut(entry.tensors)
        self.meta = dict(entry.meta)
        self.nbytes = sum(t.nbytes for t in self.tensors.values())
        nh = entry.nh or {}
        self.rehash = part.tensor if part is not None and part.tensor in nh else None
        kept = {k: v for k, v in nh.items() if part is None or k != part.tensor}
        self.entry_nh = kept or None
        self._buffer = buffer
        self._entry = entry
        self._open = True

    @property
    def open(self) -> bool:
        """True until the lease is checked in."""
        return self._open

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._open:
            self._buffer.checkin(self, delivered=exc_type is None)

    def __repr__(self) -> str:
        state = "open" if self._open else "checked in"
        return f"Lease({self.key!r}, part={self.part}, {self.nbytes} bytes, {state})"


class KVBuffer:
    """Producer-side dict-keyed buffer of packed KV entries (thread-safe; module docstring).

    Args:
        capacity_bytes: total tensor bytes held (default 4 GiB).
        ttl_s: seconds an unclaimed entry lives (None: forever). Default 600.
        full_policy: ``"wait"`` | ``"evict"`` | ``"error"`` (module docstring). Default ``"wait"``.
        put_timeout_s: how long ``put`` waits for room (default 10 s).
        block_size: tokens per block for ``match_prefix`` (default 16).
        tombstones: how many removed keys are remembered for miss reasons (default 100000).
        limits: the :class:`~connector.transport.frame.FrameLimits` every entry must fit as a DATA
            reply (``put`` checks; default: the wire defaults); also the default of ``serve``.
        clock: monotonic seconds (default :func:`time.monotonic`): ages, TTL and the deadlines
            of waits; tests pass a fake one.
    """

    def __init__(
        self,
        capacity_bytes: int = 4 << 30,
        *,
        ttl_s: float | None = 600.0,
        full_policy: str = "wait",
        put_timeout_s: float = 10.0,
        block_size: int = 16,
        tombstones: int = 100_000,
        limits: FrameLimits = DEFAULT_LIMITS,
        clock: Callable[[], float] = time.monotonic,
    ):
        _check_config(capacity_bytes, full_policy, limits, clock)
        self.capacity_bytes = capacity_bytes
        self.ttl_s = check_timeout("ttl_s", ttl_s, allow_none=True)
        self.full_policy = full_policy
        self.put_timeout_s = check_timeout("put_timeout_s", put_timeout_s)
        self.limits = limits
        self.clock = clock
        self._table = Table(block_size, tombstones)
        self._cond = threading.Condition()
        # (key, digest) -> checkouts waiting for it
        self._waiting: collections.Counter[tuple[str, str | None]] = collections.Counter()
        self._closed = False
        self._c = collections.Counter()

    @property
    def block_size(self) -> int:
        """Tokens per block of ``match_prefix``."""
        return self._table.prefix.block_size

    # ----------------------------------------------------------------------------- internals
    def _remove_locked(self, e: Entry, reason: str, counter: str) -> None:
        self._table.remove(e, reason)
        self._c[counter] += 1
        self._cond.notify_all()

    def _expire_locked(self, now: float) -> float | None:
        """Expire unpinned entries past their TTL; return when the next unpinned one expires
        (None: none will; a pinned one is looked at again when its delivery ends)."""
        if self.ttl_s is None:
            return None
        why = f"expired: unclaimed for {self.ttl_s:g} s (ttl_s)"
        for e in self._table.created_by(now - self.ttl_s):
            age = now - e.created
            log.warning("KVBuffer: entry %s expired unclaimed after %.1f s", short_id(e.key), age)
            self._remove_locked(e, why, "expirations")
        nxt = next(self._table.unpinned(), None)
        return None if nxt is None else nxt.created + self.ttl_s

    def _evict_one_locked(self) -> bool:
        e = next((e for e in self._table.unpinned() if not self._waiting[(e.key, e.digest)]), None)
        if e is None:
            return False
        age = self.clock() - e.created
        log.warning("KVBuffer full: evicting unclaimed entry %s (%d bytes, age %.1f s)",
                    short_id(e.key), e.nbytes, age)  # fmt: skip
        self._remove_locked(e, "evicted: buffer full (full_policy='evict')", "evictions")
        return True

    def _servable_locked(self, key: str, digest: str | None) -> Entry | None:
        """The entry of ``key`` (put with ``digest``) if one more delivery may start: not while a
        whole delivery is under way; deliveries of parts do not count (they add up to one, see
        Part)."""
        e = self._table.find(key, digest)
        if e is None or e.pins - e.part_pins > 0:
            return None
        return e

    def _wait_servable_locked(self, key: str, digest, deadline: float) -> Entry | None:
        self._waiting[key, digest] += 1
        try:
            e = None
            while e is None and not self._closed and not self._table.sealed(key, digest):
                left = deadline - self.clock()
                if left <= 0:
                    break
                self._cond.wait(left)
                e = self._servable_locked(key, digest)
            return e
        finally:
            self._waiting[key, digest] -= 1
            if self._waiting[key, digest] <= 0:
                del self._waiting[key, digest]

    # ------------------------------------------------------------------------------ leases
    def checkout(
        self,
        key: str,
        *,
        wait_s: float = 0.0,
        part: Part | None = None,
        digest: str | None = None,
    ) -> Lease:
        """Lease ``key`` for one delivery (of ``part`` only, when given), waiting up to ``wait_s``
        seconds for it to be put. Pair with :meth:`checkin`, or use the lease as a context
        manager (see :class:`Lease` for what it guarantees). ``digest``: the entry's (an entry
        put with another digest, or none, is not found).

        Raises:
            KeyMissError: ``key`` is not there for ``digest`` (or being delivered whole), with
                the reason (for a wrong digest, the reason of a key never put).
            ValueError: ``part`` names no tensor, dim or range of the entry (the entry stays;
                counted as a failed delivery).
        """
        digest = _check_checkout(key, wait_s, part, digest)
        t0 = self.clock()
        with self._cond:
            self._expire_locked(t0)
            e = self._servable_locked(key, digest)
            if e is None and wait_s > 0:
                e = self._wait_servable_locked(key, digest, t0 + wait_s)
                if e is None:
                    self._c["timeouts"] += 1
            if e is None:
                self._c["misses"] += 1
                reason = self._table.miss_reason(key, wait_s, digest)
                raise KeyMissError(
                    "key not in buffer", reason=reason, key=key, waited_s=self.clock() - t0
                )
            self._table.pin(e, part)
        try:
            if part is not None:
                part.check(e.tensors)
            return Lease(self, e, part)
        except BaseException:
            with self._cond:
                self._release_locked(e, part, delivered=False, nbytes=0)
            raise

    def checkin(self, lease: Lease, *, delivered: bool) -> None:
        """End ``lease``: ``delivered`` True once its tensors reached the consumer (the entry is
        claimed, see :class:`Lease`), False when the delivery failed (the entry stays).
        ValueError for a lease of another buffer or one already checked in."""
        if not isinstance(lease, Lease) or lease._buffer is not self:
            raise ValueError(f"checkin: expected a lease of this buffer, got {lease!r}")
        with self._cond:
            if not lease._open:
                raise ValueError(f"checkin: {lease!r} was already checked in")
            lease._open = False
            self._release_locked(lease._entry, lease.part, bool(delivered), lease.nbytes)

    def _release_locked(self, e: Entry, part: Part | None, delivered: bool, nbytes: int) -> None:
        """Unpin ``e`` after a delivery (of ``part``) and count it; claim it if delivered."""
        self._table.unpin(e, part)
        if delivered:
            self._c["bytes_sent"] += nbytes
            if part is not None:
                self._c["part_deliveries"] += 1
            if part is None or e.cover(part):  # the whole entry is delivered: claim it
                self._c["hits"] += 1
                if self._table.entries.get(e.key) is e:
                    self._remove_locked(e, "claimed: already delivered", "claimed")
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
        digest: str | None = None,
        timeout_s: float | None = None,
        nh: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Store ``tensors`` (by reference) and ``meta`` under ``key``, bound to ``digest`` (if
        not None: only a checkout or discard presenting it finds the entry). ``nh``: NH outputs
        of some of ``tensors`` under :func:`tritonkv.umac.entry_keys` of the secret and ``key``,
        computed as they were packed (a whole delivery's payload tag is made from them:
        ``TensorPipe.send(entry_nh=)``; shapes are checked when sent). ``token_ids``
        (optional, ``[num_tokens]`` ints) indexes the entry's full blocks for ``match_prefix``.
        When full, follows ``full_policy`` waiting at most ``timeout_s`` (default
        ``put_timeout_s``). False (nothing stored) when ``key``'s group was sealed for
        ``digest`` (:meth:`discard`), else True. Raises ValueError for a duplicate key, an empty
        digest, an entry larger than the capacity or one the wire ``limits`` refuse (see
        KVBuffer), TypeError for a dtype the wire cannot carry, BufferFullError when no room was
        made in time, PipeClosedError once closed."""
        key = check_key(key)
        digest = _check_digest(digest, put=True)
        nbytes = _entry_bytes(key, tensors, meta, self.limits, self.capacity_bytes)
        meta = dict(meta or {})
        hashes = [] if token_ids is None else self._table.prefix.hashes(token_ids)
        timeout_s = (
            self.put_timeout_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        )
        t0 = self.clock()
        deadline = t0 + timeout_s
        with self._cond:
            if self._closed:
                raise PipeClosedError("buffer is closed", key=key)
            table = self._table
            if table.sealed(key, digest):
                self._c["sealed_puts"] += 1
                return False
            table.check_absent(key)
            while True:
                next_expiry = self._expire_locked(self.clock())
                if table.nbytes + nbytes <= self.capacity_bytes:
                    break
                if self.full_policy == "evict" and self._evict_one_locked():
                    continue
                left = deadline - self.clock()
                if self.full_policy == "error" or left <= 0 or self._closed:
                    self._c["full_errors"] += 1
                    if self.full_policy != "error":
                        self._c["timeouts"] += 1
                    why = table.full(nbytes, self.capacity_bytes, self.full_policy)
                    raise BufferFullError(why, key=key, waited_s=self.clock() - t0)
                self._c["full_waits"] += 1
                if next_expiry is not None:  # an expiry makes room too: wake up for it
                    left = min(left, max(0.001, next_expiry - self.clock()))
                self._cond.wait(left)
                table.check_absent(key)
            entry = Entry(key, dict(tensors), meta, nbytes, self.clock(), digest)
            entry.nh = None if nh is None else dict(nh)
            table.add(entry, hashes)
            self._c["puts"] += 1
            self._c["bytes_put"] += nbytes
            self._cond.notify_all()
            return True

    def discard(self, key: str, digest: str | None = None, *, seal: bool = False) -> bool:
        """Discard ``key`` (abort) if it was put with ``digest``. True if it was held (for that
        digest). A lease of it keeps its tensors. ``seal``: discard every key of its group put
        with ``digest`` and refuse later puts of the group with it (``sealed_puts``); checkouts
        waiting for them end: a transfer nobody will load, parts of it maybe still to come."""
        return self._discard(check_key(key), _check_digest(digest), any_digest=False, seal=seal)

    def discard_any(self, key: str, *, seal: bool = False) -> bool:
        """The owner's :meth:`discard` (a producer aborting its own entry; never on behalf of a
        request): whatever digest it was put with (``seal``: for every digest)."""
        return self._discard(check_key(key), None, any_digest=True, seal=seal)

    def _discard(self, key: str, digest: str | None, *, any_digest: bool, seal: bool) -> bool:
        with self._cond:  # the owner's discard finds the entry whatever its digest
            held = self._table.held(key, ANY if any_digest else digest, group=seal)
            for e in held:
                self._remove_locked(e, "discarded", "discards")
            if seal:
                self._table.seal(group_of(key), ANY if any_digest else digest)
                self._cond.notify_all()  # checkouts waiting for the group's keys end
            return bool(held)

    def match_prefix(self, token_ids) -> tuple[int, str | None]:
        """Longest stored prefix of ``token_ids`` in whole blocks: ``(num_tokens, key)``, or
        ``(0, None)``. O(number of blocks of the query), independent of the number of entries.
        Among entries sharing that prefix, the most recently put one is returned."""
        hashes = self._table.prefix.hashes(token_ids)
        with self._cond:
            self._expire_locked(self.clock())
            n, best = self._table.prefix.longest(hashes)
            self._c["prefix_hits" if best else "prefix_misses"] += 1
            return n, best

    def __len__(self) -> int:
        return len(self._table.entries)  # one read of a dict: atomic

    def __contains__(self, key: str) -> bool:
        return key in self._table.entries

    def stats(self) -> dict[str, int]:
        """Counters: entries, bytes, capacity_bytes, pinned (entries with a lease out), and
        ``_COUNTERS`` (bytes_sent: of the leases checked in as delivered; sealed_puts: refused,
        their group sealed)."""
        with self._cond:
            self._expire_locked(self.clock())
            out = dict.fromkeys(_COUNTERS, 0)
            out.update(self._c)
            out["entries"] = len(self._table.entries)
            out["bytes"] = self._table.nbytes
            out["capacity_bytes"] = self.capacity_bytes
            out["pinned"] = len(self._table.pinned)
            return out

    def close(self) -> None:
        """Refuse new puts and wake every waiter (idempotent). Held entries stay readable."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
