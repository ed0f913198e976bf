"""Tests of the P/D proxy (``connector/serve/``: proxy, router, bodies) against fake servers.

The fakes (``tests/support/fake_openai.py``) run in-process on loopback ports; each proxy runs as a real
``python -m connector.serve.proxy`` subprocess, so the command line, logging and signal handling are
exercised too. No vLLM engine is involved.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402
from support.fake_openai import FakeServer, LoopThread  # noqa: E402

from connector.logs import short_id  # noqa: E402
from connector.serve.bodies import (  # noqa: E402
    InvalidBody,
    client_body,
    decode_body,
    encode,
    handoff_params,
    prefill_body,
)
from connector.serve.guards import is_loopback, request_id  # noqa: E402
from connector.serve.launch import free_port  # noqa: E402
from connector.serve.proxy import create_app  # noqa: E402
from connector.serve.router import ProxyConfig  # noqa: E402

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1.5  # the main proxy's --timeout-s, kept short so that the hang tests stay fast
MAX_BYTES = 4096  # the tight proxy's --max-request-bytes
MAX_IN_FLIGHT = 2  # the tight proxy's --max-concurrent-requests
BODY_TIMEOUT_S = 1.0  # the tight proxy's --body-timeout-s
PATHS = ["/v1/completions", "/v1/chat/completions"]


class ProxyProcess:
    """A ``python -m connector.serve.proxy`` subprocess logging to a file."""

    def __init__(self, log_path: Path, prefill: list[str], decode: list[str], *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = [sys.executable, "-m", "connector.serve.proxy", "--port", str(self.port)]
        for u in prefill:
            args += ["--prefill", u]
        for u in decode:
            args += ["--decode", u]
        args += list(extra)
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, deadline_s: float = 20.0) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                pytest.fail(f"proxy exited with {self.proc.returncode}:\n{self.log()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2),
            ):
                return
            time.sleep(0.05)
        pytest.fail(f"proxy did not start within {deadline_s} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 10.0) -> int | None:
        """Signals the proxy and returns its exit status (None if it had to be killed)."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
                try:
                    return self.proc.wait(wait_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
                    return None
            return self.proc.returncode
        finally:
            self._log.close()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10.0, trust_env=False)


