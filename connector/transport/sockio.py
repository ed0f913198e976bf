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

from .errors import PeerDeadError, ProtocolError, TransferTimeout, error_text
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
from .session import TAG_BYTES, FrameMac, Session

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
    sock: socket.socket,
    limits: FrameLimits,
    first_deadline: float | None,
    frame_timeout_s: float,
    session: Session,
) -> tuple[Header, FrameMac] | None:
    """Read, authenticate and validate one header of ``session``
    (:mod:`connector.transport.session`): the header and the MAC its inline payload, if any, is
    checked against. The first byte may take until ``first_deadline`` (None: idle wait, woken by
    shutdown); the rest of the header and its tag must follow within ``frame_timeout_s``.
    Returns None on a clean EOF before the first byte; ProtocolError for a bad frame or tag."""
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
    rest = bytearray(body_len + TAG_BYTES)
    recv_into(sock, memoryview(rest), deadline, f"{kind_name(kind)} header body")
    body, tag = bytes(rest[:body_len]), bytes(rest[body_len:])
    mac = session.receiving(bytes(prefix) + body)
    mac.check_header(tag, f"a {kind_name(kind)} header")
    return decode_body(kind, flags, body, limits), mac


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
    session: Session,
) -> Header:
    """One frame of the handshake (HELLO, HELLO_ACK, ERROR, RENDEZVOUS: no payload) before
    ``deadline``; TransferTimeout at the deadline, PeerDeadError if the connection closes or
    breaks first, ProtocolError for a bad frame or one announcing a payload."""
    t0 = time.monotonic()
    try:
        got = read_frame(sock, limits, deadline, frame_timeout_s, session)
    except TimeoutError:
        raise TransferTimeout(
            f"no {what} within the connect deadline", peer=peer, waited_s=time.monotonic() - t0
        ) from None
    except PeerClosed:
        got = None
    except ProtocolError as e:
        raise ProtocolError(f"reading {what}: {e.detail}", peer=peer) from None
    except OSError as e:
        raise PeerDeadError(
            f"connection broke waiting for {what}: {e}", peer=peer, waited_s=time.monotonic() - t0
        ) from None
    if got is None:
        raise PeerDeadError(
            f"peer closed the connection before {what}", peer=peer, waited_s=time.monotonic() - t0
        )
    h = got[0]
    if h.specs:
        raise ProtocolError(
            f"{kind_name(h.kind)} ({what}): expected no tensors, got {len(h.specs)}", peer=peer
        )
    return h


def send_frame(
    sock: socket.socket, session: Session, header: bytes, deadline: float, what: str
) -> None:
    """Write one frame without payload (``header``: prefix + body) with its tag."""
    send_all(sock, session.seal(header), deadline, what)


def send_error_frame(sock: socket.socket, message: str, session: Session | None = None) -> None:
    """Tell the peer why it is refused (an ERROR frame, best effort within 1 s; never raises):
    sealed in ``session``, or (None) before authentication, in place of the CHALLENGE."""
    with contextlib.suppress(Exception):
        frame = encode_header(Kind.ERROR, "", {"error": error_text(message)})
        if session is not None:
            frame = session.seal(frame)
        send_all(sock, frame, time.monotonic() + 1.0, "ERROR")
