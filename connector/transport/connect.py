"""The connector side: :func:`connect_pipe` (the protocol: :mod:`connector.transport.handshake`).

Everything before the first byte is under the connect deadline too: a host name is looked up on a
thread of its own that the caller stops waiting for at the deadline (the system resolver has no
timeout of ours), and at most :data:`MAX_LOOKUPS` lookups run at once, so names whose resolver
never answers can neither stall a caller past its deadline nor pile up threads.
"""

from __future__ import annotations

import socket
import threading
import time

import torch

from . import auth
from .errors import PeerDeadError, TransferTimeout
from .handshake import Request, authenticate_connector, open_pipe
from .options import PipeOptions, check_options, check_timeout, check_transport, device_uuid
from .pipe import TensorPipe
from .sockio import configure

MAX_LOOKUPS = 8  # host name lookups in flight at once (each may outlive its caller's deadline)
_lookups = threading.BoundedSemaphore(MAX_LOOKUPS)


def resolve(host: str, port: int, deadline: float, peer: str) -> list[tuple]:
    """``socket.getaddrinfo`` results for ``host:port`` (TCP), by the deadline: an IP address at
    once, a host name on a lookup thread. Raises TransferTimeout when the lookup outlives the
    deadline, PeerDeadError when the name does not resolve or too many lookups are in flight."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass  # a name, not an address
    t0 = time.monotonic()
    if not _lookups.acquire(blocking=False):
        raise PeerDeadError(
            f"not looked up: {MAX_LOOKUPS} host name lookups are already in flight", peer=peer
        )
    result: dict = {}
    done = threading.Event()

    def lookup() -> None:
        try:
            result["addrs"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            result["error"] = exc
        finally:
            _lookups.release()
            done.set()

    threading.Thread(target=lookup, name="tkv-resolve", daemon=True).start()
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise TransferTimeout(
            f"looking up {host!r} took longer than the connect deadline",
            peer=peer,
            waited_s=time.monotonic() - t0,
        )
    if "error" in result:
        raise PeerDeadError(f"cannot resolve {host!r}: {result['error']}", peer=peer)
    return result["addrs"]


def addresses_of(host: str, port: int, timeout_s: float = 10.0) -> list[str]:
    """Every address ``host:port`` resolves to (an IP address: itself), written as the
    authentication writes them (``"10.0.0.5:7000"``): a listener's aliases for the name it is
    advertised under. Raises TransferError when the name does not resolve within ``timeout_s``."""
    found = resolve(host, port, time.monotonic() + timeout_s, f"{host}:{port}")
    return sorted({auth.address_text(a[4]) for a in found})


def _connect(host: str, port: int, deadline: float, peer: str) -> socket.socket:
    """A TCP connection to the first address of ``host`` that answers, by the deadline."""
    t0 = time.monotonic()
    error: OSError | None = None
    for family, kind, proto, _, address in resolve(host, port, deadline, peer):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(address)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    if error is None or isinstance(error, TimeoutError):
        raise TransferTimeout("connect timed out", peer=peer, waited_s=time.monotonic() - t0)
    raise PeerDeadError(f"cannot connect: {error}", peer=peer, waited_s=time.monotonic() - t0)


def connect_pipe(
    host: str,
    port: int,
    *,
    transport: str = "gloo",
    device: str | torch.device = "cpu",
    connect_timeout_s: float = 10.0,
    secret: bytes | str | None = None,
    options: PipeOptions | None = None,
) -> TensorPipe:
    """Connect to a :class:`~connector.transport.listener.PipeListener` and return the
    connector-side pipe (rank 1).

    ``secret``: the shared secret (:mod:`connector.transport.auth`; at least 32 bytes), which the
    listener must hold too; None only for a listener that has none.

    Raises PeerDeadError (refused / closed), TransferTimeout (no answer within
    ``connect_timeout_s``), AuthError (secrets differ, only one side has one, or the listener
    was not reached at its own address: a relay in between), RemoteError
    (the listener refused the transport) or ProtocolError.
    """
    secret = auth.check_secret(secret)
    check_transport(transport)
    if type(port) is not int or not 0 < port < 65536:
        raise ValueError(f"port: expected an int in [1, 65535], got {port!r}")
    connect_timeout_s = check_timeout("connect_timeout_s", connect_timeout_s)
    options = check_options(options)
    peer = f"{host}:{port}"
    t0 = time.monotonic()
    deadline = t0 + connect_timeout_s
    sock = _connect(host, port, deadline, peer)
    try:
        configure(sock)
        session = authenticate_connector(sock, secret, options.limits, deadline, peer)
        return open_pipe(
            sock,
            peer,
            Request(transport, device_uuid(device)),
            session,
            device=device,
            options=options,
            t0=t0,
            deadline=deadline,
        )
    except BaseException:
        sock.close()
        raise
