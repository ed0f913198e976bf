"""The integrity digest (tritonkv.digest): its definition, the same bits from the Triton kernels
(under the interpreter here) and the torch twins, detection of each fault it is meant to catch,
the write-back check, and outputs that stay bit-exact with the digest off. On the CPU the twins'
digest runs fused in their copy (the native library, tritonkv/_cpu_digest.py): ``torch`` here
(its widest lane loop this CPU has), ``torch-avx2`` and ``torch-portable`` the same with the lane
loop capped (TRITONKV_NATIVE_ISA; where the CPU lacks AVX2, ``torch-avx2`` runs the portable
one); ``torch-numpy`` is the twin with that library off (the NumPy pass after the copy, its
fallback).

Every fault is applied to the packed tensor between pack (the producer's digest) and unpack (the
consumer's digest of what it read); a fault that leaves the bytes unchanged (two equal tokens
swapped) is skipped by ``assume``, since no function can see it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from support.kv_cases import LAYOUT_IDS, bits, like_with_sentinel, make_cache, storage_bits

from tritonkv import (
    _cpu_digest,
    _digest_core,
    kv_digest,
    pack_hidden,
    pack_kv,
    unpack_hidden,
    unpack_kv,
)
from tritonkv import digest as digest_mod
from tritonkv._digest_triton import byte_lanes
from tritonkv.digest import digest_hex, finalize, finalize_host, packed_digest

MAX = (1 << 63) - 1  # the largest int64 lane sum

KERNELS = ("torch", "torch-avx2", "torch-portable", "torch-numpy", "triton")
EXAMPLES = {
    "torch": 200,
    "torch-avx2": 100,
    "torch-portable": 100,
    "torch-numpy": 100,
    "triton": 60,
}
_ISA = {
    "torch-avx2": "avx2",
    "torch-portable": "default",
}  # TRITONKV_NATIVE_ISA of each  # the interpreter: ~1.5 ms a program
_PROPERTY = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


def _use(monkeypatch, name: str) -> None:
    """Run the ops on ``name`` of :data:`KERNELS` from now on."""
    monkeypatch.setenv("TRITONKV_KERNELS", "triton" if name == "triton" else "torch")
    if name in _ISA:
        monkeypatch.setenv("TRITONKV_NATIVE_ISA", _ISA[name])
    else:
        monkeypatch.delenv("TRITONKV_NATIVE_ISA", raising=False)
    _cpu_digest._reset()
    if name == "torch-numpy":
        monkeypatch.setenv("TRITONKV_NATIVE", "0")
        with pytest.warns(RuntimeWarning, match="disabled by TRITONKV_NATIVE=0"):
            assert _cpu_digest.native() is None
    else:
        monkeypatch.delenv("TRITONKV_NATIVE", raising=False)
        assert name == "triton" or _cpu_digest.native() is not None, _cpu_digest.backend()


@pytest.fixture(autouse=True)
def _native_library_reset(monkeypatch):
    """Tests here switch the native library off and on: leave it loaded as by default."""
    yield
    monkeypatch.undo()
    _cpu_digest._reset()


@pytest.fixture(params=KERNELS)
def kernels(request, monkeypatch):
    _use(monkeypatch, request.param)
    return request.param


def _definition(packed: torch.Tensor, keyed: bool = True) -> str:
    """The digest by the module docstring's definition, word by word in Python (small tensors);
    ``keyed=False``: the same without the position key (what the detection tests rule out)."""
    raw = bytes(bits(packed).reshape(-1).tolist())
    raw += b"\0" * (-len(raw) % 4)
    a = b = 0
    for p in range(len(raw) // 4):
        w = int.from_bytes(raw[4 * p : 4 * p + 4], "little")
        k = (p * digest_mod.KEY + digest_mod.SEED) & digest_mod.MASK if keyed else 0
        h = digest_mod.fmix32(w ^ k)
        a, b = (a + h) & digest_mod.MASK, (b + h * (k | 1)) & digest_mod.MASK
    c0, c1 = digest_mod.count_keys(len(bits(packed).reshape(-1)))
    return f"{digest_mod.fmix32(a ^ c0):08x}{digest_mod.fmix32(b ^ c1):08x}"


def _random(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)


# ----------------------------------------------------------------------- the definition


@pytest.mark.parametrize("num_bytes", [0, 1, 3, 4, 7, 64, 130])
def test_reference_is_the_definition(monkeypatch, num_bytes):
    """packed_digest (NumPy, chunked; chunks of 5 words here) equals the word-by-word definition,
    partial last words included; the Triton byte kernel too."""
    monkeypatch.setattr(_digest_core, "CHUNK_WORDS", 5)
    t = _random((num_bytes,), torch.uint8, num_bytes)
    want = _definition(t)
    assert digest_hex(packed_digest(t)) == want
    lanes = torch.zeros(2, dtype=torch.int64)
    byte_lanes(t, lanes)  # word loads for whole words, byte loads else
    assert digest_hex(finalize(lanes, num_bytes)) == want
    if num_bytes > 4:  # an unaligned start: byte loads
        unaligned = _random((num_bytes + 1,), torch.uint8, num_bytes)[1:]
        lanes.zero_()
        byte_lanes(unaligned, lanes)
        assert digest_hex(finalize(lanes, num_bytes)) == _definition(unaligned)


def test_host_finalization_is_the_finalization():
    """finalize_host (Python ints: the native library's lanes) gives finalize's bits, for lane
    sums above 2**32 (only the low 32 bits count) and sizes past 2**32 bytes too."""
    gen = torch.Generator().manual_seed(5)
    lanes = [*torch.randint(0, 1 << 40, (9, 2), generator=gen).tolist(), [0, 0], [MAX, MAX]]
    for num_bytes in (0, 3, 4096, (1 << 32) + 5):
        want = torch.stack([finalize(torch.tensor(pair), num_bytes) for pair in lanes])
        assert torch.equal(finalize_host(lanes, num_bytes), want)
    assert finalize_host([], 8).shape == (0, 2)


def test_digest_of_a_dtype_is_the_digest_of_its_bytes():
    t = _random((3, 5, 4), torch.bfloat16, 1)
    assert digest_hex(packed_digest(t)) == digest_hex(packed_digest(t.view(torch.uint8)))
    assert digest_hex(packed_digest(t)) == _definition(t)


def test_without_the_position_key_a_swap_would_go_unseen():
    """Why positions are keyed: an unkeyed sum of mixed words cannot see two swapped tokens."""
    packed = _random((1, 2, 3, 1, 4), torch.float32, 5)
    swapped = packed.clone()
    swapped[:, :, [0, 2]] = packed[:, :, [2, 0]]
    assert _definition(packed, keyed=False) == _definition(swapped, keyed=False)
    assert _definition(packed) != _definition(swapped)
    assert digest_hex(packed_digest(packed)) != digest_hex(packed_digest(swapped))


def test_reference_rejects_non_contiguous_and_non_tensors():
    with pytest.raises(ValueError, match="contiguous"):
        packed_digest(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="tensor"):
        packed_digest([1, 2])


# ----------------------------------------------------------------- same bits everywhere

TWIN_CASES = [
    (layout, dtype, head_size)
    for layout in LAYOUT_IDS
    for dtype, head_size in (
        (torch.float32, 8),
        (torch.bfloat16, 6),
        (torch.float16, 8),
        (torch.float8_e4m3fn, 5),
        (torch.int8, 8),
    )
]


@pytest.mark.parametrize(
    "layout,dtype,head_size",
    TWIN_CASES,
    ids=[f"{lay}-{str(d).removeprefix('torch.')}-d{h}" for lay, d, h in TWIN_CASES],
)
def test_triton_and_twin_digests_are_equal(monkeypatch, layout, dtype, head_size):
    """pack, unpack and kv_digest give the definition's digest on both kernels: 8-byte and 4-byte
    copies (fused in the launch) and 1-/2-byte ones (the digest's own launch)."""
    raw, layers = make_cache(layout, dtype, head_size=head_size, num_blocks=5, block_size=4)
    slots = torch.tensor([3, 17, -1, 0, 19, 8, 9, 10, 11, 5], dtype=torch.int64)
    qsl = torch.tensor([0, 4, 10], dtype=torch.int32)
    got = {}
    for name in KERNELS:
        _use(monkeypatch, name)
        packed, _, d_pack = pack_kv(layers, slots, qsl, digest=True)
        dst_raw, dst_layers = like_with_sentinel(raw, layout)
        d_unpack = unpack_kv(packed, dst_layers, slots, qsl, digest=True)
        d_again = kv_digest(layers, slots, qsl)
        got[name] = [digest_hex(d) for d in (d_pack, d_unpack, d_again)]
        assert d_pack.dtype == torch.int64 and d_pack.shape == (2,)
    want = _definition(packed)
    assert got == {name: [want] * 3 for name in KERNELS}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
def test_hidden_digests_are_equal_and_detect_a_flip(monkeypatch, dtype):
    hidden = _random((11, 12), dtype, 3)
    qsl = torch.tensor([0, 4, 11], dtype=torch.int32)
    got = []
    for name in KERNELS:
        _use(monkeypatch, name)
        packed, _, d_pack = pack_hidden(hidden, qsl, digest=True)
        dst = torch.zeros_like(hidden)
        d_unpack = unpack_hidden(packed, dst, qsl, digest=True)
        assert torch.equal(bits(dst), bits(hidden))
        flipped = packed.clone()
        flipped.view(torch.uint8).view(-1)[7] ^= 0x10
        d_flipped = unpack_hidden(flipped, dst, qsl, digest=True)
        got.append((digest_hex(d_pack), digest_hex(d_unpack), digest_hex(d_flipped)))
    assert got == [got[0]] * len(KERNELS)
    assert got[0][0] == got[0][1] == _definition(packed) != got[0][2]


# ------------------------------------------------------------ digest off: nothing changes


def test_digest_off_leaves_outputs_and_signatures_unchanged(kernels):
    raw, layers = make_cache("vllm_pages_lbhnc", torch.bfloat16, num_blocks=5, block_size=4)
    slots = torch.tensor([3, 17, -1, 0, 19, 8], dtype=torch.int64)
    qsl = torch.tensor([0, 2, 6], dtype=torch.int32)
    plain = pack_kv(layers, slots, qsl)
    with_digest = pack_kv(layers, slots, qsl, digest=True)
    assert len(plain) == 2 and len(with_digest) == 3
    assert torch.equal(bits(plain[0]), bits(with_digest[0]))
    assert torch.equal(plain[1], with_digest[1])
    stores = []
    for digest in (False, True):
        dst_raw, dst_layers = like_with_sentinel(raw, "vllm_pages_lbhnc")
        result = unpack_kv(plain[0], dst_layers, slots, qsl, digest=digest)
        assert (result is None) == (not digest)
        stores.append(storage_bits(dst_raw))
    for off, on in zip(*stores, strict=True):
        assert torch.equal(off, on)
    hidden = _random((6, 8), torch.float16, 4)
    plain_h = pack_hidden(hidden, qsl)
    on_h = pack_hidden(hidden, qsl, digest=True)
    assert len(plain_h) == 2 and torch.equal(bits(plain_h[0]), bits(on_h[0]))
    assert unpack_hidden(plain_h[0], torch.zeros_like(hidden), qsl) is None


def test_empty_selection_has_the_digest_of_no_bytes(kernels):
    _, layers = make_cache("flash_attn_nhd", torch.float32)
    packed, _, d = pack_kv(layers, torch.tensor([1, 2]), torch.tensor([0, 2]), [], digest=True)
    assert packed.numel() == 0
    assert digest_hex(d) == _definition(packed)


# ---------------------------------------------------------------- detection (hypothesis)

FAULTS = ("bit_flip", "swap_tokens", "swap_layers", "swap_k_v", "zero_block", "truncate_tail")


@st.composite
def faulty_transfers(draw):
    """A pack of a random batch and one fault of ``FAULTS`` applied to the packed tensor."""
    layout = draw(st.sampled_from(LAYOUT_IDS))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e5m2]))
    block_size = draw(st.sampled_from([2, 4]))
    num_blocks = 6
    num_tokens = draw(st.integers(2, num_blocks * block_size))
    slots = draw(st.permutations(range(num_blocks * block_size)))[:num_tokens]
    fault = draw(st.sampled_from(FAULTS))
    num_layers = 2 if fault != "swap_layers" else draw(st.integers(2, 3))
    return dict(
        layout=layout,
        dtype=dtype,
        shape=dict(
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=draw(st.sampled_from([1, 2])),
            head_size=draw(st.sampled_from([4, 6, 8])),
            seed=draw(st.integers(0, 1000)),
        ),
        slots=torch.tensor(slots, dtype=torch.int64),
        fault=fault,
        pick=draw(st.lists(st.integers(0, 1 << 30), min_size=3, max_size=3)),
    )


