"""The integrity digest of a packed tensor: what ``pack_kv(..., digest=True)`` and friends return.

Definition (the same bits on every backend, whatever the copy width or block order):

- the packed tensor's bytes, in memory order, are read as little-endian 32-bit words ``w[p]``,
  ``p = 0 .. ceil(num_bytes / 4) - 1`` (a last partial word is padded with zero bytes);
- each word is keyed by its position, ``k[p] = (p * 0x9E3779B1 + SEED) mod 2**32``, and mixed
  by the murmur3 finalizer ``fmix32`` (a bijection of 32-bit integers): ``h[p] = fmix32(w[p] ^
  k[p])``;
- two 32-bit lanes sum them modulo 2**32: ``A = sum(h[p])``, ``B = sum(h[p] * (k[p] | 1))``;
  integer addition is associative, so programs may add their partial sums in any order (atomics);
- the byte count is folded in at the end: ``digest = [fmix32(A ^ c0), fmix32(B ^ c1)]`` with
  ``c0, c1`` derived from ``num_bytes`` (:func:`finalize`).

What it detects. By construction: any change of a single word, so any single-bit flip, always
(``fmix32`` is a bijection, so that word's term in lane A changes and no other term does; the
finalization is a bijection too). With overwhelming probability, not by construction: two swapped
tokens, swapped layers, K and V swapped (a word's term depends on its position), a zeroed block, a
truncated tail (fewer terms and another byte count), and any other multi-word change; for such a
change lane A, a sum of well-mixed 32-bit terms, stays equal by chance (about 2**-32), and lane B,
a position-weighted sum of the same terms, is a second, different check (together about 2**-64 if
the lanes behave independently: a heuristic, not a proven bound). tests/kernels/test_digest.py
checks each case of that list with hypothesis on both backends, and that a digest without the
position key misses swaps. It is **not a MAC**: anyone can compute it, so it does nothing against
an attacker who can rewrite the data; the transport's authenticated session and the keyed payload
tags of :mod:`tritonkv.umac` are what stop those.
Positions repeat every 2**32 words (16 GiB of packed data).

The digest is a ``[2]`` int64 tensor (``A``, ``B``, each in ``[0, 2**32)``) on the packed tensor's
device; :func:`digest_hex` spells it as 16 hex digits. This module holds the reference
(:func:`packed_digest`: NumPy, in chunks; the ``*_torch`` oracles' digest, and the twins' where
the native library cannot be built) and the digests of slices, heads and segments; the
definition's constants and the finalization every backend shares are in the leaf module
:mod:`tritonkv._digest_core`. The Triton kernels compute the lane sums in their copy launch
(:mod:`tritonkv._digest_triton`), the CPU twins in theirs (:mod:`tritonkv._cpu_digest`, C).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from . import _cpu, _cpu_digest, _digest_core
from ._digest_core import (
    DIGEST_SIZE,
    KEY,
    MASK,
    SEED,
    count_keys,
    finalize,
    finalize_host,
    fmix32_torch,
    lanes_numpy,
)
from ._digest_core import (
    fmix32 as fmix32,  # re-exported: the definition's finalizer (tests, oracles)
)
from ._digest_triton import byte_lanes
from ._dispatch import use_triton

__all__ = [
    "DIGEST_SIZE",
    "digest_hex",
    "digests_equal",
    "digests_hex",
    "finalize",
    "finalize_host",
    "head_digests",
    "packed_digest",
    "segment_digests",
    "tensor_digest",
]

PARALLEL_MIN_WORDS = 1 << 20  # NumPy reference: from 4 MiB on, ranges go to the copy threads
SEGMENT_CHUNK_WORDS = 1 << 21  # segment_digests: words per pass (int64 temporaries of 16 MiB;
# about six are alive at once: ~100 MiB of scratch at most, on the rows' device)


def _lanes_parallel(words: np.ndarray) -> tuple[int, int]:
    """:func:`~tritonkv._digest_core.lanes_numpy` of ``words``, in ranges on the twins' copy threads when it is big
    (NumPy releases the GIL in its loops; lane sums add, whatever the ranges)."""
    workers = min(_cpu.MAX_WORKERS, torch.get_num_threads())
    if words.size < PARALLEL_MIN_WORDS or workers < 2:
        return lanes_numpy(words)
    chunk = _digest_core.CHUNK_WORDS
    step = -(-words.size // workers // chunk) * chunk
    starts = range(0, words.size, step)
    futures = [_cpu._executor().submit(lanes_numpy, words[s : s + step], s) for s in starts[1:]]
    a, b = lanes_numpy(words[:step])
    for future in futures:
        more_a, more_b = future.result()
        a, b = (a + more_a) & MASK, (b + more_b) & MASK
    return a, b


def packed_digest(packed: torch.Tensor) -> torch.Tensor:
    """The digest of ``packed`` by the definition above (the reference; the twins' digest).

    Runs on the host (a GPU tensor is copied there first: oracle use only). Costs a pass over the
    bytes at about 2.4 GB/s per core (NumPy, 13 ufuncs per chunk of 128 KiB), tensors from
    4 MiB on split over the twins' copy threads (:mod:`tritonkv._cpu`).

    Args:
        packed: any contiguous tensor (a packed KV or hidden-state tensor), any dtype.

    Returns:
        ``[2]`` int64 digest on ``packed``'s device.
    """
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed: expected a tensor, got {type(packed).__name__}")
    if not packed.is_contiguous():
        raise ValueError(f"packed: expected a contiguous tensor, got strides {packed.stride()}")
    num_bytes = packed.numel() * packed.element_size()
    raw = packed.detach().reshape(-1).view(torch.uint8).cpu().numpy()
    if num_bytes % 4:
        raw = np.concatenate([raw, np.zeros(4 - num_bytes % 4, np.uint8)])
    lanes = _lanes_parallel(raw.view("<u4"))
    return finalize(torch.tensor(lanes, dtype=torch.int64), num_bytes).to(packed.device)


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """The digest of any tensor's bytes in the memory order of its contiguous form: on the CPU
    read where they lie by the twins' native library (:mod:`tritonkv._cpu_digest`: a strided
    slice, e.g. one head of a packed tensor, is not copied first), or :func:`packed_digest` of a
    contiguous copy without it; the Triton byte kernel where Triton runs (its own launch).

    Args:
        t: any tensor, e.g. a slice of a packed tensor.

    Returns:
        ``[2]`` int64 digest on ``t``'s device.
    """
    if not use_triton(t.device):
        lib = _cpu_digest.native() if t.device.type == "cpu" else None
        if lib is not None:
            return _cpu_digest.tensor_digest(lib, t)
        return packed_digest(t.contiguous())
    t = t.contiguous()
    lanes = torch.zeros(2, dtype=torch.int64, device=t.device)
    byte_lanes(t, lanes)
    return finalize(lanes, t.numel() * t.element_size())


def _mul32(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``h * k mod 2**32`` of int64 tensors holding values in ``[0, 2**32)`` (products of 16-bit
    halves stay below 2**63)."""
    return ((h & 0xFFFF) * k + (((h >> 16) * k) & 0xFFFF) * 65536) & MASK


