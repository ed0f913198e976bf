"""Kernel internals checked on purpose, where the public API cannot show them.

- The GPU path's sequence index (one launch of ``_seq_index_kernel``, run here under the
  interpreter) against the host's: the public ops build it only for offsets on a GPU, so it is
  called directly (``tritonkv._index``).
- The per-view-set cache (``tritonkv._layer_sets.LAYER_SETS``): that it holds nothing once the
  caller's views are gone and keeps a CUDA graph's address table while they live is invisible in
  the ops' results.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kv_cases import every_other, make_cache

from tritonkv import pack_kv
from tritonkv._index import device_seq_index, host_seq_index
from tritonkv._layer_sets import LAYER_SETS

SEED_QSL = torch.tensor([0, 18, 19, 20], dtype=torch.int32)  # an 18-token prefill, two decodes


def _slots(num_tokens: int, num_slots: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_slots, generator=gen)[:num_tokens].to(torch.int64)


@pytest.mark.parametrize("seq_ids", [None, [2, 0]], ids=["all", "some"])
@pytest.mark.parametrize("last_only", [False, True], ids=["all_rows", "last_only"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_device_index_is_contiguous(dtype, last_only, seq_ids):
    """The GPU path's index (device ops only; run here on CPU tensors) equals the host path's and
    is contiguous even for non-contiguous offsets (an int64 query_start_loc was used as it is)."""
    qsl = every_other(SEED_QSL.to(dtype))
    ids = None if seq_ids is None else every_other(torch.tensor(seq_ids))
    got = device_seq_index(qsl, ids, torch.device("cpu"), last_only)
    want = host_seq_index(qsl, ids, 20, last_only)
    assert got.cu_seqlens.is_contiguous() and got.src_start.is_contiguous()
    assert got.num_sel == want.num_sel
    assert torch.equal(got.cu_seqlens, want.cu_seqlens)
    assert torch.equal(got.src_start, want.src_start)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=40),
    repeat=st.sampled_from([1, 60]),
    data=st.data(),
    last_only=st.booleans(),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_device_index_matches_host(lens, repeat, data, last_only, dtype):
    """The GPU index kernel (one program, 1024 sequences a step; run here under the interpreter)
    equals the host index for any batch: empty sequences, any selection order, and more than one
    step's worth of sequences (``repeat=60``: up to 2400)."""
    lens = (lens * repeat)[:2400]
    if last_only:
        lens = [n or 1 for n in lens]
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=dtype)
    num_seqs = len(lens)
    ids = data.draw(st.none() | st.lists(st.integers(0, num_seqs - 1), max_size=30))
    if ids is not None and repeat > 1:
        ids = [*ids, *range(num_seqs - 1, -1, -1)]  # every sequence, backwards, after the draw
    ids_t = None if ids is None else torch.tensor(ids, dtype=dtype)
    got = device_seq_index(qsl, ids_t, torch.device("cpu"), last_only)
    want = host_seq_index(qsl, ids_t, int(qsl[-1]), last_only)
    assert got.num_sel == want.num_sel
    assert got.cu_seqlens.dtype == got.src_start.dtype == torch.int64
    assert torch.equal(got.cu_seqlens, want.cu_seqlens)
    assert torch.equal(got.src_start, want.src_start)


def test_what_calls_derive_from_views_goes_with_them():
    """The per-view-set cache keeps nothing once the caller's views are gone (no memory held)."""
    import gc

    gc.collect()
    before = set(LAYER_SETS.keys())
    raw, layers = make_cache("vllm_cpu", torch.bfloat16)
    pack_kv(layers, _slots(20, 48, seed=12), SEED_QSL)
    assert set(LAYER_SETS.keys()) - before, "the call made no entry"
    del raw, layers
    gc.collect()
    assert set(LAYER_SETS.keys()) <= before


def test_what_calls_derive_from_views_lives_as_long_as_they_do():
    """The address table a CUDA graph replays with stays while its views live, however many other
    layer sets are used meanwhile (they were evicted oldest first after 16, freeing the table)."""
    _raw, hot = make_cache("flash_attn_nhd", torch.float16)
    slots = _slots(20, 48, seed=13)
    pack_kv(hot, slots, SEED_QSL)
    entry = LAYER_SETS.lookup(hot)
    table = entry.launches(entry.width, hot)[0].offsets
    others = [make_cache("flash_attn_nhd", torch.float16, seed=i)[1] for i in range(20)]
    for layers in others:
        pack_kv(layers, slots, SEED_QSL)
        pack_kv(hot, slots, SEED_QSL)
    assert LAYER_SETS.lookup(hot) is entry
    assert entry.launches(entry.width, hot)[0].offsets is table
