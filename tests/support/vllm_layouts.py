"""KV caches exactly as vLLM 0.32's GPU model runner allocates them, built on the CPU.

The GPU runner (``vllm/v1/worker/gpu_model_runner.py``, ``initialize_kv_cache_tensors``) takes each
layer's spec (the attention layer's ``get_kv_cache_spec``, adjusted by its backend's
``customize_spec`` in ``vllm.v1.worker.utils.customize_attention_spec``), places the layers in one
int8 allocation (``vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups``), picks the kernel
block size (``prepare_kernel_block_sizes``: the scheduler's block when layers are interleaved per
block, else ``select_common_block_size``) and registers with the KV connector the per-layer
``[num_blocks, H, N, C]`` views ``vllm.v1.worker.utils.allocate_kv_cache`` makes of that
allocation in the resolved layout's stride order. In vLLM 0.32 this is what replaced the
backends' ``get_kv_cache_shape`` / ``get_kv_cache_stride_order``: a backend publishes the shape
through ``customize_spec`` (``num_head_slots``, ``state_content_bytes``), its kernel block sizes,
and the layouts it takes (``supported_kv_cache_layouts``).

:func:`vllm_caches` calls those very functions with ``device="cpu"`` (only the memory size and the
layout resolution, which need a running engine, are given directly). Backend classes that import
on a CPU-only vLLM are used as they are; FlashInfer's module imports the ``flashinfer`` package,
which is not installed here, so :class:`FlashInferFromSource` restates its three hooks from
``vllm/v1/attention/backends/flashinfer.py``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, get_dtype_size, nvfp4_kv_cache_full_dim
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.flash_attn_diffkv import FlashAttentionDiffKVBackend
from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.triton_attn_diffkv import TritonAttentionDiffKVBackend
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    get_kv_quant_mode,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import (
    allocate_kv_cache,
    customize_attention_spec,
    select_common_block_size,
)

MODEL_DTYPE = torch.bfloat16  # what "auto" resolves to for these caches


class FlashInferFromSource:
    """FlashInfer's spec hooks as vLLM 0.32 declares them (restated: its module needs the
    ``flashinfer`` package). NVFP4 stores K and V as separate head slots (``2 * num_kv_heads``
    of them) of packed fp4 data plus fp8 block scales, ``head_size / 2 + head_size / 16`` bytes
    each; kernel blocks of 16, 32 or 64 tokens off Blackwell; any layout off SM100."""

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @classmethod
    def customize_spec(cls, spec):
        if spec.state_content_bytes is not None or not spec.kv_quant_mode.is_nvfp4:
            return spec
        width = nvfp4_kv_cache_full_dim(spec.head_size)
        return replace(
            spec,
            num_head_slots=2 * spec.num_kv_heads,
            state_content_bytes=width * get_dtype_size(spec.dtype),
        )

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [16, 32, 64]

    @classmethod
    def supported_kv_cache_layouts(cls):
        return None


@dataclass(frozen=True)
class Case:
    """One backend with one ``--kv-cache-dtype``; sizes small enough for CPU tests."""

    name: str
    backend: type
    kv_cache_dtype: str = "auto"
    mla: bool = False
    head_size: int = 64
    head_size_v: int | None = None
    num_kv_heads: int = 2
    block_size: int = 32
    num_blocks: int = 7
    num_layers: int = 2

    @property
    def layouts(self) -> list[KVCacheLayout]:
        """The layouts vLLM may resolve for this backend: those it declares, else any (the
        default preference starts at LBNHC; ``VLLM_KV_CACHE_LAYOUT`` picks another)."""
        return list(self.backend.supported_kv_cache_layouts() or KVCacheLayout)


# Every vLLM 0.32 CUDA attention backend whose cache a KV connector sees, with the cache dtypes
# that change its shape. Head sizes: what each backend accepts (MLA: 576 = 512 latent + 64 rope).
CASES = [
    Case("flash_attn", FlashAttentionBackend),
    Case("flash_attn-fp8", FlashAttentionBackend, "fp8"),
    Case("flash_attn_diffkv", FlashAttentionDiffKVBackend, head_size=64, head_size_v=32),
    Case("flashinfer", FlashInferFromSource),
    Case("flashinfer-fp8", FlashInferFromSource, "fp8_e4m3"),
    Case("flashinfer-nvfp4", FlashInferFromSource, "nvfp4", block_size=128, num_blocks=5),
    Case("triton_attn", TritonAttentionBackend),
    Case("triton_attn-fp8", TritonAttentionBackend, "fp8_e5m2"),
    Case("triton_attn-int8_per_token_head", TritonAttentionBackend, "int8_per_token_head"),
    Case("triton_attn-fp8_per_token_head", TritonAttentionBackend, "fp8_per_token_head"),
    Case("triton_attn-int4_per_token_head", TritonAttentionBackend, "int4_per_token_head"),
    Case("triton_attn_diffkv", TritonAttentionDiffKVBackend, head_size=64, head_size_v=32),
    Case("flashmla", FlashMLABackend, mla=True, head_size=576, block_size=64, num_blocks=4),
    Case("flashmla-fp8", FlashMLABackend, "fp8", mla=True, head_size=576, block_size=128),
    Case(
        "flashmla_sparse-fp8_ds_mla",
        FlashMLASparseBackend,
        "fp8_ds_mla",
        mla=True,
        head_size=576,
        block_size=64,
        num_blocks=4,
    ),
    Case("triton_mla", TritonMLABackend, mla=True, head_size=576, num_blocks=5),
    Case(
        "triton_mla-int8_per_token_head",
        TritonMLABackend,
        "int8_per_token_head",
        mla=True,
        head_size=576,
        num_blocks=5,
    ),
]


@dataclass
class Allocation:
    """What the runner made: the spec, the kernel block size, and the caches it registers."""

    spec: object
    kernel_block_size: int
    caches: list[torch.Tensor]

    @property
    def raw(self) -> torch.Tensor:
        """The whole backing allocation as bytes (every layer, padding included)."""
        storage = self.caches[0].untyped_storage()
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    @property
    def ratio(self) -> int:
        """Kernel blocks per scheduler block."""
        return self.spec.block_size // self.kernel_block_size


def layer_spec(case: Case):
    """The attention layer's spec (``Attention`` / ``MLAAttention.get_kv_cache_spec``) after
    ``customize_attention_spec``."""
    ds = case.kv_cache_dtype
    dtype = MODEL_DTYPE if ds == "auto" else STR_DTYPE_TO_TORCH_DTYPE[ds]
    common = dict(block_size=case.block_size, head_size=case.head_size, dtype=dtype)
    if case.mla:
        spec = MLAAttentionSpec(
            **common,
            num_kv_heads=1,
            max_tp_shards=1,
            cache_dtype_str=ds,
            kv_quant_mode=get_kv_quant_mode(ds),
            state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(ds),
        )
    else:
        spec = FullAttentionSpec(
            **common,
            num_kv_heads=case.num_kv_heads,
            head_size_v=case.head_size_v or case.head_size,
            kv_quant_mode=get_kv_quant_mode(ds),
        )
    return customize_attention_spec(case.backend, spec)


def vllm_caches(
    case: Case, layout: KVCacheLayout, fill: int | None = None, device: str = "cpu"
) -> Allocation:
    """Allocate ``case``'s caches as the GPU runner does, on ``device`` (the CPU in these tests;
    a GPU check can pass ``"cuda"``), in ``layout``; the backing bytes random (seeded by
    ``layout`` and ``case``) or all ``fill``."""
    spec = layer_spec(case)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(case.num_layers)]
    config = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=case.num_blocks,
            prefix_cache_retention_interval=None,
        ),
    )
    kv_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(names, spec)], 1 << 40)
    (tensor,) = kv_config.kv_cache_tensors
    if tensor.block_stride > tensor.layer_stride:  # interleaved per block: never split
        kernel_block_size = spec.block_size
    else:
        kernel_block_size = select_common_block_size(spec.block_size, [case.backend], [spec])
    caches = allocate_kv_cache(kv_config, torch.device(device), layout, [kernel_block_size])
    out = Allocation(spec, kernel_block_size, [caches[n] for n in names])
    raw = out.raw
    if fill is None:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{case.name}-{layout.name}".encode()))
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    else:
        raw.fill_(fill)
    return out


def cells(cache: torch.Tensor) -> torch.Tensor:
    """vLLM's logical ``[kernel blocks, H, N, C]`` view of ``cache`` in bytes (C of them)."""
    return cache.view(torch.uint8)


