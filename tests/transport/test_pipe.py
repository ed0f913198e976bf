"""Tensor pipe: ordered messages, deadlines, budget, dead peers, clean close.

In-process pairs (listener and connector in one process, gloo or inline socket) cover the logic
quickly; child processes (tests/support/transport.py) cover real peers, killed with SIGKILL.
"""

import contextlib
import os
import socket
import threading
import time

import pytest
import torch
from support.transport import (
    Child,
    assert_entry_equal,
    big_tensor,
    make_entry,
    pipe_pair,
    raw_authenticate,
    waited_s,
)

from connector.transport import (
    FrameLimits,
    Kind,
    PeerDeadError,
    PipeClosedError,
    PipeListener,
    PipeOptions,
    RemoteError,
    TransferError,
    TransferTimeout,
    connect_pipe,
    encode_header,
)
from connector.transport.buffers import RECV_POOL, RecvPool
from connector.transport.errors import classify_failure

TRANSPORTS = ("gloo", "socket")


@pytest.fixture
def child_pipe(request):
    """Listener here, echo child connected (transport from the test's parameter, default gloo)."""
    transport = getattr(request, "param", "gloo")
    listener = PipeListener(transport=transport)
    child = Child("pipe", "--port", str(listener.port), "--transport", transport)
    pipe = None
    try:
        pipe = listener.accept(timeout_s=60)
        child.wait_line("READY", 60)
        yield pipe, child
    finally:
        child.kill()
        if pipe is not None:
            pipe.close(timeout_s=2)
        listener.close()


# ------------------------------------------------------------------------------------ in process
@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_mixed_entries_arrive_bit_exact_and_in_order(transport):
    with pipe_pair(transport) as (server, client):
        ids = [*range(0, 200, 7), 24, 99, 199]  # inline, packed and single chunks
        for i in ids:
            tensors, meta = make_entry(i)
            client.send(f"k{i}", tensors, meta)
        for i in ids:
            m = server.recv(timeout_s=20)
            tensors, meta = make_entry(i)
            assert (m.kind, m.key, m.meta) == (Kind.MSG, f"k{i}", meta)
            assert_entry_equal(m.tensors, tensors, f"k{i}")
        client.flush(10)
        s = client.stats()
        assert s["msgs_sent"] == len(ids) and s["inflight_bytes"] == 0
        assert server.stats()["bytes_received"] == s["bytes_sent"] > 0


@pytest.mark.timeout(60)
def test_both_directions_and_non_contiguous_input():
    with pipe_pair("gloo") as (server, client):
        x = torch.arange(3 * 400_000, dtype=torch.float32).reshape(3, 400_000)
        client.send("t", {"xt": x.t(), "col": x[:, 5]})
        m = server.recv(timeout_s=20)
        assert torch.equal(m.tensors["xt"], x.t()) and torch.equal(m.tensors["col"], x[:, 5])
        server.send("back", m.tensors, {"n": 1})
        m2 = client.recv(timeout_s=20)
        assert m2.key == "back" and torch.equal(m2.tensors["xt"], x.t())


@pytest.mark.timeout(60)
def test_recv_into_out_tensors():
    with pipe_pair("gloo") as (server, client):
        a = torch.randn(300_000)
        b = torch.randn(10)
        client.send("k", {"a": a, "b": b, "c": torch.ones(3)})
        out = {"a": torch.empty(300_000), "b": torch.empty(10)}
        m = server.recv(timeout_s=20, out=out)
        assert m.tensors["a"].data_ptr() == out["a"].data_ptr()
        assert torch.equal(out["a"], a) and torch.equal(out["b"], b)
        client.send("k2", {"a": a})
        with pytest.raises(ValueError, match=r"out\['a'\]: expected a contiguous torch.float32"):
            server.recv(timeout_s=20, out={"a": torch.empty(5)})
        assert server.broken is not None  # a half-read message breaks the pipe
    with pipe_pair("gloo") as (server, client):  # gloo would be handed device memory
        client.send("k", {"a": torch.randn(300_000)})
        elsewhere = {"a": torch.empty(300_000, device="meta")}
        with pytest.raises(ValueError, match=r"on cpu \(recv's device\), got .* on meta"):
            server.recv(timeout_s=20, out=elsewhere)


