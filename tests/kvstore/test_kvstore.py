"""KV buffer, server and client: lookups, capacity policies, TTL, prefix matching, two real
processes over gloo, killed peers, and hostile bytes on the wire."""

import random
import socket
import struct
import threading
import time

import pytest
import torch
from support.transport import (
    STORE_REQUESTS,
    Child,
    assert_bits_equal,
    assert_entry_equal,
    big_tensor,
    make_entry,
    raw_authenticate,
    raw_listener_authenticate,
    recv_exact,
    settled_stat,
    waited_s,
)
from support.vllm_fixtures import captured_log

import connector.kvstore.store as buffer_mod
import connector.transport.receiving as pipe_mod
from connector.kvstore.protocol import Op
from connector.kvstore.store import (
    MAX_PREFIX_TOKENS,
    BufferFullError,
    KeyMissError,
    KVBuffer,
    KVClient,
    PeerDeadError,
    PipeClosedError,
    ProtocolError,
    RemoteError,
    TransferError,
    TransferTimeout,
    block_hashes,
)
from connector.transport import connect_pipe
from connector.transport import frame as wire
from connector.transport.frame import FrameLimits, Kind, TensorSpec, encode_header
from connector.transport.options import PipeOptions


def _accounted(s: dict) -> bool:
    """Nothing vanished: every put is held or was claimed, discarded, evicted or expired."""
    return (
        s["puts"] == s["entries"] + s["claimed"] + s["discards"] + s["evictions"] + s["expirations"]
    )


def _t(nbytes: int) -> dict:
    return {"x": torch.zeros(nbytes, dtype=torch.uint8)}


# ------------------------------------------------------------------------------- KVBuffer alone
@pytest.mark.timeout(30)
def test_put_take_discard_and_miss_reasons():
    buf = KVBuffer(1 << 20)
    tensors, meta = make_entry(3)
    buf.put("a", tensors, meta)
    got, got_meta = buf.take("a")
    assert_entry_equal(got, tensors) and got_meta == meta
    with pytest.raises(KeyMissError, match="claimed") as ei:
        buf.take("a")
    assert ei.value.reason.startswith("claimed") and ei.value.key == "a"
    buf.put("b", _t(10))
    assert buf.discard("b") and not buf.discard("b")
    with pytest.raises(KeyMissError, match="discarded"):
        buf.take("b")
    with pytest.raises(KeyMissError, match="never put"):
        buf.take("zzz")
    s = buf.stats()
    assert (s["hits"], s["misses"], s["claimed"], s["discards"], s["entries"]) == (1, 3, 1, 1, 0)
    assert _accounted(s)


@pytest.mark.timeout(30)
def test_bad_inputs_say_expected_and_given():
    buf = KVBuffer(1000)
    buf.put("a", _t(10))
    with pytest.raises(ValueError, match="already in the buffer"):
        buf.put("a", _t(10))
    with pytest.raises(ValueError, match=r"can never fit, capacity_bytes=1000"):
        buf.put("huge", _t(1001))
    with pytest.raises(TypeError, match=r"expected dict\[str, Tensor\], got list"):
        buf.put("c", [torch.ones(1)])
    with pytest.raises(TypeError, match=r"tensors\['x'\]: expected a Tensor, got int"):
        buf.put("c", {"x": 3})
    with pytest.raises(TypeError, match=r"meta\['m'\]"):
        buf.put("c", _t(1), {"m": [1]})
    with pytest.raises(TypeError, match="key: expected str, got int"):
        buf.put(5, _t(1))
    with pytest.raises(ValueError, match=r"key: expected 1\.\.1024"):
        buf.put("", _t(1))
    with pytest.raises(ValueError, match="full_policy: expected one of"):
        KVBuffer(10, full_policy="drop")
    with pytest.raises(ValueError, match="ttl_s: expected a positive number"):
        KVBuffer(10, ttl_s=0)
    with pytest.raises(TypeError, match="token_ids"):
        buf.match_prefix("abc")


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_put_refuses_entries_no_consumer_could_receive():
    """put checks the DATA reply an entry becomes against the wire limits (a 9-D entry used to be
    stored, then break every consumer's pipe, and count as delivered)."""
    buf = KVBuffer(1 << 20)
    with pytest.raises(ValueError, match=r"tensor 'x': expected ndim <= 8, got 9"):
        buf.put("k", {"x": torch.zeros([1] * 9)})
    with pytest.raises(ValueError, match=r"name: expected 1\.\.256 UTF-8 bytes, got 300"):
        buf.put("k", {"n" * 300: torch.zeros(2)})
    with pytest.raises(TypeError, match="cannot travel on the wire"):
        buf.put("k", {"x": torch.zeros(2, dtype=torch.complex32)})
    assert len(buf) == 0 and buf.stats()["puts"] == 0