def segment_digests(rows: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """The digest of each segment of rows, ``tensor_digest(rows[cu_seqlens[i] :
    cu_seqlens[i + 1]])`` for every ``i``, in a few torch passes over ``rows`` whatever the
    number of segments (no per-segment launch, no host synchronisation on a GPU): e.g. each
    request's hidden states of one pack. On the CPU the native library takes each segment
    instead, one call each (where it is built; else the torch passes).

    Args:
        rows: ``[num_rows, ...]`` contiguous tensor, any dtype, whose rows are whole 32-bit
            words (else each segment is digested apart, by :func:`tensor_digest`).
        cu_seqlens: ``[num_seqs + 1]`` row offsets, on the host (a list of ints), from 0 to at
            most ``num_rows``, non-decreasing.

    Returns:
        ``[num_seqs, 2]`` int64 digests on ``rows``' device.
    """
    if not isinstance(rows, torch.Tensor) or rows.dim() < 1 or not rows.is_contiguous():
        raise ValueError(
            f"rows: expected a contiguous [num_rows, ...] tensor, got {type(rows).__name__} "
            f"{getattr(rows, 'shape', '')}"
        )
    bounds = [int(b) for b in cu_seqlens]
    if (
        not bounds
        or bounds[0] != 0
        or bounds[-1] > rows.shape[0]
        or any(b > c for b, c in itertools.pairwise(bounds))
    ):
        raise ValueError(
            f"cu_seqlens: expected non-decreasing offsets from 0 to at most {rows.shape[0]}, "
            f"got {bounds[:8]}{'...' if len(bounds) > 8 else ''}"
        )
    num_seqs = len(bounds) - 1
    row_bytes = math.prod(rows.shape[1:]) * rows.element_size() if rows.shape[0] else 0
    if num_seqs == 0:
        return torch.zeros((0, DIGEST_SIZE), dtype=torch.int64, device=rows.device)
    if rows.device.type == "cpu" and _native():
        return _native_segments(rows, bounds, row_bytes)
    if row_bytes % 4 or row_bytes == 0:
        return torch.stack([tensor_digest(rows[a:b]) for a, b in itertools.pairwise(bounds)])
    per_row = row_bytes // 4
    words = rows[: bounds[-1]].reshape(-1).view(torch.uint8).view(torch.int32).view(-1, per_row)
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    device = rows.device
    on_device = lambda values: torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
    seg_of_row = torch.repeat_interleave(
        torch.arange(num_seqs, device=device), on_device(lengths), output_size=bounds[-1]
    )
    first_row = on_device(bounds[:-1])
    lanes = torch.zeros((num_seqs, DIGEST_SIZE), dtype=torch.int64, device=device)
    col = torch.arange(per_row, dtype=torch.int64, device=device)
    key = torch.full((), KEY, dtype=torch.int64, device=device)
    step = max(1, SEGMENT_CHUNK_WORDS // per_row)
    for start in range(0, bounds[-1], step):
        stop = min(start + step, bounds[-1])
        seg = seg_of_row[start:stop]
        local = torch.arange(start, stop, dtype=torch.int64, device=device) - first_row[seg]
        pos = local[:, None] * per_row + col[None, :]  # word position within its segment
        k = (_mul32(pos & MASK, key) + SEED) & MASK
        h = fmix32_torch((words[start:stop].to(torch.int64) & MASK) ^ k)
        sums = torch.stack([h.sum(1) & MASK, _mul32(h, k | 1).sum(1) & MASK], dim=1)
        lanes.index_add_(0, seg, sums)
    keys = on_device([count_keys(n * row_bytes) for n in lengths])
    return fmix32_torch((lanes & MASK) ^ keys)


def _native_segments(rows: torch.Tensor, bounds: list[int], row_bytes: int) -> torch.Tensor:
    """:func:`segment_digests` by the native library: a segment of ``PARALLEL_MIN_BYTES`` or
    more by :func:`tensor_digest` (the copy threads share it), the others one lane-loop call
    each on this thread (a ctypes call each, not a few torch ops)."""
    ranges = list(itertools.pairwise(bounds))
    small = [i for i, (a, b) in enumerate(ranges) if (b - a) * row_bytes < _cpu.PARALLEL_MIN_BYTES]
    out = torch.empty((len(ranges), DIGEST_SIZE), dtype=torch.int64)
    if small:
        lanes = _cpu_digest.native().segment_lanes(rows, [ranges[i] for i in small])
        sizes = [(ranges[i][1] - ranges[i][0]) * row_bytes for i in small]
        if len(small) == len(ranges):  # the usual case: no tensor op but the result's
            return finalize_host(lanes, sizes)
        out[small] = finalize_host(lanes, sizes)
    for i, (a, b) in enumerate(ranges):
        if (b - a) * row_bytes >= _cpu.PARALLEL_MIN_BYTES:
            out[i] = tensor_digest(rows[a:b])
    return out


def _native() -> bool:
    return _cpu_digest.native() is not None


def head_digests(packed: torch.Tensor) -> torch.Tensor:
    """The digest of each head of a packed tensor, ``tensor_digest(packed[..., h, :])`` for every
    ``h`` (what a consumer pulling a slice of the heads checks): on the CPU in one pass over
    ``packed`` by the native library where it runs and heads are whole 32-bit words.

    Args:
        packed: ``[..., num_kv_heads, head_size]`` contiguous tensor (a packed KV tensor).

    Returns:
        ``[num_kv_heads, 2]`` int64 digests on ``packed``'s device.
    """
    if not isinstance(packed, torch.Tensor) or packed.dim() < 2 or not packed.is_contiguous():
        raise ValueError(
            "packed: expected a contiguous [..., num_kv_heads, head_size] tensor, got "
            f"{type(packed).__name__} {getattr(packed, 'shape', '')}"
        )
    whole_words = packed.shape[-1] * packed.element_size() % 4 == 0
    lib = _cpu_digest.native() if packed.device.type == "cpu" and whole_words else None
    if lib is not None:
        return _cpu_digest.head_digests(lib, packed)
    return torch.stack([tensor_digest(packed[..., h, :]) for h in range(packed.shape[-2])])


def digest_hex(digest: torch.Tensor) -> str:
    """16 lowercase hex digits (lane A then B): how metadata and logs carry a digest (syncs)."""
    return digests_hex([digest])[0]


def digests_hex(digests: list[torch.Tensor]) -> list[str]:
    """:func:`digest_hex` of each digest (of one device), with one host synchronisation."""
    if not digests:
        return []
    values = torch.stack(digests).tolist()
    return [f"{a:08x}{b:08x}" for a, b in values]


def digests_equal(expected: torch.Tensor | str, got: torch.Tensor | str) -> bool:
    """Whether two digests (tensors or :func:`digest_hex` strings) are the same (syncs)."""
    as_text = [d if isinstance(d, str) else digest_hex(d) for d in (expected, got)]
    return as_text[0] == as_text[1]
