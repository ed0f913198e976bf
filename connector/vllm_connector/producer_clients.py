"""The producers a consumer loads from: one client per producer rank, plus a few leased out
one load at a time for loads that wait for their entry (:class:`ProducerClients`), the hosts that
timed out, not asked again for a while (:class:`ProducerBackoff`), and the requests to discard
entries no one will load (:func:`discard_entries`). No vLLM import."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

from ..kvstore import ClientBusyError, KVClient, hide_ids, short_id
from ..logs import get_logger
from ..transport import (
    PeerDeadError,
    PipeClosedError,
    TransferError,
    error_text,
)

log = get_logger("connector")

Addr = tuple[str, int]


class ProducerBackoff:
    """Producer ports that did not connect or answer in time, not asked again for ``hold_s``.

    Sync loads stall the whole decode batch: after one load from a producer's port timed out,
    further loads from it fail at once (and are recomputed) until ``hold_s`` has passed. By
    (host, port): one stuck engine does not fail the loads of the others on its host. Only ports
    a producer named are dialed (a consumer with a secret dials only signed hand-offs, one
    without only loopback producers), so no client can make it walk a tarpit's ports. At most
    ``max_addrs`` are remembered (the oldest forgotten first).
    """

    def __init__(self, hold_s: float, max_addrs: int = 1024):
        self.hold_s, self.max_addrs = hold_s, max_addrs
        self._down: OrderedDict[Addr, tuple[float, str]] = OrderedDict()  # -> (retry at, why)

    def check(self, addr: Addr, transfer_id: str) -> None:
        """PeerDeadError if ``addr`` timed out less than ``hold_s`` ago."""
        retry_at, why = self._down.get(addr, (0.0, ""))
        if time.monotonic() < retry_at:
            raise PeerDeadError(
                f"not tried: this producer timed out ({why}) less than connect_timeout_s "
                f"({self.hold_s:g} s) ago",
                peer=f"{addr[0]}:{addr[1]}",
                key=transfer_id,
            )

    def timed_out(self, addr: Addr, why: str) -> None:
        self._down.pop(addr, None)
        self._down[addr] = (time.monotonic() + self.hold_s, why)
        while len(self._down) > self.max_addrs:
            self._down.popitem(last=False)

    def answered(self, addr: Addr) -> None:
        self._down.pop(addr, None)


class ProducerClients:
    """One client per producer rank, made on first use by ``connect(host, port)`` and shared by
    the load threads (a KVClient serialises its requests); none are made after :meth:`close`.

    At most ``max_clients`` are kept: making one more closes the least recently used (a request
    still running on it fails, and its load is recomputed), so hand-offs naming ever new
    addresses cannot pile up connections.

    A load that may wait for its entry (an overlapped load) must not hold the shared client for
    the whole wait: it takes a client of its own with :meth:`lease`, at most ``max_leased`` per
    producer rank at once (each one connection the producer's server holds open; its cap is 16
    per consumer host), kept for the next lease when its load succeeded. :meth:`load` gives a
    load its client: the shared one, or a leased one that :meth:`end` closes when the load's
    request ends meanwhile.
    """

    def __init__(
        self,
        connect: Callable[[str, int], KVClient],
        max_clients: int = 64,
        max_leased: int = 4,
    ):
        self._connect = connect
        self.max_clients, self.max_leased = max_clients, max_leased
        self._clients: OrderedDict[Addr, KVClient] = OrderedDict()
        self._idle: dict[Addr, list[KVClient]] = {}  # leased clients given back, by address
        self._leased: dict[Addr, set[KVClient]] = {}  # leased clients out, by address
        self._closed = False
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)
        self._waiting: dict[str, set[KVClient]] = {}  # request id -> its loads' leased clients
        self._ended: OrderedDict[str, None] = OrderedDict()  # the last 4096 requests ended

    def get(self, host: str, port: int) -> KVClient:
        with self._lock:
            if self._closed:  # a discard or async load still running after shutdown
                raise PipeClosedError("connector shut down", peer=f"{host}:{port}")
            client = self._clients.get((host, port))
            if client is not None:
                self._clients.move_to_end((host, port))
                return client
            client = self._clients[(host, port)] = self._connect(host, port)
            evicted = []
            while len(self._clients) > self.max_clients:
                evicted.append(self._clients.popitem(last=False)[1])
        for old in evicted:
            old.close()
        return client

    @contextlib.contextmanager
    def lease(self, host: str, port: int, timeout_s: float) -> Iterator[KVClient]:
        """A client of ``host:port`` for this caller alone until the block ends: an idle one, or
        one made anew while fewer than ``max_leased`` are out; else wait up to ``timeout_s`` for
        one to come back (ClientBusyError naming the wait). One whose block raised is closed,
        never given to another caller (another thread may close it to end its load at once)."""
        addr = (host, port)
        deadline = time.monotonic() + timeout_s
        with self._returned:
            while True:
                if self._closed:
                    raise PipeClosedError("connector shut down", peer=f"{host}:{port}")
                idle, out = self._idle.setdefault(addr, []), self._leased.setdefault(addr, set())
                if idle or len(out) < self.max_leased:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ClientBusyError(
                        f"all {self.max_leased} leased clients busy for {timeout_s:g} s",
                        peer=f"{host}:{port}",
                        waited_s=timeout_s,
                    )
                self._returned.wait(left)
            client = idle.pop() if idle else None
            if client is None:
                client = self._connect(host, port)
            out.add(client)
        ok = False
        try:
            yield client
            ok = True
        finally:
            with self._returned:
                self._leased[addr].discard(client)
                keep = ok and not self._closed
                if keep:
                    self._idle[addr].append(client)
                self._returned.notify()
            if not keep:
                client.close()

    @contextlib.contextmanager
    def loading(
        self, req_id: str, addr: Addr, wait_s: float, timeout_s: float
    ) -> Iterator[KVClient]:
        """The client of one load of request ``req_id`` from ``addr``: the shared one (:meth:`get`)
        unless it may wait for its entry (``wait_s`` > 0); then a leased one (:meth:`lease`,
        within ``timeout_s``), closed when :meth:`end` names that request (the load then raises
        PipeClosedError saying so)."""
        if wait_s <= 0:
            yield self.get(*addr)
            return
        host, port = addr
        with self.lease(host, port, timeout_s) as client:
            with self._lock:
                self._waiting.setdefault(req_id, set()).add(client)
                ended = req_id in self._ended
            try:
                if ended:
                    client.close()
                yield client
            except TransferError as exc:
                if req_id not in self._ended:
                    raise
                raise PipeClosedError(
                    "its request ended while the load waited for the entry",
                    peer=f"{host}:{port}",
                    key=exc.key,
                ) from exc
            finally:
                with self._lock:
                    self._waiting[req_id].discard(client)
                    if not self._waiting[req_id]:
                        del self._waiting[req_id]

    def end(self, req_ids: set[str]) -> None:
        """These requests ended while loading: close the clients of their waiting loads (and of
        those still to start), so that each fails at once (request ids are never reused)."""
        with self._lock:
            for req_id in req_ids:
                self._ended[req_id] = None
            while len(self._ended) > 4096:
                self._ended.popitem(last=False)
            clients = [c for r in req_ids for c in self._waiting.get(r, ())]
        for client in clients:
            client.close()

    def __len__(self) -> int:
        return len(self._clients)

    def close(self) -> None:
        with self._lock:  # load and discard threads may still be adding clients
            self._closed = True
            clients = list(self._clients.values())
            for group in (*self._idle.values(), *self._leased.values()):
                clients += list(group)
            self._idle.clear()
            self._returned.notify_all()
        for client in clients:
            client.close()


def discard_entries(
    remote_discards: list,
    tp_rank: int,
    tp_size: int,
    backoff: ProducerBackoff,
    clients: ProducerClients,
    timeout_s: float,
) -> None:
    """Ask each producer rank of ``discards`` (DiscardSpec) that TP rank ``tp_rank`` of
    ``tp_size`` asks to discard the entry, through ``clients``, within ``timeout_s`` each; failures
    are logged (the entry's TTL discards it later)."""
    targets = [  # each producer rank is asked by one rank here
        (spec, spec.port + rank)
        for spec in remote_discards
        for rank in range(tp_rank, spec.producer_tp, tp_size)
    ]
    for spec, port in targets:
        try:
            backoff.check((spec.host, port), spec.transfer_id)
            client = clients.get(spec.host, port)
            held = client.discard(
                spec.transfer_id,
                timeout_s=timeout_s,
                digest=spec.prompt_digest,
            )
        except Exception as exc:  # whatever it is, the entry's TTL discards it later
            log.info(
                "tritonkv: could not discard transfer %s on %s:%d (%s: %s); its TTL will",
                short_id(spec.transfer_id),
                spec.host,
                port,
                type(exc).__name__,
                hide_ids(error_text(exc)),
            )
            continue
        log.info(
            "tritonkv: discarded unused transfer %s on %s:%d (%s)",
            short_id(spec.transfer_id),
            spec.host,
            port,
            "it was held" if held else "already gone",
        )
