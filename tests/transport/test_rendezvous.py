"""The process group meets over the authenticated connection (connector/transport/rendezvous.py):
no rendezvous port, a store that bounds what a peer sets, a probe that proves the group's peer,
and no reverse-DNS lookup on the way."""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from connector.kvstore import KVBuffer, KVClient, KVServer
from connector.transport import auth
from connector.transport.errors import PeerDeadError, ProtocolError, TransferTimeout
from connector.transport.frame import DEFAULT_LIMITS, Kind, encode_header
from connector.transport.rendezvous import MAX_KEYS, MAX_VALUE_BYTES, ChannelStore, probe
from connector.transport.session import Session

SECRET = b"rendezvous-test-secret-0123456789abc"
ROOT = Path(__file__).resolve().parents[2]


def _listening_ports() -> dict[int, str]:
    """TCP ports this process listens on, with the local address in /proc/net's hex."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN, one of ours
                addr, port = f[1].rsplit(":", 1)
                ports[int(port, 16)] = addr
    return ports


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs /proc/net/tcp")
def test_a_server_and_its_gloo_pipes_open_no_port_but_gloos_pair_listeners_on_loopback():
    """The KV server's port is the one port it opens; each gloo pipe adds only gloo's own pair
    listener, bound to the connection's (loopback) address, never a wildcard, and no store."""
    before = _listening_ports()
    buf = KVBuffer(1 << 20)
    with KVServer(buf, secret=SECRET) as srv:
        assert set(_listening_ports()) - set(before) == {srv.port}
        clients = [KVClient("127.0.0.1", srv.port, secret=SECRET, timeout_s=5) for _ in range(2)]
        for i, c in enumerate(clients):
            buf.put(f"k{i}", {"x": torch.arange(3)})
            c.get(f"k{i}")
        added = {p: a for p, a in _listening_ports().items() if p not in before}
        for c in clients:
            c.close()
    assert srv.port in added
    gloo = {p: a for p, a in added.items() if p != srv.port}
    assert len(gloo) <= 4, gloo  # one pair listener per rank of each of the two pipes
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
    assert all(a in loopback for a in gloo.values()), gloo


def _sealed_pair():
    """A socket pair with both ends of one session: (our socket, our session, the peer's
    socket, the peer's session)."""
    a, b = socket.socketpair()
    a.setblocking(False)
    keys = auth.session_keys(SECRET, bytes(32), bytes(32), "127.0.0.1:1")
    return a, Session.pair(*keys, listener=True), b, Session.pair(*keys, listener=False)


def _set(sock, session, key: str, value: bytes) -> None:
    sock.sendall(session.seal(encode_header(Kind.RENDEZVOUS, key, {"value": value.hex()})))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "peer_sends",
    ["too-many-keys", "value-too-large", "a-key-twice", "another-kind", "done-without-the-key"],
)
def test_the_rendezvous_store_bounds_what_the_peer_sets(peer_sends):
    ours, session, theirs, peer = _sealed_pair()
    store = ChannelStore(ours, session, DEFAULT_LIMITS, time.monotonic() + 5, 1.0, "peer")
    if peer_sends == "too-many-keys":
        for i in range(MAX_KEYS + 1):
            _set(theirs, peer, f"k{i}", b"v")
    elif peer_sends == "value-too-large":
        _set(theirs, peer, "want", b"v" * (MAX_VALUE_BYTES + 1))
    elif peer_sends == "a-key-twice":
        _set(theirs, peer, "k", b"1")
        _set(theirs, peer, "k", b"2")
    elif peer_sends == "another-kind":
        theirs.sendall(peer.seal(encode_header(Kind.MSG, "want", {"value": "00"})))
    else:
        theirs.sendall(peer.seal(encode_header(Kind.RENDEZVOUS, "", {"done": True})))
    with pytest.raises(ProtocolError):
        store.get("want")
    ours.close()
    theirs.close()


