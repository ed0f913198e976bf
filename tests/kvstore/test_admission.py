"""A KV server's connection caps: strangers who never authenticate take only pending places, shared
out fairly, so neither one address nor many can lock consumers out; authenticated connections
have caps of their own, in all and per host."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
from support.kvstore import HELLO_SOCKET, read_frame
from support.transport import raw_authenticate, settled_stat

from connector.kvstore import ConnectionCaps, KVBuffer, KVClient, KVServer
from connector.kvstore.admission import Admission, Refused, host_of
from connector.transport import Kind, RemoteError

SECRET = b"admission-tests-secret-012345678"


# ------------------------------------------------------------------------------ the rules alone
def _arrive(adm: Admission, address: str, evicted: list | None = None):
    return adm.arrive(address, evict=lambda: evicted.append(address) if evicted is not None else 0)


def test_caps_are_positive_ints_and_say_what_they_got():
    assert ConnectionCaps() == ConnectionCaps(64, 16, 64, 4)
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(
            ValueError, match=rf"max_pending_per_host: expected a positive int, got {bad!r}"
        ):
            ConnectionCaps(max_pending_per_host=bad)
    with pytest.raises(TypeError, match="caps: expected ConnectionCaps or None, got dict"):
        Admission({"max_connections": 1})


def test_an_address_holds_at_most_its_share_of_pending_places_and_refusals_are_counted():
    adm = Admission(ConnectionCaps(max_pending_per_host=2))
    slots = [_arrive(adm, "10.0.0.1") for _ in range(2)]
    with pytest.raises(Refused, match=r"^too many pending handshakes from this address \(2\)$"):
        _arrive(adm, "10.0.0.1")
    _arrive(adm, "10.0.0.2")  # another address is not held up
    adm.release(slots[0])
    adm.release(slots[0])  # idempotent
    _arrive(adm, "10.0.0.1")
    assert adm.counts() == {
        "pending_connections": 3,
        "open_connections": 0,
        "rejected_connections": 1,
        "evicted_handshakes": 0,
    }


def test_a_full_pending_pool_gives_a_newcomer_the_oldest_place_of_the_address_holding_most():
    adm = Admission(ConnectionCaps(max_pending=4, max_pending_per_host=4))
    evicted: list[str] = []
    a = [_arrive(adm, "10.0.0.1", evicted) for _ in range(3)]
    b = _arrive(adm, "10.0.0.2", evicted)
    new = _arrive(adm, "10.0.0.3", evicted)  # full: the address holding most gives up its oldest
    assert evicted == ["10.0.0.1"] and a[0].evicted and not a[1].evicted and not b.evicted
    with pytest.raises(Refused, match=r"^too many pending handshakes \(4\)$"):
        _arrive(adm, "10.0.0.1", evicted)  # holding as many as the most: it takes no one's place
    _arrive(adm, "10.0.0.4", evicted)
    assert evicted == ["10.0.0.1", "10.0.0.1"] and a[1].evicted and not new.evicted
    with pytest.raises(Refused, match="handshake ended by the server"):
        adm.authenticated(a[0])  # an evicted handshake that authenticated just too late
    assert adm.counts()["pending_connections"] == 4 and adm.counts()["evicted_handshakes"] == 2


def test_open_places_are_capped_in_all_and_per_host_and_loopback_is_one_host():
    adm = Admission(ConnectionCaps(max_connections=3, max_connections_per_host=2))
    for address in ("127.0.0.1", "127.0.0.2"):  # two loopback addresses: one host
        adm.authenticated(_arrive(adm, address))
    assert host_of("127.0.0.9") == host_of("::1") == host_of("::ffff:127.0.0.1") == "loopback"
    with pytest.raises(Refused, match=r"^too many connections from this host \(2\)$"):
        _arrive(adm, "127.0.0.3")  # refused as it arrives: no pending place is taken
    pending = _arrive(adm, "10.0.0.1")
    other = _arrive(adm, "10.0.0.2")
    adm.authenticated(pending)
    with pytest.raises(Refused, match=r"^too many connections \(3\)$"):
        adm.authenticated(other)  # the cap filled while it authenticated: refused then
    assert other.refused
    adm.release(pending)
    assert adm.counts() == {
        "pending_connections": 0,
        "open_connections": 2,
        "rejected_connections": 2,
        "evicted_handshakes": 0,
    }


# ---------------------------------------------------------------------------- a server's caps
@pytest.fixture
def served():
    buf = KVBuffer(1 << 22)
    srv = KVServer(buf, secret=SECRET, connect_timeout_s=5)
    try:
        yield buf, srv
    finally:
        srv.close()


def _stall(port: int, source: str) -> socket.socket:
    """A connection from ``source`` that reads nothing and never answers the challenge."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    s.settimeout(5)
    return s