class Stack:
    """Two prefill and two decode fakes plus four proxies in front of them."""

    def __init__(self, tmp: Path) -> None:
        self.lt = LoopThread()
        self.p0 = FakeServer(self.lt, "P0", "prefill")
        self.p1 = FakeServer(self.lt, "P1", "prefill")
        self.d0 = FakeServer(self.lt, "D0", "decode")
        self.d1 = FakeServer(self.lt, "D1", "decode")
        self.servers = [self.p0, self.p1, self.d0, self.d1]
        for b in self.servers:
            b.start()
        short = ["--timeout-s", str(TIMEOUT_S), "--connect-timeout-s", "1"]
        short += ["--health-timeout-s", "1", "--shutdown-timeout-s", "1"]
        # Main proxy: one prefill, one decode, short timeouts.
        self.main = ProxyProcess(tmp / "main.log", [self.p0.url], [self.d0.url], *short)
        # Round-robin proxy: two of each (trailing slash on purpose).
        self.rr = ProxyProcess(
            tmp / "rr.log", [self.p0.url, self.p1.url + "/"], [self.d0.url, self.d1.url]
        )
        # A prefill URL where nothing listens.
        self.dead_url = f"http://127.0.0.1:{free_port()}"
        self.dead = ProxyProcess(tmp / "dead.log", [self.dead_url], [self.d0.url], *short)
        # Tight limits: small bodies, few requests in flight.
        limits = ["--max-request-bytes", str(MAX_BYTES)]
        limits += ["--max-concurrent-requests", str(MAX_IN_FLIGHT)]
        limits += ["--body-timeout-s", str(BODY_TIMEOUT_S)]
        self.tight = ProxyProcess(tmp / "tight.log", [self.p0.url], [self.d0.url], *limits)
        self.proxies = [self.main, self.rr, self.dead, self.tight]
        for p in self.proxies:
            p.wait_ready()

    def close(self) -> None:
        for p in self.proxies:
            p.stop()
        for b in self.servers:
            b.stop()
        self.lt.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("proxy"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(autouse=True)
def _reset(request: pytest.FixtureRequest) -> None:
    if "stack" in request.fixturenames:
        for b in request.getfixturevalue("stack").servers:
            b.reset()


def _events(raw: bytes) -> list[Any]:
    """Parses SSE ``data:`` events; ``[DONE]`` stays a string."""
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _wait_log_line(proxy: ProxyProcess, needle: str, wait_s: float = 3.0) -> str:
    """The first line of ``proxy``'s log holding ``needle``, waiting for it up to ``wait_s``."""
    end = time.monotonic() + wait_s
    while needle not in proxy.log() and time.monotonic() < end:
        time.sleep(0.05)
    return next(ln for ln in proxy.log().splitlines() if needle in ln)


def _body(path: str, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "fake-model", "temperature": 0.0, "seed": 3}
    if path == "/v1/completions":
        base["prompt"] = "The quick brown fox"
    else:
        base["messages"] = [{"role": "user", "content": "The quick brown fox"}]
    base.update(kw)
    return base


# ---------------------------------------------------------------------------- pure body builders


def test_prefill_and_decode_bodies() -> None:
    body = _body(
        "/v1/chat/completions",
        max_tokens=50,
        max_completion_tokens=40,
        n=3,
        best_of=3,
        min_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        kv_transfer_params={"from": "client"},
    )
    snapshot = json.loads(json.dumps(body))
    p = prefill_body(body, "/v1/chat/completions")
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["n"] == 1
    assert p["stream"] is False
    assert "stream_options" not in p and "best_of" not in p and "min_tokens" not in p
    assert p["kv_transfer_params"] == {"do_remote_decode": True}
    assert p["messages"] == body["messages"]
    # Completions: max_completion_tokens is not added where it was absent.
    pc = prefill_body(_body("/v1/completions", max_tokens=9), "/v1/completions")
    assert "max_completion_tokens" not in pc and "n" not in pc and pc["max_tokens"] == 1
    kv = {"do_remote_prefill": True, "transfer_id": "t", "nested": {"a": [1, 2]}}
    d = decode_body(body, kv)
    assert d["kv_transfer_params"] is kv
    assert {k: v for k, v in d.items() if k != "kv_transfer_params"} == {
        k: v for k, v in body.items() if k != "kv_transfer_params"
    }
    assert "kv_transfer_params" not in decode_body(body, None)
    assert body == snapshot  # the client's body is never mutated


def test_handoff_is_the_prefill_answers_kv_transfer_params_as_is() -> None:
    kv = {"do_remote_prefill": True, "transfer_id": "t", "remote_prefill_cached_tokens": 3}
    assert handoff_params(json.dumps({"id": "x", "kv_transfer_params": kv}).encode()) == kv
    assert handoff_params(b'{"kv_transfer_params": null}') is None
    assert handoff_params(b'{"choices": []}') is None
    deep = b'{"kv_transfer_params": ' + b"[" * 100_000
    for bad in (b"not json", b"[1, 2]", b'{"kv_transfer_params": "t"}', b"\xff", deep):
        with pytest.raises(ValueError, match="kv_transfer_params"):
            handoff_params(bad)


def test_client_body_names_what_was_expected() -> None:
    assert client_body(b'{"prompt": "a", "temperature": 0.5}', PATHS[0])["temperature"] == 0.5
    cases = {
        b"[1]": "request body is an array: expected a JSON object",
        b"null": "request body is null: expected a JSON object",
        b"\xff": "not UTF-8 (byte 0): expected a JSON object in UTF-8",
        b"[" * 100_000: "nested too deeply to parse; expected a JSON object",
        b'{"t": NaN}': "NaN is not allowed: expected finite numbers only",
        b'{"t": 1e400}': "number 1e400 is out of range: expected finite numbers only",
    }
    for raw, message in cases.items():
        with pytest.raises(InvalidBody, match=re.escape(message)):
            client_body(raw, PATHS[1])
    with pytest.raises(InvalidBody) as info:
        client_body(b'{"prompt": ["a", "b"]}', PATHS[0])
    assert info.value.param == "prompt"
    nested: list[Any] = []
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(ValueError, match="nested too deeply to encode"):
        encode({"prompt": nested})
    assert encode({"t": 1.5, "s": "\ud800"}) == b'{"t": 1.5, "s": "\\ud800"}'


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        ProxyConfig(prefill_urls=(), decode_urls=("http://x",))
    with pytest.raises(ValueError):
        ProxyConfig(prefill_urls=("x:1",), decode_urls=("http://x",))
    with pytest.raises(ValueError):
        ProxyConfig(prefill_urls=("http://x",), decode_urls=("http://y",), timeout_s=0)
    assert ProxyConfig(("http://x",), ("http://y",), timeout_s=7).prefill_limit_s == 7


# ---------------------------------------------------------------------------- happy paths


@pytest.mark.parametrize("path", PATHS)
def test_non_streaming(stack: Stack, path: str) -> None:
    extra = {"max_completion_tokens": 21} if path.endswith("chat/completions") else {}
    body = _body(path, max_tokens=17, n=1, min_tokens=2, **extra)
    with stack.main.client() as c:
        trace = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
        r = c.post(
            path,
            json=body,
            headers={"X-Request-Id": "req-abc", "Authorization": "Bearer k", **trace},
        )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "req-abc"
    out = r.json()
    assert out["served_by"] == "D0"

    [pre] = stack.p0.received
    assert pre.path == path
    expected_pre = {k: v for k, v in body.items() if k != "min_tokens"}
    expected_pre.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if extra:
        expected_pre["max_completion_tokens"] = 1
    assert pre.body == expected_pre
    assert pre.headers["x-request-id"] == "req-abc"
    assert pre.headers["authorization"] == "Bearer k"
    assert pre.headers["traceparent"] == trace["traceparent"] and "tracestate" not in pre.headers

    [issued] = stack.p0.issued
    [dec] = stack.d0.received
    assert dec.path == path
    assert dec.body == {**body, "kv_transfer_params": issued}  # original max_tokens, exact params
    assert dec.headers["x-request-id"] == "req-abc"
    assert dec.headers["traceparent"] == trace["traceparent"]
    assert out["kv_transfer_params"] == issued  # the fake decode echoes what it got

    # One log line per request with the timings and the transfer id's first 8 characters only.
    shown = issued["transfer_id"][:8] + "…"
    line = _wait_log_line(stack.main, shown)
    assert "req-abc" in line and "prefill" in line and "ttfb" in line and " ms" in line
    assert issued["transfer_id"] not in stack.main.log()


@pytest.mark.parametrize("path", PATHS)
def test_streaming_relayed_in_order_without_buffering(stack: Stack, path: str) -> None:
    body = _body(path, max_tokens=9, stream=True, stream_options={"include_usage": True})
    stack.d0.make_gate()  # the fake sends chunk 0, then waits until the client has seen it
    with stack.main.client() as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = r.iter_raw()
        got = b""
        while b"\n\n" not in got:
            got += next(chunks)
        first = _events(got)
        assert [e["seq"] for e in first] == [0]  # relayed before the server sent the rest
        stack.d0.open_gate()
        for chunk in chunks:
            got += chunk
    events = _events(got)
    assert events[-1] == "[DONE]"
    assert [e["seq"] for e in events[:-1]] == [0, 1, 2, 3]
    key = "text" if path == "/v1/completions" else "delta"
    assert events[1]["choices"][0][key] in ("tok1", {"content": "tok1"})

    [pre] = stack.p0.received
    assert pre.body["stream"] is False and "stream_options" not in pre.body
    assert pre.body["max_tokens"] == 1
    assert pre.body["kv_transfer_params"] == {"do_remote_decode": True}
    [dec] = stack.d0.received
    assert dec.body == {**body, "kv_transfer_params": stack.p0.issued[0]}


def test_client_disconnect_closes_decode_stream(stack: Stack) -> None:
    # The round-robin proxy has the default 600 s timeout: only the disconnect can end the stream.
    for d in (stack.d0, stack.d1):
        d.make_gate()
    body = _body("/v1/completions", max_tokens=100, stream=True)
    with stack.rr.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert b"tok0" in next(r.iter_raw())
    end = time.monotonic() + 5
    while stack.d0.disconnects + stack.d1.disconnects == 0 and time.monotonic() < end:
        time.sleep(0.02)
    assert stack.d0.disconnects + stack.d1.disconnects == 1


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_client_leaving_a_non_streamed_request_closes_the_server_call(
    stack: Stack, stage: str
) -> None:
    """The round-robin proxy has the default 600 s timeout: only the client leaving can end a
    call to a server that never answers; decode is never called after a prefill left behind."""
    hanging = (stack.p0, stack.p1) if stage == "prefill" else (stack.d0, stack.d1)
    for b in hanging:
        b.mode = "hang"
    # 2 s: the whole prefill leg must fit in it for decode to be the stage left hanging
    client = httpx.Client(base_url=stack.rr.url, timeout=2.0, trust_env=False)
    with client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json=_body("/v1/completions"))
    end = time.monotonic() + 5
    while sum(b.disconnects for b in hanging) == 0 and time.monotonic() < end:
        time.sleep(0.02)
    assert sum(b.disconnects for b in hanging) == 1
    if stage == "prefill":
        assert stack.d0.received == stack.d1.received == []


