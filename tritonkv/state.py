"""Pack the selected sequences' state slots (Mamba, gated delta net, short conv layers) into one
byte tensor, and write such rows back: the public API, its checks, and the dispatch.

vLLM keeps a state layer's states per slot (the block id of the request's state block): each
state tensor is ``[num_slots, *state_shape]``, one slot's state contiguous, slots a stride apart
that is often larger than the state (the tensors are views into one buffer of pages holding a
layer's conv and SSM states back to back, :meth:`MambaBase.bind_kv_cache`). A request's state is
one slot of every such tensor; :func:`pack_state` lays those rows, tensor after tensor, as the
bytes of one packed row per sequence. The copy runs in the Triton kernel
(:mod:`tritonkv._state_triton`, one launch for every tensor) or the torch twin
(:mod:`tritonkv._state_torch`), as :func:`tritonkv.use_triton` picks; both move integer views
(:mod:`tritonkv._intview`), so every dtype is copied bit for bit.

These ops copy whatever the slots hold: which state that is, is the caller's to get right. A
consumer that recomputes the prompt's last token needs the state from before that token, not
the one after it; a state one token off gives plausible but wrong tokens, never an error here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import _digest_triton, _state_torch, _state_triton
from ._checks import check_index, checks_enabled
from ._dispatch import use_triton
from ._index import on_device
from ._intview import as_int
from .digest import finalize, packed_digest

__all__ = [
    "pack_state",
    "pack_state_torch",
    "state_row_bytes",
    "unpack_state",
    "unpack_state_torch",
]


def _check_states(states) -> tuple[int, torch.device]:
    """Validate the state tensors; returns ``(num_slots, device)``."""
    if isinstance(states, torch.Tensor) or not isinstance(states, Sequence):
        raise TypeError(f"states: expected a list or tuple of tensors, got {type(states).__name__}")
    if not states:
        raise ValueError("states: expected at least one state tensor, got none")
    for i, t in enumerate(states):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"states[{i}]: expected a tensor, got {type(t).__name__}")
        if t.dim() < 1:
            raise ValueError(f"states[{i}]: expected [num_slots, *state_shape], got a 0-d tensor")
    num_slots, device = states[0].shape[0], states[0].device
    for i, t in enumerate(states):
        if t.shape[0] != num_slots or t.device != device:
            raise ValueError(
                f"states[{i}]: expected {num_slots} slots in dim 0 on {device} (as states[0]), "
                f"got shape {tuple(t.shape)} on {t.device}"
            )
        expected = 1 if math.prod(t.shape[1:]) else None  # (an empty state: any strides)
        for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:], strict=True))):
            if expected is not None and size != 1 and stride != expected:
                raise ValueError(
                    f"states[{i}]: expected each slot's state contiguous (strides "
                    f"{_contiguous_strides(t.shape[1:])} after dim 0), got strides {t.stride()} "
                    f"for shape {tuple(t.shape)}"
                )
            expected = None if expected is None else expected * size
    return num_slots, device


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def state_row_bytes(states: Sequence[torch.Tensor]) -> int:
    """Bytes of one packed row: one slot's state of every tensor of ``states``.

    Args:
        states: per-layer state tensors, as in :func:`pack_state`.
    """
    _check_states(states)
    return sum(_row_bytes(t) for t in states)


def _width(states, packed, widest: int) -> int:
    """Widest integer (bytes) dividing every address, slot stride and row of the states and
    ``packed``'s address and row: integer views of it address exactly the same bytes."""
    values = [packed.data_ptr(), packed.shape[1]]
    for t in states:
        values += [t.data_ptr(), t.stride(0) * t.element_size(), _row_bytes(t)]
    return next((w for w in (16, 8, 4, 2) if w <= widest and all(v % w == 0 for v in values)), 1)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``[num_slots, row_words]`` integer view of a state tensor (one slot's state per row)."""
    row_elems = math.prod(t.shape[1:])
    flat = torch.as_strided(t, (t.shape[0], row_elems), (t.stride(0), 1))
    return as_int(flat.view(torch.uint8), width)


def _run(states, slots, packed, *, unpack, force_torch, digest):
    """Validate, widen and dispatch; returns ``(packed, digest or None)``."""
    num_slots, device = _check_states(states)
    check_index("slots", slots, allow_none=False)
    num_seqs = slots.shape[0]
    row_bytes = sum(_row_bytes(t) for t in states)
    name = "packed" if unpack else "out"
    if packed is None:
        if unpack:
            raise TypeError("packed: expected a tensor, got None")
        packed = torch.zeros(num_seqs, row_bytes, dtype=torch.uint8, device=device)
    elif not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(packed).__name__}")
    elif (
        tuple(packed.shape) != (num_seqs, row_bytes)
        or packed.dtype != torch.uint8
        or packed.device != device
        or not packed.is_contiguous()
    ):
        raise ValueError(
            f"{name}: expected a contiguous [{num_seqs}, {row_bytes}] (num_seqs, row bytes) "
            f"torch.uint8 tensor on {device}, got {tuple(packed.shape)} {packed.dtype} on "
            f"{packed.device} (contiguous={packed.is_contiguous()})"
        )
    if checks_enabled(slots) and num_seqs:
        low, high = int(slots.min()), int(slots.max())
        if low < -1 or high >= num_slots:
            raise ValueError(
                f"slots: expected values in [-1, {num_slots}) (num_slots), got values in "
                f"[{low}, {high}]"
            )
    slots = on_device(slots, device)
    triton_path = use_triton(device) and not force_torch
    width = _width(states, packed, 8 if triton_path else 16)
    packed_int = as_int(packed, width)
    result = None
    if triton_path:
        fused = digest and width >= 4
        lanes = torch.zeros(2, dtype=torch.int64, device=device) if digest else None
        if num_seqs and row_bytes:
            layout = tuple(
                (t.data_ptr(), t.stride(0) * t.element_size(), _row_bytes(t))
                for t in states
                if _row_bytes(t)
            )
            chunks = _state_triton.chunk_table(layout, width, device)
            base = _rows(next(t for t in states if _row_bytes(t)), width)
            _state_triton.copy_state(
                base, chunks, slots, packed_int, unpack=unpack, lanes=lanes if fused else None
            )
        if digest and not fused:  # 1- or 2-byte integers: the digest's own launch
            _digest_triton.byte_lanes(packed, lanes)
        if digest:
            result = finalize(lanes, packed.numel())
    else:
        if num_seqs and row_bytes:
            rows = [_rows(t, width) for t in states]
            columns = [0]
            for row in rows[:-1]:
                columns.append(columns[-1] + row.shape[1])
            _state_torch.copy_state(rows, columns, slots, packed_int, unpack=unpack)
        result = packed_digest(packed) if digest else None
    return packed, result


