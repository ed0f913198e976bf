"""KVServer: a producer in another process over gloo, deliveries and their accounting, parts,
killed consumers, closing, and hostile bytes on the wire."""

import random
import socket
import threading
import time

import pytest
import torch
from support.kvstore import (
    accounted,
    closed_by_server,
    hello,
    no_big_alloc,  # noqa: F401 (a fixture)
    raw_connection,
    read_frame,
)
from support.transport import (
    Child,
    assert_bits_equal,
    assert_entry_equal,
    big_tensor,
    make_entry,
    settled_stat,
)

from connector.kvstore import (
    BufferFullError,
    ConnectionCaps,
    KeyMissError,
    KVBuffer,
    KVClient,
    KVServer,
    Part,
)
from connector.kvstore.protocol import Op
from connector.transport import PipeOptions, RemoteError
from connector.transport import frame as wire
from connector.transport.frame import APP_KIND_MIN, FrameLimits, Kind, TensorSpec, encode_header


def _t(nbytes: int) -> dict:
    return {"x": torch.zeros(nbytes, dtype=torch.uint8)}


# -------------------------------------------------------------------- two processes over gloo
N_ENTRIES = 1000


@pytest.fixture(scope="module")
def producer():
    # k0 .. k999 for the loads, k1000 for the check that a connection survives misses
    child = Child("producer", "--n", str(N_ENTRIES + 1))
    try:
        yield child, child.ready_port(60)
    finally:
        child.stop()


@pytest.mark.timeout(120)
def test_many_keys_fetched_out_of_order_bit_exact(producer):
    child, port = producer
    keys = list(range(700))
    random.Random(0).shuffle(keys)
    with KVClient("127.0.0.1", port, timeout_s=20) as client:
        for i in keys:
            got, meta = client.get(f"k{i}")
            want, want_meta = make_entry(i)
            assert meta == want_meta
            assert_entry_equal(got, want, f"k{i}")
        s = client.stats()
    assert (s["hits"], s["misses"], s["connects"]) == (700, 0, 1)
    assert settled_stat(child, "claimed", 700) >= 700
    ps = child.stats()
    assert ps["hits"] >= 700 and accounted(ps)


@pytest.mark.timeout(120)
def test_threads_get_across_processes_and_put_in_process_concurrently(producer):
    """Threads, two sharing a client and two with their own, load the child's entries while they
    put fresh ones into a buffer of this process and load those back through its server."""
    child, port = producer
    local = KVBuffer(64 << 20)
    server = KVServer(local)

    def clients(port):
        shared = KVClient("127.0.0.1", port, timeout_s=30)
        return [shared, shared, *(KVClient("127.0.0.1", port, timeout_s=30) for _ in range(2))]

    remote, nearby = clients(port), clients(server.port)
    errors = []

    def worker(w):
        try:
            for i in range(700 + w, N_ENTRIES, len(remote)):
                got, meta = remote[w].get(f"k{i}")
                assert_entry_equal(got, make_entry(i)[0], f"k{i}")
                mine = {"v": torch.full((3, i), float(w)), "e": torch.empty(0)}
                local.put(f"t{w}-{i}", mine, {"w": w})
                back, m = nearby[w].get(f"t{w}-{i}")
                assert m == {"w": w}
                assert_entry_equal(back, mine, f"t{w}-{i}")
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(len(remote))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(100)
    finally:
        for c in {id(c): c for c in remote + nearby}.values():
            c.close()
        server.close()
    assert not errors, errors[:3]
    assert accounted(child.stats()) and accounted(local.stats())