def _apply(fault, packed, pick, block_size):
    """``packed`` with ``fault``; for truncate_tail, the packed tensor with fewer tokens."""
    num_layers, num_parts, num_rows = packed.shape[:3]
    out = packed.clone()
    as_bytes = out.view(torch.uint8)
    if fault == "bit_flip":
        flat = as_bytes.view(-1)
        flat[pick[0] % flat.numel()] ^= 1 << (pick[1] % 8)
    elif fault == "swap_tokens":
        r, s = pick[0] % num_rows, pick[1] % num_rows
        as_bytes[:, :, [r, s]] = as_bytes[:, :, [s, r]]
    elif fault == "swap_layers":
        a, b = pick[0] % num_layers, (pick[0] + 1 + pick[1] % (num_layers - 1)) % num_layers
        as_bytes[[a, b]] = as_bytes[[b, a]]
    elif fault == "swap_k_v":
        if num_parts == 2:
            as_bytes[:, [0, 1]] = as_bytes[:, [1, 0]]
    elif fault == "zero_block":
        first = (pick[0] % num_rows) // block_size * block_size
        as_bytes[:, :, first : first + block_size] = 0
    elif fault == "truncate_tail":
        keep = pick[0] % num_rows
        return out[:, :, :keep].contiguous()
    return out


