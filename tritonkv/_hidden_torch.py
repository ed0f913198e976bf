"""The torch twin of the hidden-state copy kernel (the CPU path, and the test oracle as
``pack_hidden_torch`` / ``unpack_hidden_torch``).

Tiny, yet a module of its own like :mod:`tritonkv._kv_torch`: every op's twin lives in
``_<op>_torch.py`` beside its kernel in ``_<op>_triton.py``.
"""

from __future__ import annotations

import torch

from ._index import SeqIndex

__all__ = ["MAX_SLICE_RUNS", "copy_hidden"]

MAX_SLICE_RUNS = 32  # CPU twin: up to this many stretches of rows are copied as slices


def copy_hidden(
    hidden: torch.Tensor, index: SeqIndex, packed: torch.Tensor, *, unpack: bool
) -> None:
    """Slice copies for a few stretches of rows (CPU), else one row gather (or scatter).

    Args:
        hidden: ``[num_tokens, hidden_size]`` integer view, any strides.
        index: the selected sequences' :class:`~tritonkv._index.SeqIndex`.
        packed: ``[num_rows, hidden_size]`` integer view of ``hidden``'s width, contiguous.
        unpack: write ``packed`` into ``hidden`` instead of reading it.
    """
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
