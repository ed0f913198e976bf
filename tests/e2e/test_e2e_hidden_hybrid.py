"""End to end: ``extract_hidden_states`` through TritonKVConnector on a hybrid model, a tiny
Qwen3-Next (gated-delta-net state layers beside full attention, bfloat16), whose KV needs two
cache groups beside the hidden-state layer's own (its block size 32, the attention groups' 160):
every request's hidden states are the model's (the prompt's, and with ``include_output_tokens``
the whole sequence's), checked against transformers' own hidden states of the same weights in
float32, over files and the network, the same bits both ways.

vLLM 0.32 on the CPU runs this only with prefix caching off (``--no-enable-prefix-caching``: its
``align`` state mode copies states between speculative blocks with a Triton kernel, which the
connector refuses by name at start; ``tests/vllm_connector/test_hidden_groups.py``). Such a
producer saves no prompt's KV: a ``do_remote_decode`` request gets its hidden states, whole, but
no hand-off, and the refusal is logged by name at start.

bfloat16 activations against a float32 reference differ by a few percent (relative to each
token's norm, worst on the last layer: MoE routing near ties); the tolerance :data:`TOL` is set
from that, and negative controls (the states of another prompt, of the neighbouring aux layer, and
zeros) miss it by far. One server, a 64-token chunked-prefill budget (the 150-token prompt takes
three steps), started once for the module.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from support.e2e import hidden_states_config, run_concurrently
from support.vllm_fixtures import requires_vllm

from connector.hidden import load_hidden_states, prompt_digest, read_hidden_file
from connector.serve.launch import Cluster, free_port, free_port_run, http_json

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

LAYERS = [1, 3]  # aux ids: what enters layer 1 (full attention) and layer 3 (the last)
SECRET = "hidden-hybrid-shared-secret-0123456789abcdef"
LENGTHS = [5, 40, 150]  # one block of the hidden-state group, two, five (and three prefill steps)
#: the largest relative difference (``||got - ref|| / ||ref||``) allowed between vLLM's bfloat16
#: hidden states and transformers' float32 ones, over a prompt and for its median token (seen:
#: at most 0.072 and 0.06; a single token up to 0.42, on the last layer)
TOL = 0.15


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from connector.serve.tiny_model import build_tiny_qwen3_next

    model = build_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next_hidden") / "model")
    workdir = tmp_path_factory.mktemp("e2e_hidden_hybrid")
    storage = workdir / "dataset"
    spec = hidden_states_config(LAYERS)
    kv_port = free_port_run(1)
    cluster = Cluster(workdir)
    try:
        proc = cluster.start_vllm(
            "hidden", model, free_port(), role="kv_producer", kv_port=kv_port, dtype="bfloat16",
            extra_config={"shared_storage_path": str(storage)},
            env={"TORCHDYNAMO_DISABLE": "1", "TRITONKV_SECRET": SECRET},
            args=["--speculative-config", json.dumps(spec), "--max-num-batched-tokens", "64",
                  "--no-enable-prefix-caching"],
        )  # fmt: skip
        cluster.wait_ready([proc], timeout_s=400)
        yield proc, model
    finally:
        cluster.stop()


def _ask(url: str, prompt: list[int], **params) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, **params}
    return http_json(url + "/v1/completions", body, timeout_s=300)["kv_transfer_params"]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``[num_tokens]`` relative differences of ``got`` from ``ref`` (both ``[num_tokens,
    hidden_size]``), each token against its own norm."""
    return (got - ref).norm(dim=-1) / ref.norm(dim=-1)


def _reference(model_dir, prompt: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' hidden states of ``prompt``, float32: entry ``i`` ``[num_tokens,
    hidden_size]`` is what enters layer ``i``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    return tuple(h[0] for h in out)