def test_round_robin(stack: Stack) -> None:
    served = []
    with stack.rr.client() as c:
        for i in range(4):
            r = c.post("/v1/completions", json=_body("/v1/completions", max_tokens=4 + i))
            assert r.status_code == 200, r.text
            served.append(r.json()["served_by"])
    # The cursors may start anywhere (other tests use this proxy too), but must alternate.
    assert sorted(served[:2]) == ["D0", "D1"] and served[2:] == served[:2]
    assert len(stack.p0.received) == len(stack.p1.received) == 2
    assert len(stack.d0.received) == len(stack.d1.received) == 2
    # Every decode got exactly the params one prefill issued, each transfer used once.
    issued = {kv["transfer_id"]: kv for kv in stack.p0.issued + stack.p1.issued}
    got = [d.body["kv_transfer_params"] for d in stack.d0.received + stack.d1.received]
    assert sorted(kv["transfer_id"] for kv in got) == sorted(issued)
    assert all(kv == issued[kv["transfer_id"]] for kv in got)
    by_tokens = {d.body["max_tokens"]: d for d in stack.d0.received + stack.d1.received}
    assert sorted(by_tokens) == [4, 5, 6, 7]  # original max_tokens reached the decode servers


def test_prefill_without_params_decodes_without_them(stack: Stack) -> None:
    stack.p0.mode = "no_kv"
    body = _body("/v1/completions", max_tokens=5, kv_transfer_params={"client": "junk"})
    with stack.main.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200
    [dec] = stack.d0.received
    assert "kv_transfer_params" not in dec.body
    assert dec.body["max_tokens"] == 5


