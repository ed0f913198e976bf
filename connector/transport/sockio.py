"""Socket I/O of the transport: reads and writes under deadlines, poll-based (no socket-wide
timeout shared by threads), on non-blocking sockets.

:func:`configure` is the one place that sets a connection's socket options. The readers raise
:class:`PeerClosed` when the peer closed the socket and ``TimeoutError`` at the deadline;
:func:`read_fixed` and :func:`read_handshake_frame` turn both into the transport's errors for the
handshake (:mod:`connector.transport.handshake`).
"""

from __future__ import annotations

import contextlib
import select
import socket
import time

from .errors import PeerDeadError, TransferTimeout, error_text
from .frame import (
    PREFIX_SIZE,
    FrameLimits,
    Header,
    Kind,
    decode_body,
    decode_prefix,
    encode_header,
    kind_name,
)

IO_CHUNK = 4 << 20  # socket read/write slice


class PeerClosed(Exception):
    """The peer closed the socket (recv returned 0 bytes)."""


def configure(sock: socket.socket) -> None:
    """Set a connection's options (no Nagle delay, keepalive) and make it non-blocking."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setblocking(False)


def peer_name(addr) -> str:
    """``"host:port"`` of a socket address."""
    return f"{addr[0]}:{addr[1]}"


def poll(sock: socket.socket, events: int, deadline: float | None) -> bool:
    """Wait until ``sock`` is ready for ``events`` or ``deadline``; False on timeout."""
    p = select.poll()
    p.register(sock, events | select.POLLERR | select.POLLHUP)
    while True:
        if deadline is None:
            ready = p.poll()
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready = p.poll(max(1, int(left * 1000 + 0.999)))
        if ready:
            return True


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None, what: str) -> None:
    """Fill ``view`` from ``sock`` before ``deadline`` (None: wait forever, woken by shutdown).

    Raises:
        PeerClosed: the peer closed the socket first.
        TimeoutError: the deadline passed.
    """
    got = 0
    n = len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], min(n - got, IO_CHUNK))
        except (BlockingIOError, InterruptedError):
            if not poll(sock, select.POLLIN, deadline):
                raise TimeoutError(f"timed out reading {what} ({got}/{n} bytes)") from None
            continue
        if k == 0:
            raise PeerClosed(f"peer closed the connection while reading {what} ({got}/{n} bytes)")
        got += k


def send_all(sock: socket.socket, data, deadline: float | None, what: str) -> None:
    """Write all of ``data`` (bytes or a buffer) before ``deadline``, else TimeoutError."""
    view = memoryview(data).cast("B")
    sent = 0
    while sent < len(view):
        try:
            sent += sock.send(view[sent : sent + IO_CHUNK])
        except (BlockingIOError, InterruptedError):
            if not poll(sock, select.POLLOUT, deadline):
                raise TimeoutError(f"timed out writing {what} ({sent}/{len(view)} bytes)") from None


def read_frame(
    sock: socket.socket, limits: FrameLimits, first_deadline: float | None, frame_timeout_s: float
) -> Header | None:
    """Read and validate one header. The first byte may take until ``first_deadline`` (None: idle
    wait, woken by shutdown); the rest of the header must follow within ``frame_timeout_s``.
    Returns None on a clean EOF before the first byte."""
    prefix = bytearray(PREFIX_SIZE)
    view = memoryview(prefix)
    try:
        recv_into(sock, view[:1], first_deadline, "frame prefix")
    except PeerClosed:
        return None
    deadline = time.monotonic() + frame_timeout_s
    if first_deadline is not None:
        deadline = max(deadline, first_deadline)
    recv_into(sock, view[1:], deadline, "frame prefix")
    kind, flags, body_len = decode_prefix(bytes(prefix), limits)
    body = bytearray(body_len)
    if body_len:
        recv_into(sock, memoryview(body), deadline, f"{kind_name(kind)} header body")
    return decode_body(kind, flags, bytes(body), limits)


def read_fixed(sock: socket.socket, size: int, deadline: float, peer: str, what: str) -> bytes:
    """Exactly ``size`` bytes before ``deadline`` (the authentication messages' fixed sizes);
    TransferTimeout at the deadline, PeerDeadError if the connection closes first."""
    t0 = time.monotonic()
    raw = bytearray(size)
    try:
        recv_into(sock, memoryview(raw), deadline, what)
    except TimeoutError:
        raise TransferTimeout(
            f"no {what} within the connect deadline", peer=peer, waited_s=time.monotonic() - t0
        ) from None
    except (PeerClosed, OSError) as e:
        raise PeerDeadError(
            f"connection closed while reading the {what}: {e}",
            peer=peer,
            waited_s=time.monotonic() - t0,
        ) from None
    return bytes(raw)


def read_handshake_frame(
    sock: socket.socket,
    limits: FrameLimits,
    deadline: float,
    frame_timeout_s: float,
    peer: str,
    what: str,
) -> Header:
    """One frame (HELLO, HELLO_ACK or ERROR) before ``deadline``; TransferTimeout at the deadline,
    PeerDeadError if the connection closes or breaks first."""
    t0 = time.monotonic()
    try:
        h = read_frame(sock, limits, deadline, frame_timeout_s)
    except TimeoutError:
        raise TransferTimeout(
            f"no {what} within the connect deadline", peer=peer, waited_s=time.monotonic() - t0
        ) from None
    except PeerClosed:
        h = None
    except OSError as e:
        raise PeerDeadError(
            f"connection broke waiting for {what}: {e}", peer=peer, waited_s=time.monotonic() - t0
        ) from None
    if h is None:
        raise PeerDeadError(
            f"peer closed the connection before {what}", peer=peer, waited_s=time.monotonic() - t0
        )
    return h


def send_error_frame(sock: socket.socket, message: str) -> None:
    """Tell the peer why it is refused (an ERROR frame, best effort within 1 s; never raises)."""
    with contextlib.suppress(Exception):
        frame = encode_header(Kind.ERROR, "", {"error": error_text(message)})
        send_all(sock, frame, time.monotonic() + 1.0, "ERROR")
