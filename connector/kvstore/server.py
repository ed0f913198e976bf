"""The producer's KV server: answers consumers' GET and DISCARD requests for a :class:`KVBuffer`.

One accept thread; per connection one handler thread (authentication and handshake, then
request / reply, :mod:`connector.kvstore.protocol`), so one consumer dying or misbehaving only
loses its own connection. Least privilege: consumers load and discard entries by transfer id; nothing
on the wire can put, list or probe entries, and an entry bound to a digest (the connector binds
each to its prompt) is served or discarded only for the same digest: to anyone else it does not
exist (MISS with an unknown key's reason; DISCARD: ``existed`` False). A GET delivers through a :class:`~.store.Lease`: the
entry is pinned while its payload is sent, claimed when the send completed, kept for a retry
when it failed. An entry put with NH outputs that goes inline (which no umac tag covers) is first
checked against them (:func:`check_inline_entry`). Deadlines: ``max_get_wait_s`` (60 s) caps how
long a GET may wait for a key to be put (default 0: an absent key is an immediate MISS),
``io_timeout_s`` (60 s) per payload.

Which connections it takes: :mod:`connector.kvstore.admission` (pending and authenticated ones
capped apart; a refused one costs no thread).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Callable

import torch

from tritonkv import umac

from ..logs import get_logger
from ..transport import (
    Kind,
    Message,
    PeerDeadError,
    PipeClosedError,
    PipeListener,
    PipeOptions,
    ProtocolError,
    TensorPipe,
    TransferError,
    auth,
    check_timeout,
    error_text,
    goes_inline,
    send_error_frame,
    transfer_thread,
)
from .admission import Admission, ConnectionCaps, Refused, Slot
from .errors import KeyMissError
from .protocol import DIGEST, EXISTED, REASON, WAIT_MS, Op, Part, hide_ids, op_name, short_id
from .store import KVBuffer, Lease

__all__ = ["KVServer"]

log = get_logger("kvstore")


class KVServer:
    """Serves a :class:`KVBuffer` to consumers over tensor pipes (background threads).

    Args:
        buffer: the entries served.
        host, port: where to listen (port 0: any free port; see ``address``).
        transport: ``"gloo"`` (default) or ``"nccl"`` for CUDA.
        allow_socket: also accept inline-TCP clients (default True).
        device: where received payloads land (default ``"cpu"``).
        caps: the :class:`~connector.kvstore.admission.ConnectionCaps` of its connections:
            open (authenticated) ones at most 64, 16 per host; pending (not yet authenticated)
            ones at most 64, 4 per source address. Pending and open ones count apart, so
            strangers who never authenticate cannot take what consumers need (``caps``: the
            ones in force).
        max_get_wait_s: cap on a GET's wait for its key to be put (60 s).
        connect_timeout_s: authentication and handshake deadline (10 s).
        secret, insecure: as for :class:`~connector.transport.PipeListener` (every connection
            authenticates first; a non-loopback address needs a secret or ``insecure=True``).
        options: the pipes' :class:`~connector.transport.options.PipeOptions` (default: the
            defaults, with ``limits=buffer.limits``); ``max_payload_bytes`` is always 0.

    Failed authentications are counted (``auth_failures``) and logged at most once per host a
    minute. A connection over a cap is told why in a short fixed text (an ERROR frame in place of
    the challenge; nothing is read from it, no thread starts) and closed, or, when the cap is found
    full only as it authenticates, told in place of HELLO_ACK; either way it is counted in
    ``rejected_connections``. A request of another kind than GET or DISCARD: an ERROR reply, closed.
    """

    def __init__(
        self,
        buffer: KVBuffer,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        transport: str = "gloo",
        allow_socket: bool = True,
        device: str | torch.device = "cpu",
        caps: ConnectionCaps | None = None,
        max_get_wait_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        secret: bytes | str | None = None,
        insecure: bool = False,
        options: PipeOptions | None = None,
        aliases: tuple[str, ...] | list[str] = (),
    ):
        if not isinstance(buffer, KVBuffer):
            raise TypeError(f"buffer: expected a KVBuffer, got {type(buffer).__name__}")
        self.buffer = buffer
        self._secret = auth.check_secret(secret)
        self._admission = Admission(caps)
        self.caps = self._admission.caps
        self.max_get_wait_s = check_timeout("max_get_wait_s", max_get_wait_s)
        options = PipeOptions(limits=buffer.limits) if options is None else options
        # Requests (GET, DISCARD) carry no payload: a header announcing any is refused before a
        # byte of it is allocated (on a GPU pipe, device memory), whatever the request's kind.
        options = options.replace(max_payload_bytes=0)
        self.io_timeout_s = options.io_timeout_s
        self._handlers: dict[int, Callable[[TensorPipe, Message], None]] = {
            Op.GET: self._on_get,
            Op.DISCARD: self._on_discard,
        }
        self._listener = PipeListener(
            host,
            port,
            transport=transport,
            allow_socket=allow_socket,
            device=device,
            connect_timeout_s=connect_timeout_s,
            secret=secret,
            insecure=insecure,
            options=options,
            aliases=aliases,
        )
        self.host, self.port = self._listener.address
        self._auth_failures = auth.FailureLog()
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

    @property
    def requests(self) -> frozenset[str]:
        """The requests this server answers (``GET``, ``DISCARD``): nothing else is served."""
        return frozenset(Op(kind).name for kind in self._handlers)

    def stats(self) -> dict[str, int]:
        """Buffer stats plus connections (authenticated, so far), open_connections and
        pending_connections (now), handshake_errors, auth_failures, protocol_errors, peer_errors,
        requests, rejected_connections (refused by a cap) and evicted_handshakes (pending ones
        ended to make room: :mod:`~connector.kvstore.admission`), and group_device_bytes (the
        device memory NCCL's communicators of the open connections took, measured at connect)."""
        out = self.buffer.stats()
        with self._lock:
            for k in ("connections", "handshake_errors", "protocol_errors", "peer_errors",
                      "requests"):  # fmt: skip
                out[k] = self._c[k]
            out["group_device_bytes"] = sum(p.group_device_bytes for p in self._pipes.values())
        out.update(self._admission.counts())
        out["auth_failures"] = self._auth_failures.count
        return out

    # ----------------------------------------------------------------------------- connections
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
            try:
                slot = self._admission.arrive(peer.rsplit(":", 1)[0], evict=_shutter(sock))
            except Refused as e:
                # Nothing is read from the peer; it is told why (in place of the challenge).
                send_error_frame(sock, str(e))
                sock.close()
                continue
            with self._lock:
                cid = next(self._ids)
                t = transfer_thread(
                    self._handle, f"tkv-server[{self.port}]-conn{cid}", (cid, sock, peer, slot)
                )
                self._threads[cid] = t
            t.start()

    def _handle(self, cid: int, sock, peer: str, slot: Slot) -> None:
        pipe = None

        def authenticated(error: auth.AuthError | None) -> str | None:
            # Before the peer learns the verdict: a refused peer that reconnects at once finds
            # its failure counted and its slot free.
            if error is None:
                try:
                    self._admission.authenticated(slot)
                except Refused as e:
                    return str(e)
                return None
            if not slot.evicted and self._auth_failures.failed(peer):
                log.warning("KVServer: authentication of %s failed: %s", peer, error)
            self._admission.release(slot)
            return None

        try:
            try:
                pipe = self._listener.handshake(sock, peer, on_auth=authenticated)
            except auth.AuthError:
                return  # counted and logged by authenticated()
            except TransferError as e:
                if slot.refused or slot.evicted:  # counted by the admission
                    log.info("KVServer: refused %s: %s", peer, e)
                    return
                log.warning("KVServer: handshake with %s failed: %s", peer, e)
                with self._lock:
                    self._c["handshake_errors"] += 1
                return
            with self._lock:
                if self._closed:
                    return
                self._pipes[cid] = pipe
                self._c["connections"] += 1
            self._serve(pipe)
        except ProtocolError as e:
            log.warning("KVServer: dropping %s: protocol error: %s", peer, hide_ids(str(e)))
            with self._lock:
                self._c["protocol_errors"] += 1
        except (PeerDeadError, PipeClosedError) as e:
            log.info("KVServer: connection %s ended: %s", peer, hide_ids(str(e)))
            if isinstance(e, PeerDeadError):
                with self._lock:
                    self._c["peer_errors"] += 1
        except TransferError as e:
            log.warning("KVServer: dropping %s: %s", peer, hide_ids(str(e)))
            with self._lock:
                self._c["peer_errors"] += 1
        except Exception:
            log.exception("KVServer: handler for %s crashed", peer)
        finally:
            if pipe is not None:
                pipe.close()
            self._admission.release(slot)  # pending (the handshake ended early) or open
            with self._lock:
                self._pipes.pop(cid, None)
                self._threads.pop(cid, None)

    # -------------------------------------------------------------------------------- requests
    def _serve(self, pipe: TensorPipe) -> None:
        while not self._closed:
            msg = pipe.recv(self.io_timeout_s, idle=True)
            with self._lock:
                self._c["requests"] += 1
            handler = self._handlers.get(msg.kind)
            if handler is None:
                what = op_name(msg.kind)
                pipe.send(msg.key, kind=Kind.ERROR, meta={"error": f"unexpected {what}"})
                raise ProtocolError(f"unexpected request kind {what}", peer=pipe.peer)
            handler(pipe, msg)

    @staticmethod
    def _error(pipe: TensorPipe, key: str, e: BaseException | str) -> None:
        pipe.send(key, kind=Kind.ERROR, meta={"error": error_text(e)})

    @staticmethod
    def _digest(msg: Message) -> str | None:
        """The digest a request presents; a malformed one ("") matches no entry."""
        digest = msg.meta.get(DIGEST)
        return digest if digest is None or isinstance(digest, str) else ""

    def _on_discard(self, pipe: TensorPipe, msg: Message) -> None:
        try:
            existed = self.buffer.discard(msg.key, self._digest(msg), seal=True)
        except (ValueError, TypeError) as e:
            self._error(pipe, msg.key, e)
            return
        pipe.send(msg.key, kind=Op.ACK, meta={EXISTED: existed})

    def _on_get(self, pipe: TensorPipe, msg: Message) -> None:
        wait_ms = msg.meta.get(WAIT_MS, 0)
        if isinstance(wait_ms, bool) or not isinstance(wait_ms, (int, float)) or wait_ms < 0:
            self._error(pipe, msg.key, f"bad {WAIT_MS} {wait_ms!r}")
            return
        wait_s = min(wait_ms / 1000.0, self.max_get_wait_s)
        try:
            lease = self.buffer.checkout(
                msg.key, wait_s=wait_s, part=Part.from_meta(msg.meta), digest=self._digest(msg)
            )
        except KeyMissError as e:
            pipe.send(msg.key, kind=Op.MISS, meta={REASON: e.reason})
            return
        except ValueError as e:  # a malformed part, or one the entry does not have
            self._error(pipe, msg.key, e)
            return
        self._deliver(pipe, lease)

    def _deliver(self, pipe: TensorPipe, lease: Lease) -> None:
        """Send ``lease``'s tensors; check it in from the sender thread once sent (or failed)."""
        done = threading.Event()
        buffer = self.buffer

        def on_done(exc: BaseException | None) -> None:
            if done.is_set():
                return
            done.set()
            buffer.checkin(lease, delivered=exc is None)
            if exc is not None:
                log.warning(
                    "KVServer: delivering %s to %s failed: %s",
                    short_id(lease.key),
                    pipe.peer,
                    hide_ids(str(exc)),
                )

        try:
            check_inline_entry(pipe, lease, self._secret)
            pipe.send(
                lease.key,
                lease.tensors,
                lease.meta,
                kind=Op.DATA,
                on_done=on_done,
                entry_nh=delivery_nh(pipe, lease, self._secret),
            )
        except (ValueError, TypeError) as e:  # this consumer's limits refuse the entry: it stays
            on_done(e)
            self._error(pipe, lease.key, e)
        except BaseException as e:
            on_done(e)
            raise

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, close every connection, join threads, all within one ``timeout_s``
        (plus about a second). Idempotent. The buffer stays usable."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pipes = list(self._pipes.values())
            threads = list(self._threads.values())
        self._listener.close()
        for p in pipes:  # a consumer that stopped reading takes the budget once, not once each
            p.close(timeout_s=max(0.0, deadline - time.monotonic()))
        self._accept_thread.join(max(0.1, deadline - time.monotonic()))
        for t in threads:
            t.join(max(0.05, deadline - time.monotonic()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _shutter(sock: socket.socket):
    """What ends a pending handshake that a newcomer evicts: its socket shut down (the handshake
    thread's poll wakes at once). Only a pending slot is evicted, and the listener decides the
    slot's fate (``on_auth``) before it closes the socket, so the descriptor is still this one."""

    def shut() -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    return shut


def delivery_nh(pipe: TensorPipe | None, lease: Lease, secret: bytes | None) -> dict | None:
    """The NH outputs, under the entry's key (:func:`tritonkv.umac.entry_keys`), that the tag
    of ``lease``'s delivery on ``pipe`` (None: as on a process group) is made from: those its
    producer made as it packed the entry, and for a part of an entry put with them, the part's
    slice hashed now. A consumer's unpack then computes the NH the tag is checked with, for a
    slice of heads as for a whole entry, and its pipe hashes nothing. The slice's outputs stand
    for the bytes as they are in the store, not as packed: the part's head digests still check
    those. None for an inline delivery (its frame's MAC covers it)."""
    if pipe is not None and goes_inline(pipe, lease.nbytes):
        return None
    if lease.rehash is None:
        return lease.entry_nh
    keys = umac.entry_keys(secret, lease.key)
    return {**(lease.entry_nh or {}), lease.rehash: umac.nh_hash(lease.tensors[lease.rehash], keys)}


def check_inline_entry(pipe: TensorPipe, lease: Lease, secret: bytes | None) -> None:
    """Before ``lease`` goes inline on ``pipe`` (:func:`~connector.transport.goes_inline`),
    check its tensors against the NH outputs its producer computed as it packed them, under the
    entry's key (:func:`tritonkv.umac.entry_keys`): no tag made from them covers an inline
    delivery, and the entry may carry no digest (its NH stands for one). Nothing to check for an
    entry put without NH outputs, or one that goes on the process group (its tag checks it).

    Raises:
        ValueError: they differ (not sent: the consumer gets an error, and recomputes).
    """
    if lease.entry_nh is None or not goes_inline(pipe, lease.nbytes):
        return
    keys = umac.entry_keys(secret, lease.key)
    for name, want in lease.entry_nh.items():
        got = umac.nh_hash(lease.tensors[name], keys)
        if not torch.equal(got.cpu(), want.cpu()):
            raise ValueError(
                f"entry {short_id(lease.key)}: its {name!r} differs from what its producer "
                "hashed as it packed it"
            )
