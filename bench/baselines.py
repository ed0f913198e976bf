"""The baselines every benchmark compares tritonkv with, written once.

``loop``  vLLM SimpleConnector's way: for each sequence, for each layer, index that sequence's
          slots in the layer's cache, then concatenate (one small indexing op per sequence × layer
          × K/V, and a host round trip to read the offsets).
``torch`` the vectorised version: one flat index for the whole batch, one advanced-indexing op per
          layer × K/V.
``copy``  a plain copy of a contiguous buffer holding the same bytes into another preallocated one:
          the limit any pack or unpack can approach.

They use the same addressing as tritonkv (sequence ``i`` owns flat tokens
``query_start_loc[i] : query_start_loc[i + 1]``; slot ``s`` is block ``s // block_size``, offset
``s % block_size`` of every ``[num_blocks, num_kv_heads, block_size, head_size]`` view) and return
tensors of tritonkv's packed shapes, so the benchmarks can check every provider bit for bit. They
assume every selected token owns a slot (the benchmarks never pad).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Layers = Sequence[tuple[torch.Tensor, "torch.Tensor | None"]]


def _parts(pair) -> list[torch.Tensor]:
    return [t for t in pair if t is not None]


def flat_tokens(query_start_loc: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """``[rows]`` flat token of every packed row: the selected sequences' tokens back to back."""
    starts = query_start_loc[seq_ids]
    lens = query_start_loc[seq_ids + 1] - starts
    first_row = torch.cumsum(lens, 0) - lens
    total = int(lens.sum())
    return torch.repeat_interleave(starts - first_row, lens, output_size=total) + torch.arange(
        total, device=lens.device
    )


# --------------------------------------------------------------------------------------------- kv


def loop_pack_kv(layers: Layers, slot_mapping, query_start_loc, seq_ids) -> torch.Tensor:
    """Per sequence × per layer indexing, then stack and concatenate (SimpleConnector's loop)."""
    offsets = query_start_loc.tolist()
    block_size = layers[0][0].shape[2]
    per_seq = []
    for i in seq_ids.tolist():
        slots = slot_mapping[offsets[i] : offsets[i + 1]].long()
        block, offset = slots // block_size, slots % block_size
        per_layer = [torch.stack([t[block, :, offset, :] for t in _parts(p)]) for p in layers]
        per_seq.append(torch.stack(per_layer))  # [num_layers, 1 or 2, seq tokens, heads, head_size]
    return torch.cat(per_seq, dim=2)


def loop_unpack_kv(packed, layers: Layers, slot_mapping, query_start_loc, seq_ids) -> None:
    """Per sequence × per layer: write the sequence's packed rows to its slots."""
    offsets = query_start_loc.tolist()
    block_size = layers[0][0].shape[2]
    row = 0
    for i in seq_ids.tolist():
        n = offsets[i + 1] - offsets[i]
        slots = slot_mapping[offsets[i] : offsets[i + 1]].long()
        block, offset = slots // block_size, slots % block_size
        for layer, pair in enumerate(layers):
            for part, t in enumerate(_parts(pair)):
                t[block, :, offset, :] = packed[layer, part, row : row + n]
        row += n


def torch_pack_kv(layers: Layers, slot_mapping, query_start_loc, seq_ids, out) -> torch.Tensor:
    """One flat index for the batch, one advanced-indexing op per layer × K/V, into ``out``."""
    slots = slot_mapping[flat_tokens(query_start_loc, seq_ids)].long()
    block_size = layers[0][0].shape[2]
    block, offset = slots // block_size, slots % block_size
    for layer, pair in enumerate(layers):
        for part, t in enumerate(_parts(pair)):
            out[layer, part] = t[block, :, offset, :]
    return out


def torch_unpack_kv(packed, layers: Layers, slot_mapping, query_start_loc, seq_ids) -> None:
    slots = slot_mapping[flat_tokens(query_start_loc, seq_ids)].long()
    block_size = layers[0][0].shape[2]
    block, offset = slots // block_size, slots % block_size
    for layer, pair in enumerate(layers):
        for part, t in enumerate(_parts(pair)):
            t[block, :, offset, :] = packed[layer, part]


# ----------------------------------------------------------------------------------------- hidden


def loop_pack_hidden(hidden, query_start_loc, seq_ids) -> torch.Tensor:
    """Slice each sequence's rows, concatenate."""
    offsets = query_start_loc.tolist()
    return torch.cat([hidden[offsets[i] : offsets[i + 1]] for i in seq_ids.tolist()])


def torch_pack_hidden(hidden, query_start_loc, seq_ids, out) -> torch.Tensor:
    """One flat index, one advanced-indexing op, into ``out``."""
    out[:] = hidden[flat_tokens(query_start_loc, seq_ids)]
    return out


# ------------------------------------------------------------------------------------------- copy


def copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """The limit: the same bytes, contiguous to contiguous, preallocated."""
    return dst.copy_(src)