@pytest.mark.timeout(30)
def test_the_rendezvous_store_gets_what_the_peer_set_and_ends_at_its_deadline():
    ours, session, theirs, peer = _sealed_pair()
    store = ChannelStore(ours, session, DEFAULT_LIMITS, time.monotonic() + 1, 1.0, "peer")
    _set(theirs, peer, "0/1", b"address")
    assert store.get("0/1") == b"address" and store.check(["0/1"])
    store.set("0/0", b"mine")
    assert store.get("0/0") == b"mine"  # one's own keys too (gloo waits for them)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        store.get("never")  # the peer is silent
    assert time.monotonic() - t0 < 2
    theirs.close()
    with pytest.raises(PeerDeadError):
        ChannelStore(ours, session, DEFAULT_LIMITS, time.monotonic() + 1, 1.0, "p").get("x")
    ours.close()


def _gloo_pair():
    store = dist.HashStore()
    pgs = {}

    def build(rank):
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = datetime.timedelta(seconds=10)
        pgs[rank] = dist.ProcessGroupGloo(store, rank, 2, opts)

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return pgs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("same_session", [True, False], ids=["the-session-peer", "a-stranger"])
def test_the_probe_proves_that_the_groups_peer_holds_the_session(same_session):
    """What a party that reached gloo's pair listener first would be: a group whose other rank
    does not hold the session's keys. Both ends refuse it; the session's own peer passes."""
    keys = auth.session_keys(SECRET, bytes(32), bytes(32), "127.0.0.1:1")
    other = keys if same_session else auth.session_keys(SECRET, bytes(32), b"x" * 32, "127.0.0.1:1")
    sessions = {0: Session.pair(*keys, listener=True), 1: Session.pair(*other, listener=False)}
    pgs = _gloo_pair()
    errors = {}

    def run(rank):
        try:
            probe(pgs[rank], sessions[rank], rank, "cpu", time.monotonic() + 10, "peer")
        except ProtocolError as e:
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert set(errors) == (set() if same_session else {0, 1}), errors


# ------------------------------------------------------------------------ no reverse lookups
_NO_ANSWER = textwrap.dedent(
    """
    import socket, sys, time
    sys.path.insert(0, sys.argv[1])
    t0 = time.monotonic()
    try:
        socket.getnameinfo(("::ffff:127.0.0.1", 1, 0, 0), 0)
    except OSError:
        pass
    print("control", round(time.monotonic() - t0, 2), flush=True)
    import torch
    from connector.kvstore import KVBuffer, KVClient, KVServer
    buf = KVBuffer(1 << 20)
    secret = b"s" * 32
    with KVServer(buf, host="127.0.0.1", secret=secret) as srv:
        for i in range(3):
            buf.put(f"k{i}", {"x": torch.arange(3)})
            t0 = time.monotonic()
            with KVClient("127.0.0.1", srv.port, secret=secret, timeout_s=20) as c:
                c.get(f"k{i}")
            print("connect", round(time.monotonic() - t0, 2), flush=True)
    """
)


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_connections_make_no_reverse_dns_lookup(tmp_path):
    """Under a resolver that never answers (a private mount namespace whose resolv.conf names
    a UDP socket of this test that reads queries and answers none), a reverse lookup stalls for
    seconds (the control, measured first), while gloo connections with authentication stay
    fast."""
    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        dns.bind(("127.0.0.1", 53))
    except OSError as e:
        pytest.skip(f"cannot listen on 127.0.0.1:53 for the silent resolver: {e}")
    dns.settimeout(0.2)
    stop = threading.Event()

    def swallow():
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                dns.recv(4096)

    swallower = threading.Thread(target=swallow, daemon=True)
    swallower.start()
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.1\noptions timeout:3 attempts:1\n")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    script = tmp_path / "no_answer.py"
    script.write_text(_NO_ANSWER)
    shell = (
        f"mount --bind {resolv} /etc/resolv.conf && mount --bind {hosts} /etc/hosts && "
        f"exec {sys.executable} {script} {ROOT}"
    )
    cmd = ["unshare", "-rm", "--propagation", "private", "sh", "-c", shell]
    probe_ns = subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False)
    if probe_ns.returncode != 0:
        pytest.skip(f"this machine allows no mount namespace: {probe_ns.stderr.decode()[:200]}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, check=False)
    finally:
        stop.set()
        swallower.join(5)
        dns.close()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert float(lines["control"]) >= 2.5, proc.stdout  # the resolver really never answers
    connects = [
        float(v) for k, v in (ln.split() for ln in proc.stdout.splitlines()) if k == "connect"
    ]
    assert len(connects) == 3 and max(connects) < 2.0, proc.stdout
