"""Which connections a KV server takes: caps that strangers cannot fill for its consumers.

A connection is *pending* from the moment it is accepted until its authentication is decided,
then *open* (its peer proved the secret) until it closes. The two kinds have caps of their own,
so peers that never authenticate can only take pending places, and never the open ones that
consumers hold:

- **pending**: at most ``max_pending`` in all and ``max_pending_per_host`` per source address.
  When every pending place is taken, a newcomer from an address that holds fewer of them than
  the address holding the most takes that address's oldest place (its handshake is ended at
  once: an honest peer answers the challenge within milliseconds); any other newcomer is
  refused. So strangers with many addresses can slow consumers' handshakes, but not lock them
  out, unless they open connections faster than ``max_pending`` per handshake time.
- **open**: at most ``max_connections`` in all and ``max_connections_per_host`` per host (every
  loopback address counts as one host: they are all this machine). Checked when a connection
  arrives (a server at a cap refuses it at once, before any thread starts) and again when it
  authenticates, which is when the place is taken.

For pending places each address counts apart, loopback ones too: a stranger gains nothing from
many addresses, the pending places being shared out by the rule above.

A refusal's text (:class:`Refused`) is fixed, the cap's value included: nothing the peer sent.
"""

from __future__ import annotations

import collections
import ipaddress
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields

__all__ = ["Admission", "ConnectionCaps", "Refused", "Slot", "host_of"]


@dataclass(frozen=True)
class ConnectionCaps:
    """The caps of a KV server's connections (module docstring): open ones in all and per host,
    pending ones in all and per source address. Each a positive int (ValueError otherwise)."""

    max_connections: int = 64
    max_connections_per_host: int = 16
    max_pending: int = 64
    max_pending_per_host: int = 4

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ConnectionCaps.{f.name}: expected a positive int, got {value!r}")


class Refused(Exception):
    """A connection a cap refuses; its text is what the peer is told (fixed, short)."""


def host_of(address: str) -> str:
    """The host an address counts for in the caps on open connections: ``"loopback"`` for every
    loopback address, else the address itself (an IPv4-mapped IPv6 address as its IPv4 one)."""
    ip = _ip(address)
    return address if ip is None else "loopback" if ip.is_loopback else str(ip)


def _address_of(address: str) -> str:
    ip = _ip(address)
    return address if ip is None else str(ip)


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    return (ip.ipv4_mapped or ip) if ip.version == 6 else ip


class Slot:
    """One connection's place: pending from :meth:`Admission.arrive`, open after
    :meth:`Admission.authenticated`, given up by :meth:`Admission.release`."""

    def __init__(self, number: int, address: str, evict: Callable[[], None]):
        self.number = number  # in order of arrival
        self.address = address  # the source address (pending caps)
        self.host = host_of(address)  # what it counts for (open caps)
        self.state = "pending"  # -> "open" | "evicted" | "refused" | "released"
        self._evict = evict

    @property
    def evicted(self) -> bool:
        """Whether a newcomer took this connection's pending place (its handshake was ended)."""
        return self.state == "evicted"

    @property
    def refused(self) -> bool:
        """Whether this connection authenticated but a cap on open connections refused it."""
        return self.state == "refused"


class Admission:
    """The places of a KV server's connections under :class:`ConnectionCaps` (thread-safe).

    ``arrive(address, evict)`` gives a pending :class:`Slot` or raises :class:`Refused`;
    ``evict`` is called (under the lock, at most once) to end that connection's handshake when a
    newcomer takes its place. ``authenticated(slot)`` makes it open or raises Refused;
    ``release(slot)`` gives up its place (idempotent). ``counts()`` for stats.
    """

    def __init__(self, caps: ConnectionCaps | None = None):
        caps = ConnectionCaps() if caps is None else caps
        if not isinstance(caps, ConnectionCaps):
            raise TypeError(f"caps: expected ConnectionCaps or None, got {type(caps).__name__}")
        self.caps = caps
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._pending: dict[int, Slot] = {}
        self._pending_at: collections.Counter[str] = collections.Counter()  # address -> pending
        self._open_at: collections.Counter[str] = collections.Counter()  # host -> open
        self._open = 0
        self._c: collections.Counter[str] = collections.Counter()

    def arrive(self, address: str, evict: Callable[[], None]) -> Slot:
        """A pending place for a connection from ``address``, or Refused (counted)."""
        caps = self.caps
        address = _address_of(address)
        with self._lock:
            why = self._open_refusal(host_of(address))
            if why is None and self._pending_at[address] >= caps.max_pending_per_host:
                why = f"too many pending handshakes from this address ({caps.max_pending_per_host})"
            if why is None and len(self._pending) >= caps.max_pending:
                victim = max(
                    self._pending.values(), key=lambda s: (self._pending_at[s.address], -s.number)
                )
                if self._pending_at[address] >= self._pending_at[victim.address]:
                    why = f"too many pending handshakes ({caps.max_pending})"
                else:
                    self._drop_pending(victim, "evicted")
                    self._c["evicted_handshakes"] += 1
                    victim._evict()
            if why is not None:
                self._c["rejected_connections"] += 1
                raise Refused(why)
            slot = Slot(next(self._numbers), address, evict)
            self._pending[slot.number] = slot
            self._pending_at[address] += 1
            return slot

    def authenticated(self, slot: Slot) -> None:
        """``slot``'s peer proved the secret: its place becomes an open one, unless a cap on open
        connections (or an eviction just before) refuses it: Refused (counted), place given up."""
        with self._lock:
            if slot.state != "pending":
                raise Refused("handshake ended by the server")
            why = self._open_refusal(slot.host)
            self._drop_pending(slot, "refused" if why else "open")
            if why is not None:
                self._c["rejected_connections"] += 1
                raise Refused(why)
            self._open += 1
            self._open_at[slot.host] += 1

    def release(self, slot: Slot) -> None:
        """Give up ``slot``'s place, pending or open (idempotent)."""
        with self._lock:
            if slot.state == "pending":
                self._drop_pending(slot, "released")
            elif slot.state == "open":
                slot.state = "released"
                self._open -= 1
                self._open_at[slot.host] -= 1
                if not self._open_at[slot.host]:
                    del self._open_at[slot.host]

    def counts(self) -> dict[str, int]:
        """pending_connections and open_connections now; rejected_connections (refused by a cap,
        before or after authenticating) and evicted_handshakes (pending places taken) so far."""
        with self._lock:
            return {
                "pending_connections": len(self._pending),
                "open_connections": self._open,
                "rejected_connections": self._c["rejected_connections"],
                "evicted_handshakes": self._c["evicted_handshakes"],
            }

    def _open_refusal(self, host: str) -> str | None:
        if self._open >= self.caps.max_connections:
            return f"too many connections ({self.caps.max_connections})"
        if self._open_at[host] >= self.caps.max_connections_per_host:
            return f"too many connections from this host ({self.caps.max_connections_per_host})"
        return None

    def _drop_pending(self, slot: Slot, state: str) -> None:
        del self._pending[slot.number]
        self._pending_at[slot.address] -= 1
        if not self._pending_at[slot.address]:
            del self._pending_at[slot.address]
        slot.state = state
