"""The NH layer of :mod:`tritonkv.umac` in Triton: a kernel of its own, whose programs each take
:data:`BLOCKS` 4 KiB blocks of a payload's words, both Toeplitz iterations from the same loaded
words and one load of the key; and the tile helpers the pack/unpack copy kernel
(:mod:`tritonkv._kv_triton`) fuses into its launch: the NH sums of each row of a tile of packed
elements (:func:`tile_nh`), and their addition into the ``[num_blocks, 2]`` int64 outputs with
one atomic add per block and iteration a tile touches (:func:`add_nh_rows`)."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._dispatch import interpreter_lock
from ._umac_core import CHUNK_WORDS, ITERATIONS, KEY_WORDS, SHIFT_WORDS

__all__ = ["add_nh_rows", "flush_nh_rows", "nh_triton", "tile_nh"]

BLOCKS = 4  # 4 KiB blocks per program (the key is loaded once for them)
# The definition's constants, as the compiler accepts globals in kernels (the tile helpers').
_CHUNK_WORDS = tl.constexpr(CHUNK_WORDS)
_ITERATIONS = tl.constexpr(ITERATIONS)
_SHIFT_WORDS = tl.constexpr(SHIFT_WORDS)


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


@triton.jit
def tile_nh(
    x,
    word0,
    key_ptr,  # [KEY_WORDS] int32: the NH key
    BLOCK_T: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    WORDS: tl.constexpr,
    REAL_WORDS: tl.constexpr,
):
    """NH sums of each row of a tile of packed elements, both iterations.

    ``x`` is ``[BLOCK_T, ROW_WORDS // WORDS]`` int32 (``WORDS`` 1) or int64 (``WORDS`` 2), of
    which each row's first ``REAL_WORDS`` 32-bit words are a run of the packed tensor's bytes
    that starts at its word ``word0`` (``[BLOCK_T]`` int64; the rest is padding of the tile).
    ``ROW_WORDS`` is a power of two from 8 to 1024; ``REAL_WORDS`` a multiple of 8 up to it and
    ``word0`` a multiple of ``REAL_WORDS`` (rows are whole 8-word groups). Returns ``(t0, t1,
    s0, s1)``, each ``[BLOCK_T]`` uint64: the row's terms of the NH sums of the block holding its
    first word, and of the next block (zeros unless the row runs into it: only where
    ``REAL_WORDS`` does not divide a block's 1024 words). Rows are not masked here.
    """
    tl.static_assert(_ITERATIONS == 2 and _SHIFT_WORDS == 4)
    tl.static_assert(ROW_WORDS % 8 == 0 and ROW_WORDS <= _CHUNK_WORDS)
    tl.static_assert(REAL_WORDS % 8 == 0 and REAL_WORDS <= ROW_WORDS)
    GROUPS: tl.constexpr = ROW_WORDS // 8
    # rows inside one block, the tile's columns all real: the key at the row's offset
    ALIGNED: tl.constexpr = REAL_WORDS == ROW_WORDS
    # the row's words in memory order (an int64 element: its low word, then its high word)
    if WORDS == 1:
        w = x.to(tl.uint32, bitcast=True)
    else:
        u = x.to(tl.uint64, bitcast=True)
        w = tl.join((u & 0xFFFFFFFF).to(tl.uint32), (u >> 32).to(tl.uint32))
        w = tl.reshape(w, (BLOCK_T, ROW_WORDS))
    # each 8-word group's first and second half: word j pairs with word j + 4
    m_lo, m_hi = tl.split(tl.permute(tl.reshape(w, (BLOCK_T, GROUPS, 2, 4)), (0, 1, 3, 2)))
    q = tl.arange(0, ROW_WORDS // 2)
    lo = tl.reshape((q // 4) * 8 + q % 4, (GROUPS, 4))  # word 8g + j of the row
    if ALIGNED:
        at = key_ptr + (word0 % _CHUNK_WORDS)[:, None, None] + lo[None, :, :]  # its key word
    else:  # a group's key word at its own offset in its block (8-word groups never straddle)
        at = key_ptr + (word0[:, None, None] + lo[None, :, :]) % _CHUNK_WORDS
    k_a = tl.load(at).to(tl.uint32, bitcast=True)  # k[8g+j]
    k_b = tl.load(at + 4).to(tl.uint32, bitcast=True)  # k[8g+j+4]
    k_c = tl.load(at + 8).to(tl.uint32, bitcast=True)  # k[8g+j+8]
    # 32-bit adds wrap; the products are exact in 64 bits and summed modulo 2**64
    p0 = (m_lo + k_a).to(tl.uint64) * (m_hi + k_b).to(tl.uint64)
    p1 = (m_lo + k_b).to(tl.uint64) * (m_hi + k_c).to(tl.uint64)
    if ALIGNED:
        t0 = tl.sum(tl.reshape(p0, (BLOCK_T, ROW_WORDS // 2)), axis=1)
        t1 = tl.sum(tl.reshape(p1, (BLOCK_T, ROW_WORDS // 2)), axis=1)
        return t0, t1, tl.zeros_like(t0), tl.zeros_like(t1)
    g0 = tl.sum(p0, axis=2)  # [BLOCK_T, GROUPS]: each group's terms
    g1 = tl.sum(p1, axis=2)
    group = tl.arange(0, GROUPS)
    real = (group < REAL_WORDS // 8)[None, :]  # the tile's padding groups are no bytes
    block = (word0[:, None] + 8 * group[None, :]) // _CHUNK_WORDS
    first = block == (word0 // _CHUNK_WORDS)[:, None]
    t0 = tl.sum(tl.where(real & first, g0, 0), axis=1)
    t1 = tl.sum(tl.where(real & first, g1, 0), axis=1)
    s0 = tl.sum(tl.where(real & ~first, g0, 0), axis=1)
    s1 = tl.sum(tl.where(real & ~first, g1, 0), axis=1)
    return t0, t1, s0, s1


@triton.jit
def flush_nh_rows(
    nh_ptr,  # [num_blocks, 2] int64: NH sums (uint64 bit patterns)
    block,
    t0,
    t1,
    mask,
):
    """Add each row's sums ``t0``, ``t1`` (``[BLOCK_T]`` uint64) into its block ``block``'s
    outputs (``[BLOCK_T]`` int64), rows ``mask`` only: one atomic add per row and iteration."""
    at = nh_ptr + block * _ITERATIONS
    tl.atomic_add(at, t0.to(tl.int64, bitcast=True), mask=mask, sem="relaxed")
    tl.atomic_add(at + 1, t1.to(tl.int64, bitcast=True), mask=mask, sem="relaxed")


@triton.jit
def add_nh_rows(
    nh_ptr,  # [num_blocks, 2] int64: NH sums (uint64 bit patterns)
    block,
    t0,
    t1,
    row_ok,
    BLOCK_T: tl.constexpr,
):
    """Add a tile's row sums ``t0``, ``t1`` (``[BLOCK_T]`` uint64, row ``i``'s into block
    ``block[i]``, nondecreasing; rows ``row_ok`` only) into the outputs with one atomic add per
    distinct block and iteration: rows of one block are summed first (a one-hot sum over the
    blocks ``block - first``, ``first`` the tile's first block; a row ``BLOCK_T`` blocks or more
    past it adds its own)."""
    first = tl.min(tl.where(row_ok, block, 1 << 62), axis=0)
    rel = block - first
    slots = tl.arange(0, BLOCK_T)
    hit = (rel[:, None] == slots[None, :]) & row_ok[:, None]  # [BLOCK_T rows, BLOCK_T blocks]
    s0 = tl.sum(tl.where(hit, t0[:, None], 0), axis=0)
    s1 = tl.sum(tl.where(hit, t1[:, None], 0), axis=0)
    used = tl.max(hit.to(tl.int32), axis=0) > 0
    flush_nh_rows(nh_ptr, first + slots, s0, s1, used)
    flush_nh_rows(nh_ptr, block, t0, t1, row_ok & (rel >= BLOCK_T))


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
    with interpreter_lock():
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
