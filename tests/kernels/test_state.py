"""pack_state / unpack_state on both kernels (Triton and the torch twin), bit-exact against plain
row indexing of the state bytes; clip_to_window and a window-clipped pack_kv / unpack_kv."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kv_cases import assert_bits_equal, random_bits_

from tritonkv import (
    clip_to_window,
    layouts,
    pack_kv,
    pack_state,
    pack_state_torch,
    state_row_bytes,
    unpack_kv,
    unpack_state,
    unpack_state_torch,
)

SENTINEL = 0x5A
NUM_SLOTS = 7
SLOTS = (4, -1, 0, 6, 2)  # out of order, one skipped

# Case id -> (page padding in bytes or None for separate tensors, [(state shape, dtype), ...]).
# "pages" cases carve every state out of one page per slot, as vLLM's MambaBase.bind_kv_cache
# does (conv then SSM state back to back, the page padded past them): a slot stride larger than
# the state. Every case has an odd size somewhere.
STATE_CASES = {
    "mamba2_pages_bf16_fp32": (24, [((3, 14), torch.bfloat16), ((2, 5, 7), torch.float32)]),
    "aligned_pages_16_bytes": (16, [((4, 8), torch.bfloat16), ((2, 3, 8), torch.float32)]),
    "gdn_pages_fp16": (8, [((9, 3), torch.float16), ((3, 4, 5), torch.float16)]),
    "short_conv_fp8": (0, [((3, 11), torch.float8_e4m3fn)]),
    "int8_odd_rows": (5, [((7,), torch.int8), ((1, 3), torch.uint8), ((5,), torch.int8)]),
    "separate_tensors": (None, [((4, 4), torch.float32), ((6,), torch.bfloat16)]),
    "scalar_per_slot": (None, [((), torch.float64), ((2, 3), torch.float8_e5m2)]),
}
CASE_IDS = list(STATE_CASES)


@pytest.fixture(params=("torch", "triton"))
def kernels(request, monkeypatch):
    monkeypatch.setenv("TRITONKV_KERNELS", request.param)
    return request.param


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def make_states(case, *, num_slots=NUM_SLOTS, sentinel=False, seed=0, device="cpu"):
    """``(backing tensors, state views)`` of ``case``: random bytes, or every byte ``SENTINEL``."""
    padding, specs = STATE_CASES[case] if isinstance(case, str) else case
    gen = torch.Generator().manual_seed(seed)

    def fill(t):
        if sentinel:
            t.view(torch.uint8).fill_(SENTINEL)
        else:
            random_bits_(t, gen)
        return t

    if padding is None:
        states = [fill(torch.empty(num_slots, *s, dtype=d, device=device)) for s, d in specs]
        return states, states
    # each state at a multiple of its element size, as vLLM's state shapes always fall
    offsets, end, align = [], 0, 1
    for shape, dtype in specs:
        size = torch.empty(0, dtype=dtype).element_size()
        end = -(-end // size) * size
        offsets.append(end)
        end, align = end + _nbytes(shape, dtype), max(align, size)
    page = -(-(end + padding) // align) * align
    pages = fill(torch.empty(num_slots, page, dtype=torch.uint8, device=device))
    states = [
        pages[:, at : at + _nbytes(shape, dtype)].view(dtype).view(num_slots, *shape)
        for at, (shape, dtype) in zip(offsets, specs, strict=True)
    ]
    return [pages], states


def oracle_rows(states, slots) -> torch.Tensor:
    """The obviously-right packed rows: each slot's bytes of every state, concatenated."""
    rows = torch.zeros(
        len(slots), sum(_nbytes(t.shape[1:], t.dtype) for t in states), dtype=torch.uint8
    )
    for i, slot in enumerate(slots):
        if slot >= 0:
            rows[i] = torch.cat(
                [t[slot].contiguous().reshape(-1).view(torch.uint8).cpu() for t in states]
            )
    return rows


def storage(backing) -> list[torch.Tensor]:
    return [b.contiguous().view(torch.uint8).cpu().clone() for b in backing]


