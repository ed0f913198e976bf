"""pack_kv / unpack_kv: every layout × dtype, on both kernels (Triton and the torch twin), against
the loop oracle, bit-exact.

Unpack always lands in a sentinel-filled cache and the *whole storage* is compared, so a write to a
wrong slot, a missed slot, or a stray write between strided elements all fail.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kv_cases import (
    DTYPE_IDS,
    DTYPES,
    LAYOUT_IDS,
    assert_bits_equal,
    every_other,
    like_with_sentinel,
    loop_pack,
    loop_unpack,
    make_cache,
    storage_bits,
)

from tritonkv import pack_kv, unpack_kv

KERNELS = ("torch", "triton")

# The batch that shows why query offsets: one 18-token prefill batched with two decodes.
# seq_lens would be [18, 17, 16]; the query lengths are [18, 1, 1].
SEED_QSL = torch.tensor([0, 18, 19, 20], dtype=torch.int32)


@pytest.fixture(params=KERNELS)
def kernels(request, monkeypatch):
    monkeypatch.setenv("TRITONKV_KERNELS", request.param)
    return request.param


def _slots(num_tokens: int, num_slots: int, seed: int, pad=()) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens].to(torch.int64)
    for i in pad:
        slots[i] = -1
    return slots


def _roundtrip(layout, dtype, slot_mapping, qsl, seq_ids, **shape):
    """Pack from a random cache and unpack into a sentinel cache; check both against the loop."""
    raw, layers = make_cache(layout, dtype, **shape)
    packed, cu_seqlens = pack_kv(layers, slot_mapping, qsl, seq_ids)
    ids = range(len(qsl) - 1) if seq_ids is None else seq_ids
    expected = loop_pack(layers, slot_mapping, qsl, ids)
    assert_bits_equal(packed, expected, f"pack {layout} {dtype}")
    lens = [int(qsl[s + 1] - qsl[s]) for s in ids]
    assert cu_seqlens.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]

    dst_raw, dst_layers = like_with_sentinel(raw, layout)
    exp_raw, exp_layers = like_with_sentinel(raw, layout)
    unpack_kv(packed, dst_layers, slot_mapping, qsl, seq_ids)
    loop_unpack(packed, exp_layers, slot_mapping, qsl, ids)
    for i, (got, want) in enumerate(zip(storage_bits(dst_raw), storage_bits(exp_raw), strict=True)):
        assert torch.equal(got, want), f"unpack {layout} {dtype}: layer {i} storage differs"
    return packed


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_every_layout_and_dtype(kernels, layout, dtype):
    # An odd head size and three layers; the mixed batch of the seed, padding inside sequence 0.
    slots = _slots(20, 6 * 8, seed=1, pad=(3,))
    _roundtrip(layout, dtype, slots, SEED_QSL, [2, 0], num_layers=3, head_size=12)


@pytest.mark.parametrize("layout", ["flash_attn_nhd", "vllm_cpu", "mla"])
def test_layers_in_one_buffer(kernels, layout):
    _raw, layers = make_cache(layout, torch.bfloat16, one_buffer=True, num_layers=3)
    slots = _slots(20, 48, seed=2)
    packed, _ = pack_kv(layers, slots, SEED_QSL)
    assert_bits_equal(packed, loop_pack(layers, slots, SEED_QSL, range(3)), "one buffer")


def test_seed_batch_packs_exactly_the_prefill(kernels):
    """Sequence 0 of [18-token prefill, decode, decode] packs its 18 tokens, not seq_lens' 18..35."""
    raw, layers = make_cache("flash_attn_nhd", torch.float16, num_blocks=8, block_size=16)
    slots = torch.cat([torch.arange(16, 34), torch.tensor([70, 101])])  # prefill spans 2 blocks
    packed, cu_seqlens = pack_kv(layers, slots, SEED_QSL, [0])
    assert packed.shape == (2, 2, 18, 2, 8)
    assert cu_seqlens.tolist() == [0, 18]
    for layer, (k, v) in enumerate(layers):
        assert_bits_equal(packed[layer, 0], k.transpose(1, 2).reshape(-1, 2, 8)[16:34], "k")
        assert_bits_equal(packed[layer, 1], v.transpose(1, 2).reshape(-1, 2, 8)[16:34], "v")
    # Unpack restores exactly those 18 slots and nothing else.
    dst_raw, dst_layers = like_with_sentinel(raw, "flash_attn_nhd")
    before = storage_bits(dst_raw)
    unpack_kv(packed, dst_layers, slots, SEED_QSL, [0])
    for layer, (k, _) in enumerate(dst_layers):
        flat = k.transpose(1, 2).reshape(-1, 2, 8)
        assert_bits_equal(
            flat[16:34], layers[layer][0].transpose(1, 2).reshape(-1, 2, 8)[16:34], "k"
        )
        changed = (storage_bits([dst_raw[layer]])[0] != before[layer]).sum()
        assert int(changed) <= 2 * 18 * 2 * 8 * 2  # K and V bytes of 18 tokens, at most