@pytest.mark.timeout(30)
def test_put_waiting_for_room_wakes_when_an_entry_expires():
    """An expiring entry makes room: put waits until then, not until its own deadline."""
    buf = KVBuffer(100, ttl_s=1.0)  # long enough that "new" cannot expire before stats() too
    buf.put("old", _t(100))
    t0 = time.monotonic()
    buf.put("new", _t(100), timeout_s=10)
    assert time.monotonic() - t0 < 3
    s = buf.stats()
    assert s["expirations"] == 1 and "new" in buf and _accounted(s)


@pytest.mark.timeout(30)
def test_full_policy_error_refuses_at_once():
    buf = KVBuffer(1000, full_policy="error")
    buf.put("a", _t(600))
    t0 = time.monotonic()
    with pytest.raises(
        BufferFullError, match=r"600 of 1000 bytes used by 1 entries, entry needs 600"
    ):
        buf.put("b", _t(600))
    assert time.monotonic() - t0 < 0.5
    s = buf.stats()
    assert s["full_errors"] == 1 and s["entries"] == 1 and _accounted(s)


@pytest.mark.timeout(30)
def test_full_policy_wait_blocks_until_room_then_times_out():
    buf = KVBuffer(1000, full_policy="wait", put_timeout_s=5)
    buf.put("a", _t(600))
    done = threading.Event()
    t = threading.Thread(target=lambda: (buf.put("b", _t(600)), done.set()))
    t.start()
    assert not done.wait(0.2)  # blocked: no room
    buf.take("a")  # claiming frees room
    assert done.wait(5)
    t.join(5)
    t0 = time.monotonic()
    with pytest.raises(BufferFullError) as ei:
        buf.put("c", _t(600), timeout_s=0.3)
    assert 0.25 < time.monotonic() - t0 < 2 and ei.value.waited_s >= 0.25
    s = buf.stats()
    assert (s["full_errors"], s["timeouts"], s["entries"]) == (1, 1, 1)
    assert s["full_waits"] >= 1 and _accounted(s)


@pytest.mark.timeout(30)
def test_full_policy_evict_drops_oldest_unclaimed_with_warning(caplog):
    buf = KVBuffer(1000, full_policy="evict", put_timeout_s=0.3)
    for k in "abc":
        buf.put(k, _t(300))
    pinned = buf._checkout("a")  # "a" is being sent: must not be evicted
    with captured_log("vllm.tritonkv.kvstore") as records:
        buf.put("d", _t(300))
    assert "a" in buf and "b" not in buf and "d" in buf
    assert any("evicting unclaimed entry 'b'" in r.getMessage() for r in records)
    with pytest.raises(KeyMissError, match="evicted"):
        buf.take("b")
    buf._checkin(pinned, delivered=False)
    s = buf.stats()
    assert s["evictions"] == 1 and s["failed_deliveries"] == 1 and _accounted(s)
    # everything pinned: eviction impossible, falls back to a bounded wait
    pins = [buf._checkout(k) for k in ("a", "c", "d")]
    with pytest.raises(BufferFullError):
        buf.put("e", _t(300))
    for p in pins:
        buf._checkin(p, delivered=True)
    assert _accounted(buf.stats())


