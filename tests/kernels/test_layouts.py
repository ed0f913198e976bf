"""Layout view builders address exactly the documented elements and share storage."""

from __future__ import annotations

import pytest
import torch

from tritonkv import layouts

B, N, H, D = 3, 4, 2, 5


def _arange(*shape):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.int64).view(shape)


def test_flash_attn_nhd_and_hnd():
    for cache in (_arange(2, B, N, H, D), _arange(2, B, H, N, D).transpose(2, 3)):
        k, v = layouts.flash_attn(cache)
        assert k.shape == v.shape == (B, H, N, D)
        assert k[2, 1, 3, 4] == cache[0, 2, 3, 1, 4] and v[1, 0, 2, 3] == cache[1, 1, 2, 0, 3]
        assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()


def test_flashinfer():
    cache = _arange(B, 2, N, H, D)
    k, v = layouts.flashinfer(cache)
    assert k[2, 1, 3, 4] == cache[2, 0, 3, 1, 4] and v[0, 1, 1, 2] == cache[0, 1, 1, 1, 2]


def test_mla_has_no_v():
    cache = _arange(B, N, 576)
    latent, v = layouts.mla(cache)
    assert v is None and latent.shape == (B, 1, N, 576)
    assert latent[1, 0, 2, 500] == cache[1, 2, 500]


@pytest.mark.parametrize("physical", ["LBHNC", "LBNHC"])
def test_vllm_pages_any_permutation(physical):
    cache = (
        _arange(B, H, N, 2 * D) if physical == "LBHNC" else _arange(B, N, H, 2 * D).transpose(1, 2)
    )
    k, v = layouts.vllm_pages(cache)
    assert k[1, 1, 2, 3] == cache[1, 1, 2, 3] and v[1, 1, 2, 3] == cache[1, 1, 2, D + 3]


@pytest.mark.parametrize("isa", ["vec", "vec16", "vsx", "vxe", "rvv"])
def test_vllm_cpu_k_is_transposed_inside_each_chunk(isa):
    cache = _arange(B, H, N, 2 * D)
    k, v = layouts.vllm_cpu(cache, isa=isa)
    flat = cache.flatten()
    for b, h, n, d in [(0, 0, 0, 0), (2, 1, 3, 4), (1, 0, 2, 1)]:
        chunk = (b * H + h) * N * 2 * D
        assert k[b, h, n, d] == flat[chunk + d * N + n]
        assert v[b, h, n, d] == flat[chunk + N * D + n * D + d]
    # K and V together cover every element of the cache exactly once.
    seen = torch.cat([k.flatten(), v.flatten()]).sort().values
    assert torch.equal(seen, flat)
    # The views and the written-down offsets agree element for element.
    k_off, v_off = layouts.vllm_cpu_offsets(isa, N, D, cache.dtype)
    chunks = flat.view(B, H, 2 * N * D)
    assert torch.equal(k, chunks[:, :, k_off]) and torch.equal(v, chunks[:, :, v_off])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_vllm_cpu_amx_offsets_cover_each_chunk_once_and_match_the_worked_example(dtype):
    block_size, head_size = 32, 64
    k_off, v_off = layouts.vllm_cpu_offsets("amx", block_size, head_size, dtype)
    seen = torch.cat([k_off.flatten(), v_off.flatten()]).sort().values
    assert torch.equal(seen, torch.arange(2 * block_size * head_size))
    if dtype != torch.float32:  # the module docstring's example (P = 2)
        assert (int(k_off[18, 5]), int(v_off[18, 5])) == (1093, 2346)
        # Channel pairs of one token are neighbours in K; token pairs of one channel in V.
        assert int(k_off[18, 5] - k_off[18, 4]) == 1 and int(v_off[19, 5] - v_off[18, 5]) == 1
    else:  # P = 1: 16-token runs in K, 16-channel runs in V
        assert int(k_off[18, 5] - k_off[17, 5]) == 1 and int(v_off[18, 5] - v_off[18, 4]) == 1


@pytest.mark.parametrize(
    "isa,dtype,match",
    [
        ("amx", torch.bfloat16, "'amx' interior of a bfloat16 cache splits"),
        ("neon", torch.bfloat16, "depends on how the wheel was built"),
    ],
)
def test_vllm_cpu_refuses_interiors_no_view_expresses(isa, dtype, match):
    with pytest.raises(ValueError, match=match):
        layouts.vllm_cpu(torch.zeros(B, H, 32, 64, dtype=dtype), isa=isa)


def test_vllm_cpu_neon_views_for_other_dtypes_and_no_default_isa():
    assert layouts.vllm_cpu_interior("neon", torch.float32) == "vec"
    with pytest.raises(TypeError, match="isa"):
        layouts.vllm_cpu(_arange(B, H, N, 2 * D))  # the ISA is never assumed
    with pytest.raises(ValueError, match="expected one of"):
        layouts.vllm_cpu(_arange(B, H, N, 2 * D), isa="avx512")


def test_opaque_pages_cover_each_page_once():
    cache = _arange(B, 7, 3, 8)  # a page of 168 values, block_size 4 -> rows of 42
    pages, v = layouts.opaque_pages(cache, 4)
    assert v is None and pages.shape == (B, 1, 4, 42)
    assert torch.equal(pages.flatten(), cache.flatten())


def test_opaque_pages_of_a_permuted_cache_cover_each_page_in_memory_order():
    """An HND cache seen in NHD order (FlashAttention's K half): a page is the memory it covers."""
    raw = _arange(B, H, N, D)  # memory order [B, H, N, D]
    pages, _ = layouts.opaque_pages(raw.transpose(1, 2), N)  # logical [B, N, H, D]
    assert pages.shape == (B, 1, N, H * D)
    assert torch.equal(pages.flatten(), raw.flatten())


@pytest.mark.parametrize(
    "cache",
    [
        _arange(B, N, 2 * D)[..., :D],  # a page with holes (half of each row)
        _arange(B + 1, N, D).as_strided((B, N, D), (N * D // 2, D, 1)),  # pages overlap
    ],
)
def test_opaque_pages_refuse_pages_that_are_not_one_range_each(cache):
    with pytest.raises(ValueError, match="dense, non-overlapping pages"):
        layouts.opaque_pages(cache, N)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: layouts.flash_attn(torch.zeros(3, B, N, H, D)), ValueError, "size 2"),
        (lambda: layouts.flash_attn(torch.zeros(B, N, H, D)), ValueError, "5-D"),
        (lambda: layouts.flashinfer(torch.zeros(B, 3, N, H, D)), ValueError, "size 2"),
        (lambda: layouts.mla([1, 2]), TypeError, "torch.Tensor"),
        (lambda: layouts.vllm_pages(torch.zeros(B, H, N, 7)), ValueError, "odd"),
        (lambda: layouts.vllm_pages(torch.zeros(B, H, N, 8), head_size=3), ValueError, "head_size"),
        (
            lambda: layouts.vllm_cpu(torch.zeros(B, N, H, 8).transpose(1, 2), isa="vec"),
            ValueError,
            "contiguous",
        ),
        (lambda: layouts.opaque_pages(torch.zeros(B, 10), 3), ValueError, "divisor"),
    ],
)
def test_bad_caches_are_rejected(call, error, match):
    with pytest.raises(error, match=match):
        call()
