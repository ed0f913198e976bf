"""The NH layer of :mod:`tritonkv.umac` in Triton: each program takes :data:`BLOCKS` 4 KiB
blocks of a payload's words, both Toeplitz iterations from the same loaded words and one load of
the key (a separate launch over the packed tensor, not fused into the pack/unpack copy)."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._umac_core import CHUNK_WORDS, ITERATIONS, KEY_WORDS, SHIFT_WORDS

__all__ = ["nh_triton"]

BLOCKS = 4  # 4 KiB blocks per program (the key is loaded once for them)


@triton.jit(do_not_specialize=["num_blocks"])
def _nh_kernel(
    words_ptr,  # [num_blocks * CHUNK_WORDS] int32: the payload's little-endian words
    key_ptr,  # [KEY_WORDS] int32: the transfer's NH key
    out_ptr,  # [num_blocks, 2] int64: NH sums (uint64 bit patterns), one per iteration
    num_blocks,
    stride_out,  # out_ptr's row stride, in elements
    CHUNK_WORDS: tl.constexpr,
    ITERATIONS: tl.constexpr,
    SHIFT_WORDS: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """Grid ``(cdiv(num_blocks, BLOCKS),)``: program ``p`` sums the NH of blocks ``p * BLOCKS
    ..`` for both iterations, the key loaded once. Iteration 1 is iteration 0's key shifted by
    4 words, i.e. the pairs' partner words: three key vectors serve both."""
    tl.static_assert(ITERATIONS == 2 and SHIFT_WORDS == 4)
    q = tl.arange(0, CHUNK_WORDS // 2)  # one pair per 8-word group and j in 0..3
    lo = (q // 4) * 8 + q % 4  # word j of its group; its partner is word j + 4
    k_a = tl.load(key_ptr + lo).to(tl.uint32, bitcast=True)  # k[8g+j]
    k_b = tl.load(key_ptr + lo + 4).to(tl.uint32, bitcast=True)  # k[8g+j+4]
    k_c = tl.load(key_ptr + lo + 8).to(tl.uint32, bitcast=True)  # k[8g+j+8]
    for i in tl.static_range(BLOCKS):
        block = tl.program_id(0).to(tl.int64) * BLOCKS + i
        ok = (q * 0 + block) < num_blocks  # [CHUNK_WORDS // 2]: the block exists
        base = words_ptr + block * CHUNK_WORDS
        m_lo = tl.load(base + lo, mask=ok, other=0).to(tl.uint32, bitcast=True)
        m_hi = tl.load(base + lo + 4, mask=ok, other=0).to(tl.uint32, bitcast=True)
        # 32-bit adds wrap; the products are exact in 64 bits and summed modulo 2**64
        t0 = tl.sum((m_lo + k_a).to(tl.uint64) * (m_hi + k_b).to(tl.uint64), axis=0)
        t1 = tl.sum((m_lo + k_b).to(tl.uint64) * (m_hi + k_c).to(tl.uint64), axis=0)
        # out has rows for whole programs (the wrapper drops those past num_blocks)
        tl.store(out_ptr + block * stride_out, t0.to(tl.int64, bitcast=True))
        tl.store(out_ptr + block * stride_out + 1, t1.to(tl.int64, bitcast=True))


def nh_triton(words: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """NH of whole blocks by the Triton kernel.

    Args:
        words: ``[n * CHUNK_WORDS]`` int32, contiguous (the payload's words).
        key: ``[KEY_WORDS]`` int32 on ``words``' device.

    Returns:
        ``[n, ITERATIONS]`` int64 on ``words``' device.
    """
    n = words.numel() // CHUNK_WORDS
    programs = triton.cdiv(n, BLOCKS)
    out = torch.empty((programs * BLOCKS, ITERATIONS), dtype=torch.int64, device=words.device)
    if n:
        assert key.numel() == KEY_WORDS and key.dtype == torch.int32
        on_device = words.device.type == "cuda"  # a transport thread's current device may differ
        guard = torch.cuda.device(words.device) if on_device else contextlib.nullcontext()
        with guard:
            _launch(words, key, out, n, programs)
    return out[:n]


def _launch(words, key, out, n: int, programs: int) -> None:
    """One launch of :func:`_nh_kernel` over ``n`` blocks in ``programs`` programs."""
    _nh_kernel[(programs,)](
        words,
        key,
        out,
        n,
        out.stride(0),
        CHUNK_WORDS=CHUNK_WORDS,
        ITERATIONS=ITERATIONS,
        SHIFT_WORDS=SHIFT_WORDS,
        BLOCKS=BLOCKS,
        num_warps=4,
    )