@pytest.mark.timeout(30)
def test_key_a_consumer_waits_for_is_not_evicted():
    buf = KVBuffer(1000, full_policy="evict")
    buf.put("x", _t(10))
    got = []
    t = threading.Thread(target=lambda: got.append(buf.take("later", wait_s=5)))
    t.start()
    time.sleep(0.1)
    buf.put("later", _t(500))
    t.join(5)
    assert got and got[0][0]["x"].numel() == 500


@pytest.mark.timeout(30)
def test_ttl_expires_unclaimed_entries(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(buffer_mod, "_now", lambda: clock[0])
    buf = KVBuffer(1000, ttl_s=0.2)
    buf.put("old", _t(10))
    clock[0] += 0.3
    buf.put("new", _t(10))
    s = buf.stats()
    assert (s["expirations"], s["entries"]) == (1, 1) and _accounted(s)
    with pytest.raises(KeyMissError, match=r"expired: unclaimed for 0.2 s"):
        buf.take("old")


@pytest.mark.timeout(30)
def test_take_waits_for_a_late_put():
    buf = KVBuffer(1000)
    threading.Timer(0.1, lambda: buf.put("late", _t(4))).start()
    got, _ = buf.take("late", wait_s=5)
    assert got["x"].numel() == 4
    t0 = time.monotonic()
    with pytest.raises(KeyMissError, match=r"not put within wait_s=0\.2"):
        buf.take("never", wait_s=0.2)
    assert 0.15 < time.monotonic() - t0 < 1


@pytest.mark.timeout(30)
def test_max_reads_zero_keeps_entry_for_every_reader():
    buf = KVBuffer(1000, max_reads=0)
    buf.put("shared", _t(4))
    for _ in range(5):
        buf.take("shared")
    buf.put("once", _t(4), max_reads=1)
    buf.take("once")
    assert "shared" in buf and "once" not in buf


@pytest.mark.timeout(30)
def test_match_prefix_longest_block_prefix():
    buf = KVBuffer(1 << 20, block_size=4)
    a = list(range(12))  # 3 blocks
    b = [*range(8), 100, 101, 102, 103, 7]  # shares 2 blocks with a, 1 own, 1 partial token
    buf.put("A", _t(4), token_ids=a, max_reads=0)
    buf.put("B", _t(4), token_ids=torch.tensor(b), max_reads=0)
    assert buf.match_prefix([*a, 5, 5]) == (12, "A")
    assert buf.match_prefix(b) == (12, "B")
    assert buf.match_prefix(list(range(6))) == (4, "B")  # most recent entry holding the prefix
    assert buf.match_prefix([9, 9, 9, 9, 1]) == (0, None)
    assert buf.match_prefix([0, 1, 2]) == (0, None)  # no full block
    buf.discard("B")
    assert buf.match_prefix(b) == (8, "A")
    assert buf.match_prefix(list(range(6))) == (4, "A")
    s = buf.stats()
    assert s["prefix_hits"] == 5 and s["prefix_misses"] == 2


@pytest.mark.timeout(60)
def test_match_prefix_caps_tokens_and_hashes_tensors_without_lists(monkeypatch):
    """A MATCH carried up to 4 GiB of token ids, which tolist() blew up several times over in
    server memory: at most MAX_PREFIX_TOKENS are taken, and a tensor is hashed in place."""
    buf = KVBuffer(1 << 20, block_size=4)
    buf.put("A", _t(4), token_ids=torch.arange(12), max_reads=0)
    too_many = torch.zeros(MAX_PREFIX_TOKENS + 1, dtype=torch.int64)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("tolist() called"))
        assert buf.match_prefix(torch.arange(14)) == (12, "A")
        with pytest.raises(ValueError, match=rf"at most {MAX_PREFIX_TOKENS} tokens .*got "):
            buf.match_prefix(too_many)
    srv = buf.serve(allow=STORE_REQUESTS)
    try:
        with KVClient("127.0.0.1", srv.port, timeout_s=20) as client:
            with pytest.raises(ValueError, match="at most"):  # refused before sending
                client.match_prefix(too_many)
            assert client.match_prefix(list(range(14))) == (12, "A")
        pipe = connect_pipe("127.0.0.1", srv.port)  # a raw MATCH: the server refuses it too
        try:
            pipe.send("", {"token_ids": too_many}, kind=Op.MATCH)
            reply = pipe.recv(20)
            assert reply.kind == Kind.ERROR and "at most" in reply.meta["error"]
        finally:
            pipe.close()
    finally:
        srv.close()


