"""Helpers of the KV store tests: the accounting invariant of a buffer's stats, a delivery in
process, a hand-written
client and server on plain sockets (past authentication, speaking frames of
:mod:`connector.transport.frame`), and a spy on the tensors allocated while hostile frames arrive."""

from __future__ import annotations

import math
import socket
import threading
import time

import pytest
import torch

from connector.kvstore.server import delivery_nh
from connector.transport import Kind, PayloadAuthError, ProtocolError, encode_header
from connector.transport import frame as wire
from support.transport import Sealed, raw_authenticate, raw_listener_authenticate, recv_exact
from tritonkv import umac


def accounted(s: dict) -> bool:
    """Nothing vanished: every put is held or was claimed, discarded, evicted or expired."""
    return (
        s["puts"] == s["entries"] + s["claimed"] + s["discards"] + s["evictions"] + s["expirations"]
    )


def deliver(
    buffer,
    key: str,
    *,
    wait_s: float = 0.0,
    part=None,
    digest=None,
    max_bytes=None,
    defer_entry_check=False,
    secret=None,
) -> tuple:
    """One delivery of ``key`` (put with ``digest``) from a KVBuffer in process (what a server's
    GET does, with ``KVClient.get``'s arguments): its tensors and meta, the entry claimed. Raises
    KeyMissError as ``KVBuffer.checkout`` does, ProtocolError (the entry stays) for more than
    ``max_bytes`` bytes, as the client does. With ``defer_entry_check`` a third item: for an
    entry put with NH outputs, a :class:`LocalEntryTag` of those the server's delivery on a
    process group sends (:func:`~connector.kvstore.server.delivery_nh`; ``secret``: the entry
    key's), else None."""
    with buffer.checkout(key, wait_s=wait_s, part=part, digest=digest) as lease:
        if max_bytes is not None and lease.nbytes > max_bytes:
            raise ProtocolError(f"{lease.nbytes} payload bytes announced, expected <= {max_bytes}")
        if not defer_entry_check:
            return lease.tensors, lease.meta
        nh = delivery_nh(None, lease, secret)
        tag = None if nh is None else LocalEntryTag(umac.entry_keys(secret, key), nh, key)
        return lease.tensors, lease.meta, tag


class LocalEntryTag:
    """An in-process stand-in of :class:`connector.transport.EntryTag` (no wire, no PRF): its
    ``check`` compares the NH outputs the caller computed with those the entry was put with,
    bit for bit, and raises PayloadAuthError as the real one does when they differ."""

    def __init__(self, entry_keys, nh: dict, key: str):
        self.entry_keys, self._nh, self._key = entry_keys, nh, key
        self.names = tuple(nh)
        self.checked: list[str] = []

    def check(self, outputs: dict) -> None:
        for name in self.names:
            self.checked.append(name)
            if not torch.equal(outputs[name].cpu(), self._nh[name].cpu()):
                raise PayloadAuthError(
                    "payload authentication failed: the tag of 1 tensor(s) differs from the "
                    "sender's (in process)",
                    key=self._key,
                )


def raw_connection(srv) -> Sealed:
    """A raw connection to KVServer ``srv``, past authentication (the server has no secret)."""
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    s.settimeout(5)
    return raw_authenticate(s)


def read_frame(s) -> wire.Header | None:
    """The next frame's header from ``s`` (its payload stays on the socket); None at its end.
    On a :class:`~support.transport.Sealed` socket its tag is checked; on a plain one (before
    authentication: a refusal in place of the challenge) there is none."""
    if isinstance(s, Sealed):
        return s.read_frame()
    prefix = recv_exact(s, wire.PREFIX_SIZE)
    if len(prefix) < wire.PREFIX_SIZE:
        return None
    kind, flags, body_len = wire.decode_prefix(prefix)
    return wire.decode_body(kind, flags, recv_exact(s, body_len))


HELLO_SOCKET = encode_header(Kind.HELLO, "", {"proto": 2, "transport": "socket"})


def hello(s: Sealed) -> None:
    """The client's HELLO for the socket transport; checks the HELLO_ACK."""
    s.send_frame(HELLO_SOCKET)
    ack = read_frame(s)
    assert ack.kind == Kind.HELLO_ACK and ack.meta["transport"] == "socket"
    assert wire.limits_from_meta(ack.meta, wire.FrameLimits(max_ndim=1)) == wire.DEFAULT_LIMITS


def closed_by_server(s, timeout_s: float = 5.0) -> bool:
    """True once the server closed the connection (an ERROR frame may come first)."""
    s.settimeout(timeout_s)
    try:
        while True:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def fake_server(behaviour) -> socket.socket:
    """A raw listener that authenticates and handshakes one client (socket transport), then runs
    ``behaviour(conn, request_header)`` (``conn``: a :class:`~support.transport.Sealed`) and stays
    silent for 3 s. Returns the listening socket."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = lsock.accept()
        conn.settimeout(10)
        try:
            sealed = raw_listener_authenticate(conn)
            assert sealed is not None
            assert read_frame(sealed).kind == Kind.HELLO
            sealed.send_frame(encode_header(Kind.HELLO_ACK, "", {"transport": "socket"}))
            behaviour(sealed, read_frame(sealed))
            time.sleep(3)
        except Exception:
            pass
        finally:
            conn.close()

    threading.Thread(target=run, daemon=True).start()
    return lsock


@pytest.fixture
def no_big_alloc(monkeypatch):
    """Bytes of every tensor ``torch.empty`` makes during the test (receive buffers among them;
    ``math.inf`` for one too large to make)."""
    sizes = []
    real = torch.empty

    def spy(*args, **kw):
        try:
            t = real(*args, **kw)
        except RuntimeError:
            sizes.append(math.inf)
            raise
        sizes.append(t.nbytes)
        return t

    monkeypatch.setattr(torch, "empty", spy)
    return sizes