def test_models_and_health(stack: Stack) -> None:
    with stack.main.client() as c:
        r = c.get("/v1/models")
        assert r.status_code == 200 and r.json()["by"] == "D0"
        r = c.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        stack.d0.healthy = False
        r = c.get("/health", params={"details": "1"})  # this test is a loopback client
        assert r.status_code == 503
        bad = [b for b in r.json()["servers"] if not b["ok"]]
        assert [(b["role"], b["url"]) for b in bad] == [("decode", stack.d0.url)]
        stack.d0.healthy = True
        stack.p0.mode = "hang"  # a server that never answers /health: 503 within the limit
        t0 = time.monotonic()
        r = c.get("/health")
        assert r.status_code == 503 and time.monotonic() - t0 < 4


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("path", PATHS)
def test_prefill_error_propagated_and_decode_not_called(stack: Stack, path: str) -> None:
    stack.p0.mode = "error"
    stack.p0.error_status = 422
    with stack.main.client() as c:
        r = c.post(path, json=_body(path, max_tokens=8, stream=True))
    assert r.status_code == 422
    assert r.json()["error"]["message"] == "P0 refuses"
    assert len(stack.p0.received) == 1
    assert stack.d0.received == []


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_timeout_is_504(stack: Stack, stream: bool) -> None:
    stack.p0.mode = "hang"
    t0 = time.monotonic()
    with stack.main.client() as c:
        r = c.post("/v1/completions", json=_body("/v1/completions", stream=stream))
    elapsed = time.monotonic() - t0
    assert r.status_code == 504
    err = r.json()["error"]
    assert err["stage"] == "prefill" and err["server"] == stack.p0.url
    assert err["timeout_s"] == TIMEOUT_S
    assert stack.p0.url in err["message"] and "1.5 s" in err["message"]
    assert TIMEOUT_S - 0.1 < elapsed < TIMEOUT_S + 3
    assert stack.d0.received == []