def pack_state(
    states: Sequence[torch.Tensor],
    slots: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    digest: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pack the state slot of each selected sequence, every state tensor, into one byte tensor.

    Packed row ``i`` holds slot ``slots[i]`` of ``states[0]``, then of ``states[1]``, ..., each
    as its bytes in memory order (:func:`state_row_bytes` bytes in all).

    Args:
        states: per-layer state tensors as vLLM allocates them, each ``[num_slots,
            *state_shape]`` (e.g. a linear-attention layer's conv state ``[num_slots, 3, 8192]``
            and SSM state ``[num_slots, 32, 128, 128]``), any dtypes and shapes, on one device,
            with the same ``num_slots``; each slot's state contiguous, any slot stride (views into
            a buffer of larger pages).
        slots: ``[num_seqs]`` int32/int64 state slot of each selected sequence; ``-1``: skipped
            (its packed row is left as it is: zeros without ``out``).
        out: optional contiguous ``[num_seqs, state_row_bytes(states)]`` uint8 tensor.
        digest: also return the integrity digest of ``packed`` (:mod:`tritonkv.digest`), every
            row, skipped ones as they are.

    Returns:
        ``packed`` ``[num_seqs, state_row_bytes(states)]`` uint8; with ``digest=True``,
        ``(packed, digest)``, ``digest`` ``[2]`` int64.

    Raises:
        TypeError, ValueError: inputs of the wrong type, shape, dtype, strides or range (the
            message says what was expected and what was given). Slots are range-checked when
            on the host, or on the GPU with ``TRITONKV_CHECK=1``.
    """
    packed, result = _run(states, slots, out, unpack=False, force_torch=False, digest=digest)
    return (packed, result) if digest else packed


def unpack_state(
    packed: torch.Tensor,
    states: Sequence[torch.Tensor],
    slots: torch.Tensor,
    *,
    digest: bool = False,
) -> torch.Tensor | None:
    """Write rows made by :func:`pack_state` into the state slots ``slots`` of ``states``.

    Nothing but the addressed slots is written; rows whose slot is ``-1`` are skipped. If two
    rows name the same slot, which one lands is unspecified.

    Args:
        packed: ``[num_seqs, state_row_bytes(states)]`` uint8, contiguous.
        states, slots: as in :func:`pack_state`, for the destination (same shapes and dtypes
            as the producer's, in the same order; slot strides may differ).
        digest: return the ``[2]`` int64 digest of ``packed`` as read (every row), else None.
    """
    return _run(states, slots, packed, unpack=True, force_torch=False, digest=digest)[1]


def pack_state_torch(states, slots, *, out=None, digest=False):
    """:func:`pack_state` on the plain-torch twin, whatever the device and ``TRITONKV_KERNELS``."""
    packed, result = _run(states, slots, out, unpack=False, force_torch=True, digest=digest)
    return (packed, result) if digest else packed


def unpack_state_torch(packed, states, slots, *, digest=False):
    """:func:`unpack_state` on the plain-torch twin, whatever the device and
    ``TRITONKV_KERNELS``."""
    return _run(states, slots, packed, unpack=True, force_torch=True, digest=digest)[1]
