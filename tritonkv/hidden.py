"""Pack the selected sequences' hidden-state rows into one tensor, and write such rows back: the
public API, its checks, and the dispatch.

Addressing is the one of :mod:`tritonkv.kv` (see :mod:`tritonkv._index`): sequence ``i`` owns flat
rows ``query_start_loc[i] : query_start_loc[i + 1]``. With ``last_only=True`` each selected
sequence contributes one row, its last query token (the row whose logits sample the next token).
The copy runs in the Triton kernel (:mod:`tritonkv._hidden_triton`, one launch) or the torch twin
(:mod:`tritonkv._hidden_torch`), as :func:`tritonkv.use_triton` picks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _cpu_digest, _digest_triton, _hidden_torch, _hidden_triton
from ._checks import checks_enabled
from ._dispatch import use_triton
from ._index import seq_index
from ._intview import as_int, widest_int_view
from .digest import finalize, packed_digest

__all__ = ["pack_hidden", "pack_hidden_torch", "unpack_hidden", "unpack_hidden_torch"]


def _run(
    hidden_states,
    query_start_loc,
    seq_ids,
    packed,
    *,
    last_only,
    unpack,
    force_torch,
    digest=False,
):
    """Validate, address, widen and dispatch; returns ``(packed, SeqIndex, digest or None)``."""
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
    result = None
    if use_triton(device) and not force_torch:
        fused = digest and width >= 4
        lanes = torch.zeros(2, dtype=torch.int64, device=device) if digest else None
        if num_rows:
            _hidden_triton.copy_hidden(
                hidden_int, index, packed_int, unpack=unpack, lanes=lanes if fused else None
            )
        if digest and not fused:  # 1- or 2-byte integers: the digest's own launch
            _digest_triton.byte_lanes(packed, lanes)
        if digest:
            result = finalize(lanes, packed.numel() * packed.element_size())
    elif digest and device.type == "cpu" and not force_torch and (lib := _cpu_digest.native()):
        table = _cpu_digest.RowTable.of_rows(hidden_states)  # copy and digest in one pass
        slots = index.flat_tokens(num_rows)
        result = _cpu_digest.copy_with_digest(lib, table, slots, packed, unpack=unpack)
    else:
        _hidden_torch.copy_hidden(hidden_int, index, packed_int, unpack=unpack)
        result = packed_digest(packed) if digest else None
    return packed, index, result


def pack_hidden(
    hidden_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_ids: torch.Tensor | Sequence[int] | None = None,
    *,
    last_only: bool = False,
    out: torch.Tensor | None = None,
    digest: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack the selected sequences' hidden-state rows into one contiguous tensor.

    Args:
        hidden_states: ``[num_tokens, hidden_size]``, any dtype and strides.
        query_start_loc: ``[num_seqs + 1]`` int32/int64 offsets of each sequence's rows.
        seq_ids: sequences to pack, in output order; None = all.
        last_only: pack only each selected sequence's last query row.
        out: optional contiguous ``[rows, hidden_size]`` tensor of ``hidden_states``' dtype, rows =
            the selected sequences' query tokens (``len(seq_ids)`` with ``last_only``).
        digest: also return the integrity digest of ``packed`` (:mod:`tritonkv.digest`), as
            :func:`tritonkv.pack_kv` does.

    Returns:
        ``(packed, cu_seqlens)``: ``packed`` ``[rows, hidden_size]`` and ``cu_seqlens``
        ``[len(seq_ids) + 1]`` int64 row offsets of each selected sequence (``0, 1, 2, ...`` with
        ``last_only``). With ``digest=True``, ``(packed, cu_seqlens, digest)``, ``digest`` ``[2]``
        int64.
    """
    return _pack(hidden_states, query_start_loc, seq_ids, last_only, out, digest, False)


def _pack(hidden_states, query_start_loc, seq_ids, last_only, out, digest, force_torch):
    packed, index, result = _run(
        hidden_states,
        query_start_loc,
        seq_ids,
        out,
        last_only=last_only,
        unpack=False,
        force_torch=force_torch,
        digest=bool(digest),
    )
    return (packed, index.cu_seqlens, result) if digest else (packed, index.cu_seqlens)


def unpack_hidden(
    packed: torch.Tensor,
    hidden_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_ids: torch.Tensor | Sequence[int] | None = None,
    *,
    last_only: bool = False,
    digest: bool = False,
) -> torch.Tensor | None:
    """Write rows made by :func:`pack_hidden` back to the same positions of ``hidden_states``.

    Args:
        packed: ``[rows, hidden_size]`` contiguous, ``hidden_states``' dtype.
        hidden_states, query_start_loc, seq_ids, last_only: as in :func:`pack_hidden`.
        digest: return the ``[2]`` int64 digest of ``packed`` as read (else None).
    """
    return _run(
        hidden_states,
        query_start_loc,
        seq_ids,
        packed,
        last_only=last_only,
        unpack=True,
        force_torch=False,
        digest=bool(digest),
    )[2]


def pack_hidden_torch(
    hidden_states, query_start_loc, seq_ids=None, *, last_only=False, out=None, digest=False
):
    """:func:`pack_hidden` on the plain-torch twin, whatever the device and ``TRITONKV_KERNELS``."""
    return _pack(hidden_states, query_start_loc, seq_ids, last_only, out, digest, True)


def unpack_hidden_torch(
    packed, hidden_states, query_start_loc, seq_ids=None, *, last_only=False, digest=False
):
    """:func:`unpack_hidden` on the plain-torch twin, whatever the device and ``TRITONKV_KERNELS``."""
    return _run(
        hidden_states,
        query_start_loc,
        seq_ids,
        packed,
        last_only=last_only,
        unpack=True,
        force_torch=True,
        digest=bool(digest),
    )[2]