@pytest.mark.parametrize("case", CASE_IDS)
def test_pack_unpack_state(kernels, case):
    backing, states = make_states(case)
    slots = torch.tensor(SLOTS)
    packed = pack_state(states, slots)
    assert packed.dtype == torch.uint8 and packed.shape == (5, state_row_bytes(states))
    assert_bits_equal(packed, oracle_rows(states, SLOTS), "pack_state")

    dst_backing, dst = make_states(case, sentinel=True)
    expected_backing, expected = make_states(case, sentinel=True)
    for slot in SLOTS:
        if slot >= 0:
            for e, s in zip(expected, states, strict=True):
                e[slot] = s[slot]
    unpack_state(packed, dst, slots)
    # every byte of the backing buffers: unaddressed slots and page padding keep the sentinel
    for got, want in zip(storage(dst_backing), storage(expected_backing), strict=True):
        assert_bits_equal(got, want, "unpack_state")


@pytest.mark.parametrize("case", CASE_IDS)
def test_out_rows_of_skipped_slots_stay_untouched(kernels, case):
    _, states = make_states(case)
    out = torch.full((5, state_row_bytes(states)), SENTINEL, dtype=torch.uint8)
    packed = pack_state(states, torch.tensor(SLOTS, dtype=torch.int32), out=out)
    assert packed is out
    expected = oracle_rows(states, SLOTS)
    expected[1] = SENTINEL
    assert_bits_equal(out, expected, "out=")


@pytest.mark.parametrize("case", ["mamba2_pages_bf16_fp32", "int8_odd_rows"])
def test_triton_and_twin_agree_with_digests(monkeypatch, case):
    monkeypatch.setenv("TRITONKV_KERNELS", "triton")
    _, states = make_states(case)
    slots = torch.tensor(SLOTS)
    out = torch.full((5, state_row_bytes(states)), SENTINEL, dtype=torch.uint8)
    packed, digest = pack_state(states, slots, out=out.clone(), digest=True)
    twin, twin_digest = pack_state_torch(states, slots, out=out.clone(), digest=True)
    assert_bits_equal(packed, twin, "triton vs twin")
    assert torch.equal(digest, twin_digest)  # skipped rows' sentinels are in both digests
    _, dst = make_states(case, sentinel=True)
    _, dst_twin = make_states(case, sentinel=True)
    assert torch.equal(unpack_state(packed, dst, slots, digest=True), digest)
    assert torch.equal(unpack_state_torch(packed, dst_twin, slots, digest=True), digest)
    for a, b in zip(dst, dst_twin, strict=True):
        assert_bits_equal(a, b, "unpacked states")


def test_long_rows_span_several_chunks(kernels):
    """A row of more than one program's words (1024) next to a short one."""
    _, states = make_states((4, [((3, 701), torch.float32), ((5,), torch.int8)]), num_slots=3)
    slots = torch.tensor([2, 0])
    packed = pack_state(states, slots)
    assert_bits_equal(packed, oracle_rows(states, [2, 0]), "long rows")


def test_no_sequences_and_all_skipped(kernels):
    _, states = make_states("gdn_pages_fp16")
    none = torch.zeros(0, dtype=torch.int64)
    empty, digest = pack_state(states, none, digest=True)
    assert empty.shape == (0, state_row_bytes(states))
    assert torch.equal(digest, pack_state_torch(states, none, digest=True)[1])
    packed = pack_state(states, torch.tensor([-1, -1]))
    assert not packed.any()
    backing, dst = make_states("gdn_pages_fp16", sentinel=True)
    unpack_state(torch.ones_like(packed), dst, torch.tensor([-1, -1]))
    assert (storage(backing)[0] == SENTINEL).all()