@pytest.mark.parametrize("kernels_name", KERNELS)
def test_property_every_fault_is_detected(monkeypatch, kernels_name):
    """For random caches, batches and faults: the digest unpack computes over what it read
    differs from pack's whenever the fault changed the packed bytes (a truncated tail: whenever
    tokens were dropped, the shorter transfer unpacked with the shorter batch)."""
    _use(monkeypatch, kernels_name)

    @settings(_PROPERTY, max_examples=EXAMPLES[kernels_name])
    @given(faulty_transfers())
    def check(case):
        raw, layers = make_cache(case["layout"], case["dtype"], **case["shape"])
        slots = case["slots"]
        packed, _, sent = pack_kv(layers, slots, digest=True)
        block_size = case["shape"]["block_size"]
        bad = _apply(case["fault"], packed, case["pick"], block_size)
        if case["fault"] == "truncate_tail":
            dst_slots = slots[: bad.shape[2]]
        else:
            assume(not torch.equal(bits(bad), bits(packed)))
            dst_slots = slots
        _, dst_layers = like_with_sentinel(raw, case["layout"])
        read = unpack_kv(bad, dst_layers, dst_slots, digest=True)
        assert digest_hex(read) != digest_hex(sent), f"{case['fault']} went unseen"
        clean = unpack_kv(packed, dst_layers, slots, digest=True)
        assert digest_hex(clean) == digest_hex(sent)

    check()


