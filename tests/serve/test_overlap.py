"""The proxy's overlapped flow (``--overlap``: ``connector/serve/overlap.py``) against fake servers.

The proxy runs in-process (Starlette's TestClient drives its app and lifespan); the fakes
(``tests/support/fake_openai.py``) run on a loop thread of their own. A prefill fake holding its
answer behind a gate shows whether the decode call waited for it. No vLLM engine is involved.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("fastapi")

from starlette.testclient import TestClient
from support.fake_openai import FakeServer, LoopThread
from support.vllm_fixtures import captured_log

from connector.serve import overlap
from connector.serve.launch import free_port
from connector.serve.proxy import create_app
from connector.serve.router import ProxyConfig
from connector.vllm_connector import handoff as connector_handoff

pytestmark = pytest.mark.timeout(60)

PATH = "/v1/completions"
BODY = {"model": "fake-model", "prompt": "The quick brown fox", "max_tokens": 5, "seed": 3}


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[FakeServer, FakeServer]]:
    lt = LoopThread()
    prefill, decode = FakeServer(lt, "P0", "prefill"), FakeServer(lt, "D0", "decode")
    for server in (prefill, decode):
        server.start()
    try:
        yield prefill, decode
    finally:
        for server in (prefill, decode):
            server.stop()
        lt.stop()


@pytest.fixture
def servers(fakes: tuple[FakeServer, FakeServer]) -> tuple[FakeServer, FakeServer]:
    for server in fakes:
        server.reset()
    return fakes


def _proxy(prefill: FakeServer, decode: FakeServer, **kw: Any) -> TestClient:
    config = ProxyConfig((prefill.url,), (decode.url,), overlap=True, **kw)
    return TestClient(create_app(config))


def _wait(what: str, done: Callable[[], bool], wait_s: float = 10.0) -> None:
    """Polls ``done`` until it holds (a deadline only, never a measured time)."""
    end = time.monotonic() + wait_s
    while not done():
        if time.monotonic() > end:
            pytest.fail(f"{what} did not happen within {wait_s} s")
        time.sleep(0.01)


def _sequential(client: TestClient, prefill: FakeServer, decode: FakeServer) -> dict[str, Any]:
    """One request served sequentially (the prefill server's first, or after a failure): the
    producer mints the id, the decode server gets its hand-off as is. Returns that hand-off."""
    n = len(prefill.received)
    r = client.post(PATH, json=BODY)
    assert r.status_code == 200, r.text
    assert prefill.received[n].body["kv_transfer_params"] == {"do_remote_decode": True}
    issued = prefill.issued[-1]
    assert decode.received[-1].body["kv_transfer_params"] == issued
    return issued


def test_a_servers_first_request_is_sequential_and_the_next_ones_overlap(servers) -> None:
    """The first hand-off teaches the proxy the producer's site; the next request reaches the
    decode server, and its answer the client, while the prefill answer is still held back,
    with a hand-off naming that site and the id the producer was asked to save under."""
    prefill, decode = servers
    with _proxy(prefill, decode) as client:
        issued = _sequential(client, prefill, decode)
        prefill.make_gate()  # the prefill answer waits until the client got its own
        r = client.post(PATH, json=BODY)
        assert r.status_code == 200, r.text
        assert r.json()["served_by"] == "D0"
        assert len(prefill.received) == 2 and len(prefill.issued) == 1  # still held back
        chosen = prefill.received[1].body["kv_transfer_params"]
        assert set(chosen) == {"do_remote_decode", "transfer_id"}
        tid = chosen["transfer_id"]
        assert chosen["do_remote_decode"] is True and connector_handoff.TRANSFER_ID.fullmatch(tid)
        sent = decode.received[1].body
        assert sent == {**BODY, "kv_transfer_params": sent["kv_transfer_params"]}
        site = {k: issued[k] for k in overlap.SITE_KEYS}
        assert sent["kv_transfer_params"] == {**site, "transfer_id": tid, "overlap": True}
        assert r.json()["kv_transfer_params"]["transfer_id"] == tid
        prefill.open_gate()
        _wait("the held prefill answer", lambda: len(prefill.issued) == 2)
        assert prefill.issued[1]["transfer_id"] == tid
        # every request gets an id of its own
        client.post(PATH, json=BODY)
        third = prefill.received[2].body["kv_transfer_params"]["transfer_id"]
        assert (
            third != tid and decode.received[2].body["kv_transfer_params"]["transfer_id"] == third
        )


def test_the_site_follows_the_producers_latest_hand_off(servers) -> None:
    """Each overlapped prefill answer confirms the site again: a producer that moved (here the
    fake's port changes with every answer) is looked for where it said it is now."""
    prefill, decode = servers
    with _proxy(prefill, decode) as client:
        _sequential(client, prefill, decode)
        client.post(PATH, json=BODY)
        _wait("the overlapped prefill answer", lambda: len(prefill.issued) == 2)
        client.post(PATH, json=BODY)
        assert (
            decode.received[2].body["kv_transfer_params"]["remote_port"]
            == (prefill.issued[1]["remote_port"])
        )
        assert prefill.issued[1]["remote_port"] != prefill.issued[0]["remote_port"]


def test_an_overlapped_stream_is_relayed_while_the_prefill_is_held(servers) -> None:
    prefill, decode = servers
    with _proxy(prefill, decode) as client:
        _sequential(client, prefill, decode)
        prefill.make_gate()
        with client.stream("POST", PATH, json={**BODY, "stream": True}) as r:
            assert r.status_code == 200
            raw = b"".join(r.iter_raw())
        events = [b[6:] for b in raw.decode().split("\n\n") if b.startswith("data: ")]
        assert events[-1] == "[DONE]" and [json.loads(e)["seq"] for e in events[:-1]] == [
            0,
            1,
            2,
            3,
        ]
        assert len(prefill.issued) == 1  # the whole stream went out before the prefill answered
        prefill.open_gate()
        _wait("the held prefill answer", lambda: len(prefill.issued) == 2)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_decode_call_that_fails_cancels_the_prefill_call(servers, stream: bool) -> None:
    """A decode server answering an error: the client gets that answer, and the prefill call is
    closed (vLLM aborts the request, and drops its KV) rather than left to finish for nobody."""
    prefill, decode = servers
    with _proxy(prefill, decode) as client:
        _sequential(client, prefill, decode)
        prefill.make_gate()
        decode.mode, decode.error_status = "error", 503
        r = client.post(PATH, json={**BODY, "stream": stream})
        assert r.status_code == 503 and "D0 refuses" in r.text
        _wait("the prefill call's close", lambda: prefill.disconnects == 1)
        assert len(prefill.issued) == 1


def test_a_prefill_server_that_failed_is_served_sequentially_again(servers) -> None:
    """An overlapped prefill call that fails (here: past the prefill limit) is logged and
    forgets the site: the server may come back elsewhere, so its next request goes sequential
    and learns the site anew. The client got the decode answer all along."""
    prefill, decode = servers
    with (
        _proxy(prefill, decode, prefill_timeout_s=0.3) as client,
        captured_log("vllm.tritonkv.proxy") as logs,
    ):
        _sequential(client, prefill, decode)
        prefill.mode = "hang"
        r = client.post(PATH, json=BODY)
        assert r.status_code == 200 and r.json()["served_by"] == "D0"
        _wait("the prefill call's timeout", lambda: prefill.disconnects == 1)
        _wait("its warning", lambda: any("did not complete" in x.getMessage() for x in logs))
        prefill.mode = "ok"
        issued = _sequential(client, prefill, decode)
        client.post(PATH, json=BODY)
        site = {k: issued[k] for k in overlap.SITE_KEYS}
        assert {k: decode.received[-1].body["kv_transfer_params"][k] for k in site} == site


def test_a_producer_that_saves_under_its_own_id_is_never_overlapped_again(servers) -> None:
    """A producer that does not take the proxy's id (an older tritonkv) would make every
    overlapped decode wait in vain: after its first such answer (warned), it is served
    sequentially for good."""
    prefill, decode = servers
    prefill.honor_ids = False
    with _proxy(prefill, decode) as client, captured_log("vllm.tritonkv.proxy") as logs:
        _sequential(client, prefill, decode)
        client.post(PATH, json=BODY)
        assert "transfer_id" in prefill.received[1].body["kv_transfer_params"]
        _wait("the warning", lambda: any("another transfer id" in x.getMessage() for x in logs))
        for _ in range(3):
            _sequential(client, prefill, decode)


def test_without_overlap_nothing_is_sent_before_the_hand_off(servers) -> None:
    """The default stays the sequential flow: no proxy-chosen id, decode after prefill."""
    prefill, decode = servers
    config = ProxyConfig((prefill.url,), (decode.url,))
    assert config.overlap is False
    with TestClient(create_app(config)) as client:
        for _ in range(3):
            _sequential(client, prefill, decode)


def test_what_the_proxy_writes_the_consumer_completes_into_the_producers_hand_off() -> None:
    """The overlapped hand-off (the site of an earlier hand-off, a new id, ``overlap``),
    completed by a consumer from its own prompt, is exactly the hand-off the producer gives for
    that prompt and id: the consumer checks and loads it as one. Both sides name one key."""
    assert overlap.OVERLAP == connector_handoff.OVERLAP
    tokens, tid = [5, 9, 2, 7, 7, 1], "ab" * 16

    def handoff(transfer_id: str, token_ids: list[int]) -> dict[str, Any]:
        return connector_handoff.build_handoff(
            transfer_id=transfer_id,
            host="10.0.0.7",
            engine_port=14600,
            num_tokens=len(token_ids),
            prompt_digest=connector_handoff.prompt_digest(token_ids),
            fingerprint="float32|4|2|32",
            tp_size=2,
        )

    earlier = {**handoff("cd" * 16, [1, 2, 3]), "remote_prefill_cached_tokens": 0}
    written = overlap.overlap_params(overlap.site_of(earlier), tid)
    assert "num_tokens" not in written and "prompt_digest" not in written
    done = connector_handoff.completed(written, SimpleNamespace(prompt_token_ids=tokens))
    assert {k: v for k, v in done.items() if k != "overlap"} == handoff(tid, tokens)
    assert connector_handoff.handoff_problems(done) == []
    assert (
        connector_handoff.completed(earlier, SimpleNamespace(prompt_token_ids=tokens)) is earlier
    )  # not overlapped: as it is
    # only a tritonkv hand-off that names its whole site is one
    assert overlap.site_of(None) is None
    assert overlap.site_of({**earlier, "protocol": "nixl"}) is None
    assert overlap.site_of({k: v for k, v in earlier.items() if k != "tp_size"}) is None


def test_a_client_leaving_before_the_first_token_cancels_both_calls(servers, tmp_path) -> None:
    """The decode server sent its headers and the prefill still runs when the client leaves:
    the proxy (a real ``--overlap`` process, so that the client really disconnects) closes both
    calls, so both servers abort the request and the producer stores nothing for nobody."""
    prefill, decode = servers
    port = free_port()
    log = (tmp_path / "proxy.log").open("w")
    args = [sys.executable, "-m", "connector.serve.proxy", "--overlap", "--port", str(port)]
    proc = subprocess.Popen(
        [*args, "--prefill", prefill.url, "--decode", decode.url], stdout=log, stderr=log
    )
    try:
        _wait("the proxy", lambda: _listens(port))
        url = f"http://127.0.0.1:{port}{PATH}"
        with httpx.Client(timeout=10, trust_env=False) as client:
            assert client.post(url, json=BODY).status_code == 200  # learns the site
            prefill.make_gate()
            decode.mode = "headers"
            with pytest.raises(httpx.ReadTimeout):
                client.post(url, json={**BODY, "stream": True}, timeout=1.0)
        _wait("both calls closed", lambda: (prefill.disconnects, decode.disconnects) == (1, 1))
        assert len(prefill.issued) == 1
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _listens(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


@pytest.mark.parametrize("failure", ["error", "no_kv", "other_id"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_prefill_failing_before_the_decode_answered_sends_the_decode_again_alone(
    servers, stream: bool, failure: str
) -> None:
    """A decode server waiting for the KV of a prefill that failed (an error answer, no
    hand-off, or one under another id) would wait out its ``prefill_wait_s``: the proxy closes
    that decode call (vLLM aborts the request) and sends the client's body again without a
    hand-off, so the prompt is computed at once. The client gets that answer."""
    prefill, decode = servers
    with _proxy(prefill, decode) as client, captured_log("vllm.tritonkv.proxy") as logs:
        _sequential(client, prefill, decode)
        decode.await_kv = True
        if failure == "error":
            prefill.mode, prefill.error_status = "error", 500
        elif failure == "no_kv":
            prefill.mode = "no_kv"
        else:
            prefill.honor_ids = False
        r = client.post(PATH, json={**BODY, "stream": stream})
        assert r.status_code == 200, r.text
        assert "D0" in r.text  # the answer of the decode call sent again
        _wait("the waiting decode call's close", lambda: decode.disconnects == 1)
        assert len(decode.received) == 3
        assert decode.received[1].body["kv_transfer_params"]["overlap"] is True
        assert decode.received[2].body == {**BODY, "stream": stream}  # no hand-off
        assert any("sent again without a hand-off" in x.getMessage() for x in logs)


def test_a_prefill_failing_after_the_decode_answered_changes_nothing(servers) -> None:
    """Once the decode answer came (here a stream's first bytes, before the held prefill
    fails), the prefill's failure is only logged: nothing is sent again."""
    prefill, decode = servers
    with _proxy(prefill, decode) as client, captured_log("vllm.tritonkv.proxy") as logs:
        _sequential(client, prefill, decode)
        prefill.make_gate()
        prefill.honor_ids = False
        with client.stream("POST", PATH, json={**BODY, "stream": True}) as r:
            assert r.status_code == 200
            chunks = r.iter_raw()
            first = next(chunks)
            prefill.open_gate()
            _wait(
                "the prefill's warning",
                lambda: any("another transfer id" in x.getMessage() for x in logs),
            )
            raw = first + b"".join(chunks)
        assert raw.decode().count("data: ") == 5  # 4 chunks and [DONE], from the one call
        assert len(decode.received) == 2 and decode.disconnects == 0