@pytest.mark.timeout(60)
def test_missing_key_is_a_fast_miss_naming_peer_and_key(producer):
    child, port = producer
    with KVClient("127.0.0.1", port, timeout_s=20) as client:
        client.discard("warm")  # connects first: a fresh gloo rendezvous is not what is timed
        t0 = time.monotonic()
        with pytest.raises(KeyMissError, match="never put") as ei:
            client.get("never-put")
        assert time.monotonic() - t0 < 1
        assert ei.value.key == "never-put" and ei.value.peer == f"127.0.0.1:{port}"
        t0 = time.monotonic()
        with pytest.raises(KeyMissError, match=r"not put within wait_s=0\.3"):
            client.get("never-put-2", wait_s=0.3)
        assert 0.25 < time.monotonic() - t0 < 2
        with pytest.raises(ValueError, match="wait_s: expected < timeout_s"):
            client.get("x", timeout_s=1, wait_s=2)
        # the connection survived the misses
        got, _ = client.get(f"k{N_ENTRIES}")
        assert_entry_equal(got, make_entry(N_ENTRIES)[0])
        assert client.stats()["connects"] == 1


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_entry_of_256_mib():
    child = Child("producer", "--big-mib", "256")
    try:
        port = child.ready_port(60)
        with KVClient("127.0.0.1", port, timeout_s=60) as client:
            got, meta = client.get("big")
        assert meta == {"mib": 256}
        assert_bits_equal(got["big"], big_tensor(256), "big")
    finally:
        child.kill()


# ---------------------------------------------------------------------------- in process
@pytest.mark.timeout(60)
def test_a_full_buffer_refuses_until_a_consumer_claims_an_entry():
    """full_policy "error": the fourth put is refused at once; a load over the wire claims an
    entry (once the server's sender is done), which makes room for it."""
    buf = KVBuffer(1 << 20, full_policy="error")
    for j in range(3):
        buf.put(f"p{j}", _t(300 << 10))
    with pytest.raises(BufferFullError, match="buffer full") as ei:
        buf.put("p3", _t(300 << 10))
    assert ei.value.key == "p3"
    srv = KVServer(buf)
    try:
        with KVClient("127.0.0.1", srv.port, timeout_s=20) as client:
            client.get("p0")
        assert settled_stat(buf, "claimed", 1) == 1  # once the server's sender is done
        buf.put("p3", _t(300 << 10))
    finally:
        srv.close()
    s = buf.stats()
    assert (s["puts"], s["full_errors"], s["entries"], s["claimed"]) == (4, 1, 3, 1)
    assert accounted(s)


@pytest.mark.timeout(60)
def test_entry_a_consumer_cannot_receive_is_refused_and_kept():
    """A consumer announcing stricter limits (rank <= 2) gets an error for a 3-D entry before
    anything is sent: its connection stays up, and the producer counts no delivery (it used to
    send the entry, break the consumer's pipe and claim the entry as delivered)."""
    buf = KVBuffer(1 << 20)
    cube = torch.arange(24.0).reshape(2, 3, 4)
    buf.put("k", {"x": cube})
    srv = KVServer(buf)
    try:
        with KVClient(
            "127.0.0.1", srv.port, timeout_s=20, options=PipeOptions(limits=FrameLimits(max_ndim=2))
        ) as c:
            with pytest.raises(RemoteError, match=r"expected ndim <= 2, got 3"):
                c.get("k")
            buf.put("flat", {"y": torch.ones(3)})  # what this consumer can receive it gets
            assert torch.equal(c.get("flat")[0]["y"], torch.ones(3))
            assert c.stats()["connects"] == 1
        assert settled_stat(buf, "claimed", 1) == 1  # "flat", once the server's sender is done
        s = buf.stats()
        assert (s["entries"], s["claimed"], s["failed_deliveries"]) == (1, 1, 1)
        with KVClient("127.0.0.1", srv.port, timeout_s=20) as c:
            assert torch.equal(c.get("k")[0]["x"], cube)
    finally:
        srv.close()


class _CountingBuffer(KVBuffer):
    """Sets ``all_out`` once ``n`` deliveries have started."""

    def __init__(self, n, *a, **kw):
        super().__init__(*a, **kw)
        self.n = n
        self.all_out = threading.Event()

    def checkout(self, key, **kw):
        lease = super().checkout(key, **kw)
        self.n -= 1
        if self.n == 0:
            self.all_out.set()
        return lease