# ------------------------------------------------------------------- the write-back check


def test_write_back_check_catches_a_wrong_destination_slot(kernels):
    """The consumer writes through a slot_mapping with one wrong slot; kv_digest over the slots
    derived from the block table (independently of the write) differs from the sent digest, while
    re-reading through the very slots written (not independent) would see nothing wrong."""
    block_size, table = 4, [5, 2, 7]
    raw, layers = make_cache("vllm_pages_lbhnc", torch.bfloat16, num_blocks=8, block_size=4)
    src_slots = torch.arange(10)
    packed, _, sent = pack_kv(layers, src_slots, digest=True)
    from_table = torch.tensor(
        [table[t // block_size] * block_size + t % block_size for t in range(10)]
    )
    wrong = from_table.clone()
    wrong[6] = 0  # block 0 is not in the table: the write lands on another request's page
    for written, expect_ok in ((from_table, True), (wrong, False)):
        dst_raw, dst_layers = like_with_sentinel(raw, "vllm_pages_lbhnc")
        assert digest_hex(unpack_kv(packed, dst_layers, written, digest=True)) == digest_hex(sent)
        check = kv_digest(dst_layers, from_table)
        assert (digest_hex(check) == digest_hex(sent)) == expect_ok
        assert digest_hex(kv_digest(dst_layers, written)) == digest_hex(sent)  # not independent


def test_reference_in_parallel_ranges_is_the_same(monkeypatch):
    """Split over the copy threads (ranges of whole chunks, the last one short), same digest."""
    t = _random((4 * 7 * 5 + 3,), torch.uint8, 9)
    serial = digest_hex(packed_digest(t))
    monkeypatch.setattr(_digest_core, "CHUNK_WORDS", 7)
    monkeypatch.setattr(digest_mod, "PARALLEL_MIN_WORDS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert digest_hex(packed_digest(t)) == serial == _definition(t)


@pytest.mark.parametrize("way", ["native", "native-threads", "torch-passes"])
def test_segment_digests_are_each_segments_own_digest(monkeypatch, way):
    """``segment_digests`` (one pass for every request of a pack) equals ``tensor_digest`` of
    each segment, for random segmentations, dtypes and row widths (rows of a whole number of
    32-bit words, and not), on every CPU way: the native library's lane loop per segment, its
    copy threads for large segments (here from 24 bytes on), the torch passes (no native
    library; rows of other widths: the per-segment fallback); a flipped bit changes its
    segment's digest and no other."""
    from tritonkv import _cpu, _cpu_digest

    assert _cpu_digest.native() is not None, _cpu_digest.backend()
    if way == "torch-passes":
        monkeypatch.setattr(digest_mod, "_native", lambda: False)
    if way == "native-threads":
        monkeypatch.setattr(_cpu, "PARALLEL_MIN_BYTES", 24)
    monkeypatch.setattr(digest_mod, "SEGMENT_CHUNK_WORDS", 64)  # several chunks, a row across none

    @settings(_PROPERTY, max_examples=40)
    @given(
        st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]),
        st.integers(1, 7),
        st.lists(st.integers(0, 9), min_size=1, max_size=6),
        st.data(),
    )
    def check(dtype, width, lengths, data):
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        g = torch.Generator().manual_seed(len(lengths) * 31 + width)
        rows = torch.randint(0, 255, (bounds[-1] + 1, 3, width), generator=g).to(dtype)
        got = digest_mod.segment_digests(rows, bounds)
        want = [digest_mod.tensor_digest(rows[a:b]) for a, b in itertools.pairwise(bounds)]
        assert torch.equal(got, torch.stack(want))
        hit = data.draw(st.integers(0, len(lengths) - 1))
        assume(lengths[hit] > 0)
        row = bounds[hit] + data.draw(st.integers(0, lengths[hit] - 1))
        rows[row].view(-1)[:1].view(torch.uint8)[0] ^= 0x10
        after = digest_mod.segment_digests(rows, bounds)
        changed = [not torch.equal(a, b) for a, b in zip(after, got, strict=True)]
        assert changed == [i == hit for i in range(len(lengths))]

    check()


def test_segment_digests_refuse_bad_offsets():
    rows = torch.zeros(4, 2)
    for bad in ([], [1, 4], [0, 3, 2], [0, 5]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            digest_mod.segment_digests(rows, bad)
    with pytest.raises(ValueError, match="contiguous"):
        digest_mod.segment_digests(rows.t(), [0, 1])
    assert digest_mod.segment_digests(rows, [0]).shape == (0, 2)