def test_block_hashes_chain_depends_on_whole_prefix():
    h1 = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    h2 = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(h1) == 2 and h1[0] != h2[0] and h1[1] != h2[1]  # same 2nd block, other prefix
    assert block_hashes([1, 2, 3, 4, 5], 4) == h1[:1]


@pytest.mark.timeout(60)
def test_threads_put_take_discard_concurrently():
    buf = KVBuffer(64 << 10, full_policy="wait", put_timeout_s=10)
    errors = []

    def worker(w):
        try:
            for j in range(300):
                key = f"w{w}-{j}"
                buf.put(key, _t(100 + j % 50), {"j": j}, token_ids=[w, j, 0, 0] * 4)
                if j % 3 == 0:
                    assert buf.discard(key)
                else:
                    got, meta = buf.take(key)
                    assert meta == {"j": j} and got["x"].numel() == 100 + j % 50
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not errors, errors[:3]
    s = buf.stats()
    assert s["puts"] == 2400 and s["entries"] == 0 and s["bytes"] == 0 and _accounted(s)


# -------------------------------------------------------------------- two processes over gloo
N_ENTRIES = 1000


@pytest.fixture(scope="module")
def producer():
    child = Child("producer", "--n", str(N_ENTRIES))
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
    assert ps["hits"] >= 700 and _accounted(ps)


@pytest.mark.timeout(120)
def test_threads_get_and_put_concurrently_across_processes(producer):
    child, port = producer
    shared = KVClient("127.0.0.1", port, timeout_s=30)
    own = [KVClient("127.0.0.1", port, timeout_s=30) for _ in range(2)]
    clients = [shared, shared, *own]
    errors = []

    def worker(w, client):
        try:
            for i in range(700 + w, N_ENTRIES, len(clients)):
                got, meta = client.get(f"k{i}")
                assert_entry_equal(got, make_entry(i)[0], f"k{i}")
                mine = {"v": torch.full((3, i), float(w)), "e": torch.empty(0)}
                client.put(f"t{w}-{i}", mine, {"w": w})
                back, m = client.get(f"t{w}-{i}")
                assert m == {"w": w}
                assert_entry_equal(back, mine, f"t{w}-{i}")
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w, c)) for w, c in enumerate(clients)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(100)
    finally:
        for c in {id(c): c for c in clients}.values():
            c.close()
    assert not errors, errors[:3]
    assert _accounted(child.stats())


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
        client.put("after-miss", *make_entry(5))
        got, _ = client.get("after-miss")
        assert_entry_equal(got, make_entry(5)[0])
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


@pytest.mark.timeout(60)
def test_remote_buffer_full_is_reported_and_counted():
    child = Child("producer", "--capacity-mib", "1", "--policy", "error")
    try:
        port = child.ready_port(60)
        with KVClient("127.0.0.1", port, timeout_s=20) as client:
            for j in range(3):
                client.put(f"p{j}", _t(300 << 10))
            with pytest.raises(RemoteError, match="buffer full") as ei:
                client.put("p3", _t(300 << 10))
            assert ei.value.key == "p3"
            client.get("p0")  # the connection is fine; claiming frees room
            assert settled_stat(child, "claimed", 1) == 1  # once the child's sender is done
            client.put("p3", _t(300 << 10))
        s = child.stats()
        assert (s["puts"], s["full_errors"], s["entries"], s["claimed"]) == (4, 1, 3, 1)
        assert _accounted(s)
    finally:
        child.kill()


