"""The listener side: :class:`PipeListener` accepts connections and runs the listener's half of
the handshake on each (the protocol: :mod:`connector.transport.handshake`)."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import threading
import time
from collections.abc import Callable

import torch

from ..logs import get_logger
from . import auth
from .errors import PeerDeadError, PipeClosedError, TransferTimeout
from .handshake import Offer, authenticate_listener, open_pipe
from .options import PipeOptions, check_options, check_timeout, check_transport, device_uuid
from .pipe import TensorPipe
from .sockio import configure, peer_name

log = get_logger("transport")


class PipeListener:
    """Listening endpoint: accepts connections and performs the listener side of the handshake.

    Opens one port: every connection's two-rank process group meets over the connection itself
    (:mod:`connector.transport.rendezvous`). Accepts clients asking for ``transport`` and, when
    ``allow_socket`` (default), clients asking for the inline ``socket`` transport.

    ``secret`` (at least 32 bytes): every connection must prove it holds it before anything else
    is read (:mod:`connector.transport.auth`). Listening on a non-loopback address without one
    raises ValueError unless ``insecure=True`` (then it warns once): anyone who can reach the port
    could read and write entries.

    ``aliases``: addresses (``"ip:port"``) at which clients reach this listener through a NAT or
    port forward its operator trusts. A client must have connected to the address the connection
    arrives at, or to one of these: anything else is a relay (:mod:`connector.transport.auth`).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        transport: str = "gloo",
        allow_socket: bool = True,
        device: str | torch.device = "cpu",
        connect_timeout_s: float = 10.0,
        backlog: int = 64,
        secret: bytes | str | None = None,
        insecure: bool = False,
        options: PipeOptions | None = None,
        aliases: tuple[str, ...] | list[str] = (),
    ):
        check_transport(transport)
        if isinstance(aliases, str) or not isinstance(aliases, (tuple, list)):
            raise TypeError(f"aliases: expected a list of 'ip:port', got {aliases!r}")
        self.aliases = frozenset(auth.check_alias(a) for a in aliases)
        self.secret = auth.check_secret(secret)
        if self.secret is None and not auth.is_loopback(host):
            if not insecure:
                raise ValueError(
                    f"listening on {host!r} without a shared secret would let anyone who can reach "
                    f"the port read and write KV: expected a secret (secret=..., or "
                    f"{auth.SECRET_ENV} / secret_file for the vLLM connector), a loopback address, "
                    "or insecure=True"
                )
            log.warning(
                "listening on %r without a shared secret (insecure): anyone who can reach the "
                "port can read and write KV",
                host,
            )
        self.transport = transport
        self.device = device
        self.connect_timeout_s = check_timeout("connect_timeout_s", connect_timeout_s)
        self.options = check_options(options)
        self.limits = self.options.limits
        # an nccl listener takes gloo too: what two ends on one GPU fall back to
        self.allowed = {transport} | ({"gloo"} if transport == "nccl" else set())
        self.allowed |= {"socket"} if allow_socket else set()
        self._lock = threading.Lock()
        self._closed = False
        self._released = False
        self._accepting = 0  # accept_socket calls polling the socket and the wake pipe
        self._sock = socket.create_server((host, port), backlog=backlog)
        self._sock.setblocking(False)
        self.host, self.port = self._sock.getsockname()[:2]
        self._wake_r, self._wake_w = os.pipe()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def accept_socket(self, timeout_s: float | None = None):
        """Wait for one TCP connection (None: until ``close``). Returns (socket, peer name) or
        None when closed; raises TransferTimeout at the deadline."""
        with self._lock:
            if self._closed:
                return None
            self._accepting += 1
        try:
            return self._accept_socket(timeout_s)
        finally:
            with self._lock:
                self._accepting -= 1
            self._release_if_idle()

    def _accept_socket(self, timeout_s: float | None):
        t0 = time.monotonic()
        deadline = None if timeout_s is None else t0 + timeout_s
        p = select.poll()
        p.register(self._sock, select.POLLIN)
        p.register(self._wake_r, select.POLLIN)
        while True:
            if self._closed:
                return None
            try:
                conn, addr = self._sock.accept()
                configure(conn)
                return conn, peer_name(addr)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                if self._closed or e.errno in (errno.EBADF, errno.EINVAL):
                    return None
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ECONNABORTED):
                    log.warning("accept failed: %s", e)
                    time.sleep(0.05)  # back off on descriptor exhaustion, then retry
                    continue
                raise
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TransferTimeout(
                    "no connection arrived",
                    peer=f"{self.host}:{self.port}",
                    waited_s=time.monotonic() - t0,
                )
            p.poll(None if left is None else max(1, int(left * 1000)))

    def handshake(
        self,
        sock: socket.socket,
        peer: str,
        on_auth: Callable[[auth.AuthError | None], str | None] | None = None,
    ) -> TensorPipe:
        """Listener side of the handshake on an accepted socket (closes it on failure).

        ``on_auth`` is called once authentication is decided (the peer answered, failed to, or
        its socket broke), before the peer can learn the outcome: with ``None`` when the peer
        proved the secret, else with the ``AuthError`` about to be raised. A server counts
        failures and frees handshake slots there, so that a refused peer that reconnects at once
        finds both done. For an authenticated peer it may return a reason to refuse it anyway
        (a cap on open connections): the peer's HELLO is answered by an ERROR saying so, and
        PipeClosedError raised."""
        t0 = time.monotonic()
        deadline = t0 + self.connect_timeout_s
        try:
            sock.setblocking(False)
            refusal, session = authenticate_listener(
                sock, self.secret, t0, deadline, peer, on_auth, self.aliases
            )
            return open_pipe(
                sock,
                peer,
                Offer(frozenset(self.allowed), device_uuid(self.device), refusal),
                session,
                device=self.device,
                options=self.options,
                t0=t0,
                deadline=deadline,
            )
        except BaseException as e:
            with contextlib.suppress(OSError):
                sock.close()
            if isinstance(e, (TimeoutError, OSError)):
                raise PeerDeadError(
                    f"handshake failed: {e}", peer=peer, waited_s=time.monotonic() - t0
                ) from None
            raise

    def accept(self, timeout_s: float | None = None) -> TensorPipe:
        """Accept one connection and complete its handshake."""
        got = self.accept_socket(timeout_s)
        if got is None:
            raise PipeClosedError("listener closed", peer=f"{self.host}:{self.port}")
        return self.handshake(*got)

    def close(self) -> None:
        """Stop listening (idempotent); established pipes stay open. Releases the socket and the
        wake pipe as soon as no ``accept_socket`` call is polling them (a descriptor closed under a
        poller could be reused by another connection meanwhile)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._released:
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"x")
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        with self._lock:
            if not self._closed or self._accepting or self._released:
                return
            self._released = True
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()