def copy_cells(want: Allocation, src: Allocation, moves: list[tuple[int, int]]) -> None:
    """What a transfer should have done, through vLLM's own views only: for each ``(src_slot,
    dst_slot)`` in ``moves`` (``block * block_size + offset`` in scheduler blocks, which is
    ``kernel_block * kernel_block_size + offset`` too), every head slot's whole cell of that
    token, in every layer, copied from ``src`` into ``want``."""
    n = want.kernel_block_size
    for src_cache, want_cache in zip(src.caches, want.caches, strict=True):
        s, w = cells(src_cache), cells(want_cache)
        for src_slot, dst_slot in moves:
            w[dst_slot // n, :, dst_slot % n] = s[src_slot // n, :, src_slot % n]


# -- geometry for the GPU check ----------------------------------------------------------------
# The GPU machine has no vLLM: the caches' geometry (shape, strides, offset and dtype of every
# tensor registered with the connector, in one backing allocation) goes there as JSON
# (tests/data/cuda_geometry.json, read by support.cuda_geometry), written from these functions.

GEOMETRY_CASES = ["flashmla", "flashmla-fp8", "flashmla_sparse-fp8_ds_mla", "triton_mla"]
GEOMETRY_CASES += ["triton_mla-int8_per_token_head"]
# A gated-delta-net hybrid's TP shard in miniature: conv state [3, 256] bf16, SSM state
# [4, 32, 32] fp32 (Qwen3-Next's shapes shrunk), six state layers beside two FlashAttention ones.
HYBRID_STATE_SHAPES = ((3, 256), (4, 32, 32))
HYBRID_STATE_DTYPES = (torch.bfloat16, torch.float32)
HYBRID_LAYERS = {"attention": (3, 7), "state": (0, 1, 2, 4, 5, 6)}


def _config(layout: KVCacheLayout, num_blocks: int) -> SimpleNamespace:
    return SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=num_blocks,
            prefix_cache_retention_interval=None,
        ),
    )