@pytest.mark.parametrize("stream", [False, True])
def test_decode_timeout_is_504(stack: Stack, stream: bool) -> None:
    stack.d0.mode = "hang"
    t0 = time.monotonic()
    with stack.main.client() as c:
        r = c.post("/v1/chat/completions", json=_body("/v1/chat/completions", stream=stream))
    assert r.status_code == 504
    err = r.json()["error"]
    assert err["stage"] == "decode" and err["server"] == stack.d0.url
    assert stack.d0.url in err["message"]
    assert time.monotonic() - t0 < TIMEOUT_S + 3
    assert len(stack.p0.received) == len(stack.d0.received) == 1


def test_stream_stall_ends_with_error_event(stack: Stack) -> None:
    stack.d0.mode = "stall"
    t0 = time.monotonic()
    with stack.main.client() as c:
        r = c.post("/v1/completions", json=_body("/v1/completions", stream=True))
    assert r.status_code == 200  # headers were sent with the first chunk
    events = _events(r.content)
    assert events[0]["seq"] == 0
    assert events[1]["error"]["code"] == 504 and events[1]["error"]["stage"] == "decode"
    assert events[2] == "[DONE]" and len(events) == 3
    assert time.monotonic() - t0 < TIMEOUT_S + 3


def test_dead_prefill_fails_fast(stack: Stack) -> None:
    t0 = time.monotonic()
    with stack.dead.client() as c:
        r = c.post("/v1/completions", json=_body("/v1/completions"))
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["stage"] == "prefill" and err["server"] == stack.dead_url
        assert time.monotonic() - t0 < TIMEOUT_S
        r = c.get("/health", params={"details": "1"})
        assert r.status_code == 503
        states = {b["url"]: b["ok"] for b in r.json()["servers"]}
        assert states == {stack.dead_url: False, stack.d0.url: True}
    assert stack.d0.received == []


BAD_JSON = {
    "garbage": b"{not json",
    "array": b"[1, 2]",
    "string": b'"text"',
    "empty": b"",
    "not-utf8": b"\xff\xfe",
    "not-utf8-in-a-string": b'{"prompt": "a\xc3(b"}',
    "utf16": '{"model": "fake-model", "prompt": "a"}'.encode("utf-16"),
    "deep-array": b"[" * 100_000 + b"]" * 100_000,
    "deep-in-object": b'{"prompt": ' + b"[" * 100_000,
    "nan": b'{"prompt": "a", "temperature": NaN}',
    "infinity": b'{"prompt": "a", "temperature": -Infinity}',
    "overflowing-float": b'{"prompt": "a", "temperature": 1e999}',
}


