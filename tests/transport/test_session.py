"""Relay-proof, session-bound authentication (connector/transport/auth.py, session.py): a
forwarder holding no secret cannot sit between two holders of it, and every frame after the
handshake is authenticated: a rewritten byte, a dropped, repeated, reordered or spliced frame,
or a replayed session closes the connection."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest
import torch
from support.relay import Relay
from support.transport import recv_exact, settled_stat

from connector.kvstore import KVBuffer, KVClient, KVServer
from connector.transport import PipeListener, addresses_of, auth, connect_pipe, frame
from connector.transport.errors import ProtocolError, TransferError

SECRET = b"session-test-secret-0123456789abcdef"
MESSAGES = 4  # m0..m3: frames 1..4 of the connector's side (frame 0 is HELLO)


def _message(i: int) -> tuple[dict, dict]:
    return {"x": torch.full((8,), i, dtype=torch.int32)}, {"i": i}


@contextlib.contextmanager
def through_relay(tamper=None, *, transport: str = "socket"):
    """``(listener_end, connector_end, relay)``: a pipe whose connector dialed a relay the
    listener trusts as an alias (what an attacker on the path is: the bytes are its to change)."""
    relay = Relay(tamper=tamper)
    listener = PipeListener(
        transport="gloo", secret=SECRET, connect_timeout_s=5, aliases=[relay.address]
    )
    relay.target = ("127.0.0.1", listener.port)
    accepted: list = []
    t = threading.Thread(target=lambda: accepted.append(listener.accept(10)))
    t.start()
    client = connect_pipe("127.0.0.1", relay.port, transport=transport, secret=SECRET)
    t.join(10)
    server = accepted[0]
    try:
        yield server, client, relay
    finally:
        client.close(timeout_s=1)
        server.close(timeout_s=1)
        listener.close()
        relay.close()


@pytest.mark.timeout(60)
def test_a_relay_at_another_address_is_refused_and_the_entry_stays():
    """A plain forwarder holding no secret, named as the producer's address: the client's
    authentication names the relay's address, which the server does not know as its own."""
    buf = KVBuffer(1 << 20)
    buf.put("k", {"x": torch.arange(4)})
    with KVServer(buf, secret=SECRET) as srv, Relay(("127.0.0.1", srv.port)) as relay:
        client = KVClient("127.0.0.1", relay.port, secret=SECRET, timeout_s=5)
        with client, pytest.raises(auth.AuthError, match="not reached at its own address") as ei:
            client.get("k")
        assert relay.address in str(ei.value)
        assert settled_stat(srv, "auth_failures", 1) == 1 and "k" in buf
        with KVClient("127.0.0.1", srv.port, secret=SECRET, timeout_s=5) as client:
            got, _ = client.get("k")  # the control: straight to the server, it is served
        assert torch.equal(got["x"], torch.arange(4))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["gloo", "socket"])
def test_a_forwarder_named_as_an_alias_carries_the_session(transport):
    with through_relay(transport=transport) as (server, client, _):
        big = torch.arange(1 << 18, dtype=torch.float32)  # on the group for gloo
        client.send("k", {"big": big, "small": torch.ones(3)}, {"n": 1})
        m = server.recv(10)
        assert torch.equal(m.tensors["big"], big) and m.meta == {"n": 1}
        server.send("back", {"y": torch.arange(5)})
        assert torch.equal(client.recv(10).tensors["y"], torch.arange(5))


def test_aliases_are_checked():
    with pytest.raises(ValueError, match="alias: expected 'ip:port'"):
        PipeListener(aliases=["example.com:7000"])
    with pytest.raises(ValueError, match="port 1-65535"):
        PipeListener(aliases=["10.0.0.1:70000"])
    with pytest.raises(TypeError, match="aliases: expected a list"):
        PipeListener(aliases="10.0.0.1:7000")
    listener = PipeListener(aliases=["[::ffff:10.0.0.1]:7000", "[2001:db8::1]:7000"])
    assert listener.aliases == {"10.0.0.1:7000", "[2001:db8::1]:7000"}
    listener.close()