@pytest.mark.timeout(60)
def test_inflight_budget_blocks_send_then_raises():
    with pipe_pair("gloo", max_inflight_bytes=1 << 20) as (server, client):
        big = torch.zeros(8 << 20, dtype=torch.uint8)  # nobody receives yet: stays in flight
        client.send("first", {"x": big})
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout) as ei:
            client.send("second", {"x": big}, timeout_s=0.5)
        assert 0.4 < time.monotonic() - t0 < 3
        assert "budget" in str(ei.value) and "'second'" in str(ei.value)
        assert "waited=" in str(ei.value) and "peer=" in str(ei.value)
        # nothing was queued: the pipe still works
        assert server.recv(timeout_s=20).key == "first"
        client.send("second", {"x": big})
        assert server.recv(timeout_s=20).key == "second"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_recv_timeout_names_peer_key_and_wait_and_breaks_pipe(transport):
    with pipe_pair(transport) as (server, client):
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout) as ei:
            client.recv(timeout_s=0.3, expect_key="req-9")
        assert time.monotonic() - t0 < 2
        text = str(ei.value)
        assert "req-9" in text and f"peer={client.peer}" in text
        assert 0.3 <= waited_s(text) < 2
        with pytest.raises(TransferTimeout, match="pipe is broken"):
            client.send("x")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_close_is_clean_on_both_sides_and_idempotent(transport):
    with pipe_pair(transport) as (server, client):
        client.send("last", {"x": torch.ones(100)})
        client.close()
        client.close()
        assert server.recv(timeout_s=10).key == "last"  # sent before the goodbye: delivered
        t0 = time.monotonic()
        with pytest.raises(PipeClosedError, match="peer closed the pipe"):
            server.recv(timeout_s=20)
        assert time.monotonic() - t0 < 2
        with pytest.raises(PipeClosedError):
            client.send("after-close")
        server.close()
        server.close()


@pytest.mark.timeout(60)
def test_close_with_unreceived_send_is_bounded_and_reported():
    """close() gives up on a send stuck in the process group; once that send fails, the sender
    thread ends and lets go of the payload (it used to wait for a BYE that close() had dropped)."""
    import gc
    import weakref

    with pipe_pair("gloo") as (server, client):
        done = []
        payload = torch.ones(1 << 20)
        payload_ref = weakref.ref(payload)
        client.send("never-received", {"x": payload}, on_done=done.append)
        del payload
        t0 = time.monotonic()
        client.close(timeout_s=0.5)
        assert time.monotonic() - t0 < 3
        deadline = time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done and isinstance(done[0], TransferError)
    sender = client.threads["send"]
    sender.join(10)  # the peer is gone now: the stuck send fails
    assert not sender.is_alive(), "sender thread outlived its pipe"
    gc.collect()
    assert payload_ref() is None, "the payload of a failed send is still held"


@pytest.mark.timeout(30)
def test_connect_refused_is_peer_dead_and_fast():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    t0 = time.monotonic()
    with pytest.raises(PeerDeadError, match=f"127.0.0.1:{port}"):
        connect_pipe("127.0.0.1", port, connect_timeout_s=5)
    assert time.monotonic() - t0 < 2


@pytest.mark.timeout(30)
def test_connect_to_silent_listener_times_out():
    s = socket.create_server(("127.0.0.1", 0))
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="auth challenge"):
            connect_pipe("127.0.0.1", s.getsockname()[1], connect_timeout_s=0.5)
        assert time.monotonic() - t0 < 2
    finally:
        s.close()


@pytest.mark.timeout(60)
def test_peer_gone_after_hello_does_not_hold_up_other_handshakes():
    """A peer that vanishes after HELLO leaves its rendezvous waiting until the listener's deadline
    (8 s); another client (4 s deadline) must connect meanwhile: each connection's rendezvous
    runs over its own socket (with a shared TCPStore client, it once waited behind the stray's)."""
    listener = PipeListener(transport="gloo", connect_timeout_s=8)
    accepted = []

    def accept():
        try:
            accepted.append(listener.accept(timeout_s=30))
        except TransferError as e:
            accepted.append(e)

    threads = [threading.Thread(target=accept) for _ in range(2)]
    for t in threads:
        t.start()
    stray = socket.create_connection(("127.0.0.1", listener.port))
    try:
        sealed = raw_authenticate(stray)
        sealed.send_frame(encode_header(Kind.HELLO, "", {"proto": 2, "transport": "gloo"}))
        assert sealed.read_frame().kind == Kind.HELLO_ACK  # the stray's rendezvous has begun
        # ... and it never joins
        client = connect_pipe("127.0.0.1", listener.port, transport="gloo", connect_timeout_s=4)
        client.close(timeout_s=1)
    finally:
        stray.close()
        for t in threads:
            t.join(30)
        for got in accepted:
            if not isinstance(got, TransferError):
                got.close(timeout_s=1)
        listener.close()
    assert sum(isinstance(got, TransferError) for got in accepted) == 1, accepted