@pytest.mark.parametrize("content", BAD_JSON.values(), ids=BAD_JSON.keys())
def test_bad_json_is_400(stack: Stack, content: bytes) -> None:
    with stack.main.client() as c:
        for path in PATHS:
            r = c.post(path, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == 400
            assert "expected" in r.json()["error"]["message"]
    assert stack.p0.received == [] and stack.d0.received == []


def test_batched_prompt_is_400(stack: Stack) -> None:
    with stack.main.client() as c:
        r = c.post("/v1/completions", json=_body("/v1/completions", prompt=["a", "b"]))
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = c.post("/v1/completions", json=_body("/v1/completions", prompt=[1, 2, 3]))
        assert r.status_code == 200  # one tokenized prompt is fine
    assert len(stack.p0.received) == 1


# ---------------------------------------------------------------------------- bounds


def _raw_http(port: int, data: bytes, timeout_s: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Sends ``data`` as is and reads the answer until the proxy closes the connection.

    Returns:
        ``(status, headers with lower-case names, body)``; a proxy that never answers makes the
        read time out (TimeoutError).
    """
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout_s) as sock:
        sock.sendall(data)
        while chunk := sock.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines)}
    return int(status_line.split()[1]), headers, body


def _assert_413(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 413, body
    err = json.loads(body)["error"]
    assert err["code"] == 413 and err["max_request_bytes"] == MAX_BYTES
    assert f"at most {MAX_BYTES} bytes" in err["message"]
    assert headers["x-request-id"].startswith("pd-")


def test_a_content_length_over_the_limit_is_413_before_the_body_is_read(stack: Stack) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        f"Content-Length: {10**12}\r\n\r\n"
    )
    t0 = time.monotonic()
    _assert_413(*_raw_http(stack.tight.port, head.encode()))  # no body byte was sent
    assert time.monotonic() - t0 < 3
    assert stack.p0.received == [] and stack.d0.received == []


def test_a_chunked_body_is_refused_at_the_chunk_that_passes_the_limit(stack: Stack) -> None:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"[" * 1000
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(MAX_BYTES // 1000 + 1))
    _assert_413(*_raw_http(stack.tight.port, head + chunks))  # the body never ends
    assert stack.p0.received == [] and stack.d0.received == []


def test_a_body_of_exactly_the_limit_is_served_and_one_byte_more_is_413(stack: Stack) -> None:
    raw = json.dumps(_body("/v1/completions", max_tokens=3)).encode()
    raw += b" " * (MAX_BYTES - len(raw))
    with stack.tight.client() as c:
        r = c.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        f"Content-Length: {MAX_BYTES + 1}\r\n\r\n"
    )
    _assert_413(*_raw_http(stack.tight.port, head.encode() + raw + b" "))
    assert len(stack.p0.received) == len(stack.d0.received) == 1


def test_a_body_trickling_past_the_body_timeout_is_408(stack: Stack) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        "Content-Length: 100\r\n\r\n"
    )
    t0 = time.monotonic()
    status, headers, body = _raw_http(stack.tight.port, head.encode() + b'{"prompt": ')
    assert status == 408, body
    assert BODY_TIMEOUT_S - 0.1 < time.monotonic() - t0 < BODY_TIMEOUT_S + 3
    err = json.loads(body)["error"]
    assert err["code"] == 408 and err["timeout_s"] == BODY_TIMEOUT_S
    assert "not received within 1 s" in err["message"]
    assert headers["x-request-id"].startswith("pd-")
    assert stack.p0.received == []


def _refused_for_concurrency(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
    err = r.json()["error"]
    assert err["code"] == 503 and err["max_concurrent_requests"] == MAX_IN_FLIGHT
    assert f"limit of {MAX_IN_FLIGHT} concurrent requests" in err["message"]


def _wait_served(proxy: ProxyProcess, wait_s: float = 5.0) -> httpx.Response:
    """Posts a small request until it is not refused for concurrency (slots free up shortly
    after the proxy closed the upstream call)."""
    end = time.monotonic() + wait_s
    with proxy.client() as c:
        while True:
            r = c.post("/v1/completions", json=_body("/v1/completions"))
            if r.status_code != 503 or time.monotonic() > end:
                return r
            time.sleep(0.05)


def test_requests_beyond_the_concurrency_limit_get_503_and_reach_no_server(stack: Stack) -> None:
    stack.p0.mode = "hang"
    errors: list[BaseException] = []

    def hang_up_after_2_s() -> None:
        client = httpx.Client(base_url=stack.tight.url, timeout=2.0, trust_env=False)
        with client, pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=_body("/v1/completions"))

    def run() -> None:
        try:
            hang_up_after_2_s()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(MAX_IN_FLIGHT)]
    for t in threads:
        t.start()
    end = time.monotonic() + 5
    while len(stack.p0.received) < MAX_IN_FLIGHT and time.monotonic() < end:
        time.sleep(0.02)
    assert len(stack.p0.received) == MAX_IN_FLIGHT
    with stack.tight.client() as c:
        _refused_for_concurrency(c.post("/v1/completions", json=_body("/v1/completions")))
        _refused_for_concurrency(c.get("/health"))  # every request counts, /health too
    assert len(stack.p0.received) == MAX_IN_FLIGHT and stack.d0.received == []
    for t in threads:
        t.join(10)
    assert errors == []
    stack.p0.mode = "ok"
    assert _wait_served(stack.tight).status_code == 200  # the clients left: slots are free
    assert "refused 1 request(s) with 503: 2 in flight" in stack.tight.log()  # once a second


def test_a_stream_holds_its_slot_until_the_client_leaves(stack: Stack) -> None:
    stack.d0.make_gate()  # streams send their first chunk, then wait
    body = _body("/v1/completions", max_tokens=9, stream=True)
    readers = []  # kept: dropping an iter_raw() generator closes its stream
    with contextlib.ExitStack() as streams:
        for _ in range(MAX_IN_FLIGHT):
            c = streams.enter_context(stack.tight.client())
            r = streams.enter_context(c.stream("POST", "/v1/completions", json=body))
            readers.append(r.iter_raw())
            assert r.status_code == 200 and b"tok0" in next(readers[-1])
        with stack.tight.client() as c:
            _refused_for_concurrency(c.post("/v1/completions", json=_body("/v1/completions")))
        assert len(stack.p0.received) == MAX_IN_FLIGHT
    # Both clients left in the middle of their streams: their slots come back.
    r = _wait_served(stack.tight)
    assert r.status_code == 200 and stack.d0.disconnects == MAX_IN_FLIGHT


def test_health_answers_only_the_status_unless_details_are_asked(stack: Stack) -> None:
    with stack.main.client() as c:
        assert c.get("/health").json() == {"status": "ok"}
        r = c.get("/health", params={"details": "1"})  # a loopback client may ask
        urls = [(s["role"], s["url"], s["ok"]) for s in r.json()["servers"]]
        assert urls == [("prefill", stack.p0.url, True), ("decode", stack.d0.url, True)]
        stack.p0.mode = "hang"
        r = c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "unhealthy"}
        assert stack.p0.url not in r.text


@pytest.mark.parametrize(
    ("client", "health_details", "shown"),
    [
        ("203.0.113.7", False, False),
        ("203.0.113.7", True, True),
        ("::1", False, True),
        ("127.0.0.2", False, True),
    ],
    ids=["remote", "remote-with-health-details", "ipv6-loopback", "ipv4-loopback"],
)
def test_health_details_go_to_loopback_clients_or_with_health_details(
    stack: Stack, client: str, health_details: bool, shown: bool
) -> None:
    config = ProxyConfig((stack.p0.url,), (stack.d0.url,), health_details=health_details)
    with TestClient(create_app(config), client=(client, 40000)) as c:
        r = c.get("/health", params={"details": "1"})
        assert r.status_code == 200
        assert ("servers" in r.json()) is shown
        assert stack.p0.url in r.text if shown else r.json() == {"status": "ok"}
        assert c.get("/health").json() == {"status": "ok"}  # details only when asked


@pytest.mark.parametrize(
    ("client", "health_details", "shown"),
    [("203.0.113.7", False, False), ("203.0.113.7", True, True), ("127.0.0.1", False, True)],
    ids=["remote", "remote-with-health-details", "loopback"],
)
def test_error_bodies_name_servers_only_to_loopback_clients_or_with_health_details(
    stack: Stack, client: str, health_details: bool, shown: bool
) -> None:
    """A failed prefill (nothing listens) and a decode stream that stalls: a remote client gets
    the stage and the status, never which server or what error (the log has them)."""
    dead = ProxyConfig((stack.dead_url,), (stack.d0.url,), health_details=health_details)
    with TestClient(create_app(dead), client=(client, 40000)) as c:
        r = c.post("/v1/completions", json=_body("/v1/completions"))
    err = r.json()["error"]
    assert r.status_code == 502 and err["stage"] == "prefill"
    assert ("server" in err) is shown and (stack.dead_url in r.text) is shown
    assert ("Connect" in err["message"] or "connect" in err["message"]) is shown
    stack.d0.mode = "stall"
    config = ProxyConfig(
        (stack.p0.url,), (stack.d0.url,), timeout_s=TIMEOUT_S, health_details=health_details
    )
    with TestClient(create_app(config), client=(client, 40000)) as c:
        r = c.post("/v1/completions", json=_body("/v1/completions", stream=True))
    events = _events(r.content)
    assert events[-2]["error"]["code"] == 504 and events[-2]["error"]["stage"] == "decode"
    assert (stack.d0.url in r.text) is shown


def test_is_loopback() -> None:
    for host in ("127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(host), host
    for host in ("10.0.0.1", "192.0.2.2", "fd00::2", "::ffff:10.0.0.1", "localhost", "", None):
        assert not is_loopback(host), host


UNSAFE_IDS = {
    "too-long": "x" * 129,
    "space": "req abc",
    "semicolon": "a;b",
    "latin1": "café",
    "percent": "a%0Ab",
    "tab": "a\tb",
}


@pytest.mark.parametrize("value", UNSAFE_IDS.values(), ids=UNSAFE_IDS.keys())
def test_an_unsafe_request_id_is_replaced_and_logged_cut_short(stack: Stack, value: str) -> None:
    with stack.main.client() as c:
        r = c.post(
            "/v1/completions",
            json=_body("/v1/completions"),
            headers={"X-Request-Id": value.encode("latin-1")},  # type: ignore[dict-item]
        )
    assert r.status_code == 200
    minted = r.headers["x-request-id"]
    assert minted.startswith("pd-") and len(minted) == 35
    [pre], [dec] = stack.p0.received, stack.d0.received
    assert pre.headers["x-request-id"] == dec.headers["x-request-id"] == minted
    line = _wait_log_line(stack.main, f"req {minted}: not the client's X-Request-Id")
    shown = repr(value)
    assert (shown if len(shown) <= 40 else shown[:37] + "...") in line
    if len(shown) > 40 or not value.isprintable():
        assert value not in stack.main.log()


def test_a_safe_request_id_is_kept_up_to_128_characters(stack: Stack) -> None:
    value = "A-z_0.9:" * 16  # 128 characters
    with stack.main.client() as c:
        r = c.post(
            "/v1/completions", json=_body("/v1/completions"), headers={"X-Request-Id": value}
        )
    assert r.headers["x-request-id"] == value
    assert stack.p0.received[0].headers["x-request-id"] == value


def test_request_id_and_short_id_are_pure() -> None:
    assert request_id(None, "pd-1") == ("pd-1", None)
    assert request_id("", "pd-1") == ("pd-1", None)
    assert request_id("ok-1", "pd-1") == ("ok-1", None)
    assert request_id("a\nb", "pd-1") == ("pd-1", "'a\\nb'")
    assert request_id("y" * 1000, "pd-1") == ("pd-1", "'" + "y" * 36 + "...")
    assert short_id("0123456789abcdef0123456789abcdef") == "01234567…"
    assert short_id(None) == "none"
    assert short_id("a\nbcdefghij") == "a\\nbcdef…"
    assert short_id(12345678901) == "12345678…"


def test_a_failed_decode_logs_only_the_start_of_the_transfer_id(stack: Stack) -> None:
    stack.d0.mode = "hang"
    with stack.main.client() as c:
        r = c.post("/v1/completions", json=_body("/v1/completions"))
    assert r.status_code == 504
    [issued] = stack.p0.issued
    line = _wait_log_line(stack.main, f"transfer_id {issued['transfer_id'][:8]}…; decode")
    assert stack.d0.url in line
    assert issued["transfer_id"] not in stack.main.log()


def test_a_stream_logs_only_the_start_of_the_transfer_id(stack: Stack) -> None:
    body = _body("/v1/chat/completions", stream=True)
    with stack.main.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and _events(r.content)[-1] == "[DONE]"
    [issued] = stack.p0.issued
    line = _wait_log_line(stack.main, f"transfer_id {issued['transfer_id'][:8]}… |")
    assert "stream started" in line
    assert issued["transfer_id"] not in stack.main.log()


def test_limits_must_be_positive() -> None:
    for bad in ({"max_request_bytes": 0}, {"max_concurrent_requests": 0}):
        with pytest.raises(ValueError, match=">= 1"):
            ProxyConfig(("http://x",), ("http://y",), **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="> 0"):
        ProxyConfig(("http://x",), ("http://y",), body_timeout_s=0)
    config = ProxyConfig(("http://x",), ("http://y",))
    assert (config.max_request_bytes, config.max_concurrent_requests) == (32 * 2**20, 512)
    assert config.body_timeout_s == 60
    assert config.health_details is False


def test_help_documents_the_limits() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "connector.serve.proxy", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert r.returncode == 0
    flags = ("--max-request-bytes", "--body-timeout-s", "--max-concurrent-requests")
    for flag in (*flags, "--health-details"):
        assert flag in r.stdout
    assert "/health?details=1" in r.stdout and "loopback" in r.stdout


# ---------------------------------------------------------------------------- shutdown


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_clean_shutdown_on_signal(stack: Stack, tmp_path: Path, sig: signal.Signals) -> None:
    proxy = ProxyProcess(
        tmp_path / "sig.log", [stack.p0.url], [stack.d0.url], "--shutdown-timeout-s", "2"
    )
    try:
        proxy.wait_ready()
        with proxy.client() as c:
            assert c.post("/v1/completions", json=_body("/v1/completions")).status_code == 200
    finally:
        rc = proxy.stop(sig, wait_s=8)
    assert rc == 0, proxy.log()
    assert f"stopped (signal: {sig.name})" in proxy.log()


def test_cli_requires_both_roles() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "connector.serve.proxy", "--prefill", "http://127.0.0.1:1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert r.returncode == 2 and "--decode" in r.stderr