@pytest.mark.timeout(60)
def test_entry_a_consumer_cannot_receive_is_refused_and_kept():
    """A consumer announcing stricter limits (rank <= 2) gets an error for a 3-D entry before
    anything is sent: its connection stays up, and the producer counts no delivery (it used to
    send the entry, break the consumer's pipe and claim the entry as delivered)."""
    buf = KVBuffer(1 << 20)
    cube = torch.arange(24.0).reshape(2, 3, 4)
    buf.put("k", {"x": cube})
    srv = buf.serve(allow=STORE_REQUESTS)
    try:
        with KVClient(
            "127.0.0.1", srv.port, timeout_s=20, options=PipeOptions(limits=FrameLimits(max_ndim=2))
        ) as c:
            with pytest.raises(RemoteError, match=r"expected ndim <= 2, got 3"):
                c.get("k")
            c.put("flat", {"y": torch.ones(3)})
            assert c.stats()["connects"] == 1
        s = buf.stats()
        assert (s["entries"], s["claimed"], s["failed_deliveries"]) == (2, 0, 1)
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

    def _checkout(self, key, wait_s=0.0, part=False):
        e = super()._checkout(key, wait_s, part)
        self.n -= 1
        if self.n == 0:
            self.all_out.set()
        return e


@pytest.mark.timeout(60)
def test_server_close_shares_one_deadline_among_stalled_consumers():
    """Three consumers stopped reading a 32 MiB reply: close(timeout_s=1) takes about 1 s, not
    about 1 s per consumer."""
    buf = _CountingBuffer(3, 1 << 30, max_reads=0)
    buf.put("big", {"x": torch.zeros(32 << 20, dtype=torch.uint8)})
    srv = buf.serve()
    socks = []
    try:
        for _ in range(3):
            s = _raw(srv)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            socks.append(s)
            _hello(s)
            s.sendall(encode_header(Op.GET, "big", {"wait_ms": 0}))  # never reads the reply
        assert buf.all_out.wait(10)
        t0 = time.monotonic()
        srv.close(timeout_s=1.0)
        took = time.monotonic() - t0
        assert took < 3.0, f"close took {took:.2f} s"  # 1 s, plus joins of 0.1 s each
    finally:
        for s in socks:
            s.close()
        srv.close()
    assert "big" in buf and settled_stat(buf, "failed_deliveries", 3) == 3


@pytest.mark.timeout(30)
def test_client_close_interrupts_a_request_in_flight():
    """close() used to wait for the request lock, i.e. for another thread's request to end."""
    asked = threading.Event()
    lsock = _fake_server(lambda conn, req: asked.set())  # then silent for 3 s
    try:
        client = KVClient("127.0.0.1", lsock.getsockname()[1], transport="socket", timeout_s=20)
        result = []

        def get():
            try:
                client.get("k")
            except TransferError as e:
                result.append(e)

        t = threading.Thread(target=get)
        t.start()
        assert asked.wait(10)
        t0 = time.monotonic()
        client.close()
        t.join(10)
        assert time.monotonic() - t0 < 1.5
        assert len(result) == 1 and isinstance(result[0], PipeClosedError), result
        with pytest.raises(PipeClosedError, match="client is closed"):
            client.get("k")
    finally:
        lsock.close()


