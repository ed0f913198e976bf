"""The Triton kernel that packs and unpacks paged KV, every layer in one launch, and its launcher.

Views are as in :mod:`tritonkv.layouts`; rows are addressed as in :mod:`tritonkv._index`. The
launcher takes the integer views (:mod:`tritonkv._intview`) of one layer set, grouped by strides
(:func:`launch_groups`, made once per layer set), and launches :func:`_kv_copy_kernel` once per
group; strides come from the views, so any layout is "just strides".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from ._autotune import TunedLaunch, autotune_bench, autotune_configs
from ._digest_triton import add_lanes, tile_lanes
from ._index import SeqIndex, flat_token
from ._intview import as_int
from ._launch import DIRECT, DirectLaunch, current_device, int_spec, pointer_spec
from ._umac_core import CHUNK_WORDS
from ._umac_triton import add_nh_rows, flush_nh_rows, tile_nh

__all__ = ["LaunchGroup", "copy_kv", "launch_groups", "nh_fusable"]

_CHUNK_WORDS = tl.constexpr(CHUNK_WORDS)


def nh_fusable(width: int, row_bytes: int) -> bool:
    """Whether the copy kernel computes NH in its launch: it moves 4- or 8-byte integers and one
    head row of the packed tensor (``row_bytes``) is whole 32-byte groups, at most 4096 bytes,
    so that a head row touches at most two 4 KiB blocks (one where its size divides 4096)."""
    return width >= 4 and 32 <= row_bytes <= 4096 and row_bytes % 32 == 0


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
    token = flat_token(rows, row_ok, cu_seqlens_ptr, src_start_ptr, num_sel, search_steps)
    slot = tl.load(slot_mapping_ptr + token, mask=row_ok, other=-1).to(tl.int64)
    cached = row_ok & (slot >= 0)
    slot = tl.where(cached, slot, 0)
    return rows, row_ok, cached, slot // block_size, slot % block_size


@triton.jit
def _copy_heads(
    cache_ptr,  # [*] integer view: base of every layer's address
    layer_offset,  # element offset of this layer's K (or V) view from cache_ptr
    packed_ptr,  # [num_rows, num_kv_heads, head_size] this layer's K (or V) part of the packed tensor
    packed_first,  # element offset of packed_ptr in the whole packed tensor (digest positions)
    nh_key_ptr,  # [KEY_WORDS] int32 NH key (NH only)
    nh_ptr,  # [num_chunks, 2] int64 NH sums of the whole packed tensor (NH only)
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
    STORE: tl.constexpr,
    DIGEST: tl.constexpr,
    NH: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Copy BLOCK_T rows × all heads between one cache view and the packed tensor; returns the
    lane sums of the packed elements it moved (zeros without DIGEST). With NH, adds the NH terms
    of those elements into ``nh_ptr``: each row's sums are kept while its head rows stay in one
    4 KiB block (an atomic add per row where a row moves on to the next block), and at the end
    the rows of the tile that share a block are summed first (:func:`add_nh_rows`)."""
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HEAD_SIZE  # folds away when BLOCK_D == HEAD_SIZE, keeping accesses vectorised
    # All offsets are int64 tensors (block, offset and rows are): no int32 wrap-around. Integer
    # arguments are never `.to()`-cast, since Triton turns those equal to 1 into Python ints.
    cache_rows = layer_offset + block * stride_b + offset * stride_n
    cache_cols = cols.to(tl.int64) * stride_d
    packed_rows = rows * num_kv_heads * HEAD_SIZE
    sum_a = tl.zeros((), dtype=tl.uint64)
    sum_b = tl.zeros((), dtype=tl.uint64)
    nh_block = (packed_first + packed_rows) * WORDS // _CHUNK_WORDS  # each row's current block
    nh_0 = tl.zeros([BLOCK_T], dtype=tl.uint64)  # its NH sums in that block, iterations 0 and 1
    nh_1 = tl.zeros([BLOCK_T], dtype=tl.uint64)
    for _ in range(num_kv_heads):
        cache_addr = cache_ptr + cache_rows[:, None] + cache_cols[None, :]
        packed_addr = packed_ptr + packed_rows[:, None] + cols[None, :]
        if UNPACK:
            # with the digest or NH, rows without a slot are read too: they cover every row
            read_ok = row_ok if (DIGEST or NH) else cached
            x = tl.load(packed_addr, mask=read_ok[:, None] & col_ok[None, :], other=0)
            tl.store(cache_addr, x, mask=cached[:, None] & col_ok[None, :])
        else:
            x = tl.load(cache_addr, mask=cached[:, None] & col_ok[None, :], other=0)
            if STORE:
                tl.store(packed_addr, x, mask=row_ok[:, None] & col_ok[None, :])
        if DIGEST:
            elem = packed_first + packed_rows[:, None] + cols[None, :]
            a, b = tile_lanes(x, elem, row_ok[:, None] & col_ok[None, :], WORDS)
            sum_a += a
            sum_b += b
        if NH:
            word0 = (packed_first + packed_rows) * WORDS  # the head row's first 32-bit word
            t0, t1, s0, s1 = tile_nh(
                x, word0, nh_key_ptr, BLOCK_T, BLOCK_D * WORDS, WORDS, HEAD_SIZE * WORDS
            )
            here = word0 // _CHUNK_WORDS
            moved = here != nh_block
            flush_nh_rows(nh_ptr, nh_block, nh_0, nh_1, moved & row_ok)
            nh_0 = tl.where(moved, t0, nh_0 + t0)
            nh_1 = tl.where(moved, t1, nh_1 + t1)
            nh_block = here
            if _CHUNK_WORDS % (HEAD_SIZE * WORDS) != 0:  # a head row may run into the next block
                last = (word0 + HEAD_SIZE * WORDS - 1) // _CHUNK_WORDS
                crosses = last != here
                flush_nh_rows(nh_ptr, here, nh_0, nh_1, crosses & row_ok)
                nh_0 = tl.where(crosses, s0, nh_0)
                nh_1 = tl.where(crosses, s1, nh_1)
                nh_block = last
        cache_rows += stride_h
        packed_rows += HEAD_SIZE
    if NH:
        add_nh_rows(nh_ptr, nh_block, nh_0, nh_1, row_ok, BLOCK_T)
    return sum_a, sum_b


