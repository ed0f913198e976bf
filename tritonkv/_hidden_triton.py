"""The Triton kernel that packs and unpacks hidden-state rows, and its launcher.

Rows are addressed as in :mod:`tritonkv._index`; the copies move integer views
(:mod:`tritonkv._intview`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._autotune import TunedLaunch, autotune_bench, autotune_configs
from ._digest_triton import add_lanes, tile_lanes
from ._index import SeqIndex, flat_token

__all__ = ["copy_hidden"]


# Elements of one tile per thread above which a config spills registers: BLOCK_T * BLOCK_H (up
# to 64 x 1024) over 32 * num_warps threads. Such configs are never the fastest, and compiling
# one took 17 s (Triton 3.6, sm_90, the digest variant): the autotuner skips them.
MAX_TILE_PER_THREAD = 128


def configs_that_fit(configs: list, named_args: dict, **kwargs) -> list:
    """The autotuner's ``early_config_prune``: the configs whose tile of ``BLOCK_T`` rows by
    ``BLOCK_H`` columns is at most :data:`MAX_TILE_PER_THREAD` elements per thread (else the
    one with the smallest share)."""
    share = lambda c: c.kwargs["BLOCK_T"] * kwargs["BLOCK_H"] / (32 * c.num_warps)
    return [c for c in configs if share(c) <= MAX_TILE_PER_THREAD] or [min(configs, key=share)]


@triton.autotune(
    configs=autotune_configs(),
    key=["hidden_size", "BLOCK_H", "UNPACK", "DIGEST"],
    do_bench=autotune_bench,
    restore_value=["digest_ptr"],  # the lane sums, not summed over the timing runs (_kv_triton)
    prune_configs_by={"early_config_prune": configs_that_fit},
)
@triton.jit(do_not_specialize=["num_rows", "num_sel", "search_steps"])
def _hidden_copy_kernel(
    hidden_ptr,  # [num_tokens, hidden_size] integer view, any strides
    cu_seqlens_ptr,  # [num_sel + 1] int64
    src_start_ptr,  # [num_sel] int64
    packed_ptr,  # [num_rows, hidden_size] integer view, contiguous
    digest_ptr,  # [2] int64 lane sums (DIGEST only)
    num_rows,
    num_sel,
    search_steps,
    hidden_size,
    stride_row,
    stride_col,
    BLOCK_H: tl.constexpr,
    UNPACK: tl.constexpr,
    DIGEST: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid ``(cdiv(num_rows, BLOCK_T), cdiv(hidden_size, BLOCK_H))``: BLOCK_T rows × BLOCK_H cols.

    With DIGEST, each program adds the lane sums of the packed elements it moved (``WORDS``
    32-bit words each) into ``digest_ptr`` (:mod:`tritonkv._digest_triton`).
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_rows
    token = flat_token(rows, row_ok, cu_seqlens_ptr, src_start_ptr, num_sel, search_steps)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = row_ok[:, None] & (cols < hidden_size)[None, :]
    hidden_addr = hidden_ptr + (token * stride_row)[:, None] + (cols * stride_col)[None, :]
    packed_addr = packed_ptr + (rows * hidden_size)[:, None] + cols[None, :]
    if UNPACK:
        x = tl.load(packed_addr, mask=mask)
        tl.store(hidden_addr, x, mask=mask)
    else:
        x = tl.load(hidden_addr, mask=mask)
        tl.store(packed_addr, x, mask=mask)
    if DIGEST:
        a, b = tile_lanes(x, (rows * hidden_size)[:, None] + cols[None, :], mask, WORDS)
        add_lanes(digest_ptr, a, b)


def copy_hidden(
    hidden: torch.Tensor,
    index: SeqIndex,
    packed: torch.Tensor,
    *,
    unpack: bool,
    lanes: torch.Tensor | None = None,
) -> None:
    """Pack (``hidden`` rows → ``packed``) or unpack (``packed`` → ``hidden`` rows) in one launch.

    Args:
        hidden: ``[num_tokens, hidden_size]`` integer view, any strides.
        index: the selected sequences' :class:`~tritonkv._index.SeqIndex`, on ``hidden``'s device.
        packed: ``[num_rows, hidden_size]`` integer view of ``hidden``'s width, contiguous;
            ``num_rows > 0``.
        unpack: write ``packed`` into ``hidden`` instead of reading it.
        lanes: ``[2]`` int64 zeros, or None: add the digest's lane sums of the packed elements
            into it (``packed`` of 4- or 8-byte integers only).
    """
    num_rows, hidden_size = packed.shape
    block_h = min(triton.next_power_of_2(hidden_size), 1024)
    grid = lambda meta: (triton.cdiv(num_rows, meta["BLOCK_T"]), triton.cdiv(hidden_size, block_h))
    digest = lanes is not None
    key = (hidden_size, block_h, unpack, digest, hidden.dtype, packed.dtype)  # the autotuner's
    _HIDDEN_COPY(
        key,
        grid,
        hidden_ptr=hidden,
        cu_seqlens_ptr=index.cu_seqlens,
        src_start_ptr=index.src_start,
        packed_ptr=packed,
        digest_ptr=lanes if digest else index.cu_seqlens,  # never read without DIGEST
        num_rows=num_rows,
        num_sel=index.num_sel,
        search_steps=index.search_steps,
        hidden_size=hidden_size,
        stride_row=hidden.stride(0),
        stride_col=hidden.stride(1),
        BLOCK_H=block_h,
        UNPACK=unpack,
        DIGEST=digest,
        WORDS=max(packed.element_size() // 4, 1),
    )


_HIDDEN_COPY = TunedLaunch(_hidden_copy_kernel)
