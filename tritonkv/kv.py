"""Pack the selected sequences' paged KV (all layers, K and V or the MLA latent) into one tensor,
and unpack such a tensor into another paged cache: the public API, its checks, and the dispatch.

Views are explained once, in :mod:`tritonkv.layouts`; sequence addressing in :mod:`tritonkv._index`.
Where the copy runs is chosen per call (:func:`tritonkv.use_triton`, ``TRITONKV_KERNELS``): the
Triton kernel (:mod:`tritonkv._kv_triton`, one launch for every layer and both K and V) or the torch
twin (:mod:`tritonkv._kv_torch`: the same addressing as row copies; the CPU path, and the test
oracle as ``pack_kv_torch`` / ``unpack_kv_torch``).

Copies move integer views of the data (:mod:`tritonkv._intview`: as wide as strides and alignment
allow, up to 8-byte elements, which the GPU compiler vectorises to 16-byte accesses), so fp32,
fp16, bf16, fp8 and uint8-viewed caches are copied bit for bit; there is no arithmetic.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence

import torch

from . import _cpu_digest, _digest_triton, _kv_torch, _kv_triton, umac
from ._checks import check_index, checks_enabled
from ._dispatch import use_triton
from ._index import on_device, seq_index
from ._intview import as_int, widest_width
from ._layer_sets import LAYER_SETS, KVCacheSet, Layers, prepare_kv
from ._umac_core import padding_terms
from .digest import finalize, packed_digest

__all__ = [
    "KVCacheSet",
    "kv_digest",
    "kv_digest_torch",
    "nh_in_copy",
    "pack_kv",
    "pack_kv_torch",
    "prepare_kv",
    "unpack_kv",
    "unpack_kv_torch",
]


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


def _check_nh(nh_key, nh_out, num_bytes: int, device: torch.device) -> None:
    """``nh_key`` and ``nh_out`` go together; ``nh_out`` is ``[num_chunks(num_bytes), 2]`` int64,
    contiguous, on ``device`` (TypeError / ValueError naming what was expected and given)."""
    if (nh_key is None) != (nh_out is None):
        given, missing = ("nh_key", "nh_out") if nh_out is None else ("nh_out", "nh_key")
        raise TypeError(f"{missing}: expected a value with {given} (both or neither), got None")
    if nh_key is None:
        return
    if not isinstance(nh_key, umac.TransferKeys):
        raise TypeError(f"nh_key: expected umac.TransferKeys, got {type(nh_key).__name__}")
    if not isinstance(nh_out, torch.Tensor):
        raise TypeError(f"nh_out: expected a tensor, got {type(nh_out).__name__}")
    shape = (umac.num_chunks(num_bytes), umac.ITERATIONS)
    if (
        tuple(nh_out.shape) != shape
        or nh_out.dtype != torch.int64
        or nh_out.device != device
        or not nh_out.is_contiguous()
    ):
        raise ValueError(
            f"nh_out: expected a contiguous {shape} int64 tensor on {device} (NH of "
            f"{num_bytes} packed bytes), got {tuple(nh_out.shape)} {nh_out.dtype} on "
            f"{nh_out.device}{'' if nh_out.is_contiguous() else ', not contiguous'}"
        )


# NH's padding terms per key and packed size mod 4096 (a host computation of some microseconds)
_PADDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _add_padding(nh_out: torch.Tensor, nh_key: umac.TransferKeys, num_bytes: int) -> None:
    """Add the NH terms of the last block's zero padding, which the kernel never visits, to
    ``nh_out``'s last row (two scalar adds: no host synchronisation)."""
    tail = num_bytes % umac.CHUNK_BYTES
    if tail == 0:
        return
    per_key = _PADDING.setdefault(nh_key, {})
    terms = per_key.get(tail)
    if terms is None:
        terms = per_key[tail] = [
            t - (1 << 64) if t >> 63 else t for t in padding_terms(nh_key.nh_key, num_bytes)
        ]
    for t, term in enumerate(terms):
        nh_out[-1, t].add_(term)  # int64 adds wrap: the sums are modulo 2**64