@pytest.mark.timeout(30)
def test_listener_refuses_a_transport_it_does_not_speak():
    listener = PipeListener(transport="gloo", allow_socket=False)
    errors = []

    def accept():
        try:
            listener.accept(timeout_s=10)
        except TransferError as e:
            errors.append(e)

    t = threading.Thread(target=accept)
    t.start()
    try:
        with pytest.raises(RemoteError, match="transport"):
            connect_pipe("127.0.0.1", listener.port, transport="socket", connect_timeout_s=5)
    finally:
        t.join(10)
        listener.close()
    assert errors and "transport" in str(errors[0])


@pytest.mark.timeout(30)
def test_threads_are_named_by_pipe_and_role():
    with pipe_pair("socket") as (server, client):
        assert set(client.threads) == {"send", "read"}  # no process group: no waiter
        for role, t in client.threads.items():
            assert t.name == f"tkv-pipe[{client.peer}]-{role}" and t.is_alive()
        assert client.stats()["queued_frames"] == 0


FAILURES = {
    "timeout": (TimeoutError(), TransferTimeout, "data transfer timed out"),
    "gloo-timeout": (RuntimeError("Timed out waiting 5ms"), TransferTimeout, "timed out"),
    "reset": (ConnectionResetError("reset"), PeerDeadError, "peer connection broke"),
    "gloo-closed": (RuntimeError("Connection closed by peer [x]"), PeerDeadError, "broke"),
    "other": (ValueError("odd"), TransferError, "data transfer failed: ValueError: odd"),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_failures_of_the_group_or_socket_become_transfer_errors(case):
    exc, want, match = FAILURES[case]
    err = classify_failure(exc, peer="h:1", key="k", waited=0.5)
    assert type(err) is want and match in str(err)
    assert (err.peer, err.key, err.waited_s) == ("h:1", "k", 0.5)
    assert classify_failure(err, peer="other", key=None, waited=1.0) is err


@pytest.mark.timeout(30)
def test_user_errors_say_expected_and_given():
    with pipe_pair("socket") as (server, client):
        with pytest.raises(TypeError, match="expected dict"):
            client.send("k", [torch.ones(1)])
        with pytest.raises(TypeError, match=r"expected a torch\.Tensor, got list"):
            client.send("k", {"a": [1]})
        with pytest.raises(TypeError, match="meta"):
            client.send("k", None, {"a": object()})
        with pytest.raises(ValueError, match="positive number of seconds"):
            client.recv(timeout_s=-1)
        assert client.broken is None  # nothing was sent
    with pytest.raises(ValueError, match="transport"):
        connect_pipe("127.0.0.1", 1, transport="mpi")
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_inflight'"):
        PipeOptions(max_inflight=3)
    with pytest.raises(ValueError, match="max_inflight_bytes: expected a positive int, got 0"):
        PipeOptions(max_inflight_bytes=0)
    with pytest.raises(ValueError, match="max_payload_bytes: expected an int >= 0 or None"):
        PipeOptions(max_payload_bytes=-1)
    assert PipeOptions(max_payload_bytes=0).max_payload_bytes == 0
    with pytest.raises(ValueError, match="io_timeout_s: expected a positive number of seconds"):
        PipeOptions(io_timeout_s=0)
    with pytest.raises(TypeError, match="options: expected PipeOptions, got dict"):
        PipeListener(transport="socket", options={"max_inflight_bytes": 3})
    limits = FrameLimits(max_message_bytes=100)
    with (
        pipe_pair("socket", limits=limits) as (server, client),
        pytest.raises(ValueError, match=r"expected <= 100 payload bytes"),
    ):
        client.send("k", {"a": torch.ones(26)})


MIB = 1 << 20
TOO_BIG_FOR_THE_RECEIVER = {
    "rank-9": ({"x": torch.zeros([1] * 9)}, r"expected ndim <= 8, got 9"),
    "name-300-bytes": (
        {"n" * 300: torch.zeros(2)},
        r"name: expected 1\.\.256 UTF-8 bytes, got 300",
    ),
    "name-70000-bytes": (
        {"n" * 70000: torch.zeros(2)},
        r"expected 1\.\.256 UTF-8 bytes, got 70000",
    ),
    "5000-tensors": (
        {f"t{i}": torch.zeros(1) for i in range(5000)},
        r"expected <= 4096 tensors \(limits.max_tensors\), got 5000",
    ),
    "table-over-1-MiB": (
        {f"{i:0250d}": torch.zeros(1) for i in range(4000)},
        r"header body \(key, meta, tensor table\) <= 1048576 bytes",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(TOO_BIG_FOR_THE_RECEIVER))
def test_send_refuses_what_the_receiver_would_reject_and_the_pipe_survives(case):
    """Every wire limit is checked in send (it used to go out and break the pipe at the receiver,
    or raise struct.error for a name over 65535 bytes)."""
    tensors, match = TOO_BIG_FOR_THE_RECEIVER[case]
    with pipe_pair("socket") as (server, client):
        with pytest.raises(ValueError, match=match):
            client.send("k", tensors)
        assert client.broken is None
        client.send("next", {"x": torch.ones(3)})
        m = server.recv(timeout_s=10)
        assert m.key == "next" and torch.equal(m.tensors["x"], torch.ones(3))


@pytest.mark.timeout(60)
def test_send_applies_the_limits_the_peer_announced():
    """The handshake carries each end's limits: a sender checks what its peer accepts."""
    strict = FrameLimits(max_ndim=2)
    with pipe_pair("gloo", listener_kw={"options": PipeOptions(limits=strict)}) as (server, client):
        assert client.peer_limits == strict and server.peer_limits == FrameLimits()
        cube = torch.ones(2, 2, 2)
        with pytest.raises(ValueError, match=r"expected ndim <= 2, got 3"):
            client.send("k", {"x": cube})
        server.send("k", {"x": cube})  # the client accepts rank 3
        assert torch.equal(client.recv(timeout_s=10).tensors["x"], cube)
        client.send("k2", {"x": cube[0]})
        assert torch.equal(server.recv(timeout_s=10).tensors["x"], cube[0])


@pytest.mark.timeout(60)
def test_an_unexpected_reader_error_breaks_the_pipe_at_once(monkeypatch):
    """Whatever the reader thread raises (torch raised RuntimeError for a shape overflowing its
    strides) breaks the pipe and wakes recv; the reader used to die silently, recv to wait on.
    Here the allocation of an inline payload (from the receive pool: 4 MiB and more) raises."""

    def boom(*args):
        raise RuntimeError("boom")

    with pipe_pair("socket") as (server, client):
        monkeypatch.setattr(RECV_POOL, "alloc", boom)
        client.send("k", {"x": torch.ones(RECV_POOL.min_bytes, dtype=torch.uint8)})
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="RuntimeError: boom"):
            server.recv(timeout_s=20)
        assert time.monotonic() - t0 < 5


@pytest.mark.timeout(60)
def test_reader_queues_at_most_the_byte_budget():
    """Without recv calls the reader reads ahead, but holds at most ``max_queued_bytes`` of inline
    payload (always one message): a peer could park 64 frames of up to 4 GiB each."""
    x = torch.ones(16 * MIB, dtype=torch.uint8)  # beyond the budget and the socket buffers
    with pipe_pair("socket", max_queued_bytes=MIB) as (server, client):
        for i in range(3):
            client.send(f"m{i}", {"x": x})
        with pytest.raises(TransferTimeout):  # the receiver holds one, so the rest cannot leave
            client.flush(timeout_s=1.0)
        deadline = time.monotonic() + 10  # the reader may still be reading the first one in
        while not server.stats()["queued_frames"] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # room for a wrong second one to show
        s = server.stats()
        assert s["queued_frames"] == 1 and s["queued_bytes"] == x.numel()
        for i in range(3):
            m = server.recv(timeout_s=20)
            assert m.key == f"m{i}" and torch.equal(m.tensors["x"], x)
        assert server.stats()["queued_bytes"] == 0


class _PostSpy:
    """A process group whose ``recv`` reports when a receive is posted."""

    def __init__(self, pg):
        self._pg = pg
        self.posted = threading.Event()

    def recv(self, *args):
        work = self._pg.recv(*args)
        self.posted.set()
        return work

    def __getattr__(self, name):
        return getattr(self._pg, name)


class _HeldSend:
    """A process group whose ``send`` waits for ``release`` before it posts (a slow peer: the
    header has left, the payload has not)."""

    def __init__(self, pg):
        self._pg = pg
        self.release = threading.Event()

    def send(self, *args):
        self.release.wait(30)
        return self._pg.send(*args)

    def __getattr__(self, name):
        return getattr(self._pg, name)


class _RefusingRecv:
    """A process group whose ``recv`` fails as it is posted, as gloo's does once the peer's pair
    connection closed (seen when a sender was killed mid-transfer)."""

    def __init__(self, pg):
        self._pg = pg

    def recv(self, *args):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]")

    def __getattr__(self, name):
        return getattr(self._pg, name)


