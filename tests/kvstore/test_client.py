"""KVClient: argument checks, closing during a request, a producer killed mid-transfer, and
hostile or silent servers."""

import struct
import threading
import time

import pytest
from support.kvstore import fake_server, no_big_alloc  # noqa: F401 (a fixture)
from support.transport import Child, waited_s

from connector.kvstore import KVClient, Part
from connector.kvstore.protocol import Op
from connector.transport import (
    PeerDeadError,
    PipeClosedError,
    ProtocolError,
    TransferError,
    TransferTimeout,
)
from connector.transport import frame as wire
from connector.transport.frame import TensorSpec, encode_header


@pytest.mark.timeout(30)
def test_bad_arguments_are_refused_before_connecting():
    client = KVClient("127.0.0.1", 9, transport="socket", timeout_s=5)  # nothing listens there
    with pytest.raises(TypeError, match="key: expected str, got int"):
        client.get(5)
    with pytest.raises(ValueError, match=r"key: expected 1\.\.1024"):
        client.discard("")
    with pytest.raises(ValueError, match="wait_s: expected a number >= 0, got -1"):
        client.get("k", wait_s=-1)
    with pytest.raises(ValueError, match=r"wait_s: expected < timeout_s=5, got 5"):
        client.get("k", wait_s=5, part=Part("kv", 0, 0, 1))
    counters = ("requests", "hits", "misses", "timeouts", "errors", "connects")
    assert client.stats() == dict.fromkeys((*counters, "bytes_received", "group_device_bytes"), 0)
    client.close()


@pytest.mark.timeout(30)
def test_client_close_interrupts_a_request_in_flight():
    """close() used to wait for the request lock, i.e. for another thread's request to end."""
    asked = threading.Event()
    lsock = fake_server(lambda conn, req: asked.set())  # then silent for 3 s
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


def _send(conn, data: bytes) -> None:
    """``data`` as a sealed frame; bytes that are no frame at all go as they are."""
    try:
        conn.send_frame(data)
    except ProtocolError:
        conn.sendall(data)


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
def test_client_rejects_hostile_replies_fast(reply, no_big_alloc):  # noqa: F811
    lsock = fake_server(lambda conn, req: _send(conn, reply(req.key)))
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
    lsock = fake_server(lambda conn, req: None)
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
@pytest.mark.parametrize(
    "announced", [4096, 4097, 1 << 32], ids=["as-expected", "one-more", "4-GiB"]
)
def test_a_reply_larger_than_the_caller_expects_is_refused_before_allocation(
    announced,
    no_big_alloc,  # noqa: F811
):
    """``max_bytes``: the consumer's own expectation caps what a peer's DATA header may make it
    allocate (the frame limit alone allows 4 GiB); refused, the connection is closed."""
    spec = TensorSpec("kv", 6, (announced,), announced)
    payload = b"\x07" * min(announced, 4097)

    def reply(conn, req):
        conn.send_frame(encode_header(Op.DATA, req.key, {}, [spec], wire.FLAG_INLINE), payload)

    lsock = fake_server(reply)
    try:
        client = KVClient("127.0.0.1", lsock.getsockname()[1], transport="socket", timeout_s=20)
        if announced == 4096:
            got, _ = client.get("mine", max_bytes=4096)
            assert got["kv"].nbytes == 4096 and no_big_alloc == [4096]
        else:
            with pytest.raises(ProtocolError) as ei:
                client.get("mine", max_bytes=4096)
            text = str(ei.value)
            assert f"{announced} payload bytes announced" in text, text
            assert "expects at most 4096" in text and "'mine'" in text, text
            assert no_big_alloc == [], "allocated before the header was refused"
            assert client.stats()["errors"] == 1  # the connection was closed
        with pytest.raises(ValueError, match="max_bytes: expected an int >= 0 or None, got -1"):
            client.get("mine", max_bytes=-1)
        client.close()
    finally:
        lsock.close()