# stride_kh tells the layouts apart (head_size for NHD, block_size * head_size for HND, ...): it
# does not change with the number of blocks, so a cache does not retune as it grows.
_KEY = ["num_kv_heads", "HEAD_SIZE", "HAS_V", "UNPACK", "STORE", "DIGEST", "NH", "stride_kh"]


# restore_value: timing a config runs the kernel many times, and DIGEST's lane sums and NH's sums
# would add up over those runs (the first launch of each key would give wrong ones); the autotuner
# puts them back after each run. (Without DIGEST or NH the pointer is the index's cu_seqlens: put
# back as is.)
@triton.autotune(
    configs=autotune_configs(),
    key=_KEY,
    do_bench=autotune_bench,
    restore_value=["digest_ptr", "nh_ptr"],
)
@triton.jit(do_not_specialize=["num_rows", "num_sel", "search_steps"])
def _kv_copy_kernel(
    cache_ptr,  # [*] integer view of the first layer's K: base of every address
    layer_offsets_ptr,  # [num_layers, 2] int64 element offsets of each layer's K and V views
    slot_mapping_ptr,  # [num_tokens] int32/int64
    cu_seqlens_ptr,  # [num_sel + 1] int64
    src_start_ptr,  # [num_sel] int64
    packed_ptr,  # [num_layers, 1 + HAS_V, num_rows, num_kv_heads, head_size], contiguous
    digest_ptr,  # [2] int64 lane sums (DIGEST only)
    nh_key_ptr,  # [KEY_WORDS] int32 NH key (NH only)
    nh_ptr,  # [num_chunks, 2] int64 NH sums of the whole packed tensor, zeroed (NH only)
    packed_first,  # element offset of packed_ptr in the whole packed tensor
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
    STORE: tl.constexpr,
    DIGEST: tl.constexpr,
    NH: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Pack (cache → packed) or unpack (packed → cache) every layer in one launch.

    Grid ``(cdiv(num_rows, BLOCK_T), num_layers)``: a program copies BLOCK_T packed rows of one
    layer, all heads, K then V. Rows whose slot is -1 are written as zeros when packing and skipped
    when unpacking. With DIGEST, each program adds the lane sums (:mod:`tritonkv.digest`) of the
    packed elements it wrote (pack) or read (unpack) into ``digest_ptr``, ``WORDS`` 32-bit words
    per element; without STORE (pack only) nothing is written but the lane sums. With NH (head
    rows of whole 32-byte groups, 32 to 4096 bytes: :func:`nh_fusable`), each program adds the NH
    terms (:mod:`tritonkv.umac`) of those packed elements into ``nh_ptr``, under the key at
    ``nh_key_ptr`` (the zero padding of the last block is the launcher's caller's to add).
    """
    if NH:
        tl.static_assert(HEAD_SIZE * WORDS >= 8 and HEAD_SIZE * WORDS <= _CHUNK_WORDS)
        tl.static_assert(HEAD_SIZE * WORDS % 8 == 0)
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
    sum_a, sum_b = _copy_heads(
        cache_ptr,
        k_offset,
        packed_ptr + layer * stride_packed_layer,
        packed_first + layer * stride_packed_layer,
        nh_key_ptr,
        nh_ptr,
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
        STORE,
        DIGEST,
        NH,
        WORDS,
        BLOCK_T,
    )
    if HAS_V:
        v_offset = tl.multiple_of(tl.load(layer_offsets_ptr + 2 * layer + 1), ALIGN)
        v_a, v_b = _copy_heads(
            cache_ptr,
            v_offset,
            packed_ptr + layer * stride_packed_layer + stride_packed_part,
            packed_first + layer * stride_packed_layer + stride_packed_part,
            nh_key_ptr,
            nh_ptr,
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
            STORE,
            DIGEST,
            NH,
            WORDS,
            BLOCK_T,
        )
        sum_a += v_a
        sum_b += v_b
    if DIGEST:
        add_lanes(digest_ptr, sum_a, sum_b)


@dataclass
class LaunchGroup:
    """Layers ``start:stop`` share their strides: one kernel launch (one group for vLLM caches)."""

    start: int
    stop: int
    base: torch.Tensor  # the first layer's K: every address is an offset from it
    offsets: torch.Tensor  # [stop - start, 2] int64 element offsets of each layer's K and V
    k_strides: tuple[int, ...]
    v_strides: tuple[int, ...]
    align: int  # every offset is a multiple of this (16-byte aligned views), else 1
    direct: dict = field(default_factory=dict)  # (op variant, argument spec) -> DirectLaunch
    streams: set = field(default_factory=set)  # the streams (raw handles) ``offsets`` is used on

    def used_on(self, stream: int, device: torch.device) -> None:
        """Note a launch on ``stream`` (the current one): ``offsets`` was allocated on the stream
        current when the group was made, and once its layer set goes (the caller's views freed)
        its memory must not be handed out there again before this stream's launches read it."""
        if stream not in self.streams:
            self.offsets.record_stream(torch.cuda.current_stream(device))
            self.streams.add(stream)


def launch_groups(views: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[LaunchGroup]:
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
        # a blocking copy, on purpose: any stream may launch with this table next
        table = torch.tensor(offsets, dtype=torch.int64).to(base.device)
        k_strides, v_strides = strides[start]
        aligned = all(p % 16 == 0 for pair in ptrs for p in pair)
        align = 16 // base.element_size() if aligned else 1
        groups.append(
            LaunchGroup(start, stop, base, table, k_strides, v_strides or k_strides, align)
        )
        start = stop
    return groups


# The arguments of _kv_copy_kernel that change from call to call; the rest are fixed per launch
# group and op variant (the group's tables and strides, the constexprs).
_VARYING = (
    "slot_mapping_ptr",
    "cu_seqlens_ptr",
    "src_start_ptr",
    "packed_ptr",
    "digest_ptr",
    "nh_key_ptr",
    "nh_ptr",
    "packed_first",
    "num_rows",
    "num_sel",
    "search_steps",
    "stride_packed_layer",
    "stride_packed_part",
)


def copy_kv(
    groups: list[LaunchGroup],
    slot_mapping: torch.Tensor,
    index: SeqIndex,
    packed: torch.Tensor,
    *,
    width: int,
    has_v: bool,
    unpack: bool,
    lanes: torch.Tensor | None = None,
    store: bool = True,
    nh_key: torch.Tensor | None = None,
    nh_out: torch.Tensor | None = None,
) -> None:
    """Pack (cache → ``packed``) or unpack (``packed`` → cache) with one launch per group.

    A group's launch goes direct (:mod:`tritonkv._launch`) once the group has launched this op
    variant with arguments that specialise alike: the call then costs the launcher, and no torch
    op (the kernel gets ``packed``'s address and its strides in ``width``-byte integers).

    Args:
        groups: the layer set's :func:`launch_groups` (one group for vLLM caches); their integer
            views are ``[num_blocks, num_kv_heads, block_size, head_size]`` of ``width`` bytes.
        slot_mapping: ``[num_tokens]`` int32/int64, contiguous, on the views' device.
        index: the selected sequences' :class:`~tritonkv._index.SeqIndex`, on that device.
        packed: ``[num_layers, 1 + has_v, num_rows, num_kv_heads, head_size]``, contiguous, of
            the cache dtype, which ``width``-byte integers can view (:mod:`tritonkv._intview`).
        width: the integer width in bytes the copy moves (the groups' views').
        has_v: whether the layers have V views (False for MLA).
        unpack: write ``packed`` into the cache instead of reading it.
        lanes: ``[2]`` int64 zeros, or None: the launch adds the digest's lane sums of the packed
            elements into it (``width`` 4 or 8 only).
        store: False (pack only): write nothing into ``packed``, only the lane sums.
        nh_key: ``[KEY_WORDS]`` int32 NH key on the views' device, with ``nh_out``; or None.
        nh_out: ``[num_chunks(packed bytes), 2]`` int64, contiguous: zeroed, then the launch adds
            the NH terms of every packed element into it (the NH of ``packed`` but for the terms
            of the last block's zero padding: the caller adds those). Only where
            :func:`nh_fusable` holds.
    """
    nh = nh_out is not None
    if nh:
        nh_out.zero_()
    num_rows = packed.size(2)
    if num_rows == 0:
        return
    digest = lanes is not None
    ratio = width // packed.element_size()
    strides = packed.stride()
    stride_layer, stride_part = strides[0] // ratio, strides[1] // ratio
    packed_address = packed.data_ptr()
    cu_seqlens, src_start = index.addresses()
    # digest_ptr is never read without DIGEST, but the autotuner puts it back after each
    # timing run: then it is this call's own cu_seqlens, never the caller's slot mapping
    # (which another stream may write, or which may be an inference-mode tensor)
    digest_at = lanes if digest else cu_seqlens  # (a tensor or an address)
    nh_key_at, nh_at = (nh_key, nh_out) if nh else (cu_seqlens, cu_seqlens)  # (likewise)
    num_sel, search_steps = index.num_sel, index.search_steps
    device = current_device() if DIRECT else None
    on_gpu = packed.device.type == "cuda"
    stream = triton.runtime.driver.active.get_current_stream(packed.device.index) if on_gpu else 0
    # What Triton specialises on in the arguments that are not fixed per group (see _launch),
    # flat: the key is hashed on every call.
    spec = (
        unpack,
        store,
        digest,
        slot_mapping.dtype,
        device,
        pointer_spec(slot_mapping.data_ptr()),
        pointer_spec(cu_seqlens),
        pointer_spec(src_start),
        pointer_spec(lanes.data_ptr() if digest else cu_seqlens),
        nh,
        pointer_spec(nh_key.data_ptr() if nh else cu_seqlens),
        pointer_spec(nh_out.data_ptr() if nh else cu_seqlens),
        int_spec(num_rows),
        int_spec(num_sel),
        int_spec(search_steps),
        int_spec(stride_layer),
        int_spec(stride_part),
    )
    for group in groups:
        if on_gpu:
            group.used_on(stream, packed.device)
        packed_first = group.start * stride_layer
        address = packed_address + packed_first * width
        group_spec = (*spec, pointer_spec(address), int_spec(packed_first))
        direct = group.direct.get(group_spec)
        if direct is not None:
            # (-(-a // b): triton.cdiv is a constexpr function, costly to call from the host)
            grid = (-(-num_rows // direct.meta["BLOCK_T"]), group.stop - group.start, 1)
            _KV_COPY.kernel.best_config = direct.config
            values = (slot_mapping, cu_seqlens, src_start, address, digest_at, nh_key_at, nh_at)
            values += (packed_first,)
            values += (num_rows, num_sel, search_steps, stride_layer, stride_part)
            direct(grid, values, device)
            continue
        grid = lambda meta: (triton.cdiv(num_rows, meta["BLOCK_T"]), group.stop - group.start)  # noqa: B023
        packed_int = as_int(packed, width)
        # _KEY's values and the tensor arguments' dtypes (the rest are int64 tables)
        _, num_kv_heads, _, head_size = group.base.shape
        key = (num_kv_heads, head_size, has_v, unpack, store, digest, nh, group.k_strides[1])
        key += (group.base.dtype, slot_mapping.dtype, packed_int.dtype)
        kwargs = _group_kwargs(group, has_v) | {
            "slot_mapping_ptr": slot_mapping,
            "cu_seqlens_ptr": index.cu_seqlens,
            "src_start_ptr": index.src_start,
            "packed_ptr": packed_int[group.start : group.stop],
            "digest_ptr": lanes if digest else index.cu_seqlens,
            "nh_key_ptr": nh_key if nh else index.cu_seqlens,
            "nh_ptr": nh_out if nh else index.cu_seqlens,
            "packed_first": packed_first,
            "num_rows": num_rows,
            "num_sel": index.num_sel,
            "search_steps": index.search_steps,
            "stride_packed_layer": stride_layer,
            "stride_packed_part": stride_part,
            "UNPACK": unpack,
            "STORE": store,
            "DIGEST": digest,
            "NH": nh,
            "WORDS": max(width // 4, 1),
        }
        compiled, config = _KV_COPY(key, grid, **kwargs)
        direct = DirectLaunch.make(
            compiled, _KV_COPY.kernel.fn, kwargs | config.kwargs, _VARYING, config
        )
        if direct is not None:
            group.direct[group_spec] = direct


def _group_kwargs(group: LaunchGroup, has_v: bool) -> dict:
    """The kernel arguments fixed by the group (its views' table, sizes and strides)."""
    _, num_kv_heads, block_size, head_size = group.base.shape
    stride_kb, stride_kh, stride_kn, stride_kd = group.k_strides
    stride_vb, stride_vh, stride_vn, stride_vd = group.v_strides
    return {
        "cache_ptr": group.base,
        "layer_offsets_ptr": group.offsets,
        "block_size": block_size,
        "num_kv_heads": num_kv_heads,
        "stride_kb": stride_kb,
        "stride_kh": stride_kh,
        "stride_kn": stride_kn,
        "stride_kd": stride_kd,
        "stride_vb": stride_vb,
        "stride_vh": stride_vh,
        "stride_vn": stride_vn,
        "stride_vd": stride_vd,
        "HAS_V": has_v,
        "ALIGN": group.align,
        "HEAD_SIZE": head_size,
        "BLOCK_D": triton.next_power_of_2(head_size),
    }


_KV_COPY = TunedLaunch(_kv_copy_kernel)