# (the kernels fixture sets the same environment for every example: reuse is harmless)
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    dtypes=st.lists(
        st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8]),
        min_size=1,
        max_size=3,
    ),
    padding=st.one_of(st.none(), st.integers(0, 9)),
    num_slots=st.integers(1, 6),
)
def test_property_any_batch(kernels, data, dtypes, padding, num_slots):
    shapes = [tuple(data.draw(st.lists(st.integers(1, 5), min_size=0, max_size=3))) for _ in dtypes]
    case = (padding, list(zip(shapes, dtypes, strict=True)))
    slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=0, max_size=6))
    slot_t = torch.tensor(slots, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    _, states = make_states(case, num_slots=num_slots, seed=len(slots))
    packed = pack_state(states, slot_t)
    assert_bits_equal(packed, oracle_rows(states, slots), "pack_state")
    backing, dst = make_states(case, num_slots=num_slots, sentinel=True)
    expected_backing, expected = make_states(case, num_slots=num_slots, sentinel=True)
    for slot in slots:  # (a repeated slot gets the same row each time)
        if slot >= 0:
            for e, s in zip(expected, states, strict=True):
                e[slot] = s[slot]
    unpack_state(packed, dst, slot_t)
    for got, want in zip(storage(backing), storage(expected_backing), strict=True):
        assert_bits_equal(got, want, "unpack_state")


def _bad_layouts():
    pages = torch.zeros(4, 64, dtype=torch.uint8)
    return {
        "a tensor, not a list": (lambda s: pack_state(pages, s), TypeError, "list or tuple"),
        "no states": (lambda s: pack_state([], s), ValueError, "at least one"),
        "not a tensor": (lambda s: pack_state([pages, 3], s), TypeError, r"states\[1\]"),
        "0-d state": (lambda s: pack_state([torch.tensor(1.0)], s), ValueError, "0-d"),
        "slots differ": (
            lambda s: pack_state([pages, torch.zeros(3, 2)], s),
            ValueError,
            r"expected 4 slots.*got shape \(3, 2\)",
        ),
        "slot not contiguous": (
            lambda s: pack_state([torch.zeros(4, 3, 5).transpose(1, 2)], s),
            ValueError,
            r"contiguous \(strides \(3, 1\).*got strides \(15, 1, 5\)",
        ),
        "float slots": (lambda s: pack_state([pages], s.float()), TypeError, "int32 or int64"),
        "2-d slots": (lambda s: pack_state([pages], s[None]), ValueError, "1-D"),
        "slot too big": (
            lambda s: pack_state([pages], torch.tensor([0, 4])),
            ValueError,
            r"\[-1, 4\).*\[0, 4\]",
        ),
        "slot below -1": (lambda s: pack_state([pages], -2 * s), ValueError, r"\[-2, 0\]"),
        "out dtype": (
            lambda s: pack_state([pages], s, out=torch.zeros(2, 64)),
            ValueError,
            r"\[2, 64\].*torch.uint8.*got \(2, 64\) torch.float32",
        ),
        "out shape": (
            lambda s: pack_state([pages], s, out=torch.zeros(2, 63, dtype=torch.uint8)),
            ValueError,
            r"got \(2, 63\)",
        ),
        "out not a tensor": (lambda s: pack_state([pages], s, out=[0]), TypeError, "out"),
        "packed None": (lambda s: unpack_state(None, [pages], s), TypeError, "packed"),
    }


BAD = _bad_layouts()


@pytest.mark.parametrize("what", list(BAD))
def test_input_errors(what):
    call, error, match = BAD[what]
    with pytest.raises(error, match=match):
        call(torch.tensor([1, 0]))


# -- sliding windows ---------------------------------------------------------------------------

WINDOW_QSL = torch.tensor([0, 10, 13, 13, 20])  # 10 tokens, 3, none, 7


@pytest.mark.parametrize(
    ("window", "seq_ids", "cu", "tokens"),
    [
        (4, None, [0, 3, 6, 6, 9], [7, 8, 9, 10, 11, 12, 17, 18, 19]),
        (4, [3, 0], [0, 3, 6], [17, 18, 19, 7, 8, 9]),
        (1, None, [0, 0, 0, 0, 0], []),
        (50, [1], [0, 3], [10, 11, 12]),
    ],
    ids=["window4", "window4_selected", "window1_nothing", "window_past_the_prompt"],
)
def test_clip_to_window(window, seq_ids, cu, tokens):
    slot_mapping = torch.arange(20, dtype=torch.int32) * 3 + 1
    qsl, slots = clip_to_window(WINDOW_QSL, slot_mapping, window, seq_ids)
    assert qsl.tolist() == cu and qsl.dtype == torch.int64
    assert slots.dtype == torch.int32 and slots.tolist() == [3 * t + 1 for t in tokens]


@pytest.mark.parametrize(
    ("window", "error", "match"),
    [(True, TypeError, "got bool"), (4.0, TypeError, "got float"), (0, ValueError, ">= 1")],
    ids=["bool", "float", "zero"],
)
def test_clip_to_window_errors(window, error, match):
    with pytest.raises(error, match=match):
        clip_to_window(WINDOW_QSL, torch.arange(20), window)
    with pytest.raises(ValueError, match="query_start_loc"):
        clip_to_window(torch.tensor([0, 30]), torch.arange(20), 4)


# Paged caches a sliding-window layer may have: layout id -> builds the raw cache of
# (num_blocks, block_size, num_kv_heads, head_size) and its (k, v) views.
WINDOW_LAYOUTS = {
    "flash_attn_nhd": lambda shape, make: layouts.flash_attn(make((2, *shape))),
    "flashinfer_hnd": lambda shape, make: layouts.flashinfer(
        make((shape[0], 2, shape[2], shape[1], shape[3])).transpose(2, 3)
    ),
}


def _paged(layout, num_blocks, fill, device="cpu", seed=0):
    """A bf16 cache of ``layout`` (block_size 4, 2 heads, head_size 5): ``(raw, [(k, v)])``."""
    raws = []

    def make(shape):
        raw = torch.empty(shape, dtype=torch.bfloat16, device=device)
        if fill == "sentinel":
            raw.view(torch.uint8).fill_(SENTINEL)
        else:
            random_bits_(raw, torch.Generator().manual_seed(seed))
        raws.append(raw)
        return raw

    views = WINDOW_LAYOUTS[layout]((num_blocks, 4, 2, 5), make)
    return raws[0], [views]


def check_window_clipped_kv(layout, device):
    """Two prompts handed over (13 and 6 tokens, last token recomputed elsewhere), window 6: only
    the last 5 tokens of each move. The producer's out-of-window slots hold sentinels that must
    not reach the packed rows; every byte of the consumer's cache but the window's slots keeps
    its sentinel."""
    window, block_size = 6, 4
    _, src_layers = _paged(layout, 10, "random", device)
    (k, v), at = src_layers[0], lambda t, slot: t[slot // block_size, :, slot % block_size]
    # producer: prompt 0 in blocks 1, 2, 3, 4; prompt 1 in blocks 6, 7
    src_slots = [b * block_size + o for b in (1, 2, 3, 4) for o in range(4)][:13]
    src_slots += [b * block_size + o for b in (6, 7) for o in range(4)][:6]
    in_window = src_slots[8:13] + src_slots[14:19]
    for slot in set(src_slots) - set(in_window):  # sentinels outside the window
        for t in (k, v):
            at(t, slot).view(torch.uint8).fill_(SENTINEL)
    qsl = torch.tensor([0, 13, 19], device=device)
    clipped_qsl, clipped = clip_to_window(qsl, torch.tensor(src_slots, device=device), window)
    assert clipped.tolist() == in_window
    packed, cu = pack_kv(src_layers, clipped, clipped_qsl)
    assert cu.tolist() == [0, 5, 10] and packed.shape[2] == 10
    expected = torch.stack([torch.stack([at(t, s) for s in in_window]) for t in (k, v)])
    assert_bits_equal(packed.cpu(), expected[None].cpu(), "window rows")

    # consumer: other blocks, every byte a sentinel; only the window's slots may change
    dst, dst_layers = _paged(layout, 12, "sentinel", device)
    dst_slots = [b * block_size + o for b in (9, 0, 5, 11) for o in range(4)][:13]
    dst_slots += [b * block_size + o for b in (3, 8) for o in range(4)][:6]
    clipped_qsl, clipped = clip_to_window(qsl, torch.tensor(dst_slots, device=device), window)
    unpack_kv(packed, dst_layers, clipped, clipped_qsl)
    want, want_layers = _paged(layout, 12, "sentinel", device)
    for row, slot in enumerate(dst_slots[8:13] + dst_slots[14:19]):
        for part, t in enumerate(want_layers[0]):
            at(t, slot).copy_(packed[0, part, row])
    assert_bits_equal(dst.cpu(), want.cpu(), "window unpack")


@pytest.mark.parametrize("layout", list(WINDOW_LAYOUTS))
def test_window_clipped_kv_moves_only_the_window(kernels, layout):
    check_window_clipped_kv(layout, "cpu")


# -- the compiled kernel ------------------------------------------------------------------------

COMPILE = """
import json
from support.compile_sm90 import compile_variant
from tritonkv._state_triton import _state_copy_kernel
for slots in ("*i32", "*i64"):
    for unpack in (False, True):
        for digest in (False, True):
            pointers = {"base_ptr": "*i64", "chunks_ptr": "*i64", "slots_ptr": slots,
                        "packed_ptr": "*i64", "digest_ptr": "*i64"}
            constexprs = {"UNPACK": unpack, "DIGEST": digest, "WORDS": 2, "BLOCK_W": 1024,
                          "ALIGN": 2}
            result = compile_variant(_state_copy_kernel, pointers, constexprs, list(pointers))
            print(json.dumps({"unpack": unpack, "digest": digest, **result}))
"""


@pytest.mark.timeout(300)
def test_state_kernel_compiles_for_sm90_with_16_byte_accesses(tmp_path):
    """The interpreter never runs Triton's compiler: compile every variant for an H100/H200 here
    (no GPU needed), and check that the copy moves 16-byte vectors both ways."""
    tests = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["PYTHONPATH"] = os.pathsep.join([str(tests.parent), str(tests), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=280
    )
    assert run.returncode == 0, run.stderr[-3000:]
    variants = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(variants) == 8, run.stdout
    for v in variants:
        assert "ld.global.v2.b64" in v["loads"] and "st.global.v2.b64" in v["stores"], v
        assert bool(v["atomics"]) == v["digest"], v


# -- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("conv_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_state_pages_as_vllm_allocates_them(monkeypatch, conv_dtype):
    """Gated-delta-net-sized states (a TP shard of a Qwen3-Next layer: conv ``[3, 2048]``, SSM
    ``[8, 128, 128]`` fp32) of 4 layers in 64 padded pages, block-outermost as vLLM allocates
    them: Triton against the twin, digests, and the pages around the addressed slots."""
    monkeypatch.setenv("TRITONKV_KERNELS", "auto")
    num_layers, num_slots = 4, 64
    specs = [((3, 2048), conv_dtype), ((8, 128, 128), torch.float32)] * num_layers
    case = (256, specs)
    backing, states = make_states(case, num_slots=num_slots, device="cuda")
    slots = torch.tensor([17, -1, 3, 63, 0, 40], device="cuda")
    packed, digest = pack_state(states, slots, digest=True)
    twin, twin_digest = pack_state_torch(states, slots, digest=True)
    assert_bits_equal(packed, twin, "gpu pack")
    assert torch.equal(digest, twin_digest)
    assert_bits_equal(packed.cpu(), oracle_rows(states, slots.tolist()), "gpu oracle")
    dst_backing, dst = make_states(case, num_slots=num_slots, sentinel=True, device="cuda")
    want_backing, want = make_states(case, num_slots=num_slots, sentinel=True, device="cuda")
    assert torch.equal(unpack_state(packed, dst, slots, digest=True), digest)
    unpack_state_torch(packed, want, slots)
    for got, exp in zip(storage(dst_backing), storage(want_backing), strict=True):
        assert_bits_equal(got, exp, "gpu unpack")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", list(WINDOW_LAYOUTS))
def test_gpu_window_clipped_kv(monkeypatch, layout):
    """FlashAttention (NHD) and FlashInfer (HND) sliding-window pages on the GPU: only the
    window's tokens move and land."""
    monkeypatch.setenv("TRITONKV_KERNELS", "auto")
    check_window_clipped_kv(layout, "cuda")