@pytest.mark.timeout(60)
def test_a_receive_refused_as_it_is_posted_is_a_peer_dead_error_and_breaks_the_pipe():
    """Before, the RuntimeError itself left recv: no transport error, no peer, no key."""
    with pipe_pair("gloo") as (server, client):
        server.process_group = _RefusingRecv(server.process_group)
        client.send("k", {"x": torch.ones(MIB, dtype=torch.uint8)})
        with pytest.raises(PeerDeadError, match="closed by peer") as ei:
            server.recv(timeout_s=10)
        assert "'k'" in str(ei.value) and f"peer={server.peer}" in str(ei.value)
        assert isinstance(server.broken, PeerDeadError)


@pytest.mark.timeout(60)
def test_nothing_lands_in_out_after_recv_gave_up_on_close():
    """close() from another thread ends a recv(out=...) whose payload is late. The gloo receive
    into the caller's tensor is cancelled before recv raises: the late payload must not land there
    (it did, up to recv's deadline, after recv had raised and close had returned)."""
    with pipe_pair("gloo") as (server, client):
        x = torch.full((MIB,), 7, dtype=torch.uint8)
        held = client.process_group = _HeldSend(client.process_group)
        client.send("k", {"x": x})  # the header leaves, the payload is held back
        spy = server.process_group = _PostSpy(server.process_group)
        out = torch.zeros_like(x)
        errors = []

        def receive():
            try:
                server.recv(timeout_s=30, out={"x": out})
            except TransferError as e:
                errors.append(e)

        t = threading.Thread(target=receive)
        t.start()
        assert spy.posted.wait(10)
        server.close(timeout_s=0.5)
        t.join(10)
        assert len(errors) == 1 and isinstance(errors[0], PipeClosedError), errors
        held.release.set()  # the late payload (its connection is gone)
        with contextlib.suppress(TransferError):
            client.flush(timeout_s=30)
        waiter = server.threads["wait"]
        waiter.join(10)  # it ends once the receive it waited for ended either way
        assert not waiter.is_alive()
        assert int(out.count_nonzero()) == 0, "the late payload landed in the caller's tensor"


