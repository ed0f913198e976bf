"""Pack the selected sequences' hidden-state rows into one tensor, and write such rows back.

Addressing is the one of :mod:`tritonkv.kv` (see :mod:`tritonkv._common`): sequence ``i`` owns flat
rows ``query_start_loc[i] : query_start_loc[i + 1]``. With ``last_only=True`` each selected
sequence contributes one row, its last query token (the row whose logits sample the next token).
On CUDA one Triton launch copies everything; on CPU the torch twins do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._common import (
    SeqIndex,
    TunedLaunch,
    _flat_token,
    as_int,
    autotune_bench,
    autotune_configs,
    checks_enabled,
    seq_index,
    use_triton,
    widest_int_view,
)

__all__ = ["pack_hidden", "pack_hidden_torch", "unpack_hidden", "unpack_hidden_torch"]


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
    token = _flat_token(rows, row_ok, cu_seqlens_ptr, src_start_ptr, num_sel, search_steps)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = row_ok[:, None] & (cols < hidden_size)[None, :]
    hidden_addr = hidden_ptr + (token * stride_row)[:, None] + (cols * stride_col)[None, :]
    packed_addr = packed_ptr + (rows * hidden_size)[:, None] + cols[None, :]
    if UNPACK:
        tl.store(hidden_addr, tl.load(packed_addr, mask=mask), mask=mask)
    else:
        tl.store(packed_addr, tl.load(hidden_addr, mask=mask), mask=mask)


def _run(hidden_states, query_start_loc, seq_ids, packed, *, last_only, unpack, force_torch):
    """Validate, address, widen and dispatch; returns ``(packed, SeqIndex)``."""
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states: expected a tensor, got {type(hidden_states).__name__}")
    if hidden_states.dim() != 2 or hidden_states.shape[1] == 0:
        raise ValueError(
            "hidden_states: expected [num_tokens, hidden_size] with hidden_size > 0, got shape "
            f"{tuple(hidden_states.shape)}"
        )
    if query_start_loc is None:
        raise TypeError("query_start_loc: expected a 1-D int32/int64 tensor, got None")
    if unpack and packed is None:
        raise TypeError("packed: expected a tensor, got None")
    num_tokens, hidden_size = hidden_states.shape
    device, dtype = hidden_states.device, hidden_states.dtype
    index = seq_index(query_start_loc, seq_ids, num_tokens, device, last_only=last_only)
    name = "packed" if unpack else "out"
    if packed is None:
        packed = torch.empty(index.total(), hidden_size, dtype=dtype, device=device)
    elif not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(packed).__name__}")
    else:
        ok = packed.dim() == 2 and packed.shape[1] == hidden_size and packed.is_contiguous()
        if not ok or packed.dtype != dtype or packed.device != device:
            raise ValueError(
                f"{name}: expected a contiguous [rows, {hidden_size}] {dtype} tensor on {device}, "
                f"got {tuple(packed.shape)} {packed.dtype} on {packed.device} "
                f"(contiguous={packed.is_contiguous()})"
            )
        if checks_enabled(query_start_loc, seq_ids) and packed.shape[0] != index.total():
            raise ValueError(
                f"{name}: expected {index.total()} rows for the selected sequences, got "
                f"{packed.shape[0]}"
            )
    num_rows = packed.shape[0]
    width = widest_int_view([hidden_states, packed], hidden_size * hidden_states.element_size())
    hidden_int, packed_int = as_int(hidden_states, width), as_int(packed, width)
    if use_triton(device) and not force_torch:
        if num_rows:
            _launch(hidden_int, index, packed_int, unpack)
    else:
        _twin(hidden_int, index, packed_int, unpack)
    return packed, index


MAX_SLICE_RUNS = 32  # CPU twin: up to this many stretches of rows are copied as slices


def _twin(hidden: torch.Tensor, index: SeqIndex, packed: torch.Tensor, unpack: bool) -> None:
    """The torch twin: slice copies for a few stretches of rows (CPU), else one row gather."""
    num_rows = packed.shape[0]
    runs = index.runs(MAX_SLICE_RUNS) if packed.device.type == "cpu" and num_rows else None
    if runs is not None and unpack:
        for src, row, rows in runs:
            hidden[src : src + rows].copy_(packed[row : row + rows])
    elif runs is not None:
        torch.cat([hidden[src : src + rows] for src, _, rows in runs], out=packed)
    elif unpack:
        hidden[index.flat_tokens(num_rows)] = packed
    else:
        torch.index_select(hidden, 0, index.flat_tokens(num_rows), out=packed)


def _launch(hidden: torch.Tensor, index: SeqIndex, packed: torch.Tensor, unpack: bool) -> None:
    num_rows, hidden_size = packed.shape
    block_h = min(triton.next_power_of_2(hidden_size), 1024)
    grid = lambda meta: (triton.cdiv(num_rows, meta["BLOCK_T"]), triton.cdiv(hidden_size, block_h))
    key = (hidden_size, block_h, unpack, hidden.dtype, packed.dtype)  # the autotuner's, in effect
    _HIDDEN_COPY(
        key,
        grid,
        hidden,
        index.cu_seqlens,
        index.src_start,
        packed,
        num_rows,
        index.num_sel,
        index.search_steps,
        hidden_size,
        hidden.stride(0),
        hidden.stride(1),
        BLOCK_H=block_h,
        UNPACK=unpack,
    )


_HIDDEN_COPY = TunedLaunch(_hidden_copy_kernel)


def pack_hidden(
    hidden_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_ids: torch.Tensor | Sequence[int] | None = None,
    *,
    last_only: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack the selected sequences' hidden-state rows into one contiguous tensor.

    Args:
        hidden_states: ``[num_tokens, hidden_size]``, any dtype and strides.
        query_start_loc: ``[num_seqs + 1]`` int32/int64 offsets of each sequence's rows.
        seq_ids: sequences to pack, in output order; None = all.
        last_only: pack only each selected sequence's last query row.
        out: optional contiguous ``[rows, hidden_size]`` tensor of ``hidden_states``' dtype, rows =
            the selected sequences' query tokens (``len(seq_ids)`` with ``last_only``).

    Returns:
        ``(packed, cu_seqlens)``: ``packed`` ``[rows, hidden_size]`` and ``cu_seqlens``
        ``[len(seq_ids) + 1]`` int64 row offsets of each selected sequence (``0, 1, 2, ...`` with
        ``last_only``).
    """
    packed, index = _run(
        hidden_states,
        query_start_loc,
        seq_ids,
        out,
        last_only=last_only,
        unpack=False,
        force_torch=False,
    )
    return packed, index.cu_seqlens