# ------------------------------------------------------------------------------------- faults
@pytest.mark.timeout(120)
def test_producer_killed_mid_transfer_consumer_raises_within_deadline():
    child = Child("producer", "--big-mib", "512", "--hook")
    try:
        port = child.ready_port(60)
        client = KVClient("127.0.0.1", port, timeout_s=20)
        result = {}

        def get():
            t0 = time.monotonic()
            try:
                client.get("big")
                result["ok"] = True
            except TransferError as e:
                result["err"] = e
            result["t"] = time.monotonic() - t0

        t = threading.Thread(target=get)
        t.start()
        child.wait_line("CHECKOUT big", 30)
        time.sleep(0.05)
        child.proc.kill()
        t.join(20 + 5)
        assert not t.is_alive(), "get hung after the producer died"
        assert "err" in result, result
        assert isinstance(result["err"], PeerDeadError), repr(result["err"])
        assert result["t"] < 20 + 5
        assert f"127.0.0.1:{port}" in str(result["err"]) and "'big'" in str(result["err"])
        # later calls fail fast too (reconnect refused)
        t0 = time.monotonic()
        with pytest.raises(PeerDeadError):
            client.get("big")
        assert time.monotonic() - t0 < 2
        client.close()
    finally:
        child.kill()


class _SignalingBuffer(KVBuffer):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.checked_out = threading.Event()

    def _checkout(self, key, wait_s=0.0, part=False):
        e = super()._checkout(key, wait_s, part)
        if key == "big":
            self.checked_out.set()
        return e


@pytest.mark.timeout(120)
def test_consumer_killed_producer_keeps_serving_and_keeps_the_entry():
    buf = _SignalingBuffer(2 << 30)
    buf.put("big", {"big": big_tensor(512)})
    for i in range(5):
        buf.put(f"k{i}", *make_entry(i))
    server = buf.serve()
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
        assert "big" in buf  # the failed delivery did not lose the entry: fetch it now
        got, _ = other.get("big", timeout_s=60)
        assert_bits_equal(got["big"], big_tensor(512), "big")
        assert _accounted(buf.stats())
    finally:
        victim.kill()
        other.close()
        server.close()


# -------------------------------------------------------------------------- hostile wire input
@pytest.fixture
def server():
    buf = KVBuffer(64 << 20)
    srv = buf.serve(
        options=PipeOptions(limits=buf.limits, frame_timeout_s=0.5),
        connect_timeout_s=2,
        allow=STORE_REQUESTS,
    )
    try:
        yield srv
    finally:
        srv.close()


def _raw(srv) -> socket.socket:
    """A raw connection to ``srv``, past authentication (the server has no secret)."""
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    s.settimeout(5)
    raw_authenticate(s)
    return s


def _read_frame(s) -> wire.Header | None:
    prefix = recv_exact(s, wire.PREFIX_SIZE)
    if len(prefix) < wire.PREFIX_SIZE:
        return None
    kind, flags, body_len = wire.decode_prefix(prefix)
    return wire.decode_body(kind, flags, recv_exact(s, body_len))


def _hello(s) -> None:
    s.sendall(encode_header(Kind.HELLO, "", {"proto": 1, "transport": "socket"}))
    ack = _read_frame(s)
    assert ack.kind == Kind.HELLO_ACK and ack.meta["transport"] == "socket"
    assert wire.limits_from_meta(ack.meta, wire.FrameLimits(max_ndim=1)) == wire.DEFAULT_LIMITS


def _closed_by_server(s, timeout_s=5.0) -> bool:
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


def _still_serves(srv) -> None:
    srv.buffer.put("probe", {"x": torch.arange(5)})
    with KVClient("127.0.0.1", srv.port, timeout_s=10) as c:
        got, _ = c.get("probe")
    assert torch.equal(got["x"], torch.arange(5))


@pytest.fixture
def no_big_alloc(monkeypatch):
    """Record every tensor allocation the pipe makes for received headers."""
    sizes = []
    real = pipe_mod._alloc

    def spy(spec, device):
        sizes.append(spec.nbytes)
        return real(spec, device)

    monkeypatch.setattr(pipe_mod, "_alloc", spy)
    return sizes


@pytest.mark.timeout(30)
def test_garbage_instead_of_hello_is_rejected(server):
    s = _raw(server)
    s.sendall(random.Random(1).randbytes(4096))
    assert _closed_by_server(s)
    s.close()
    _still_serves(server)
    assert settled_stat(server, "handshake_errors", 1) == 1


