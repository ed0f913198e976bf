"""connect_pipe before the first byte: ports checked, host names looked up under the deadline."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from connector.transport import PipeListener, connect_pipe
from connector.transport.connect import MAX_LOOKUPS
from connector.transport.errors import PeerDeadError, TransferTimeout


@pytest.fixture
def stuck_resolver(monkeypatch):
    """getaddrinfo that never answers for names (until the test ends); addresses pass."""
    real, release = socket.getaddrinfo, threading.Event()

    def getaddrinfo(host, port, *args, **kwargs):
        flags = kwargs.get("flags", 0)
        if flags & socket.AI_NUMERICHOST or host in ("127.0.0.1", "::1"):
            return real(host, port, *args, **kwargs)
        release.wait(60)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield release
    release.set()


@pytest.mark.parametrize("port", [2**63, 0, -1, 65536, 70000, True, "80"], ids=repr)
def test_a_port_out_of_range_is_refused_before_anything_is_dialed(port):
    with pytest.raises(ValueError, match=r"port: expected an int in \[1, 65535\]"):
        connect_pipe("127.0.0.1", port, transport="socket")


def test_a_host_name_whose_resolver_never_answers_times_out_at_the_connect_deadline(
    stuck_resolver,
):
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout, match=r"looking up 'never\.example' took longer"):
        connect_pipe("never.example", 14600, transport="socket", connect_timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0


def test_lookups_in_flight_are_bounded_and_free_again_once_the_resolver_answers(stuck_resolver):
    for i in range(MAX_LOOKUPS):  # each leaves its lookup thread waiting on the resolver
        with pytest.raises(TransferTimeout):
            connect_pipe(f"n{i}.example", 1, transport="socket", connect_timeout_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(PeerDeadError, match="lookups are already in flight"):
        connect_pipe("one-more.example", 1, transport="socket", connect_timeout_s=5)
    assert time.monotonic() - t0 < 0.5, "a full lookup table must refuse at once"
    stuck_resolver.set()  # the resolver answers (with an error): the threads end
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            connect_pipe("again.example", 1, transport="socket", connect_timeout_s=5)
        except PeerDeadError as exc:
            if "in flight" in str(exc):
                time.sleep(0.05)
                continue
            assert "cannot resolve 'again.example'" in str(exc)
            break
    else:
        pytest.fail("lookup slots were never freed")


def test_a_name_that_resolves_connects():
    listener = PipeListener(transport="socket")
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("p", listener.accept(timeout_s=20)))
    t.start()
    try:
        pipe = connect_pipe("localhost", listener.port, transport="socket", connect_timeout_s=10)
        t.join(20)
        pipe.send("k", meta={"n": 1})
        assert got["p"].recv(timeout_s=10).meta == {"n": 1}
        pipe.close(timeout_s=1)
        got["p"].close(timeout_s=1)
    finally:
        t.join(20)
        listener.close()
