"""A TCP forwarder holding no secret, for the tests of relay-proof authentication and session
framing: it passes the authentication exchange through untouched, then hands each frame the
connector sends to a ``tamper`` function that may rewrite, drop, repeat, reorder or splice it."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

from connector.transport import auth
from connector.transport import frame as wire
from connector.transport.session import TAG_BYTES
from support.transport import recv_exact

Tamper = Callable[[int, bytes], list[bytes]]  # (index after auth, frame bytes) -> what to send


def _read_sealed_frame(sock) -> bytes | None:
    """One whole frame as it travels in a session (tags and inline payload included)."""
    prefix = recv_exact(sock, wire.PREFIX_SIZE)
    if len(prefix) < wire.PREFIX_SIZE:
        return None
    kind, flags, body_len = wire.decode_prefix(prefix)
    body = recv_exact(sock, body_len)
    frame = prefix + body + recv_exact(sock, TAG_BYTES)
    header = wire.decode_body(kind, flags, body)
    if header.inline and header.payload_bytes:
        frame += recv_exact(sock, header.payload_bytes + TAG_BYTES)
    return frame


class Relay:
    """Listens on 127.0.0.1 (its own port) and forwards each connection to ``target`` (settable
    until the first connection).

    Without ``tamper`` it forwards bytes as they come. With it, the connector's RESPONSE passes
    untouched and every later frame of the connector goes through ``tamper(index, frame)``
    (index 0 is HELLO); ``frames`` records them, for splicing into another session.
    """

    def __init__(self, target: tuple[str, int] | None = None, tamper: Tamper | None = None):
        self.target = target
        self.tamper = tamper
        self.frames: list[bytes] = []
        self.response = b""  # the connector's RESPONSE (with a tamper function)
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self._lsock.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._socks: list[socket.socket] = []
        self.connections = 0  # accepted so far
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._lsock.accept()
            except OSError:
                return
            self.connections += 1
            up = socket.create_connection(self.target)
            self._socks += [down, up]
            c2s = self._frames if self.tamper is not None else self._bytes
            threading.Thread(target=c2s, args=(down, up), daemon=True).start()
            threading.Thread(target=self._bytes, args=(up, down), daemon=True).start()

    @staticmethod
    def _bytes(src, dst) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _frames(self, src, dst) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.response = recv_exact(src, auth.RESPONSE.size)
            dst.sendall(self.response)
            index = 0
            while (frame := _read_sealed_frame(src)) is not None:
                self.frames.append(frame)
                for out in self.tamper(index, frame):
                    dst.sendall(out)
                index += 1
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._lsock.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