def _pull(srv, key: str, **kw) -> torch.Tensor:
    srv.buffer.put(key, {"x": torch.arange(6.0)})
    with KVClient("127.0.0.1", srv.port, secret=SECRET, timeout_s=5, **kw) as client:
        return client.get(key)[0]["x"]


@pytest.mark.timeout(60)
def test_strangers_on_17_addresses_holding_pending_handshakes_do_not_lock_a_consumer_out(served):
    """17 addresses with 4 stalled handshakes each (68: more than the 64 places a server once
    shared between pending and open connections) leave an authenticated consumer free to load."""
    _, srv = served
    strangers = [_stall(srv.port, f"127.0.0.{i}") for i in range(2, 19) for _ in range(4)]
    try:
        assert settled_stat(srv, "pending_connections", 64) == 64
        assert settled_stat(srv, "evicted_handshakes", 4) == 4  # the last address took places
        assert torch.equal(_pull(srv, "k"), torch.arange(6.0))
        assert torch.equal(_pull(srv, "k2", transport="socket"), torch.arange(6.0))
        assert srv.stats()["connections"] == 2 and srv.stats()["auth_failures"] == 0
    finally:
        for s in strangers:
            s.close()


@pytest.mark.timeout(60)
def test_refusals_before_authentication_start_no_thread_and_are_counted(served):
    """An address past its pending share is refused with a short fixed text, at once, by the
    accept thread: no connection thread starts for it."""
    _, srv = served
    share = srv.caps.max_pending_per_host
    held = [_stall(srv.port, "127.0.0.2") for _ in range(share)]
    assert settled_stat(srv, "pending_connections", share) == share
    refused = [_stall(srv.port, "127.0.0.2") for _ in range(20)]
    try:
        for s in refused:
            h = read_frame(s)
            assert h.kind == Kind.ERROR
            assert h.meta == {"error": f"too many pending handshakes from this address ({share})"}
        assert srv.stats()["rejected_connections"] == 20
        names = [t.name for t in threading.enumerate()]
        assert sum(n.startswith(f"tkv-server[{srv.port}]-conn") for n in names) == share
    finally:
        for s in held + refused:
            s.close()
    assert settled_stat(srv, "auth_failures", share) == share  # the held ones failed, nothing else


@pytest.mark.timeout(60)
def test_a_host_holds_at_most_its_share_of_open_connections_whatever_its_loopback_address():
    buf = KVBuffer(1 << 22)
    caps = ConnectionCaps(max_connections_per_host=2)
    with KVServer(buf, secret=SECRET, caps=caps) as srv:
        clients = [KVClient("127.0.0.1", srv.port, secret=SECRET, transport="socket") for _ in "ab"]
        try:
            for i, c in enumerate(clients):
                buf.put(f"k{i}", {"x": torch.ones(1)})
                c.get(f"k{i}")
            with pytest.raises(RemoteError, match=r"too many connections from this host \(2\)"):
                _pull(srv, "k3", transport="socket")
            other = _stall(srv.port, "127.0.0.7")  # another loopback address: the same host
            assert read_frame(other).meta["error"] == "too many connections from this host (2)"
            other.close()
            assert srv.stats()["rejected_connections"] == 2
            clients.pop().close()
            assert settled_stat(srv, "open_connections", 1) == 1
            assert torch.equal(_pull(srv, "k4", transport="socket"), torch.arange(6.0))
        finally:
            for c in clients:
                c.close()


@pytest.mark.timeout(60)
def test_a_connection_that_authenticates_past_a_full_cap_is_told_in_place_of_hello_ack():
    """Two handshakes of one host under way when its share is one: the first to authenticate
    takes the place; the other, authenticated too, gets an ERROR answering its HELLO."""
    buf = KVBuffer(1 << 22)
    with KVServer(buf, secret=SECRET, caps=ConnectionCaps(max_connections_per_host=1)) as srv:
        first, second = (_stall(srv.port, "127.0.0.1") for _ in range(2))
        assert settled_stat(srv, "pending_connections", 2) == 2  # both past the arrival check
        for s, want in ((first, Kind.HELLO_ACK), (second, Kind.ERROR)):
            sealed = raw_authenticate(s, SECRET)
            sealed.send_frame(HELLO_SOCKET)
            h = read_frame(sealed)
            assert h.kind == want, h
        assert h.meta == {"error": "too many connections from this host (1)"}
        assert settled_stat(srv, "rejected_connections", 1) == 1
        assert srv.stats()["open_connections"] == 1 and srv.stats()["handshake_errors"] == 0
        assert srv.stats()["auth_failures"] == 0
        first.close()
        second.close()
