"""The Triton kernel that packs and unpacks state slots (Mamba, gated delta net, short conv), every
state tensor in one launch, and its launcher.

A state set is cut into chunks of at most ``BLOCK_W`` words of one tensor's row; a device table
(:class:`ChunkTable`, made once per state set and width) gives each chunk its tensor's offset
from the base pointer, its slot stride, its first column in the tensor's row and in the packed
row, and its length. Program ``(c, s)`` copies chunk ``c`` of sequence ``s``'s slot: scalar table
loads, then contiguous vector accesses. Copies move integer views (:mod:`tritonkv._intview`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from ._digest_triton import add_lanes, tile_lanes
from ._dispatch import interpreter_lock

__all__ = ["ChunkTable", "chunk_table", "copy_state"]

MAX_BLOCK_W = 1024  # words per program at most (8 KiB of 8-byte words)


@triton.jit(do_not_specialize=["row_units"])
def _state_copy_kernel(
    base_ptr,  # [*] integer view of the first state tensor: base of every address
    chunks_ptr,  # [num_chunks, 5] int64 (offset, slot stride, column, packed column, words)
    slots_ptr,  # [num_seqs] int32/int64 state slot of each packed row (-1: skipped)
    packed_ptr,  # [num_seqs, total_words] integer view, contiguous
    digest_ptr,  # [2] int64 lane sums (DIGEST only)
    row_units,  # total_words // ALIGN: a packed row's words, in units of ALIGN words
    ALIGN: tl.constexpr,
    UNPACK: tl.constexpr,
    DIGEST: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Grid ``(num_chunks, num_seqs)``: one chunk of one sequence's state rows.

    Skipped sequences (slot -1) are neither read nor written; with DIGEST their packed words are
    still read, so the lane sums (``WORDS`` 32-bit words per element) cover every packed row.
    Every table entry and a packed row's words are multiples of ``ALIGN`` words (16 bytes, when
    the tensors allow): the compiler then moves 16-byte vectors.
    """
    chunk = tl.program_id(0).to(tl.int64)
    seq = tl.program_id(1).to(tl.int64)
    offset = tl.multiple_of(tl.load(chunks_ptr + 5 * chunk), ALIGN)
    slot_stride = tl.multiple_of(tl.load(chunks_ptr + 5 * chunk + 1), ALIGN)
    column = tl.multiple_of(tl.load(chunks_ptr + 5 * chunk + 2), ALIGN)
    packed_column = tl.multiple_of(tl.load(chunks_ptr + 5 * chunk + 3), ALIGN)
    num_words = tl.multiple_of(tl.load(chunks_ptr + 5 * chunk + 4), ALIGN)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    cols = tl.arange(0, BLOCK_W).to(tl.int64)
    col_ok = cols < num_words
    # (a vector: the interpreter takes no scalar in a mask)
    cached = (tl.zeros([BLOCK_W], dtype=tl.int64) + slot) >= 0
    ok = col_ok & cached
    state_addr = base_ptr + offset + tl.maximum(slot, 0) * slot_stride + column + cols
    elem = seq * row_units * ALIGN + packed_column + cols
    packed_addr = packed_ptr + elem
    if UNPACK:
        x = tl.load(packed_addr, mask=col_ok if DIGEST else ok, other=0)
        tl.store(state_addr, x, mask=ok)
    else:
        x = tl.load(state_addr, mask=ok, other=0)
        if DIGEST:  # a skipped row's words as they are
            x = tl.where(ok, x, tl.load(packed_addr, mask=col_ok & ~cached, other=0))
        tl.store(packed_addr, x, mask=ok)
    if DIGEST:
        a, b = tile_lanes(x, elem, col_ok, WORDS)
        add_lanes(digest_ptr, a, b)


@dataclass
class ChunkTable:
    """The chunks of one state set at one width, on the states' device."""

    table: torch.Tensor  # [num_chunks, 5] int64
    block_w: int
    align: int  # every entry a multiple of this many words (16 bytes' worth if all allow)
    streams: set = field(default_factory=set)  # streams (raw handles) the table was used on

    def used_on(self, device: torch.device) -> None:
        """Note a launch on the current stream: once the table leaves the cache, its memory must
        not be handed out again before that stream's launches have read it."""
        stream = torch.cuda.current_stream(device)
        if stream.cuda_stream not in self.streams:
            self.table.record_stream(stream)
            self.streams.add(stream.cuda_stream)


@functools.lru_cache(maxsize=64)
def chunk_table(
    layout: tuple[tuple[int, int, int], ...], width: int, device: torch.device
) -> ChunkTable:
    """The chunk table of a state set (cached: its contents depend on ``layout`` alone).

    Args:
        layout: per state tensor, ``(address, slot stride in bytes, row bytes)``; every value a
            multiple of ``width``.
        width: the integer width in bytes the copy moves.
        device: the states' device.
    """
    base = layout[0][0]
    longest = max(row for _, _, row in layout) // width
    block_w = max(16, min(MAX_BLOCK_W, triton.next_power_of_2(max(longest, 1))))
    rows, packed_column = [], 0
    for address, slot_stride, row_bytes in layout:
        words = row_bytes // width
        for column in range(0, words, block_w):
            n = min(block_w, words - column)
            rows.append(((address - base) // width, slot_stride // width, column, packed_column, n))
            packed_column += n
    align = max(16 // width, 1)
    if base % 16 or any(v % align for row in rows for v in row):
        align = 1
    # a blocking copy, on purpose: any stream may launch with this table next
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 5).to(device)
    return ChunkTable(table, block_w, align)


def copy_state(
    base: torch.Tensor,
    chunks: ChunkTable,
    slots: torch.Tensor,
    packed: torch.Tensor,
    *,
    unpack: bool,
    lanes: torch.Tensor | None = None,
) -> None:
    """Pack (state slots → ``packed``) or unpack (``packed`` → state slots) in one launch.

    Args:
        base: integer view of the first state tensor (``packed``'s width): every address is an
            offset from it.
        chunks: the state set's :func:`chunk_table` at that width.
        slots: ``[num_seqs]`` int32/int64, contiguous, on the states' device.
        packed: ``[num_seqs, total_words]`` integer view, contiguous; ``num_seqs > 0``.
        unpack: write ``packed`` into the states instead of reading them.
        lanes: ``[2]`` int64 zeros, or None: add the digest's lane sums of every packed element
            into it (4- or 8-byte integers only).
    """
    num_seqs, total_words = packed.shape
    num_chunks = chunks.table.shape[0]
    if num_chunks == 0:
        return
    if packed.device.type == "cuda":
        chunks.used_on(packed.device)
    digest = lanes is not None
    aligned = packed.data_ptr() % 16 == 0 and total_words % chunks.align == 0
    align = chunks.align if aligned else 1
    with interpreter_lock():
        _state_copy_kernel[(num_chunks, num_seqs)](
            base,
            chunks.table,
            slots,
            packed,
            lanes if digest else chunks.table,  # never read without DIGEST
            total_words // align,
            ALIGN=align,
            UNPACK=unpack,
            DIGEST=digest,
            WORDS=max(packed.element_size() // 4, 1),
            BLOCK_W=chunks.block_w,
            num_warps=4 if chunks.block_w <= 512 else 8,
        )
