"""The digest of :mod:`tritonkv.digest` in Triton: lane sums of a tile, for the copy kernels to
fuse into their launch, and a kernel of its own for packed tensors no copy kernel reads in 4- or
8-byte integers.

A copy kernel adds its tiles' lane sums into a ``[2]`` int64 accumulator with one atomic add per
lane and program; sums are modulo 2**64 there (only the low 32 bits count), so the order in which
programs land does not matter. :func:`tritonkv.digest.finalize` turns the sums into the digest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._digest_core import FMIX_1, FMIX_2, KEY, SEED
from ._dispatch import interpreter_lock

__all__ = ["byte_lanes", "tile_lanes"]

# The definition's constants, as the compiler accepts globals in kernels.
_KEY = tl.constexpr(KEY)
_SEED = tl.constexpr(SEED)
_FMIX_1 = tl.constexpr(FMIX_1)
_FMIX_2 = tl.constexpr(FMIX_2)


@triton.jit
def _word_lanes(w, p, mask):
    """Lane sums (uint64) of 32-bit words ``w`` (uint32) at word positions ``p`` (int64)."""
    k = ((p * _KEY + _SEED) & 0xFFFFFFFF).to(tl.uint32)
    h = w ^ k
    h = h ^ (h >> 16)
    h = h * tl.full((), _FMIX_1, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full((), _FMIX_2, tl.uint32)
    h = h ^ (h >> 16)
    a = tl.sum(tl.where(mask, h, 0).to(tl.uint64))
    b = tl.sum(tl.where(mask, h * (k | 1), 0).to(tl.uint64))
    return a, b


@triton.jit
def tile_lanes(x, elem, mask, WORDS: tl.constexpr):
    """Lane sums of a tile of packed elements: ``x`` int32 (``WORDS`` 1) or int64 (``WORDS`` 2)
    integers at element positions ``elem`` (int64) of the packed tensor; ``mask`` picks the tile's
    real elements."""
    # (No return inside the `if`: the compiler would still build what follows it, and fail on
    # the 64-bit bitcast of 32-bit words; the interpreter, running Python, never showed it.)
    if WORDS == 1:
        a, b = _word_lanes(x.to(tl.uint32, bitcast=True), elem, mask)
    else:
        u = x.to(tl.uint64, bitcast=True)
        a_lo, b_lo = _word_lanes((u & 0xFFFFFFFF).to(tl.uint32), 2 * elem, mask)
        a_hi, b_hi = _word_lanes((u >> 32).to(tl.uint32), 2 * elem + 1, mask)
        a, b = a_lo + a_hi, b_lo + b_hi
    return a, b


@triton.jit
def add_lanes(digest_ptr, a, b):
    """Add one program's lane sums into the ``[2]`` int64 accumulator."""
    tl.atomic_add(digest_ptr, a.to(tl.int64, bitcast=True))
    tl.atomic_add(digest_ptr + 1, b.to(tl.int64, bitcast=True))


@triton.jit(do_not_specialize=["num_bytes"])
def _digest_bytes_kernel(
    bytes_ptr,  # [num_bytes] uint8: the packed tensor's bytes
    digest_ptr,  # [2] int64 lane sums, zeroed by the caller
    num_bytes,
    BLOCK: tl.constexpr,
):
    """Grid ``(cdiv(num_words, BLOCK),)``: BLOCK little-endian words, the last padded with zeros."""
    words = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    w = tl.zeros([BLOCK], dtype=tl.uint32)
    for j in tl.static_range(4):
        at = words * 4 + j
        byte = tl.load(bytes_ptr + at, mask=at < num_bytes, other=0).to(tl.uint32)
        w = w | (byte << (8 * j))
    a, b = _word_lanes(w, words, words * 4 < num_bytes)
    add_lanes(digest_ptr, a, b)


@triton.jit(do_not_specialize=["num_words"])
def _digest_words_kernel(
    words_ptr,  # [num_words] int32: the packed tensor's bytes as 32-bit words
    digest_ptr,  # [2] int64 lane sums, zeroed by the caller
    num_words,
    BLOCK: tl.constexpr,
):
    """Grid ``(cdiv(num_words, BLOCK),)``: BLOCK words (tensors of whole words only)."""
    words = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = words < num_words
    w = tl.load(words_ptr + words, mask=ok, other=0).to(tl.uint32, bitcast=True)
    a, b = _word_lanes(w, words, ok)
    add_lanes(digest_ptr, a, b)


def byte_lanes(packed: torch.Tensor, lanes: torch.Tensor) -> None:
    """Add the lane sums of every byte of contiguous ``packed`` into ``lanes`` (``[2]`` int64):
    the digest's own launch, for tensors no copy kernel reads in 4- or 8-byte integers (32-bit
    word loads when the size is whole words and the address aligned, else byte loads)."""
    num_bytes = packed.numel() * packed.element_size()
    if num_bytes == 0:
        return
    block = 1024
    flat = packed.reshape(-1).view(torch.uint8)
    if num_bytes % 4 == 0 and flat.data_ptr() % 4 == 0:
        grid = (triton.cdiv(num_bytes // 4, block),)
        with interpreter_lock():
            _digest_words_kernel[grid](flat.view(torch.int32), lanes, num_bytes // 4, BLOCK=block)
        return
    grid = (triton.cdiv(triton.cdiv(num_bytes, 4), block),)
    with interpreter_lock():
        _digest_bytes_kernel[grid](flat, lanes, num_bytes, BLOCK=block)