def test_hidden_states_are_the_models(server) -> None:
    proc, model_dir = server
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
    replies = run_concurrently(lambda p: _ask(proc.url, p), [(p,) for p in prompts])
    refs = [_reference(model_dir, p) for p in prompts]
    for i, (prompt, params) in enumerate(zip(prompts, replies, strict=True)):
        assert params["hidden_states_num_tokens"] == len(prompt)
        assert params["hidden_states_digest"] == prompt_digest(prompt)
        got = read_hidden_file(params["hidden_states_path"], timeout_s=60)
        assert got["token_ids"].tolist() == prompt
        assert got["hidden_states"].shape == (len(prompt), len(LAYERS), 128)
        assert got["hidden_states"].dtype == torch.bfloat16
        net = load_hidden_states(params["hidden_states_host"], params["hidden_states_port"],
                                 params["hidden_states_transfer_id"],
                                 params["hidden_states_digest"], secret=SECRET, timeout_s=60)  # fmt: skip
        assert torch.equal(net["hidden_states"].view(torch.int16),
                           got["hidden_states"].view(torch.int16))  # fmt: skip
        states = got["hidden_states"].float()
        other = refs[(i + 1) % len(refs)]  # another prompt's, as long as it goes
        for k, layer in enumerate(LAYERS):
            ref, mine = refs[i][layer], states[:, k]
            assert mine.abs().amax(dim=-1).min() > 0, "a token's hidden states are all zero"
            rel = _rel(mine, ref)
            whole = float((mine - ref).norm() / ref.norm())
            assert whole < TOL, (len(prompt), layer, whole)
            assert float(rel.median()) < TOL, (len(prompt), layer, rel.tolist())
            # Negative controls, each far beyond the tolerance (seen: 0.71, 1.3, 1): the
            # neighbouring aux layer's states, another prompt's, and nothing at all.
            shifted = refs[i][layer - 1]
            assert float((mine - shifted).norm() / shifted.norm()) > 3 * TOL
            n = min(len(prompt), other[layer].shape[0])
            assert float(_rel(mine[:n], other[layer][:n]).median()) > 3 * TOL
            assert float(_rel(torch.zeros_like(ref), ref).min()) > 3 * TOL


def test_do_remote_decode_gets_its_hidden_states_but_no_handoff(server) -> None:
    """A model with state layers: this producer saves no KV (a save would compute the prompt one
    token short); the request is answered, its hidden states hold the whole prompt, its params
    no hand-off, and the refusal is in the log by name (once, at start)."""
    proc, model_dir = server
    prompt = [random.Random(5).randrange(3, 500) for _ in range(70)]
    params = _ask(proc.url, prompt, kv_transfer_params={"do_remote_decode": True})
    assert "transfer_id" not in params and "remote_host" not in params, params
    assert params["hidden_states_num_tokens"] == len(prompt)
    got = read_hidden_file(params["hidden_states_path"], timeout_s=60)
    assert got["token_ids"].tolist() == prompt
    ref = _reference(model_dir, prompt)[LAYERS[-1]]
    assert float((got["hidden_states"][:, -1].float() - ref).norm() / ref.norm()) < TOL
    log = proc.log_text()
    assert "this producer takes hidden states but saves no prompt's KV" in log
    assert log.count("saves no prompt's KV") == 1


def test_include_output_tokens(server) -> None:
    """The whole sequence (``include_output_tokens``): the prompt and every output fed back, from
    the blocks vLLM keeps for the finished request in the hidden-state group, the model's."""
    proc, model_dir = server
    prompt = [random.Random(9).randrange(3, 500) for _ in range(40)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True,
            "kv_transfer_params": {"include_output_tokens": True}}  # fmt: skip
    reply = http_json(proc.url + "/v1/completions", body, timeout_s=300)
    fed = prompt + reply["choices"][0]["token_ids"][:-1]
    params = reply["kv_transfer_params"]
    assert params["hidden_states_num_tokens"] == len(fed) == 44
    got = read_hidden_file(params["hidden_states_path"], timeout_s=60)
    assert got["token_ids"].tolist() == fed
    refs = _reference(model_dir, fed)
    for k, layer in enumerate(LAYERS):
        mine, ref = got["hidden_states"][:, k].float(), refs[layer]
        assert float((mine - ref).norm() / ref.norm()) < TOL, layer
        assert float(_rel(mine[len(prompt) :], ref[len(prompt) :]).median()) < TOL, layer