@pytest.mark.timeout(30)
def test_garbage_after_handshake_is_rejected(server):
    s = _raw(server)
    _hello(s)
    s.sendall(b"GET /index.html HTTP/1.1\r\n\r\n" * 10)
    assert _closed_by_server(s)
    s.close()
    _still_serves(server)
    assert server.stats()["protocol_errors"] == 1


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
def test_hostile_put_header_rejected_without_allocation(server, no_big_alloc, spec):
    s = _raw(server)
    _hello(s)
    s.sendall(encode_header(Op.PUT, "evil", {}, [spec], wire.FLAG_INLINE))
    assert _closed_by_server(s)
    s.close()
    assert no_big_alloc == []
    assert "evil" not in server.buffer
    _still_serves(server)
    assert server.stats()["protocol_errors"] == 1


@pytest.mark.timeout(30)
def test_deeply_nested_meta_is_a_protocol_error(server):
    """60000 '[' in the meta made json raise RecursionError, which killed the reader thread: the
    connection then stayed open and its slot taken for good."""
    s = _raw(server)
    _hello(s)
    s.sendall(encode_header(Op.GET, "k", b"[" * 60000))
    assert _closed_by_server(s)
    s.close()
    _still_serves(server)
    assert server.stats()["protocol_errors"] == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("then", ["close", "stall"])
def test_truncated_payload_rejected(server, no_big_alloc, then):
    s = _raw(server)
    _hello(s)
    spec = TensorSpec("x", 6, (4096,), 4096)
    s.sendall(encode_header(Op.PUT, "cut", {}, [spec], wire.FLAG_INLINE) + b"\x01" * 100)
    if then == "close":
        s.close()
    else:  # keeps the socket open: the server's frame deadline (0.5 s + size) must fire
        t0 = time.monotonic()
        assert _closed_by_server(s, 10)
        assert time.monotonic() - t0 < 3
        s.close()
    _still_serves(server)
    assert "cut" not in server.buffer
    # the allocation was the validated size, nothing more (_still_serves allocates small ones)
    assert 4096 in no_big_alloc and max(no_big_alloc) == 4096
    if then == "stall":
        assert server.stats()["protocol_errors"] == 1


@pytest.mark.timeout(30)
def test_a_legit_raw_put_then_get_works(server):
    s = _raw(server)
    _hello(s)
    payload = bytes(range(256)) * 4
    s.sendall(
        encode_header(Op.PUT, "raw", {"n": 1}, [TensorSpec("x", 6, (1024,), 1024)], 1) + payload
    )
    assert _read_frame(s).kind == Op.ACK
    s.sendall(encode_header(Op.GET, "raw", {"wait_ms": 0}))
    reply = _read_frame(s)
    assert reply.kind == Op.DATA and reply.meta == {"n": 1}
    data = b""
    while len(data) < 1024:
        data += s.recv(1024 - len(data))
    assert data == payload
    s.close()


