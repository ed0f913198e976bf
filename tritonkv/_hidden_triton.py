"""The Triton kernel that packs and unpacks hidden-state rows, and its launcher.

Rows are addressed as in :mod:`tritonkv._index`; the copies move integer views
(:mod:`tritonkv._intview`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._autotune import TunedLaunch, autotune_bench, autotune_configs
from ._index import SeqIndex, flat_token

__all__ = ["copy_hidden"]


@triton.autotune(
    configs=autotune_configs(), key=["hidden_size", "BLOCK_H", "UNPACK"], do_bench=autotune_bench
)
@triton.jit(do_not_specialize=["num_rows", "num_sel", "search_steps"])
def _hidden_copy_kernel(
    hidden_ptr,  # [num_tokens, hidden_size] integer view, any strides
    cu_seqlens_ptr,  # [num_sel + 1] int64
    src_start_ptr,  # [num_sel] int64
    packed_ptr,  # [num_rows, hidden_size] integer view, contiguous
    num_rows,
    num_sel,
    search_steps,
    hidden_size,
    stride_row,
    stride_col,
    BLOCK_H: tl.constexpr,
    UNPACK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid ``(cdiv(num_rows, BLOCK_T), cdiv(hidden_size, BLOCK_H))``: BLOCK_T rows × BLOCK_H cols."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_rows
    token = flat_token(rows, row_ok, cu_seqlens_ptr, src_start_ptr, num_sel, search_steps)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = row_ok[:, None] & (cols < hidden_size)[None, :]
    hidden_addr = hidden_ptr + (token * stride_row)[:, None] + (cols * stride_col)[None, :]
    packed_addr = packed_ptr + (rows * hidden_size)[:, None] + cols[None, :]
    if UNPACK:
        tl.store(hidden_addr, tl.load(packed_addr, mask=mask), mask=mask)
    else:
        tl.store(packed_addr, tl.load(hidden_addr, mask=mask), mask=mask)


def copy_hidden(
    hidden: torch.Tensor, index: SeqIndex, packed: torch.Tensor, *, unpack: bool
) -> None:
    """Pack (``hidden`` rows → ``packed``) or unpack (``packed`` → ``hidden`` rows) in one launch.

    Args:
        hidden: ``[num_tokens, hidden_size]`` integer view, any strides.
        index: the selected sequences' :class:`~tritonkv._index.SeqIndex`, on ``hidden``'s device.
        packed: ``[num_rows, hidden_size]`` integer view of ``hidden``'s width, contiguous;
            ``num_rows > 0``.
        unpack: write ``packed`` into ``hidden`` instead of reading it.
    """
    num_rows, hidden_size = packed.shape
    block_h = min(triton.next_power_of_2(hidden_size), 1024)
    grid = lambda meta: (triton.cdiv(num_rows, meta["BLOCK_T"]), triton.cdiv(hidden_size, block_h))
    key = (hidden_size, block_h, unpack, hidden.dtype, packed.dtype)  # the autotuner's, in effect
    _HIDDEN_COPY(
        key,
        grid,
        hidden_ptr=hidden,
        cu_seqlens_ptr=index.cu_seqlens,
        src_start_ptr=index.src_start,
        packed_ptr=packed,
        num_rows=num_rows,
        num_sel=index.num_sel,
        search_steps=index.search_steps,
        hidden_size=hidden_size,
        stride_row=hidden.stride(0),
        stride_col=hidden.stride(1),
        BLOCK_H=block_h,
        UNPACK=unpack,
    )


_HIDDEN_COPY = TunedLaunch(_hidden_copy_kernel)
