"""Sliding-window clipping: the part of each sequence's KV that a sliding-window layer can still
read, as a smaller flat batch for :func:`tritonkv.pack_kv` / :func:`tritonkv.unpack_kv`.

In vLLM a sliding-window layer of window ``sliding_window`` lets the token at position ``p``
attend to positions ``p - sliding_window + 1 .. p``. A consumer that loads a prompt's first
``N - 1`` tokens and recomputes the last one (position ``N - 1``) reads, from what it loaded,
only positions ``N - sliding_window .. N - 2``: the last ``sliding_window - 1`` loaded tokens;
later tokens read even less of them. Packing and unpacking the clipped batch
(:func:`clip_to_window`) moves exactly those tokens: the slots of every earlier token are
neither read on the producer nor written on the consumer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._checks import check_index
from ._index import seq_index

__all__ = ["clip_to_window"]


def clip_to_window(
    query_start_loc: torch.Tensor,
    slot_mapping: torch.Tensor,
    sliding_window: int,
    seq_ids: torch.Tensor | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the last ``sliding_window - 1`` tokens of each selected sequence (all of them when it
    has fewer).

    Give it the tokens that are handed over (the prompt but its recomputed last token) on both
    sides, with each side's own ``slot_mapping``: the producer packs, and the consumer unpacks,
    the same clipped rows.

    Args:
        query_start_loc: ``[num_seqs + 1]`` int32/int64 offsets of each sequence's tokens in
            the flat batch.
        slot_mapping: ``[num_tokens]`` int32/int64 cache slot of each flat-batch token.
        sliding_window: the layer's window in tokens, vLLM's meaning (the query token
            included), ``>= 1``.
        seq_ids: sequences to keep, in output order (tensor or list of ints); None = all.

    Returns:
        ``(query_start_loc, slot_mapping)`` of the clipped flat batch: ``[len(seq_ids) + 1]``
        int64 offsets and ``[clipped tokens]`` slots of ``slot_mapping``'s dtype, on
        ``slot_mapping``'s device; pass them to :func:`tritonkv.pack_kv` /
        :func:`tritonkv.unpack_kv` without ``seq_ids``. On a GPU the call waits for the
        clipped token count (one host sync).

    Raises:
        TypeError, ValueError: inputs of the wrong type, shape, dtype or range (offsets and
            ``seq_ids`` are checked as :func:`tritonkv.pack_kv` checks them).
    """
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise TypeError(f"sliding_window: expected an int, got {type(sliding_window).__name__}")
    if sliding_window < 1:
        raise ValueError(f"sliding_window: expected >= 1 tokens, got {sliding_window}")
    check_index("slot_mapping", slot_mapping, allow_none=False)
    if query_start_loc is None:
        raise TypeError("query_start_loc: expected a 1-D int32/int64 tensor, got None")
    device = slot_mapping.device
    index = seq_index(query_start_loc, seq_ids, slot_mapping.numel(), device)
    cu_seqlens = index.cu_seqlens
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    keep = lens.clamp(max=sliding_window - 1)
    start = index.src_start + lens - keep  # each sequence's first token in the window
    clipped = torch.zeros(keep.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(keep, 0, out=clipped[1:])
    total = int(clipped[-1])
    # token r of the clipped batch, of sequence j: start[j] + (r - clipped[j])
    owner = torch.repeat_interleave(
        torch.arange(keep.numel(), device=device), keep, output_size=total
    )
    tokens = start[owner] + torch.arange(total, device=device) - clipped[:-1][owner]
    return clipped, slot_mapping[tokens]
