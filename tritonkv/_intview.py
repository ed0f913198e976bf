"""Integer views: copies move integers of the widest width the tensors allow, so every float
format (fp32, fp16, bf16, fp8) is copied bit for bit, with no arithmetic."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Integer dtype of each width. 16 bytes (CPU twins only, never a kernel): complex128, moved by plain
# loads and stores, whose bits are never interpreted.
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}


def widest_int_view(tensors: Sequence[torch.Tensor], row_bytes: int, widest: int = 8) -> int:
    """Largest access width in bytes (16, 8, 4, 2 or 1; at most ``widest``) that every tensor's last
    dim allows.

    A width wider than the element size qualifies when each tensor's last dim has stride 1 and the
    width divides ``row_bytes`` (the last dim's size in bytes), every other byte stride and every
    tensor's address, so integer views of that width address exactly the same bytes. The element
    size itself always qualifies.
    """
    itemsize = tensors[0].element_size()
    patterns = {(t.stride(), t.element_size()) for t in tensors}  # few: every layer is alike
    addresses = [t.data_ptr() for t in tensors]
    return widest_width(patterns, addresses, itemsize, row_bytes, widest)


def widest_width(
    patterns: set[tuple[tuple[int, ...], int]],
    addresses: Sequence[int],
    itemsize: int,
    row_bytes: int,
    widest: int,
) -> int:
    """:func:`widest_int_view` from the tensors' ``(strides, element size)`` patterns and
    addresses (an address may be given mod 16)."""
    for w in (16, 8, 4, 2):
        if w > widest or w <= itemsize or row_bytes % w:
            continue
        if all(a % w == 0 for a in addresses) and all(
            strides[-1] == 1 and all(s * size % w == 0 for s in strides[:-1])
            for strides, size in patterns
        ):
            return w
    return itemsize


def as_int(t: torch.Tensor, width: int) -> torch.Tensor:
    """View ``t`` as integers of ``width`` bytes (same bytes, last dim rescaled)."""
    if width < t.element_size():
        raise ValueError(f"as_int: width {width} below the element size {t.element_size()}")
    return t.view(_INT_OF_SIZE[width])