@pytest.mark.timeout(60)
def test_close_inside_on_done_ends_every_thread():
    """on_done runs on the sender thread; close() there used to raise 'cannot join current
    thread' half-way, leaving the reader and waiter threads behind."""
    with pipe_pair("gloo") as (server, client):
        closed = threading.Event()
        errors = []

        def on_done(exc):
            try:
                client.close(timeout_s=1)
            except BaseException as e:
                errors.append(e)
            closed.set()

        client.send("k", {"x": torch.ones(4)}, on_done=on_done)
        assert closed.wait(10)
        assert errors == []
        assert set(client.threads) == {"send", "read", "wait"}
        for t in client.threads.values():
            t.join(10)
            assert not t.is_alive(), t.name
        assert server.recv(timeout_s=10).key == "k"
        with pytest.raises(PipeClosedError, match="peer closed the pipe"):  # its goodbye came
            server.recv(timeout_s=10)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_closed_listeners_release_their_descriptors():
    """close() releases the listener's socket and its wake pipe (with the TCPStore server it had,
    about 11 descriptors per listener stayed open for as long as the object lived)."""

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    PipeListener(transport="gloo").close()  # first-use allocations
    before = fds()
    kept = [PipeListener(transport="gloo") for _ in range(5)]
    ports = [listener.port for listener in kept]
    for listener in kept:
        listener.close()
    assert fds() - before < len(kept)
    for port in ports:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


# ------------------------------------------------------------------------------- real processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("child_pipe", TRANSPORTS, indirect=True)
def test_two_processes_echo(child_pipe):
    pipe, child = child_pipe
    ids = [0, 1, 2, 3, 4, 5, 24, 99]
    for i in ids:
        pipe.send(f"k{i}", *make_entry(i))
    for i in ids:
        m = pipe.recv(timeout_s=30)
        assert m.key == f"k{i}" and m.meta == make_entry(i)[1]
        assert_entry_equal(m.tensors, make_entry(i)[0], f"k{i}")


