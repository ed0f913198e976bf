"""The torch twin of the state-slot copy kernel (the CPU path, and the test oracle as
``pack_state_torch`` / ``unpack_state_torch``).

Every op's twin lives in ``_<op>_torch.py`` beside its kernel in ``_<op>_triton.py``.
"""

from __future__ import annotations

import torch

__all__ = ["copy_state"]


def copy_state(
    rows: list[torch.Tensor],
    columns: list[int],
    slots: torch.Tensor,
    packed: torch.Tensor,
    *,
    unpack: bool,
) -> None:
    """Gather (or scatter) the selected slots' rows of every state tensor, one tensor at a time.

    Args:
        rows: per state tensor, its ``[num_slots, row_words]`` integer view (one slot's state
            per row, contiguous within the row, any slot stride), all of ``packed``'s width.
        columns: per state tensor, the first column of its row in ``packed``.
        slots: ``[num_seqs]`` int32/int64 state slot of each packed row; ``-1``: skipped (the
            packed row and the states are left untouched).
        packed: ``[num_seqs, total_words]`` integer view, contiguous.
        unpack: write ``packed`` into the states instead of reading them.
    """
    keep = (slots >= 0).nonzero().squeeze(1)  # (a host sync on the GPU: the twin is the oracle)
    if keep.numel() == 0:
        return
    src = slots[keep].to(torch.int64)
    for row, first in zip(rows, columns, strict=True):
        span = slice(first, first + row.shape[1])
        if unpack:
            row.index_copy_(0, src, packed[keep, span])
        else:
            packed[keep, span] = row.index_select(0, src)
