"""The trust boundary: every KV connection authenticates by a shared secret before anything else is
read, listeners refuse to face the network without one, and a producer's server grants only what
consumers need (GET, DISCARD)."""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time

import pytest
import torch
from support.kvstore import HELLO_SOCKET
from support.transport import raw_authenticate, recv_exact, settled_stat
from support.vllm_fixtures import captured_log

from connector.kvstore import KVBuffer, KVClient, KVServer
from connector.transport import PipeListener, auth, connect_pipe
from connector.transport.errors import ProtocolError, RemoteError
from connector.transport.frame import APP_KIND_MIN, Kind, encode_header

SECRET = b"s3cret-for-tests-only-0123456789"
OTHER = b"another-secret-of-32-bytes-00000"


@pytest.fixture
def served():
    """A producer's server with SECRET."""
    buf = KVBuffer(1 << 24)
    srv = KVServer(buf, secret=SECRET, connect_timeout_s=3)
    try:
        yield buf, srv
    finally:
        srv.close()


_keys = itertools.count()


def _get(srv, secret, **kw):
    """Put a fresh entry into ``srv``'s buffer and load it with ``secret`` (a delivered entry is
    claimed, so each load needs its own)."""
    key = f"k{next(_keys)}"
    srv.buffer.put(key, {"x": torch.arange(10.0)})
    with KVClient("127.0.0.1", srv.port, secret=secret, timeout_s=5, **kw) as client:
        return client.get(key)[0]["x"]


def test_the_right_secret_works_and_wrong_or_missing_ones_are_refused(served):
    buf, srv = served
    assert torch.equal(_get(srv, SECRET), torch.arange(10.0))
    with pytest.raises(auth.AuthError, match="secrets differ"):
        _get(srv, OTHER)
    with pytest.raises(auth.AuthError, match="requires the shared secret and this side has none"):
        _get(srv, None)
    assert settled_stat(srv, "auth_failures", 2) == 2
    assert srv.stats()["requests"] == 1  # nothing of the refused ones was read as a request
    assert torch.equal(_get(srv, SECRET), torch.arange(10.0))  # others are not disturbed


def test_a_refusal_is_counted_and_its_slot_freed_before_the_peer_hears_of_it(served, monkeypatch):
    """Even when the server is slow to record a failure, a refused peer that reconnects at once
    finds it counted and its handshake slot free (no "too many pending handshakes")."""
    _, srv = served
    record = auth.FailureLog.failed

    def slow_record(self, peer):
        time.sleep(0.1)
        return record(self, peer)

    monkeypatch.setattr(auth.FailureLog, "failed", slow_record)
    for n in range(1, srv.caps.max_pending_per_host + 3):
        with pytest.raises(auth.AuthError, match="secrets differ"):
            _get(srv, OTHER)
        assert srv.stats()["auth_failures"] == n  # read at once, no waiting
    assert torch.equal(_get(srv, SECRET), torch.arange(10.0))


def test_a_client_with_a_secret_refuses_a_listener_without_one():
    with (
        KVServer(KVBuffer(1 << 20)) as srv,
        pytest.raises(auth.AuthError, match="does not authenticate"),
    ):
        _get(srv, SECRET)


def _connect_raw(srv) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    s.settimeout(5)
    return s