def test_the_addresses_a_name_is_advertised_under_become_aliases():
    assert addresses_of("10.0.0.1", 7000) == ["10.0.0.1:7000"]
    assert "127.0.0.1:7000" in addresses_of("localhost", 7000)
    with pytest.raises(TransferError):
        addresses_of("no-such-host.invalid", 7000, timeout_s=5)


def _flip(frame_bytes: bytes, offset: int) -> bytes:
    b = bytearray(frame_bytes)
    b[offset] ^= 0x01
    return bytes(b)


def _held():
    held: list[bytes] = []

    def reorder(i, f):
        if i == 2:
            held.append(f)
            return []
        return [f, *held] if i == 3 else [f]

    return reorder


TAMPERS = {
    "rewritten-header-byte": lambda i, f: [_flip(f, frame.PREFIX_SIZE + 3)] if i == 2 else [f],
    "rewritten-payload-byte": lambda i, f: [_flip(f, len(f) - 20)] if i == 2 else [f],
    "rewritten-tag-byte": lambda i, f: [_flip(f, len(f) - 1)] if i == 2 else [f],
    "dropped": lambda i, f: [] if i == 2 else [f],
    "repeated": lambda i, f: [f, f] if i == 2 else [f],
    "reordered": None,  # _held()
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", [*TAMPERS, "spliced-from-another-session"])
def test_a_frame_changed_on_the_way_closes_the_connection(how):
    """Frames 1..4 carry m0..m3; frame 2 (m1) is tampered with. The receiver gets the messages
    before it intact, then a ProtocolError; never a changed message."""
    if how == "spliced-from-another-session":
        with through_relay(lambda i, f: [f]) as (server, client, recorder):
            for i in range(MESSAGES):
                client.send(f"m{i}", *_message(i))
            for _ in range(MESSAGES):
                server.recv(10)  # the same plaintext, in a session of other keys
        other = recorder.frames
        tamper = lambda i, f: [other[i]] if i == 2 else [f]
    else:
        tamper = TAMPERS[how] or _held()
    with through_relay(tamper) as (server, client, _):
        for i in range(MESSAGES):
            client.send(f"m{i}", *_message(i))
        got = []
        with pytest.raises(ProtocolError, match="frame authentication failed"):
            for _ in range(MESSAGES + 1):
                m = server.recv(5)
                got.append((m.key, m.meta, m.tensors["x"].tolist()))
        want = [(f"m{i}", {"i": i}, [i] * 8) for i in range(MESSAGES)]
        assert got == want[: len(got)] and len(got) == (2 if how == "repeated" else 1)
        assert isinstance(server.broken, ProtocolError)


@pytest.mark.timeout(60)
def test_a_replayed_session_is_refused():
    """Every byte a connector sent in a session (its authentication and its frames), replayed on
    a new connection: the listener's fresh nonce makes the recorded proof worthless."""
    with through_relay(lambda i, f: [f]) as (server, client, relay):
        client.send("m0", *_message(0))
        server.recv(10)
        recorded = relay.response + b"".join(relay.frames)
    listener = PipeListener(transport="gloo", secret=SECRET, connect_timeout_s=5)
    outcome: list = []
    t = threading.Thread(target=lambda: _accept_into(listener, outcome))
    t.start()
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as s:
        challenge = recv_exact(s, auth.CHALLENGE.size)
        assert len(challenge) == auth.CHALLENGE.size
        s.sendall(recorded)
        t.join(10)
    listener.close()
    assert len(outcome) == 1 and isinstance(outcome[0], auth.AuthError), outcome


def _accept_into(listener, outcome: list) -> None:
    try:
        outcome.append(listener.accept(10))
    except TransferError as e:
        outcome.append(e)
