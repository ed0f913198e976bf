"""A :class:`~.store.KVBuffer`'s entries (:class:`Entry`) and their table (:class:`Table`):
the entries oldest first, their bytes, their groups and prefix index, the leases that pin them,
why each removed key went, and the sealed groups. Not thread-safe: the buffer holds its lock.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

from .prefix import PrefixIndex
from .protocol import Part, group_of, same_digest

ANY = object()  # a group sealed for every digest (the owner's discard)
_NOT_SEALED = object()


@dataclass(eq=False)
class Entry:
    key: str
    tensors: dict
    meta: dict
    nbytes: int
    created: float
    digest: str | None = None  # what a checkout or discard must present (None: nothing)
    nh: dict | None = None  # name -> NH outputs under the entry's key (tritonkv.umac.entry_keys)
    pins: int = 0
    part_pins: int = 0  # of the pins, deliveries of parts (they run side by side)
    # Part deliveries (a GET of one slice of one tensor): (tensor, dim) -> indices delivered. A
    # delivery counts once every index of that dim was delivered, by one consumer or several.
    covered: dict = field(default_factory=dict)

    def cover(self, part: Part) -> bool:
        """Record ``part`` as delivered; True once the parts cover its dim (then anew)."""
        done = self.covered.setdefault((part.tensor, part.dim), set())
        done.update(range(part.start, part.stop))
        if len(done) < self.tensors[part.tensor].shape[part.dim]:
            return False
        del self.covered[(part.tensor, part.dim)]
        return True


class Table:
    """A buffer's entries (oldest first), their bytes, their prefix index, and why each removed
    key went (the last ``tombstones`` of them). Not thread-safe: the buffer holds its lock."""

    def __init__(self, block_size: int, tombstones: int):
        if isinstance(tombstones, bool) or not isinstance(tombstones, int) or tombstones <= 0:
            raise ValueError(f"tombstones: expected a positive int, got {tombstones!r}")
        self.entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self.nbytes = 0
        self.pinned: set[str] = set()  # keys of the entries a lease holds
        self.prefix = PrefixIndex(block_size)
        # key -> (why it went, its digest): the reason is told only to who presents the digest
        self._tombs: collections.OrderedDict[str, tuple[str, str | None]] = (
            collections.OrderedDict()
        )
        self._tomb_limit = tombstones
        self.groups: dict[str, set[str]] = {}  # group (protocol.group_of) -> its keys held
        # sealed groups (the last ``tombstones``): group -> the digest sealed, or ANY
        self._sealed: collections.OrderedDict[str, object] = collections.OrderedDict()

    def add(self, e: Entry, hashes: list[bytes]) -> None:
        self.entries[e.key] = e
        self.groups.setdefault(group_of(e.key), set()).add(e.key)
        self.nbytes += e.nbytes
        self.prefix.add(e.key, hashes)
        self._tombs.pop(e.key, None)

    def remove(self, e: Entry, reason: str) -> None:
        del self.entries[e.key]
        group = group_of(e.key)
        self.groups[group].discard(e.key)
        if not self.groups[group]:
            del self.groups[group]
        self.pinned.discard(e.key)
        self.nbytes -= e.nbytes
        self.prefix.remove(e.key)
        self._tombs[e.key] = (reason, e.digest)
        self._tombs.move_to_end(e.key)
        while len(self._tombs) > self._tomb_limit:
            self._tombs.popitem(last=False)

    def held(self, key: str, digest, *, group: bool) -> list[Entry]:
        """The entries of ``key`` (``group``: of every key of its group) put with ``digest``
        (:data:`ANY`: whatever their digest)."""
        keys = sorted(self.groups.get(group_of(key), ())) if group else [key]
        found = [self.entries.get(k) if digest is ANY else self.find(k, digest) for k in keys]
        return [e for e in found if e is not None]

    def seal(self, group: str, digest) -> None:
        """Refuse later puts of ``group``'s keys with ``digest`` (:data:`ANY`: any digest)."""
        self._sealed[group] = digest
        self._sealed.move_to_end(group)
        while len(self._sealed) > self._tomb_limit:
            self._sealed.popitem(last=False)

    def sealed(self, key: str, digest: str | None) -> bool:
        """Whether ``key``'s group was sealed for ``digest``."""
        held = self._sealed.get(group_of(key), _NOT_SEALED)
        return held is ANY or (held is not _NOT_SEALED and same_digest(held, digest))

    def check_absent(self, key: str) -> None:
        if key in self.entries:
            raise ValueError(f"key {key!r} is already in the buffer (discard it first)")

    def full(self, nbytes: int, capacity_bytes: int, policy: str) -> str:
        """Why an entry of ``nbytes`` does not fit."""
        return (
            f"buffer full: {self.nbytes} of {capacity_bytes} bytes used by {len(self.entries)} "
            f"entries, entry needs {nbytes} (full_policy={policy!r})"
        )

    def find(self, key: str, digest: str | None) -> Entry | None:
        """The entry of ``key`` if ``digest`` is the one it was put with, else None."""
        e = self.entries.get(key)
        return e if e is not None and same_digest(e.digest, digest) else None

    def miss_reason(self, key: str, wait_s: float, digest: str | None) -> str:
        """Why ``key`` cannot be delivered to who presents ``digest`` (after waiting ``wait_s``
        for it): with another digest, what a key never put gets."""
        if self.find(key, digest) is not None:
            return "claimed: being delivered to another consumer"
        tomb = self._tombs.get(key)
        if tomb is not None and same_digest(tomb[1], digest):
            return tomb[0]
        if self.sealed(key, digest):
            return "discarded: its transfer was discarded or aborted before this part was put"
        return f"not put within wait_s={wait_s:g} s" if wait_s > 0 else "never put (or forgotten)"

    def pin(self, e: Entry, part) -> None:
        """A lease (of ``part``, or None: the whole entry) now holds ``e``."""
        e.pins += 1
        e.part_pins += part is not None
        self.pinned.add(e.key)

    def unpin(self, e: Entry, part) -> None:
        """A lease of ``e`` ended (``e`` may have been removed meanwhile)."""
        e.pins -= 1
        e.part_pins -= part is not None
        if e.pins == 0 and self.entries.get(e.key) is e:
            self.pinned.discard(e.key)

    def created_by(self, limit: float) -> list[Entry]:
        """The unpinned entries created at ``limit`` or before (entries are oldest first: put
        appends them with the clock's time)."""
        return list(itertools.takewhile(lambda e: e.created <= limit, self.unpinned()))

    def unpinned(self):
        """The entries no lease holds, oldest first."""
        return (e for e in self.entries.values() if e.pins == 0)