@pytest.mark.timeout(60)
def test_server_close_shares_one_deadline_among_stalled_consumers():
    """Three consumers stopped reading a 32 MiB reply: close(timeout_s=1) takes about 1 s, not
    about 1 s per consumer."""
    buf = _CountingBuffer(3, 1 << 30)
    keys = [f"big{j}" for j in range(3)]
    for key in keys:
        buf.put(key, {"x": torch.zeros(32 << 20, dtype=torch.uint8)})
    srv = KVServer(buf)
    socks = []
    try:
        for key in keys:
            s = raw_connection(srv)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            socks.append(s)
            hello(s)
            s.send_frame(encode_header(Op.GET, key, {"wait_ms": 0}))  # never reads the reply
        assert buf.all_out.wait(10)
        t0 = time.monotonic()
        srv.close(timeout_s=1.0)
        took = time.monotonic() - t0
        assert took < 3.0, f"close took {took:.2f} s"  # 1 s, plus joins of 0.1 s each
    finally:
        for s in socks:
            s.close()
        srv.close()
    assert all(key in buf for key in keys)
    assert settled_stat(buf, "failed_deliveries", 3) == 3


class _SignalingBuffer(KVBuffer):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.checked_out = threading.Event()

    def checkout(self, key, **kw):
        lease = super().checkout(key, **kw)
        if key == "big":
            self.checked_out.set()
        return lease


@pytest.mark.timeout(120)
def test_consumer_killed_producer_keeps_serving_and_keeps_the_entry():
    buf = _SignalingBuffer(2 << 30)
    buf.put("big", {"big": big_tensor(512)})
    for i in range(5):
        buf.put(f"k{i}", *make_entry(i))
    server = KVServer(buf)
    victim = Child("consumer", "--port", str(server.port), "--key", "big")
    other = KVClient("127.0.0.1", server.port, timeout_s=30)
    try:
        victim.wait_line("READY", 60)
        assert buf.checked_out.wait(30)
        time.sleep(0.05)
        victim.proc.kill()
        for i in range(5):  # another consumer is not disturbed
            got, _ = other.get(f"k{i}")
            assert_entry_equal(got, make_entry(i)[0])
        assert settled_stat(buf, "pinned", 0, timeout_s=30) == 0
        assert settled_stat(server, "peer_errors", 1, timeout_s=10) >= 1  # the handler's count
        s = server.stats()
        assert s["failed_deliveries"] == 1 and s["peer_errors"] >= 1, s
        assert "big" in buf  # the failed delivery did not lose the entry: load it now
        got, _ = other.get("big", timeout_s=60)
        assert_bits_equal(got["big"], big_tensor(512), "big")
        assert accounted(buf.stats())
    finally:
        victim.kill()
        other.close()
        server.close()