@functools.lru_cache(maxsize=1024)
def _packed_width(
    strides: tuple[int, ...], address_mod_16: int, itemsize: int, row_bytes: int, widest: int
) -> int:
    """:func:`~tritonkv._intview.widest_int_view` of one packed tensor from its strides and its
    address mod 16 (all that matters for widths up to 16 bytes): calls of one shape reuse it."""
    return widest_width({(strides, itemsize)}, [address_mod_16], itemsize, row_bytes, widest)


def _run(
    layers,
    slot_mapping,
    query_start_loc,
    seq_ids,
    packed,
    *,
    unpack,
    force_torch,
    digest=False,
    store=True,
    nh_key=None,
    nh_out=None,
):
    """Common path of pack/unpack: validate, address, widen, dispatch.

    Returns ``(packed, SeqIndex, digest or None)``. ``digest``: also compute the digest of the
    packed tensor (written or read); ``store`` False (pack only): the digest is what is wanted,
    the packed rows need not be kept. ``nh_key``, ``nh_out``: also overwrite ``nh_out`` with the
    NH of the packed tensor (written or read) under ``nh_key``.
    """
    check_index("slot_mapping", slot_mapping, allow_none=False)
    checks = checks_enabled(query_start_loc, seq_ids, slot_mapping)
    if isinstance(layers, KVCacheSet):
        layer_set, views = layers.resolve(full_check=checks), layers.views
    else:
        layer_set, views = LAYER_SETS.lookup(layers), layers
    shape, dtype, device, has_v = (
        layer_set.shape,
        layer_set.dtype,
        layer_set.device,
        layer_set.has_v,
    )
    if unpack and packed is None:
        raise TypeError("packed: expected a tensor, got None")
    num_blocks, num_kv_heads, block_size, head_size = shape
    index = seq_index(query_start_loc, seq_ids, slot_mapping.numel(), device)
    slot_mapping = on_device(slot_mapping, device)  # kernel: stride 1

    def packed_shape(rows: int) -> tuple[int, ...]:
        return (len(views), 1 + has_v, rows, num_kv_heads, head_size)

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
    itemsize = packed.element_size()
    _check_nh(nh_key, nh_out, packed.numel() * itemsize, device)
    triton_path = use_triton(device) and not force_torch
    flat = None if triton_path and not checks else index.flat_tokens(rows)
    if checks:
        _check_slots(slot_mapping, flat, num_blocks * block_size)

    # The widest access both the views and this packed tensor allow (the allowed widths of each
    # are all the sizes up to its widest, so the smaller of the two widest); the kernels move at
    # most 8-byte integers, the CPU twin 16-byte elements too (fewer, longer element copies).
    widest = min(layer_set.width, 8 if triton_path else 16)
    address_mod_16 = packed.data_ptr() % 16
    width = _packed_width(packed.stride(), address_mod_16, itemsize, head_size * itemsize, widest)
    result = None
    if triton_path:
        groups = layer_set.launches(width, views)
        fused = digest and width >= 4  # the copy reads whole 32-bit words: digest in its launch
        lanes = torch.zeros(2, dtype=torch.int64, device=device) if digest else None
        # NH in the copy's launch where head rows are whole 32-byte groups inside a 4 KiB block
        nh_fused = nh_key is not None and _kv_triton.nh_fusable(width, head_size * itemsize)
        _kv_triton.copy_kv(
            groups,
            slot_mapping,
            index,
            packed,
            width=width,
            has_v=has_v,
            unpack=unpack,
            lanes=lanes if fused else None,
            store=store or not fused,
            nh_key=nh_key.nh_key_on(device) if nh_fused else None,
            nh_out=nh_out if nh_fused else None,
        )
        if digest and not fused:  # 1- or 2-byte integers: the digest's own launch
            _digest_triton.byte_lanes(packed, lanes)
        if digest:
            result = finalize(lanes, packed.numel() * packed.element_size())
        if nh_fused:
            _add_padding(nh_out, nh_key, packed.numel() * itemsize)
        elif nh_key is not None:  # other head rows: NH's own pass over the packed tensor
            nh_out.copy_(umac.nh_hash(packed, nh_key))
    elif (lib := _native(digest or nh_key is not None, device, force_torch)) is not None:
        slots = slot_mapping.to(torch.int64)[flat]  # the twin's copy, digest and NH in one pass
        table = layer_set.row_table(views)
        nh_fused = nh_key is not None and table.row_bytes % _cpu_digest.NH_ROW_BYTES == 0
        nh = (nh_key.nh_key, nh_out) if nh_fused else None
        result = _cpu_digest.copy_with_digest(
            lib, table, slots, packed, unpack=unpack, store=store, digest=digest, nh=nh
        )
        if nh_fused:
            _add_padding(nh_out, nh_key, packed.numel() * itemsize)
        elif nh_key is not None:  # rows of a partial 32-byte group: NH's own pass
            nh_out.copy_(umac.nh_hash(packed, nh_key))
    else:
        groups = layer_set.plan(width, views)
        packed_int = as_int(packed, width)
        _kv_torch.copy_kv(groups, slot_mapping, index, packed_int, unpack=unpack, flat=flat)
        result = packed_digest(packed) if digest else None
        if nh_key is not None:  # the C library on the CPU (the twin's for the *_torch oracles)
            nh = umac.nh_hash_torch if force_torch else umac.nh_hash
            nh_out.copy_(nh(packed, nh_key))
    return packed, index, result