def test_padding_inside_and_after_sequences(kernels):
    """-1 slots pack as zeros and are never written; tokens past query_start_loc[-1] are never read."""
    slots = _slots(24, 48, seed=3, pad=(0, 7, 18))
    slots[20:] = 10**12  # CUDA-graph padding past the batch: reading it would crash or fail
    packed = _roundtrip("flash_attn_hnd", torch.float32, slots, SEED_QSL, None)
    assert torch.equal(packed[:, :, 0], torch.zeros_like(packed[:, :, 0]))


@pytest.mark.parametrize("seq_ids", [[2, 1, 0], [1], [0, 0], []], ids=str)
def test_seq_id_subsets_in_any_order(kernels, seq_ids):
    slots = _slots(20, 48, seed=4)
    _roundtrip("vllm_pages_lbnhc", torch.bfloat16, slots, SEED_QSL, seq_ids)


def test_seq_ids_as_tensor_and_int32(kernels):
    slots = _slots(20, 48, seed=5).to(torch.int32)
    ids = torch.tensor([2, 0], dtype=torch.int32)
    _roundtrip("flashinfer_nhd", torch.float16, slots, SEED_QSL, ids)


def test_non_contiguous_index_tensors(kernels):
    """Columns of bigger tensors as slot_mapping, query_start_loc and seq_ids: kernels read index
    tensors with stride 1, so they must get contiguous ones."""
    slots = every_other(_slots(20, 48, seed=14, pad=(5,)))
    qsl, seq_ids = every_other(SEED_QSL), every_other(torch.tensor([2, 0]))
    assert not (slots.is_contiguous() or qsl.is_contiguous() or seq_ids.is_contiguous())
    _roundtrip("flash_attn_nhd", torch.float16, slots, qsl, seq_ids)
    _roundtrip("flash_attn_hnd", torch.float16, slots, every_other(SEED_QSL.long()), None)


def test_seq_ids_must_be_a_sequence(kernels):
    """An iterator would be used up by the type check and then select nothing: rejected. Any
    sequence of ints (tuple, range) works like a list."""
    _raw, layers = make_cache("flash_attn_nhd", torch.float16)
    slots = _slots(20, 48, seed=15)
    with pytest.raises(TypeError, match=r"expected a list of ints .*, got list_iterator"):
        pack_kv(layers, slots, SEED_QSL, iter([2, 0]))
    with pytest.raises(TypeError, match="got generator"):
        packed = torch.zeros(2, 2, 19, 2, 8, dtype=torch.float16)
        unpack_kv(packed, layers, slots, SEED_QSL, (s for s in [2, 0]))
    want, _ = pack_kv(layers, slots, SEED_QSL, [1, 2])
    for seq_ids in ((1, 2), range(1, 3)):
        assert_bits_equal(pack_kv(layers, slots, SEED_QSL, seq_ids)[0], want, str(seq_ids))


VIEW_DIMS = ("num_blocks", "num_kv_heads", "block_size", "head_size")


@pytest.mark.parametrize("dim", range(4), ids=VIEW_DIMS)
def test_zero_size_cache_dims_are_rejected(kernels, dim):
    """A cache with a dimension of size 0 holds nothing: rejected, naming the dimension."""
    shape = [6, 2, 8, 8]
    shape[dim] = 0
    k, v = torch.zeros(shape, dtype=torch.float16), torch.zeros(shape, dtype=torch.float16)
    slots = torch.full((3,), -1)
    message = re.escape(f"expected {VIEW_DIMS[dim]} > 0, got views of shape {tuple(shape)}")
    with pytest.raises(ValueError, match=message):
        pack_kv([(k, v)], slots)
    with pytest.raises(ValueError, match=message):
        unpack_kv(torch.zeros(1, 2, 3, 2, 8, dtype=torch.float16), [(k, v)], slots)