@pytest.mark.timeout(30)
def test_too_many_connections_are_refused_cleanly():
    buf = KVBuffer(1 << 20)
    srv = KVServer(buf, caps=ConnectionCaps(max_connections=1))
    try:
        with KVClient("127.0.0.1", srv.port, timeout_s=5) as a:
            buf.put("k", {"x": torch.ones(1)})
            a.get("k")
            b = KVClient("127.0.0.1", srv.port, timeout_s=5, transport="socket")
            with pytest.raises(RemoteError, match="too many connections"):
                b.get("k2")
            b.close()
        assert srv.stats()["rejected_connections"] == 1
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_parts_of_an_entry_are_claimed_once_they_cover_the_dim():
    """Consumer ranks holding some of a producer rank's heads load only those (a Part of the KV
    tensor's head dim); the entry goes once the parts cover every head, and a bad part is refused
    with the entry kept."""
    buf = KVBuffer(1 << 20)
    kv = torch.arange(2 * 3 * 4 * 2, dtype=torch.int16).view(2, 3, 4, 2)  # heads: dim 2
    buf.put("t", {"kv": kv, "cu": torch.tensor([0, 3])})
    srv = KVServer(buf)
    try:
        with KVClient("127.0.0.1", srv.port, timeout_s=10) as client:
            with pytest.raises(RemoteError, match="has no dim 2 range"):
                client.get("t", part=Part("kv", 2, 3, 5))
            first, _ = client.get("t", part=Part("kv", 2, 0, 2))
            assert torch.equal(first["kv"], kv[:, :, 0:2]) and torch.equal(
                first["cu"], kv.new_tensor([0, 3]).long()
            )
            assert buf.stats()["entries"] == 1  # heads 2 and 3 not delivered yet
            second, _ = client.get("t", part=Part("kv", 2, 2, 4))
            assert torch.equal(second["kv"], kv[:, :, 2:4])
            # claimed by the sender thread once the last byte left, maybe after the reply arrived
            assert settled_stat(buf, "claimed", 1) == 1
            with pytest.raises(KeyMissError, match="claimed"):
                client.get("t")
        s = buf.stats()
        assert (s["part_deliveries"], s["claimed"], s["failed_deliveries"]) == (2, 1, 1)
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_parts_are_delivered_side_by_side():
    """Two consumer ranks load their sides of one entry at the same time: a part being sent
    does not make the entry look claimed to the other (a whole delivery would)."""
    buf = KVBuffer(1 << 24)
    kv = torch.arange(4 * 64 * 1024, dtype=torch.int16).view(4, 64, 1024)  # heads: dim 0
    buf.put("t", {"kv": kv})
    lease = buf.checkout("t", part=Part("kv", 0, 0, 2))  # rank 0's part is on its way
    srv = KVServer(buf)
    try:
        with KVClient("127.0.0.1", srv.port, timeout_s=10) as client:
            got, _ = client.get("t", part=Part("kv", 0, 2, 4))  # rank 1's, meanwhile
            assert torch.equal(got["kv"], kv[2:4])
            assert settled_stat(buf, "part_deliveries", 1) == 1  # the server's check-in of it
            buf.checkin(lease, delivered=True)
            with pytest.raises(KeyMissError, match="claimed"):
                client.get("t", part=Part("kv", 0, 0, 2))
        assert buf.stats()["claimed"] == 1
        whole = KVBuffer(1 << 20)
        whole.put("w", {"kv": torch.ones(4)})
        pinned = whole.checkout("w")  # a whole delivery under way: parts must wait their turn
        with pytest.raises(KeyMissError, match="being delivered"):
            whole.checkout("w", part=Part("kv", 0, 0, 2))
        whole.checkin(pinned, delivered=True)
    finally:
        srv.close()


# -------------------------------------------------------------------------- hostile wire input
@pytest.fixture
def server():
    buf = KVBuffer(64 << 20)
    srv = KVServer(
        buf, options=PipeOptions(limits=buf.limits, frame_timeout_s=0.5), connect_timeout_s=2
    )
    try:
        yield srv
    finally:
        srv.close()


def _still_serves(srv) -> None:
    srv.buffer.put("probe", {"x": torch.arange(5)})
    with KVClient("127.0.0.1", srv.port, timeout_s=10) as c:
        got, _ = c.get("probe")
    assert torch.equal(got["x"], torch.arange(5))


@pytest.mark.timeout(30)
def test_garbage_instead_of_hello_is_rejected(server):
    s = raw_connection(server)
    s.sendall(random.Random(1).randbytes(4096))
    assert closed_by_server(s)
    s.close()
    _still_serves(server)
    assert settled_stat(server, "handshake_errors", 1) == 1