def _fake_server(behaviour):
    """A raw listener that handshakes (socket transport) then runs ``behaviour(conn, get_frame)``."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = lsock.accept()
        conn.settimeout(10)
        try:
            assert raw_listener_authenticate(conn)
            hello = _read_frame(conn)
            assert hello.kind == Kind.HELLO
            conn.sendall(encode_header(Kind.HELLO_ACK, "", {"transport": "socket"}))
            behaviour(conn, _read_frame(conn))
            time.sleep(3)
        except Exception:
            pass
        finally:
            conn.close()

    threading.Thread(target=run, daemon=True).start()
    return lsock


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "reply",
    [
        lambda key: encode_header(Op.DATA, key, {}, [TensorSpec("x", 6, (1 << 40,), 1 << 40)]),
        lambda key: encode_header(Op.DATA, key, {}, [TensorSpec("x", 222, (2,), 2)]),
        lambda key: b"HTTP/1.1 200 OK\r\n\r\n",
        lambda key: encode_header(Op.DATA, "other-key", {}),
        lambda key: struct.pack("<4sBBHI", b"TKVT", 1, 4, 0, 1 << 31),
        # payload announced for a process group this socket-transport pipe does not have
        lambda key: encode_header(Op.DATA, key, {}, [TensorSpec("x", 6, (4,), 4)]),
    ],
    ids=["2^40-bytes", "unknown-dtype", "garbage", "wrong-key", "huge-body", "not-inline"],
)
def test_client_rejects_hostile_replies_fast(reply, no_big_alloc):
    lsock = _fake_server(lambda conn, req: conn.sendall(reply(req.key)))
    try:
        client = KVClient("127.0.0.1", lsock.getsockname()[1], transport="socket", timeout_s=20)
        t0 = time.monotonic()
        with pytest.raises(ProtocolError) as ei:
            client.get("mine")
        assert time.monotonic() - t0 < 3
        assert "mine" in str(ei.value) or "other-key" in str(ei.value)
        assert no_big_alloc == []
        client.close()
    finally:
        lsock.close()


@pytest.mark.timeout(30)
def test_client_times_out_on_a_silent_server():
    lsock = _fake_server(lambda conn, req: None)
    try:
        client = KVClient("127.0.0.1", lsock.getsockname()[1], transport="socket", timeout_s=20)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout) as ei:
            client.get("slow", timeout_s=0.5)
        assert 0.4 < time.monotonic() - t0 < 2
        text = str(ei.value)
        assert "'slow'" in text and "peer=127.0.0.1:" in text
        assert 0.5 <= waited_s(text) < 2
        assert client.stats()["timeouts"] == 1
        client.close()
    finally:
        lsock.close()


@pytest.mark.timeout(30)
def test_too_many_connections_are_refused_cleanly():
    buf = KVBuffer(1 << 20)
    srv = buf.serve(max_connections=1)
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
    """Consumer ranks holding some of a producer rank's heads pull only those (a Part of the KV
    tensor's head dim); the entry goes once the parts cover every head, and a bad part is refused
    with the entry kept."""
    from connector.kvstore.store import Part

    buf = KVBuffer(1 << 20)
    kv = torch.arange(2 * 3 * 4 * 2, dtype=torch.int16).view(2, 3, 4, 2)  # heads: dim 2
    buf.put("t", {"kv": kv, "cu": torch.tensor([0, 3])})
    srv = buf.serve()
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
    """Two consumer ranks pull their halves of one entry at the same time: a part being sent
    does not make the entry look claimed to the other (a whole delivery would)."""
    from connector.kvstore.store import Part

    buf = KVBuffer(1 << 24)
    kv = torch.arange(4 * 64 * 1024, dtype=torch.int16).view(4, 64, 1024)  # heads: dim 0
    buf.put("t", {"kv": kv})
    entry = buf._checkout("t", part=True)  # rank 0's part is on its way
    srv = buf.serve()
    try:
        with KVClient("127.0.0.1", srv.port, timeout_s=10) as client:
            got, _ = client.get("t", part=Part("kv", 0, 2, 4))  # rank 1's, meanwhile
            assert torch.equal(got["kv"], kv[2:4])
            assert settled_stat(buf, "part_deliveries", 1) == 1  # the server's check-in of it
            buf._checkin(entry, delivered=True, part=Part("kv", 0, 0, 2))
            with pytest.raises(KeyMissError, match="claimed"):
                client.get("t", part=Part("kv", 0, 0, 2))
        assert buf.stats()["claimed"] == 1
        whole = KVBuffer(1 << 20)
        whole.put("w", {"kv": torch.ones(4)})
        pinned = whole._checkout("w")  # a whole delivery under way: parts must wait their turn
        with pytest.raises(KeyMissError, match="being delivered"):
            whole._checkout("w", part=True)
        whole._checkin(pinned, delivered=True)
    finally:
        srv.close()
