"""The NH layer of :mod:`tritonkv.umac` in Triton: one program per 4 KiB block of a payload's
words, every Toeplitz iteration from the same loaded words (a separate launch over the packed
tensor, not fused into the pack/unpack copy)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._umac_core import CHUNK_WORDS, ITERATIONS, KEY_WORDS, SHIFT_WORDS

__all__ = ["nh_triton"]


@triton.jit
def _nh_kernel(
    words_ptr,  # [num_blocks * CHUNK_WORDS] int32: the payload's little-endian words
    key_ptr,  # [KEY_WORDS] int32: the transfer's NH key
    out_ptr,  # [num_blocks, ITERATIONS] int64: NH sums (uint64 bit patterns)
    stride_out,  # out_ptr's row stride, in elements
    CHUNK_WORDS: tl.constexpr,
    ITERATIONS: tl.constexpr,
    SHIFT_WORDS: tl.constexpr,
):
    """Grid ``(num_blocks,)``: program ``c`` sums block ``c``'s NH for every iteration."""
    block = tl.program_id(0).to(tl.int64)
    q = tl.arange(0, CHUNK_WORDS // 2)  # one pair per 8-word group and j in 0..3
    lo = (q // 4) * 8 + q % 4  # word j of its group; its partner is word j + 4
    base = words_ptr + block * CHUNK_WORDS
    m_lo = tl.load(base + lo).to(tl.uint32, bitcast=True)
    m_hi = tl.load(base + lo + 4).to(tl.uint32, bitcast=True)
    for t in tl.static_range(ITERATIONS):
        k_lo = tl.load(key_ptr + lo + SHIFT_WORDS * t).to(tl.uint32, bitcast=True)
        k_hi = tl.load(key_ptr + lo + 4 + SHIFT_WORDS * t).to(tl.uint32, bitcast=True)
        a = (m_lo + k_lo).to(tl.uint64)  # 32-bit adds wrap, products are exact in 64 bits
        b = (m_hi + k_hi).to(tl.uint64)
        total = tl.sum(a * b, axis=0)  # modulo 2**64
        tl.store(out_ptr + block * stride_out + t, total.to(tl.int64, bitcast=True))


def nh_triton(words: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """NH of whole blocks by the Triton kernel.

    Args:
        words: ``[n * CHUNK_WORDS]`` int32, contiguous (the payload's words).
        key: ``[KEY_WORDS]`` int32 on ``words``' device.

    Returns:
        ``[n, ITERATIONS]`` int64 on ``words``' device.
    """
    n = words.numel() // CHUNK_WORDS
    out = torch.empty((n, ITERATIONS), dtype=torch.int64, device=words.device)
    if n:
        assert key.numel() == KEY_WORDS and key.dtype == torch.int32
        _nh_kernel[(n,)](
            words,
            key,
            out,
            out.stride(0),
            CHUNK_WORDS=CHUNK_WORDS,
            ITERATIONS=ITERATIONS,
            SHIFT_WORDS=SHIFT_WORDS,
            num_warps=4,
        )
    return out