def _closed(s) -> bool:
    """Whether the server closed ``s`` (end of stream or reset), reading at most one byte."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_replayed_handshake_is_refused(served):
    """A response recorded from an authenticated connection answers that connection's nonce only:
    replayed on a new connection (a new challenge) it is refused, and nothing after it is read."""
    _, srv = served
    first = _connect_raw(srv)
    required, nonce_l = auth.parse_challenge(recv_exact(first, auth.CHALLENGE.size), "first")
    address = auth.address_text(first.getpeername())
    recorded, nonce_c = auth.respond(SECRET, required, nonce_l, address, "first")
    first.sendall(recorded)
    verdict = recv_exact(first, auth.VERDICT.size)
    auth.check_verdict(SECRET, nonce_l, nonce_c, address, verdict, "first")
    first.close()

    replay = _connect_raw(srv)
    recv_exact(replay, auth.CHALLENGE.size)  # a fresh nonce
    replay.sendall(recorded + HELLO_SOCKET)
    with pytest.raises(auth.AuthError, match="refused"):
        verdict = recv_exact(replay, auth.VERDICT.size)
        auth.check_verdict(SECRET, nonce_l, nonce_c, address, verdict, "replay")
    assert _closed(replay), "the server kept the connection of a failed handshake"
    replay.close()
    assert settled_stat(srv, "auth_failures", 1) == 1
    assert srv.stats()["connections"] == 0  # the HELLO behind the replay was never answered


def test_a_half_finished_handshake_ends_at_its_deadline_without_holding_up_others(served):
    _, srv = served
    stalled = _connect_raw(srv)
    recv_exact(stalled, auth.CHALLENGE.size)
    stalled.sendall(b"TKVA" + bytes(20))  # part of a response, then nothing
    t0 = time.monotonic()
    # meanwhile: served at once (over the socket transport: no gloo rendezvous in the time)
    assert torch.equal(_get(srv, SECRET, transport="socket"), torch.arange(10.0))
    assert time.monotonic() - t0 < 2
    stalled.settimeout(10)
    assert _closed(stalled)  # closed by the server at its authentication deadline
    assert time.monotonic() - t0 < 8
    stalled.close()


def test_a_host_holds_at_most_a_few_pending_handshakes(served):
    _, srv = served
    stalled = [_connect_raw(srv) for _ in range(srv.caps.max_pending_per_host)]
    for s in stalled:
        recv_exact(s, auth.CHALLENGE.size)
    with pytest.raises(RemoteError, match="too many pending handshakes"):
        _get(srv, SECRET)
    for s in stalled:
        s.close()
    # the server sees the closed sockets fail their handshakes
    assert settled_stat(srv, "auth_failures", len(stalled), timeout_s=10) == len(stalled)
    assert torch.equal(_get(srv, SECRET), torch.arange(10.0))


def test_a_producer_server_answers_get_and_discard_only(served):
    """Nothing on the wire puts or probes entries: a request of another kind (here the code PUT
    had before it was removed) gets an ERROR naming it, and its connection is closed. (Sent
    without a payload: a request announcing one is refused at its header, before its kind.)"""
    buf, srv = served
    pipe = connect_pipe("127.0.0.1", srv.port, secret=SECRET)
    try:
        pipe.send("planted", kind=APP_KIND_MIN + 5)
        reply = pipe.recv(5)
        assert reply.kind == Kind.ERROR
        assert reply.meta["error"] == f"unexpected kind {APP_KIND_MIN + 5}"
    finally:
        pipe.close()
    assert "planted" not in buf and settled_stat(srv, "protocol_errors", 1) == 1
    assert torch.equal(_get(srv, SECRET), torch.arange(10.0))  # GET on another connection
    buf.put("d", {"x": torch.ones(1)})
    with KVClient("127.0.0.1", srv.port, secret=SECRET, timeout_s=5) as client:
        assert client.discard("d") is True and "d" not in buf


def _refusing_listener(frame: bytes) -> socket.socket:
    """A raw listener that answers its first connection with ``frame`` in place of the
    CHALLENGE, then holds it open for 3 s. Returns the listening socket."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = lsock.accept()
        with conn:
            conn.sendall(frame)
            time.sleep(3)

    threading.Thread(target=run, daemon=True).start()
    return lsock


def _printable(text: str) -> bool:
    return all(" " <= c <= "~" for c in text)


HOSTILE = "\x1b[2J\x1b[31mok\r\nWARNING forged line\x00\u202e\xe9"  # ANSI, CR LF, NUL, bidi


PREFIX = "listener refused: "