def hybrid_state_caches(num_blocks: int = 9) -> tuple[dict, dict[str, torch.Tensor]]:
    """A gated-delta-net + FlashAttention model's caches as the GPU runner allocates them in
    vLLM's default layout: the attention block size raised until an attention page holds a state
    page, the state page padded to the attention page (``Platform`` hybrid config update, mamba
    cache mode "align"), both groups overlaid in one allocation (their blocks share bytes).

    Returns:
        ``(groups, caches)``: ``{"attention": (spec, names), "state": (spec, names)}`` and the
        tensors registered with the connector by layer name.
    """
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    shapes, dtypes = HYBRID_STATE_SHAPES, HYBRID_STATE_DTYPES
    state_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    attn = layer_spec(Case("flash_attn", FlashAttentionBackend, block_size=16))
    align = 16  # FlashAttention's kernel blocks: multiples of 16
    block_size = align * -(-state_page // (align * attn.page_size_bytes // attn.block_size))
    attn = replace(attn, block_size=block_size)
    state = MambaSpec(
        shapes=shapes,
        dtypes=dtypes,
        block_size=block_size,
        page_size_padded=attn.page_size_bytes,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )
    names = {
        "attention": [f"model.layers.{i}.self_attn.attn" for i in HYBRID_LAYERS["attention"]],
        "state": [f"model.layers.{i}.linear_attn" for i in HYBRID_LAYERS["state"]],
    }
    layout = KVCacheLayout.LBNHC  # vLLM's first preference
    groups = [KVCacheGroupSpec(names["attention"], attn), KVCacheGroupSpec(names["state"], state)]
    kv_config = get_kv_cache_config_from_groups(_config(layout, num_blocks), groups, 1 << 40)
    caches = allocate_kv_cache(kv_config, torch.device("cpu"), layout, [block_size, block_size])
    return {"attention": (attn, names["attention"]), "state": (state, names["state"])}, caches


def _tensor_geometry(t: torch.Tensor) -> dict:
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "offset": t.storage_offset(),
    }


def cuda_geometry() -> dict:
    """The geometry of every case of the GPU check (see above): per case its backing allocation's
    bytes, and per KV cache group its kind, block size, head size and tensors."""
    out = {}
    for case in CASES:
        if case.name not in GEOMETRY_CASES:
            continue
        alloc = vllm_caches(case, KVCacheLayout.LBNHC, fill=0)
        group = {"kind": "mla" if case.mla else "attention", "block_size": case.block_size}
        group |= {
            "head_size": case.head_size,
            "tensors": [_tensor_geometry(c) for c in alloc.caches],
        }
        out[case.name] = {"bytes": alloc.raw.numel(), "groups": [group]}
    groups, caches = hybrid_state_caches()
    raw = next(iter(caches.values())).untyped_storage().nbytes()
    attn_spec, attn_names = groups["attention"]
    state_spec, state_names = groups["state"]
    out["gdn_hybrid-flash_attn"] = {
        "bytes": raw,
        "groups": [
            {"kind": "attention", "block_size": attn_spec.block_size, "head_size": 64,
             "tensors": [_tensor_geometry(caches[n]) for n in attn_names]},
            {"kind": "state", "block_size": state_spec.block_size, "head_size": None,
             "tensors": [_tensor_geometry(caches[n]) for n in state_names]},
        ],
    }  # fmt: skip
    return out


if __name__ == "__main__":  # PYTHONPATH=tests python -m support.vllm_layouts --write
    import json
    import sys
    from pathlib import Path

    from support.cuda_geometry import GEOMETRY_FILE

    text = json.dumps(cuda_geometry(), indent=1) + "\n"
    if sys.argv[1:] == ["--write"]:
        Path(GEOMETRY_FILE).write_text(text)
    else:
        print(text, end="")
