"""pack_kv / unpack_kv with the keyed hash: ``nh_out`` holds exactly ``umac.nh_hash`` of the
packed tensor as written (pack) or read (unpack), on the Triton kernel (under the interpreter
here: NH fused into the copy launch where head rows allow, its own pass elsewhere) and on the
CPU twins, bit-exact against the NumPy reference; the packed rows and cache writes are the same
bits as without it.

``nh_out`` is filled with a sentinel before every call (it must be overwritten, not added to);
unpack lands in a sentinel-filled cache whose whole storage is compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import support.kv_cases as kv_cases
import torch
import triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kv_cases import (
    DEVICES,
    assert_bits_equal,
    bits,
    like_with_sentinel,
    loop_pack,
    make_cache,
    random_bits_,
    storage_bits,
)

from tritonkv import (
    _kv_triton,
    layouts,
    pack_kv,
    pack_kv_torch,
    umac,
    unpack_kv,
    unpack_kv_torch,
)
from tritonkv._umac_core import CHUNK_BYTES, nh_numpy, padding_terms
from tritonkv.digest import digest_hex, packed_digest

KEY = umac.entry_keys(b"deployment secret", "model/entry-0")
SENTINEL = 0x5A5A5A5A5A5A5A5A
QSL = torch.tensor([0, 4, 13, 14], dtype=torch.int32)  # a prefill, a chunk, a decode
SLOTS = torch.tensor([3, 17, -1, 0, 19, 8, 9, 10, 11, -1, 30, 31, 40, 41], dtype=torch.int64)


@pytest.fixture(params=["torch", "triton"])
def kernels(request, monkeypatch):
    monkeypatch.setenv("TRITONKV_KERNELS", request.param)
    return request.param


def _nh_out(packed: torch.Tensor) -> torch.Tensor:
    n = umac.num_chunks(packed.numel() * packed.element_size())
    return torch.full((n, umac.ITERATIONS), SENTINEL, dtype=torch.int64, device=packed.device)


def _assert_nh(got: torch.Tensor, packed: torch.Tensor, what: str) -> None:
    want = umac.nh_hash_numpy(packed, KEY)
    have = got.cpu().numpy().view(np.uint64)
    assert have.shape == want.shape, f"{what}: shape {have.shape} != {want.shape}"
    bad = np.nonzero((have != want).any(axis=1))[0]
    assert bad.size == 0, f"{what}: {bad.size} of {want.shape[0]} blocks differ, first {bad[:5]}"


def _check_case(layout, dtype, slots, qsl, seq_ids, *, digest=False, **shape):
    """Pack and unpack with and without NH (and the ``*_torch`` twins with it); everything NH
    adds is checked against the reference, everything else against the call without it."""
    raw, layers = make_cache(layout, dtype, **shape)
    plain, cu_seqlens = pack_kv(layers, slots, qsl, seq_ids)
    ids = range(len(qsl) - 1) if seq_ids is None else seq_ids
    want = loop_pack(layers, slots.cpu(), qsl.cpu(), ids)
    assert_bits_equal(plain.cpu(), want, "pack without NH")
    for pack, name in ((pack_kv, "pack"), (pack_kv_torch, "pack_kv_torch")):
        nh_out = _nh_out(plain)
        got = pack(layers, slots, qsl, seq_ids, digest=digest, nh_key=KEY, nh_out=nh_out)
        assert_bits_equal(got[0].cpu(), plain.cpu(), f"{name}: packed with NH")
        assert torch.equal(got[1], cu_seqlens)
        if digest:
            want = digest_hex(packed_digest(plain.cpu()))
            assert digest_hex(got[2]) == want, f"{name}: digest"
        _assert_nh(nh_out, plain, f"{name} {layout} {dtype}")

    # unpack random bits: rows whose slot is -1 hold some too (NH covers every row read)
    src = random_bits_(torch.empty_like(plain), torch.Generator().manual_seed(7))
    want_raw, want_layers = like_with_sentinel(raw, layout)
    unpack_kv(src, want_layers, slots, qsl, seq_ids)
    for unpack, name in ((unpack_kv, "unpack"), (unpack_kv_torch, "unpack_kv_torch")):
        dst_raw, dst_layers = like_with_sentinel(raw, layout)
        nh_out = _nh_out(plain)
        result = unpack(
            src, dst_layers, slots, qsl, seq_ids, digest=digest, nh_key=KEY, nh_out=nh_out
        )
        if digest:
            assert digest_hex(result) == digest_hex(packed_digest(src.cpu())), f"{name}: digest"
        else:
            assert result is None
        for i, (a, b) in enumerate(zip(storage_bits(dst_raw), storage_bits(want_raw), strict=True)):
            assert torch.equal(a, b), f"{name} with NH: layer {i} storage differs"
        _assert_nh(nh_out, src, f"{name} {layout} {dtype}")
    return plain


# (layout, dtype, num_kv_heads, head_size): head rows of whole 32-byte groups, 32 to 4096 bytes,
# fuse NH into the copy (rows not dividing 4 KiB run into the next block); fp8 and uint8 heads
# of 6 and 12 bytes take NH's own pass.
CASES = [
    ("flash_attn_nhd", torch.float32, 2, 8),  # 32-byte head rows: the smallest fused
    ("flash_attn_hnd", torch.bfloat16, 3, 64),
    ("flash_attn_nhd", torch.float16, 1, 128),
    ("flashinfer_nhd", torch.bfloat16, 8, 64),  # 1 KiB token rows: 4 rows a block
    ("vllm_pages_lbnhc", torch.float32, 3, 1024),  # 4 KiB heads: each row spans 3 blocks
    ("flash_attn_nhd", torch.float8_e4m3fn, 8, 6),  # 2-byte integers: NH's own pass
    ("flash_attn_nhd", torch.uint8, 3, 12),  # 4-byte integers, 12-byte rows: own pass
    ("mla", torch.bfloat16, 1, 576),  # 1152-byte rows, some running into the next block
    ("flash_attn_hnd", torch.float32, 3, 24),  # 96-byte rows: 3 groups, some across blocks
    ("mla", torch.float16, 1, 64),
]


def _case_id(case) -> str:
    layout, dtype, heads, head_size = case
    return f"{layout}-{str(dtype).removeprefix('torch.')}-h{heads}-d{head_size}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_nh_equals_the_reference(kernels, case):
    layout, dtype, heads, head_size = case
    shape = dict(num_layers=2, num_blocks=6, block_size=8, num_kv_heads=heads, head_size=head_size)
    _check_case(layout, dtype, SLOTS, QSL, [1, 0, 2], **shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
def test_nh_with_the_digest_and_three_layers(kernels, dtype):
    shape = dict(num_layers=3, num_kv_heads=2, head_size=32)
    _check_case("flash_attn_nhd", dtype, SLOTS, QSL, None, digest=True, **shape)


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(kv_cases, "DEVICE", "cuda")
    monkeypatch.setenv("TRITONKV_KERNELS", "auto")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("digest", [False, True], ids=["nh", "nh+digest"])
@pytest.mark.usefixtures("on_cuda")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nh_on_cuda(case, digest):
    """The compiled kernel: fused NH (and its own pass) equal the reference on CUDA tensors;
    twice, as the second call of each op variant is a direct launch."""
    layout, dtype, heads, head_size = case
    shape = dict(num_layers=2, num_blocks=6, block_size=8, num_kv_heads=heads, head_size=head_size)
    for _ in range(2):
        _check_case(layout, dtype, SLOTS.cuda(), QSL.cuda(), [1, 0, 2], digest=digest, **shape)


def test_layers_with_different_strides_add_into_one_output(kernels):
    """Layer 0 NHD, layer 1 HND: two launches (one per stride group) add into one ``nh_out``."""
    _, (l0,) = make_cache("flash_attn_nhd", torch.float16, num_layers=1, head_size=32, seed=1)
    _, (l1,) = make_cache("flash_attn_hnd", torch.float16, num_layers=1, head_size=32, seed=2)
    plain, _ = pack_kv([l0, l1], SLOTS, QSL)
    nh_out = _nh_out(plain)
    assert_bits_equal(pack_kv([l0, l1], SLOTS, QSL, nh_key=KEY, nh_out=nh_out)[0], plain, "pack")
    _assert_nh(nh_out, plain, "two stride groups")


def test_nh_fuses_where_head_rows_allow(monkeypatch):
    """On the Triton path the fused cases never call ``umac.nh_hash``; the others call it once."""
    monkeypatch.setenv("TRITONKV_KERNELS", "triton")
    calls = []
    real = umac.nh_hash
    monkeypatch.setattr(umac, "nh_hash", lambda data, key: calls.append(1) or real(data, key))
    for layout, dtype, heads, head_size in CASES:
        _, layers = make_cache(layout, dtype, num_kv_heads=heads, head_size=head_size)
        plain, _ = pack_kv(layers, SLOTS, QSL)
        before = len(calls)
        nh_out = _nh_out(plain)
        pack_kv(layers, SLOTS, QSL, nh_key=KEY, nh_out=nh_out)
        row_bytes = head_size * plain.element_size()
        fused = row_bytes % 32 == 0 and 32 <= row_bytes <= 4096
        assert len(calls) - before == (0 if fused else 1), _case_id(
            (layout, dtype, heads, head_size)
        )
        _assert_nh(nh_out, plain, "fused" if fused else "own pass")


def test_narrow_copy_of_power_of_two_rows_takes_the_own_pass(kernels):
    """A cache 2 bytes off 4-byte alignment: the copy moves 2-byte integers (no fusion) though
    its 64-byte head rows would allow it."""
    storage = torch.randint(0, 256, (2 * 6 * 8 * 2 * 64 + 2,), dtype=torch.uint8)
    raw = storage[2:].view(2, 6, 8, 2, 64)
    layers = [layouts.flash_attn(raw)]
    plain, _ = pack_kv(layers, SLOTS, QSL)
    for pack in (pack_kv, pack_kv_torch):
        nh_out = _nh_out(plain)
        assert_bits_equal(pack(layers, SLOTS, QSL, nh_key=KEY, nh_out=nh_out)[0], plain, "pack")
        _assert_nh(nh_out, plain, "2-byte copy")
    dst = torch.zeros_like(storage)
    dst_layers = [layouts.flash_attn(dst[2:].view(2, 6, 8, 2, 64))]
    nh_out = _nh_out(plain)
    unpack_kv(plain, dst_layers, SLOTS, QSL, nh_key=KEY, nh_out=nh_out)
    _assert_nh(nh_out, plain, "2-byte copy, unpack")


def test_a_flipped_bit_changes_unpacks_nh(kernels):
    _, layers = make_cache("flash_attn_nhd", torch.bfloat16, num_kv_heads=2, head_size=64)
    plain, _ = pack_kv(layers, SLOTS, QSL)
    good = _nh_out(plain)
    pack_kv(layers, SLOTS, QSL, nh_key=KEY, nh_out=good)
    flipped = plain.clone()
    flipped.view(torch.uint8).view(-1)[5000] ^= 0x10
    nh_out = _nh_out(plain)
    _, dst_layers = make_cache("flash_attn_nhd", torch.bfloat16, num_kv_heads=2, head_size=64)
    unpack_kv(flipped, dst_layers, SLOTS, QSL, nh_key=KEY, nh_out=nh_out)
    _assert_nh(nh_out, flipped, "flipped")
    changed = (nh_out != good).any(dim=1).nonzero().flatten().tolist()
    assert changed == [5000 // CHUNK_BYTES]


def test_empty_selection_has_no_blocks(kernels):
    _, layers = make_cache("flash_attn_nhd", torch.float16, head_size=64)
    nh_out = torch.empty(0, 2, dtype=torch.int64)
    packed, _ = pack_kv(layers, SLOTS, QSL, [], nh_key=KEY, nh_out=nh_out)
    assert packed.numel() == 0
    unpack_kv(packed, layers, SLOTS, QSL, [], nh_key=KEY, nh_out=nh_out)


@pytest.mark.parametrize("tail", [32, 64, 1024, 2080, 4064])
def test_padding_terms_are_the_zero_padded_blocks(tail):
    """NH of ``tail`` bytes zero-padded to a block = their groups' terms + padding_terms."""
    rng = np.random.default_rng(tail)
    block = np.zeros(CHUNK_BYTES, dtype=np.uint8)
    block[:tail] = rng.integers(0, 256, tail, dtype=np.uint8)
    full = nh_numpy(block.view("<u4"), KEY.nh_key)[0]
    m = block.view("<u4").astype(np.uint64).reshape(-1, 2, 4)[: tail // 32]
    k = KEY.nh_key.astype(np.uint64)
    for t in range(umac.ITERATIONS):
        kt = k[4 * t : 4 * t + 1024].reshape(-1, 2, 4)[: tail // 32]
        a = (m[:, 0] + kt[:, 0]) & 0xFFFFFFFF
        b = (m[:, 1] + kt[:, 1]) & 0xFFFFFFFF
        data = sum(int(x) * int(y) for x, y in zip(a.ravel(), b.ravel(), strict=True))
        pad = padding_terms(KEY.nh_key, 5 * CHUNK_BYTES + tail)[t]
        assert (data + pad) % 2**64 == int(full[t])
    assert padding_terms(KEY.nh_key, 3 * CHUNK_BYTES) == (0, 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        padding_terms(KEY.nh_key, 100)


def test_arguments_are_checked(kernels):
    _, layers = make_cache("flash_attn_nhd", torch.float16, head_size=64)
    plain, _ = pack_kv(layers, SLOTS, QSL)
    good = _nh_out(plain)
    with pytest.raises(TypeError, match="nh_out: expected a value with nh_key"):
        pack_kv(layers, SLOTS, QSL, nh_key=KEY)
    with pytest.raises(TypeError, match="nh_key: expected a value with nh_out"):
        unpack_kv(plain, layers, SLOTS, QSL, nh_out=good)
    with pytest.raises(TypeError, match=r"nh_key: expected umac\.TransferKeys"):
        pack_kv(layers, SLOTS, QSL, nh_key=KEY.nh_key, nh_out=good)
    n = good.shape[0]
    for bad in (
        torch.zeros(n + 1, 2, dtype=torch.int64),
        torch.zeros(n, 2, dtype=torch.int32),
        torch.zeros(n, 2, dtype=torch.int64, device="meta"),
        torch.zeros(2, n, dtype=torch.int64).t(),
    ):
        with pytest.raises(ValueError, match=rf"nh_out: expected a contiguous \({n}, 2\) int64"):
            pack_kv(layers, SLOTS, QSL, nh_key=KEY, nh_out=bad)
        with pytest.raises(ValueError, match="nh_out: expected"):
            unpack_kv_torch(plain, layers, SLOTS, QSL, nh_key=KEY, nh_out=bad)


@pytest.fixture
def tuning(monkeypatch):
    """The copy kernel tunes again at its next launch of any key, over two configs, each timed
    by running it three times (as in test_autotune): NH's sums must not add up over them."""
    monkeypatch.setenv("TRITONKV_KERNELS", "triton")
    runs = []
    autotuner = _kv_triton._KV_COPY.kernel

    def bench(fn, quantiles=None):
        for _ in range(3):
            fn()
            runs.append(1)
        return [float(len(runs))] * 3

    configs = [triton.Config({"BLOCK_T": b}, num_warps=4) for b in (16, 8)]
    monkeypatch.setattr(autotuner, "configs", configs)
    monkeypatch.setattr(autotuner, "do_bench", bench)
    monkeypatch.setattr(autotuner, "cache", {})
    monkeypatch.setattr(_kv_triton._KV_COPY, "configs", {})
    return runs


@pytest.mark.parametrize("device", DEVICES)
def test_the_first_launch_of_a_key_gives_the_right_nh(tuning, monkeypatch, device):
    monkeypatch.setattr(kv_cases, "DEVICE", device)
    raw, layers = make_cache("flash_attn_nhd", torch.float32, head_size=16)
    slots, qsl = SLOTS.to(device), QSL.to(device)
    plain = pack_kv_torch(layers, slots, qsl)[0]
    nh_out = _nh_out(plain)
    packed, _, _ = pack_kv(layers, slots, qsl, digest=True, nh_key=KEY, nh_out=nh_out)
    assert len(tuning) == 6  # it did tune (else this test shows nothing)
    assert_bits_equal(packed.cpu(), plain.cpu(), "tuned pack")
    _assert_nh(nh_out, plain, "first pack of its key")
    _, dst_layers = like_with_sentinel(raw, "flash_attn_nhd")
    nh_out = _nh_out(plain)
    unpack_kv(plain, dst_layers, slots, qsl, nh_key=KEY, nh_out=nh_out)
    assert len(tuning) == 12
    _assert_nh(nh_out, plain, "first unpack of its key")
    assert torch.equal(bits(pack_kv_torch(dst_layers, slots, qsl)[0]), bits(plain))


@st.composite
def batches(draw):
    """A mixed batch (prefills, decodes, chunks; -1 slots; tokens past the batch) over random
    blocks, a layout and a head shape that fuses (or, for fp8, does not)."""
    block_size, num_blocks = 4, 16
    free = draw(st.permutations(range(num_blocks)))
    slots, qsl = [], [0]
    for _ in range(draw(st.integers(1, 4))):
        computed, query = draw(st.integers(0, 5)), draw(st.integers(0, 9))
        need = -(-(computed + query) // block_size)
        if len(free) < need:
            computed, query, need = 0, 0, 0
        table, free = free[:need], free[need:]
        slots += [
            table[p // block_size] * block_size + p % block_size
            for p in range(computed, computed + query)
        ]
        qsl.append(qsl[-1] + query)
    for i in draw(st.lists(st.integers(0, max(len(slots) - 1, 0)), max_size=2)):
        if slots:
            slots[i] = -1
    slots += [-1] * draw(st.integers(0, 2))
    num_seqs = len(qsl) - 1
    seq_ids = draw(st.lists(st.integers(0, num_seqs - 1), max_size=num_seqs, unique=True))
    return dict(
        layout=draw(
            st.sampled_from(["flash_attn_nhd", "flash_attn_hnd", "vllm_pages_lbhnc", "mla"])
        ),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e5m2])),
        slots=torch.tensor(slots, dtype=torch.int64),
        qsl=torch.tensor(qsl, dtype=torch.int64),
        seq_ids=seq_ids if draw(st.booleans()) else None,
        shape=dict(
            num_layers=draw(st.integers(1, 3)),
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=draw(st.sampled_from([1, 3])),
            head_size=draw(st.sampled_from([16, 32, 64])),
        ),
    )


@pytest.mark.parametrize("kernels_name,examples", [("torch", 50), ("triton", 15)])
def test_property_nh_of_random_batches(monkeypatch, kernels_name, examples):
    monkeypatch.setenv("TRITONKV_KERNELS", kernels_name)

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(batches())
    def check(case):
        _check_case(
            case["layout"],
            case["dtype"],
            case["slots"],
            case["qsl"],
            case["seq_ids"],
            **case["shape"],
        )

    check()


COMPILE_SCRIPT = Path(__file__).resolve().parents[1] / "support" / "compile_sm90.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fused_nh_compiles_for_sm90(tmp_path):
    """The interpreter never runs Triton's compiler: the NH variants of the copy kernel compile
    for sm_90 here, keep the copy's 16-byte accesses, and add their sums with 64-bit atomic
    reductions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    root = str(COMPILE_SCRIPT.parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    run = subprocess.run(
        [sys.executable, str(COMPILE_SCRIPT), "--nh-only"],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    variants = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(variants) == 5 and all(v["kernel"] == "kv-nh" for v in variants), run.stdout
    for v in variants:
        assert v["cubin_bytes"] > 0
        assert any(op.startswith("red.global") and "add.u64" in op for op in v["atomics"]), v
        assert any(".v2.b64" in op or ".v4.b32" in op for op in v["loads"]), v
        assert any(".v2.b64" in op or ".v4.b32" in op for op in v["stores"]), v