@pytest.mark.parametrize(
    "error, want",
    [
        (HOSTILE, PREFIX + "?[2J?[31mok??WARNING forged line???"),
        (HOSTILE * 10, PREFIX + ("?[2J?[31mok??WARNING forged line???" * 10)[:197] + "..."),
        (
            "x" * (64 << 10),
            "listener refused, giving a reason of 65557 bytes (over 4096: not read)",
        ),
        (7, PREFIX + "<int>"),
    ],
    ids=["control-characters", "long", "64KiB", "not-text"],
)
def test_a_refusal_before_authentication_reaches_errors_bounded_and_printable(error, want):
    """A stranger listening where a KV server was expected may answer with an ERROR frame of its
    choosing: its text reaches the exception (and so the logs) as at most 200 printable ASCII
    characters, and one over 4 KiB is not even read."""
    frame = encode_header(Kind.ERROR, "", json.dumps({"error": error}).encode())
    with _refusing_listener(frame) as lsock, pytest.raises(RemoteError) as err:
        connect_pipe("127.0.0.1", lsock.getsockname()[1], transport="socket", connect_timeout_s=5)
    assert err.value.detail == want and _printable(str(err.value))


def test_a_malformed_refusal_is_a_protocol_error_that_quotes_nothing_raw():
    """A refusal whose meta the decoder refuses, naming a hostile key, is a ProtocolError whose text
    is bounded and printable too."""
    frame = encode_header(Kind.ERROR, "", b"{%s: [1]}" % json.dumps(HOSTILE * 50).encode())
    with _refusing_listener(frame) as lsock, pytest.raises(ProtocolError) as err:
        connect_pipe("127.0.0.1", lsock.getsockname()[1], transport="socket", connect_timeout_s=5)
    assert err.value.detail.startswith("malformed refusal: meta['")
    assert len(err.value.detail) == len("malformed refusal: ") + 200
    assert _printable(str(err.value))


def test_listening_off_loopback_needs_a_secret_or_insecure(caplog):
    with pytest.raises(ValueError, match=r"without a shared secret .* insecure=True"):
        PipeListener("0.0.0.0", 0)
    with captured_log("vllm.tritonkv.transport") as records:
        PipeListener("0.0.0.0", 0, insecure=True).close()
    assert any("insecure" in r.getMessage() for r in records)
    PipeListener("0.0.0.0", 0, secret=SECRET).close()
    PipeListener("127.0.0.1", 0).close()  # loopback: only this machine can connect
    with pytest.raises(ValueError, match="at least 32 bytes"):
        PipeListener("127.0.0.1", 0, secret="short")


def test_a_secret_shorter_than_32_bytes_is_refused_everywhere(monkeypatch):
    """16 bytes (what was once the minimum) and 31 are refused by listeners, connectors, clients
    and the environment variable alike; 32 bytes (and `openssl rand -hex 32`'s 64) are enough."""
    for short in (b"k" * 16, "k" * 31):
        for make in (
            lambda s: PipeListener("127.0.0.1", 0, secret=s),
            lambda s: connect_pipe("127.0.0.1", 1, secret=s),
            lambda s: KVClient("127.0.0.1", 1, secret=s),
        ):
            with pytest.raises(ValueError, match=f"at least 32 bytes .*got {len(short)}"):
                make(short)
        monkeypatch.setenv(auth.SECRET_ENV, short if isinstance(short, str) else short.decode())
        with pytest.raises(ValueError, match=f"{auth.SECRET_ENV}: expected at least 32 bytes"):
            auth.load_secret()
    monkeypatch.setenv(auth.SECRET_ENV, "k" * 32)
    assert auth.load_secret() == b"k" * 32
    PipeListener("127.0.0.1", 0, secret="f" * 64).close()


