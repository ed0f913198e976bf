"""The digest's definition as code (see :mod:`tritonkv.digest` for the definition in words): its
constants, the murmur3 finalizer, the NumPy lane sums and the finalization every backend shares.

A leaf: it imports no other tritonkv module, so the Triton kernels (:mod:`tritonkv._digest_triton`),
the CPU copy + digest (:mod:`tritonkv._cpu_digest`) and the public :mod:`tritonkv.digest` all
import it, and none of them another for these pieces.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

DIGEST_SIZE = 2  # lanes: a [2] int64 tensor
MASK = 0xFFFFFFFF
KEY = 0x9E3779B1  # position key multiplier (odd)
SEED = 0x1B873593  # added to every position key
FMIX_1 = 0x85EBCA6B
FMIX_2 = 0xC2B2AE35
COUNT_SEEDS = (0x27D4EB2F, 0x165667B1)  # lane A, lane B: fold the byte count
CHUNK_WORDS = 1 << 15  # NumPy lane sums: words per chunk (its temporaries stay in cache)


def fmix32(h: int) -> int:
    """murmur3's 32-bit finalizer on a Python int (a bijection of ``[0, 2**32)``)."""
    h ^= h >> 16
    h = (h * FMIX_1) & MASK
    h ^= h >> 13
    h = (h * FMIX_2) & MASK
    return h ^ (h >> 16)


def fmix32_torch(h: torch.Tensor) -> torch.Tensor:
    """:func:`fmix32` on an int64 tensor holding values in ``[0, 2**32)`` (products stay < 2**63)."""
    h = h ^ (h >> 16)
    h = ((h & 0xFFFF) * FMIX_1 + (((h >> 16) * FMIX_1) & 0xFFFF) * 65536) & MASK
    h = h ^ (h >> 13)
    h = ((h & 0xFFFF) * FMIX_2 + (((h >> 16) * FMIX_2) & 0xFFFF) * 65536) & MASK
    return h ^ (h >> 16)


@functools.lru_cache(maxsize=256)
def count_keys(num_bytes: int) -> tuple[int, int]:
    """The values :func:`finalize` folds into lanes A and B for a tensor of ``num_bytes`` bytes."""
    lo, hi = num_bytes & MASK, num_bytes >> 32
    return tuple(fmix32(lo ^ fmix32(hi ^ seed)) for seed in COUNT_SEEDS)


def finalize(lanes: torch.Tensor, num_bytes: int) -> torch.Tensor:
    """The digest from the raw lane sums (no host synchronisation).

    Args:
        lanes: ``[2]`` int64 sums of lanes A and B (any value: only the low 32 bits count).
        num_bytes: the packed tensor's size in bytes.

    Returns:
        ``[2]`` int64 digest, each lane in ``[0, 2**32)``, on ``lanes``' device.
    """
    mixed = lanes & MASK
    for lane, key in enumerate(count_keys(num_bytes)):  # scalars: no host-to-device copy
        mixed[lane] ^= key
    return fmix32_torch(mixed)


def finalize_host(lanes: list[tuple[int, int]], num_bytes: int | Sequence[int]) -> torch.Tensor:
    """:func:`finalize` of lane sums the host holds (Python ints, e.g. from the native library):
    the same bits in Python arithmetic, one tensor made instead of a dozen small torch ops.

    Args:
        lanes: ``(A, B)`` sums of each digest (any value: only the low 32 bits count).
        num_bytes: the size in bytes of each digested tensor: one for all, or one each.

    Returns:
        ``[len(lanes), 2]`` int64 digests on the CPU.
    """
    sizes = [num_bytes] * len(lanes) if isinstance(num_bytes, int) else list(num_bytes)
    if len(sizes) != len(lanes):
        raise ValueError(f"{len(sizes)} sizes for {len(lanes)} lane sums")
    out = []
    for (a, b), n in zip(lanes, sizes, strict=True):
        c0, c1 = count_keys(n)
        out.append([fmix32((a & MASK) ^ c0), fmix32((b & MASK) ^ c1)])
    return torch.tensor(out, dtype=torch.int64).view(len(lanes), DIGEST_SIZE)


def lanes_numpy(words: np.ndarray, first_word: int = 0) -> tuple[int, int]:
    """Lane sums (mod 2**32) of ``words`` (``uint32``) at positions ``first_word, ...``."""
    a = b = 0
    chunk = min(CHUNK_WORDS, max(words.size, 1))
    steps = np.arange(chunk, dtype=np.uint32) * np.uint32(KEY)  # wraps: k - SEED of 0 .. chunk - 1
    k = np.empty(chunk, np.uint32)
    h = np.empty(chunk, np.uint32)
    t = np.empty(chunk, np.uint32)
    with np.errstate(over="ignore"):  # 13 ufuncs per chunk, each ~3 us for 32k words
        for start in range(0, words.size, chunk):
            n = min(chunk, words.size - start)
            kk, hh, tt = k[:n], h[:n], t[:n]
            np.add(steps[:n], np.uint32(((first_word + start) * KEY + SEED) & MASK), out=kk)
            np.bitwise_xor(words[start : start + n], kk, out=hh)
            for shift, factor in ((16, FMIX_1), (13, FMIX_2)):
                np.right_shift(hh, np.uint32(shift), out=tt)
                np.bitwise_xor(hh, tt, out=hh)
                np.multiply(hh, np.uint32(factor), out=hh)
            np.right_shift(hh, np.uint32(16), out=tt)
            np.bitwise_xor(hh, tt, out=hh)
            a += int(hh.sum(dtype=np.uint32))  # sums wrap modulo 2**32, as the lanes do
            np.bitwise_or(kk, np.uint32(1), out=kk)
            np.multiply(hh, kk, out=hh)
            b += int(hh.sum(dtype=np.uint32))
    return a & MASK, b & MASK