def nh_in_copy(device: torch.device, row_bytes: int) -> bool:
    """Whether :func:`pack_kv` / :func:`unpack_kv` on ``device`` compute ``nh_out`` with no pass
    of the host's own over the packed bytes: on the Triton path always (in the copy's launch, or
    a device pass after it); on the CPU where the twins' native library runs and the packed
    token rows (``num_kv_heads * head_size`` elements, ``row_bytes`` bytes) are whole 32-byte
    groups, hashed by the copy as it moves them (else ``umac.nh_hash`` after the copy).

    Args:
        device: the caches' device.
        row_bytes: bytes of one packed token row of one layer's K (or latent).
    """
    if use_triton(device):
        return True
    nh_rows = row_bytes > 0 and row_bytes % _cpu_digest.NH_ROW_BYTES == 0
    return device.type == "cpu" and nh_rows and _cpu_digest.native() is not None


def _native(hashed: bool, device: torch.device, force_torch: bool):
    """The fused copy + digest + NH library for a CPU call that hashes (None: the twin's copy,
    then :func:`packed_digest` and :func:`umac.nh_hash`; always so for the ``*_torch``
    oracles)."""
    if not hashed or force_torch or device.type != "cpu":
        return None
    return _cpu_digest.native()


def pack_kv(
    layers: Layers,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    seq_ids: torch.Tensor | Sequence[int] | None = None,
    *,
    out: torch.Tensor | None = None,
    digest: bool = False,
    nh_key: umac.TransferKeys | None = None,
    nh_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack the selected sequences' KV, every layer, into one contiguous tensor.

    Sequence ``i`` of the flat batch owns tokens ``query_start_loc[i] : query_start_loc[i + 1]``;
    token ``t``'s KV lives at cache slot ``slot_mapping[t]`` of every layer (see
    :mod:`tritonkv.layouts` for the view convention). With ``query_start_loc = [0, 18, 19, 20]``
    (one 18-token prefill, two decodes) and ``seq_ids = [0]``, the output holds exactly the
    prefill's 18 tokens, whatever ``seq_lens`` says.

    Args:
        layers: per-layer ``(k, v)`` views, each ``[num_blocks, num_kv_heads, block_size,
            head_size]`` with any strides; ``v`` None for MLA. Same shape, dtype, device for all.
            Or the :class:`~tritonkv.KVCacheSet` :func:`~tritonkv.prepare_kv` made of them once:
            the same copy, at a host cost that does not grow with the number of layers (the
            views are then not compared layer by layer on each call; see :class:`KVCacheSet`
            for what it checks).
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
            view objects do, or the :class:`~tritonkv.KVCacheSet`, so keep them alive while the
            graph may replay).
        digest: also return the integrity digest of ``packed`` (:mod:`tritonkv.digest`),
            computed by the Triton kernel in its copy launch (its own launch when the copy moves
            1- or 2-byte integers) and finalised by two tiny torch ops, with no host
            synchronisation (not yet tried under CUDA-graph capture); on the CPU, by the twins'
            native library in the copy itself (:mod:`tritonkv._cpu_digest`: the rows are copied
            and digested in one pass), or where no C compiler works, by a NumPy pass over
            ``packed`` after the twin's copy (several times the copy's time; ``pack_kv_torch``
            always takes that path: the oracle). Costs: ``bench/bench_kv.py --suite digest``.
        nh_key: the keys (:func:`tritonkv.umac.entry_keys`, :func:`~tritonkv.umac.transfer_keys`)
            under which to hash ``packed`` as written, with ``nh_out``; None (default): no hash.
            May be combined with ``digest``.
        nh_out: ``[umac.num_chunks(packed bytes), 2]`` int64, contiguous, on the cache's device,
            overwritten with exactly ``umac.nh_hash(packed, nh_key)`` (:mod:`tritonkv.umac`'s
            keyed universal hash); given with ``nh_key``. The Triton kernel computes it in its
            copy launch where the copy moves 4- or 8-byte integers and one head row
            (``head_size`` elements) is whole 32-byte groups from 32 to 4096 bytes (fp32, fp16
            and bf16 heads of a multiple of 16 elements up to 1024, MLA's 576 among them), with
            the padding of the last 4 KiB block added by two scalar torch ops (no host
            synchronisation); elsewhere (fp8 copied as bytes, odd or larger head rows)
            :func:`~tritonkv.umac.nh_hash` hashes ``packed`` in a pass of its own after the
            copy. On the CPU the twins' native library hashes the words in its copy loop as it
            moves them, where a token row is whole 32-byte groups (:func:`nh_in_copy`);
            elsewhere, and always for ``pack_kv_torch``, NH's own pass.
            ``packed`` is bit for bit the same with or without it.

    Returns:
        ``(packed, cu_seqlens)``: ``packed`` as ``out`` above (cache dtype) and ``cu_seqlens``
        ``[len(seq_ids) + 1]`` int64 offsets of each selected sequence in ``packed``'s dim 2.
        With ``digest=True``, ``(packed, cu_seqlens, digest)``, ``digest`` ``[2]`` int64.

    Raises:
        TypeError, ValueError: inputs of the wrong type, shape, dtype or range (the message says
            what was expected and what was given), ``nh_key`` without ``nh_out`` or the reverse.
            Offsets and slots are range-checked when the index tensors are on the CPU, or on the
            GPU when ``TRITONKV_CHECK=1``.
    """
    return _pack(
        layers,
        slot_mapping,
        query_start_loc,
        seq_ids,
        out,
        digest,
        force_torch=False,
        nh_key=nh_key,
        nh_out=nh_out,
    )


def _pack(
    layers,
    slot_mapping,
    query_start_loc,
    seq_ids,
    out,
    digest,
    *,
    force_torch,
    nh_key=None,
    nh_out=None,
):
    packed, index, result = _run(
        layers,
        slot_mapping,
        query_start_loc,
        seq_ids,
        out,
        unpack=False,
        force_torch=force_torch,
        digest=bool(digest),
        nh_key=nh_key,
        nh_out=nh_out,
    )
    return (packed, index.cu_seqlens, result) if digest else (packed, index.cu_seqlens)


def _unpack(
    packed,
    layers,
    slot_mapping,
    query_start_loc,
    seq_ids,
    digest,
    *,
    force_torch,
    nh_key=None,
    nh_out=None,
):
    return _run(
        layers,
        slot_mapping,
        query_start_loc,
        seq_ids,
        packed,
        unpack=True,
        force_torch=force_torch,
        digest=bool(digest),
        nh_key=nh_key,
        nh_out=nh_out,
    )[2]


def unpack_kv(
    packed: torch.Tensor,
    layers: Layers,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    seq_ids: torch.Tensor | Sequence[int] | None = None,
    *,
    digest: bool = False,
    nh_key: umac.TransferKeys | None = None,
    nh_out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Write a tensor made by :func:`pack_kv` into a paged cache, in place.

    The addressing mirrors :func:`pack_kv`: packed row ``r`` of selected sequence ``j`` goes to slot
    ``slot_mapping[query_start_loc[seq_ids[j]] + r - cu_seqlens[j]]`` of every layer. Slots ``-1``
    are never written; nothing outside the addressed slots is touched. If two rows map to the same
    slot, which one lands is unspecified.

    Args:
        packed: ``[num_layers, 2 (1 for MLA), total_selected_tokens, num_kv_heads, head_size]``,
            contiguous, cache dtype.
        layers, slot_mapping, query_start_loc, seq_ids: as in :func:`pack_kv`, for the destination.
        digest: return the digest of ``packed`` as this call read it (every row, slot -1 rows
            too), computed as in :func:`pack_kv`; compare it with the producer's
            (:func:`tritonkv.digest.digests_equal`) to know the bytes arrived intact.
        nh_key, nh_out: as in :func:`pack_kv`: ``nh_out`` is overwritten with the NH of
            ``packed`` as this call read it (every row, slot -1 rows too), computed where
            :func:`pack_kv` computes it; the tag of those outputs
            (:func:`tritonkv.umac.tag_of_outputs`) authenticates what was written.

    Returns:
        None, or with ``digest=True`` the ``[2]`` int64 digest of what was read.

    Raises:
        TypeError, ValueError: as :func:`pack_kv`.
    """
    return _unpack(
        packed,
        layers,
        slot_mapping,
        query_start_loc,
        seq_ids,
        digest,
        force_torch=False,
        nh_key=nh_key,
        nh_out=nh_out,
    )


def _digest(layers, slot_mapping, query_start_loc, seq_ids, *, force_torch):
    return _run(
        layers,
        slot_mapping,
        query_start_loc,
        seq_ids,
        None,
        unpack=False,
        force_torch=force_torch,
        digest=True,
        store=False,
    )[2]


def kv_digest(
    layers: Layers,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    seq_ids: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """The digest :func:`pack_kv` would return for these arguments, without keeping the rows.

    The write-back check: after :func:`unpack_kv`, call it on the destination with slots derived
    **independently** of the ones the unpack wrote through (e.g. from the block table): it equals
    the transferred digest only if the destination holds the packed rows at those slots. With the
    same ``slot_mapping`` as the write it would only re-read what was written, and catch nothing
    but a failed store. Costs one read of the addressed rows (the Triton kernel stores nothing;
    the twin packs into a temporary and digests it).

    Args:
        layers, slot_mapping, query_start_loc, seq_ids: as in :func:`pack_kv`.

    Returns:
        ``[2]`` int64 digest.
    """
    return _digest(layers, slot_mapping, query_start_loc, seq_ids, force_torch=False)


def pack_kv_torch(
    layers,
    slot_mapping,
    query_start_loc=None,
    seq_ids=None,
    *,
    out=None,
    digest=False,
    nh_key=None,
    nh_out=None,
):
    """:func:`pack_kv` on the plain-torch twin, whatever the device and ``TRITONKV_KERNELS``
    (NH by :func:`tritonkv.umac.nh_hash_torch` after the copy)."""
    return _pack(
        layers,
        slot_mapping,
        query_start_loc,
        seq_ids,
        out,
        digest,
        force_torch=True,
        nh_key=nh_key,
        nh_out=nh_out,
    )


def unpack_kv_torch(
    packed,
    layers,
    slot_mapping,
    query_start_loc=None,
    seq_ids=None,
    *,
    digest=False,
    nh_key=None,
    nh_out=None,
):
    """:func:`unpack_kv` on the plain-torch twin, whatever the device and ``TRITONKV_KERNELS``
    (NH by :func:`tritonkv.umac.nh_hash_torch` after the copy)."""
    return _unpack(
        packed,
        layers,
        slot_mapping,
        query_start_loc,
        seq_ids,
        digest,
        force_torch=True,
        nh_key=nh_key,
        nh_out=nh_out,
    )


def kv_digest_torch(layers, slot_mapping, query_start_loc=None, seq_ids=None) -> torch.Tensor:
    """:func:`kv_digest` on the plain-torch twin, whatever the device and ``TRITONKV_KERNELS``."""
    return _digest(layers, slot_mapping, query_start_loc, seq_ids, force_torch=True)