def test_no_tokens_pack_an_empty_tensor(kernels):
    """An empty batch, or a selection of empty sequences, packs ``[L, 2, 0, H, D]``; unpacking it
    writes nothing."""
    raw, layers = make_cache("flash_attn_nhd", torch.float16)
    some = _slots(20, 48, seed=16)
    for slots, qsl, seq_ids, want_cu_seqlens in [
        (torch.empty(0, dtype=torch.int64), None, None, [0, 0]),
        (some, torch.tensor([0, 0, 20]), [0, 0], [0, 0, 0]),
        (some, SEED_QSL, [], [0]),
    ]:
        packed, cu_seqlens = pack_kv(layers, slots, qsl, seq_ids)
        assert packed.shape == (2, 2, 0, 2, 8)
        assert cu_seqlens.tolist() == want_cu_seqlens
        dst_raw, dst_layers = like_with_sentinel(raw, "flash_attn_nhd")
        before = storage_bits(dst_raw)
        unpack_kv(packed, dst_layers, slots, qsl, seq_ids)
        for got, want in zip(storage_bits(dst_raw), before, strict=True):
            assert torch.equal(got, want)


def test_one_sequence_when_query_start_loc_is_none(kernels):
    _raw, layers = make_cache("flash_attn_nhd", torch.float32)
    slots = _slots(11, 48, seed=6)
    packed, cu_seqlens = pack_kv(layers, slots)
    assert cu_seqlens.tolist() == [0, 11]
    assert_bits_equal(packed, loop_pack(layers, slots, torch.tensor([0, 11]), [0]), "all tokens")


def test_layers_with_different_strides(kernels):
    """Layer 0 NHD, layer 1 HND: the launcher groups layers by strides; results stay exact."""
    _raw0, (l0,) = make_cache("flash_attn_nhd", torch.float16, num_layers=1, seed=7)
    _raw1, (l1,) = make_cache("flash_attn_hnd", torch.float16, num_layers=1, seed=8)
    slots = _slots(20, 48, seed=9)
    packed, _ = pack_kv([l0, l1], slots, SEED_QSL, [0, 2])
    assert_bits_equal(packed, loop_pack([l0, l1], slots, SEED_QSL, [0, 2]), "mixed strides")


def test_out_argument_is_filled_and_returned(kernels):
    _raw, layers = make_cache("flash_attn_nhd", torch.bfloat16)
    slots = _slots(20, 48, seed=10)
    out = torch.full((2, 2, 19, 2, 8), 3.0, dtype=torch.bfloat16)
    packed, _ = pack_kv(layers, slots, SEED_QSL, [0, 1], out=out)
    assert packed is out
    assert_bits_equal(out, loop_pack(layers, slots, SEED_QSL, [0, 1]), "out=")


@pytest.mark.parametrize("layout", ["flash_attn_nhd", "mla", "vllm_cpu"])
def test_whole_block_runs_next_to_loose_rows(kernels, layout):
    """The CPU twin copies runs of whole blocks as one row each and the other rows one by one:
    two whole blocks, a partial one, then a sequence that starts mid-block."""
    runs = [torch.arange(b * 8, b * 8 + 8) for b in (3, 1)]
    loose = [torch.arange(40, 44), torch.arange(34, 40)]
    slots = torch.cat(runs + loose)
    qsl = torch.tensor([0, 20, 26])
    _roundtrip(layout, torch.bfloat16, slots, qsl, None)
    _roundtrip(layout, torch.bfloat16, slots[:16], torch.tensor([0, 16]), None)  # runs only


@pytest.mark.parametrize("change", ["strides", "dtype"])
def test_views_changed_in_place_between_calls_are_seen(kernels, change):
    """Calls reuse what they derived from the same view objects (checked, widened, planned) only
    while those keep their address, shape, strides and dtype: here the same objects are re-strided
    in place into HND views of the same memory, or given another dtype of the same size (``.data``),
    and the next pack must follow them."""
    _raw, layers = make_cache("flash_attn_nhd", torch.float16)
    slots = _slots(20, 48, seed=11)
    pack_kv(layers, slots, SEED_QSL)
    for pair in layers:
        for t in pair:
            num_blocks, heads, block_size, head = t.shape
            if change == "dtype":
                t.data = t.data.view(torch.bfloat16)
            else:
                hnd = (t.stride(0), block_size * head, head, 1)
                t.as_strided_(t.shape, hnd, t.storage_offset())
    packed, _ = pack_kv(layers, slots, SEED_QSL)
    assert packed.dtype == layers[0][0].dtype
    assert_bits_equal(packed, loop_pack(layers, slots, SEED_QSL, range(3)), f"changed {change}")