@pytest.mark.timeout(30)
def test_garbage_after_handshake_is_rejected(server):
    s = raw_connection(server)
    hello(s)
    s.sendall(b"GET /index.html HTTP/1.1\r\n\r\n" * 10)
    assert closed_by_server(s)
    s.close()
    _still_serves(server)
    assert server.stats()["protocol_errors"] == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kind", "error"),
    [(Op.DATA, "unexpected DATA"), (APP_KIND_MIN + 5, f"unexpected kind {APP_KIND_MIN + 5}")],
    ids=["a-reply-kind", "the-code-PUT-had"],
)
def test_a_request_of_another_kind_gets_an_error_and_its_connection_closed(server, kind, error):
    """The server answers GET and DISCARD only: nothing on the wire puts or probes entries."""
    s = raw_connection(server)
    hello(s)
    s.send_frame(encode_header(kind, "planted", {}))
    reply = read_frame(s)
    assert reply.kind == Kind.ERROR and reply.meta["error"] == error
    assert closed_by_server(s)
    s.close()
    _still_serves(server)
    assert "planted" not in server.buffer and server.stats()["protocol_errors"] == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "spec",
    [
        TensorSpec("x", 6, (1 << 40,), 1 << 40),  # a 1 TiB tensor
        TensorSpec("x", 250, (4,), 4),  # unknown dtype code
        TensorSpec("x", 1, (4,), 999),  # byte count disagrees with the shape
        TensorSpec("x", 6, (0, 1 << 40, 1 << 40), 0),  # empty, but its strides overflow torch's
    ],
    ids=["2^40-bytes", "unknown-dtype", "bad-nbytes", "empty-with-huge-dims"],
)
def test_hostile_tensor_header_rejected_without_allocation(server, no_big_alloc, spec):  # noqa: F811
    s = raw_connection(server)
    hello(s)
    s.send_frame(encode_header(Op.GET, "evil", {}, [spec], wire.FLAG_INLINE))
    assert closed_by_server(s)
    s.close()
    assert no_big_alloc == []
    assert "evil" not in server.buffer
    _still_serves(server)
    assert server.stats()["protocol_errors"] == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("op", [Op.GET, Op.DISCARD])
def test_a_request_announcing_a_payload_is_refused_before_allocation(server, no_big_alloc, op):  # noqa: F811
    """An authenticated peer's request that announces 1 MiB inline (within every frame limit):
    requests carry no payload, so the header is refused before a byte is allocated."""
    s = raw_connection(server)
    hello(s)
    spec = TensorSpec("x", 6, (1 << 20,), 1 << 20)
    s.send_frame(encode_header(op, "bloat", {}, [spec], wire.FLAG_INLINE))
    assert closed_by_server(s)
    s.close()
    assert (1 << 20) not in no_big_alloc, no_big_alloc
    _still_serves(server)
    assert settled_stat(server, "protocol_errors", 1) == 1


@pytest.mark.timeout(30)
def test_deeply_nested_meta_is_a_protocol_error(server):
    """60000 '[' in the meta made json raise RecursionError, which killed the reader thread: the
    connection then stayed open and its slot taken for good."""
    s = raw_connection(server)
    hello(s)
    s.send_frame(encode_header(Op.GET, "k", b"[" * 60000))
    assert closed_by_server(s)
    s.close()
    _still_serves(server)
    assert server.stats()["protocol_errors"] == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("then", ["close", "stall"])
def test_truncated_payload_rejected(server, no_big_alloc, then):  # noqa: F811
    s = raw_connection(server)
    hello(s)
    spec = TensorSpec("x", 6, (4096,), 4096)
    s.send_frame(encode_header(Op.GET, "cut", {}, [spec], wire.FLAG_INLINE))
    s.sendall(b"\x01" * 100)
    if then == "close":
        s.close()
    else:  # keeps the socket open: the server's frame deadline (0.5 s + size) must fire
        t0 = time.monotonic()
        assert closed_by_server(s, 10)
        assert time.monotonic() - t0 < 3
        s.close()
    _still_serves(server)
    assert "cut" not in server.buffer
    assert settled_stat(server, "open_connections", 0) == 0  # both connections were handled
    # a request carries no payload: its header was refused before the bytes were allocated
    assert 4096 not in no_big_alloc, no_big_alloc
    assert settled_stat(server, "protocol_errors", 1) == 1


@pytest.mark.timeout(30)
def test_a_legit_raw_get_works(server):
    payload = bytes(range(256)) * 4
    x = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    server.buffer.put("raw", {"x": x}, {"n": 1})
    s = raw_connection(server)
    hello(s)
    s.send_frame(encode_header(Op.GET, "raw", {"wait_ms": 0}))
    reply = read_frame(s)
    assert reply.kind == Op.DATA and reply.meta == {"n": 1} and reply.inline
    assert [(t.name, t.shape, t.nbytes) for t in reply.specs] == [("x", (1024,), 1024)]
    assert s.read_payload(1024) == payload
    s.close()
    assert settled_stat(server.buffer, "claimed", 1) == 1