@pytest.mark.timeout(120)
def test_sender_killed_mid_transfer_raises_peer_dead_fast(child_pipe):
    pipe, child = child_pipe
    pipe.send("go", None, {"cmd": "big", "mib": 768})
    child.wait_line("SENDING", 60)
    deadline = time.monotonic() + 10
    while not pipe.stats()["queued_frames"] and time.monotonic() < deadline:  # header here
        time.sleep(0.001)  # (the payload under way)
    assert pipe.stats()["queued_frames"], "the big message's header never arrived"
    child.proc.kill()
    t0 = time.monotonic()
    with pytest.raises(PeerDeadError) as ei:
        pipe.recv(timeout_s=30)
    waited = time.monotonic() - t0
    assert waited < 30 + 5, waited
    assert waited < 10, f"dead peer noticed only after {waited:.1f} s"
    assert f"peer={pipe.peer}" in str(ei.value)
    with pytest.raises(PeerDeadError):  # the pipe stays broken
        pipe.send("x")


@pytest.mark.timeout(120)
def test_receiver_killed_sender_reports_on_next_call(child_pipe):
    pipe, child = child_pipe
    pipe.send("pause", None, {"cmd": "sleep"})
    child.wait_line("SLEEPING", 30)
    results = []
    pipe.send("big", {"x": big_tensor(64)}, on_done=results.append)
    time.sleep(0.2)
    child.proc.kill()
    t0 = time.monotonic()
    with pytest.raises((PeerDeadError, PipeClosedError)) as ei:
        for _ in range(100):  # the sender thread's error surfaces on a later call
            pipe.send("more", {"x": torch.ones(10)})
            time.sleep(0.05)
    assert time.monotonic() - t0 < 10
    assert "peer=" in str(ei.value)
    deadline = time.monotonic() + 10
    while not results and time.monotonic() < deadline:
        time.sleep(0.05)
    assert results and isinstance(results[0], TransferError), results


# ------------------------------------------------------------------------------------ NCCL path
@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL pipe needs two GPUs")
def test_nccl_two_gpus_round_trip():  # pragma: no cover - needs two GPUs
    torch.cuda.set_device(0)
    listener = PipeListener(transport="nccl", device="cuda:0")
    child = Child("pipe", "--port", str(listener.port), "--transport", "nccl", "--device", "cuda:1")
    pipe = None
    try:
        pipe = listener.accept(timeout_s=120)
        child.wait_line("READY", 120)
        ids = [0, 1, 2, 3, 4, 5, 24, 99]
        for i in ids:
            t, meta = make_entry(i)
            pipe.send(f"k{i}", {k: v.cuda() for k, v in t.items()}, meta)
        for i in ids:
            m = pipe.recv(timeout_s=60)
            assert all(v.device.type == "cuda" for v in m.tensors.values())
            assert_entry_equal(m.tensors, make_entry(i)[0], f"k{i}")
        pipe.send("go", None, {"cmd": "big", "mib": 256})
        m = pipe.recv(timeout_s=60)
        assert torch.equal(m.tensors["big"].cpu(), big_tensor(256))
    finally:
        child.kill()
        if pipe is not None:
            pipe.close(timeout_s=5)
        listener.close()


# --------------------------------------------------------------------------------- receive pool
def test_recv_pool_reuses_a_buffer_only_when_nothing_references_it():
    pool = RecvPool(max_bytes=64 << 20, min_bytes=1 << 20)
    assert pool.alloc(1000) is None  # small: not pooled
    a = pool.alloc(8 << 20)
    pa = a.data_ptr()
    b = pool.alloc(8 << 20)
    assert b.data_ptr() != pa
    view = a.view(torch.float32)[5:]  # the caller keeps only a view
    del a
    c = pool.alloc(8 << 20)
    assert c.data_ptr() not in (pa, b.data_ptr())  # still referenced: not reused
    del view
    d = pool.alloc(6 << 20)  # fits (8 MiB <= 2 × 6 MiB), now unreferenced
    assert d.data_ptr() == pa and d.numel() == 6 << 20
    assert pool.hits == 1
    big = pool.alloc(80 << 20)
    assert big is None  # over max_bytes: the caller allocates normally