@pytest.mark.slow
def test_cache_past_2_pow_31_elements(kernels):
    """int64 offsets: slots in blocks beyond 2^31 elements are addressed right (no wrap-around)."""
    # head 63 (odd bytes) keeps the copy at 1-byte elements, so offsets really pass 2^31.
    block_size, heads, head = 16, 1, 63
    num_blocks = (1 << 31) // (block_size * head) + 4
    cache = torch.empty(
        2, num_blocks, block_size, heads, head, dtype=torch.uint8
    )  # untouched pages
    k, v = cache[0].transpose(1, 2), cache[1].transpose(1, 2)
    slots = torch.tensor([num_blocks * block_size - 1, (num_blocks - 2) * block_size + 3, 5])
    gen = torch.Generator().manual_seed(0)
    for s in slots.tolist():
        for view in (k, v):
            view[s // block_size, :, s % block_size, :] = torch.randint(
                0, 256, (1, head), generator=gen, dtype=torch.uint8
            )
    packed, _ = pack_kv([(k, v)], slots)
    assert_bits_equal(packed, loop_pack([(k, v)], slots, torch.tensor([0, 3]), [0]), "2^31")
    k[-1, :, -1, :] = 0
    unpack_kv(packed, [(k, v)], slots)
    assert_bits_equal(k[-1, :, -1, :], packed[0, 0, 0], "unpack past 2^31")


# ------------------------------------------------------------------------- property tests


@st.composite
def batches(draw):
    """A random mixed batch: prefills, decodes, chunked-prefill chunks; random block tables.

    Each sequence has a context already cached (``computed``) and this step's query tokens; its
    slots come from its own block table, so a chunk or a decode can start mid-block.
    """
    block_size = draw(st.sampled_from([4, 8]))
    num_seqs = draw(st.integers(1, 5))
    kinds = draw(
        st.lists(
            st.sampled_from(["prefill", "decode", "chunk"]), min_size=num_seqs, max_size=num_seqs
        )
    )
    num_blocks = 24
    free = draw(st.permutations(range(num_blocks)))
    slots, qsl = [], [0]
    for kind in kinds:
        computed = 0 if kind == "prefill" else draw(st.integers(1, 9))
        query = 1 if kind == "decode" else draw(st.integers(1, 9))
        need = -(-(computed + query) // block_size)
        if len(free) < need:
            query, computed = 0, 0  # out of blocks: an empty sequence (allowed, packs nothing)
            need = 0
        table, free = free[:need], free[need:]
        for pos in range(computed, computed + query):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + query)
    pad = draw(st.lists(st.integers(0, max(len(slots) - 1, 0)), max_size=2))
    for i in pad:
        if slots:
            slots[i] = -1
    slots += [-1] * draw(st.integers(0, 3))  # CUDA-graph padding past the batch
    seq_ids = draw(st.lists(st.integers(0, num_seqs - 1), max_size=num_seqs, unique=True))
    layout = draw(st.sampled_from(LAYOUT_IDS))
    dtype = draw(st.sampled_from([torch.float16, torch.float8_e5m2, torch.float32]))
    return dict(
        layout=layout,
        dtype=dtype,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        qsl=torch.tensor(qsl, dtype=torch.int32),
        seq_ids=seq_ids if draw(st.booleans()) else None,
        shape=dict(
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=2,
            head_size=draw(st.sampled_from([4, 6, 8])),
        ),
    )


_PROPERTY = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@pytest.mark.parametrize(
    "kernels_name,examples", [("torch", 150), ("triton", 40)], ids=["torch", "triton"]
)
def test_property_roundtrip(monkeypatch, kernels_name, examples):
    """Random batch compositions: pack then unpack into a sentinel cache equals the loop oracle."""
    monkeypatch.setenv("TRITONKV_KERNELS", kernels_name)

    @settings(_PROPERTY, max_examples=examples)
    @given(batches())
    def check(case):
        _roundtrip(
            case["layout"],
            case["dtype"],
            case["slot_mapping"],
            case["qsl"],
            case["seq_ids"],
            **case["shape"],
        )

    check()