def test_secrets_come_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    assert auth.load_secret() is None
    monkeypatch.setenv(auth.SECRET_ENV, SECRET.decode())
    assert auth.load_secret() == SECRET
    path = tmp_path / "secret"
    path.write_bytes(OTHER + b"\n")
    path.chmod(0o600)
    assert auth.load_secret(path) == OTHER  # the file wins; its trailing newline is not secret
    with pytest.raises(ValueError, match="cannot read"):
        auth.load_secret(tmp_path / "missing")
    assert auth.is_loopback("::1") and auth.is_loopback("localhost")
    assert not auth.is_loopback("0.0.0.0") and not auth.is_loopback("10.0.0.1")


def _secret_file(tmp_path, mode: int, name: str = "secret"):
    path = tmp_path / name
    path.write_bytes(OTHER + b"\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o640, 0o620, 0o602, 0o666, 0o610], ids=oct)
def test_a_secret_file_others_may_access_is_refused_naming_it_its_mode_and_the_fix(tmp_path, mode):
    path = _secret_file(tmp_path, mode)
    with pytest.raises(ValueError) as err:
        auth.load_secret(path)
    assert str(path) in str(err.value) and f"mode {mode:04o}" in str(err.value)
    assert f"chmod 600 {path}" in str(err.value) and OTHER.decode() not in str(err.value)


def test_a_secret_file_only_its_owner_may_read_is_accepted_and_a_symlink_is_judged_by_its_target(
    tmp_path,
):
    for mode in (0o600, 0o400):
        assert auth.load_secret(_secret_file(tmp_path, mode, f"s{mode:o}")) == OTHER
    link = tmp_path / "link"  # a symlink's own mode is 0777: the file opened is what counts
    link.symlink_to(_secret_file(tmp_path, 0o600, "target"))
    assert auth.load_secret(link) == OTHER
    (tmp_path / "target").chmod(0o644)
    with pytest.raises(ValueError, match=f"{link}.*mode 0644"):
        auth.load_secret(link)


def test_a_secret_file_that_is_not_a_regular_file_is_refused_without_waiting_on_it(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # opening it blocks until a writer comes, unless non-blocking
    for path, kind in (
        (tmp_path, "a directory"),
        (fifo, "a FIFO"),
        ("/dev/null", "a character device"),
    ):
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=f"{path}.*expected a regular file, got {kind}"):
            auth.load_secret(path)
        assert time.monotonic() - t0 < 1
    big = _secret_file(tmp_path, 0o600, "big")
    big.write_bytes(b"k" * (auth.MAX_SECRET_FILE_BYTES + 1))
    with pytest.raises(ValueError, match=f"expected at most {auth.MAX_SECRET_FILE_BYTES} bytes"):
        auth.load_secret(big)


def test_failures_are_logged_at_most_once_per_host_a_minute():
    log = auth.FailureLog(interval_s=60.0, max_hosts=2)
    assert log.failed("10.0.0.1:5000") and not log.failed("10.0.0.1:5001")
    assert log.failed("10.0.0.2:1") and not log.failed("10.0.0.3:1")  # table full: not logged
    assert log.count == 4


def test_the_raw_helper_speaks_the_exchange(served):
    """The hand-written client of the raw-socket tests authenticates like connect_pipe does."""
    _, srv = served
    s = raw_authenticate(_connect_raw(srv), SECRET)
    s.send_frame(HELLO_SOCKET)
    assert s.read_frame().kind == Kind.HELLO_ACK  # its tag checked
    s.close()


def test_concurrent_wrong_secrets_do_not_disturb_a_right_one(served):
    _, srv = served
    errors = []

    def intruder():
        for _ in range(5):
            try:
                _get(srv, OTHER)
            except auth.AuthError:
                continue
            errors.append("an intruder got in")

    threads = [threading.Thread(target=intruder) for _ in range(2)]
    for t in threads:
        t.start()
    for _ in range(5):
        assert torch.equal(_get(srv, SECRET), torch.arange(10.0))
    for t in threads:
        t.join(30)
    assert not errors
    assert settled_stat(srv, "auth_failures", 10) == 10