def unpack_hidden(
    packed: torch.Tensor,
    hidden_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_ids: torch.Tensor | Sequence[int] | None = None,
    *,
    last_only: bool = False,
) -> None:
    """Write rows made by :func:`pack_hidden` back to the same positions of ``hidden_states``.

    Args:
        packed: ``[rows, hidden_size]`` contiguous, ``hidden_states``' dtype.
        hidden_states, query_start_loc, seq_ids, last_only: as in :func:`pack_hidden`.
    """
    _run(
        hidden_states,
        query_start_loc,
        seq_ids,
        packed,
        last_only=last_only,
        unpack=True,
        force_torch=False,
    )


def pack_hidden_torch(hidden_states, query_start_loc, seq_ids=None, *, last_only=False, out=None):
    """:func:`pack_hidden` on the plain-torch twin, whatever the device and backend setting."""
    packed, index = _run(
        hidden_states,
        query_start_loc,
        seq_ids,
        out,
        last_only=last_only,
        unpack=False,
        force_torch=True,
    )
    return packed, index.cu_seqlens


def unpack_hidden_torch(packed, hidden_states, query_start_loc, seq_ids=None, *, last_only=False):
    """:func:`unpack_hidden` on the plain-torch twin, whatever the device and backend setting."""
    _run(
        hidden_states,
        query_start_loc,
        seq_ids,
        packed,
        last_only=last_only,
        unpack=True,
        force_torch=True,
    )
