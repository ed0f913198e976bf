"""Payload authentication at memory speed: a keyed universal hash of a tensor's bytes, UMAC-style.

Construction (UMAC's, RFC 4418 and Black et al., "UMAC: Fast and Secure Message Authentication",
CRYPTO '99; the full write-up with the bound's arithmetic: ``docs/authentication.md``):

- **Keys, one set per transfer.** From a session key ``K`` (32 bytes, only the two ends hold it)
  and the transfer's nonce ``N`` (never used twice under one ``K``): the NH key is SHAKE256 of
  HKDF-Expand-SHA256(``K``, ``"tritonkv umac nh key v1" | len(N) | N``, 32 bytes), its first
  4112 bytes read as 1028 little-endian 32-bit words; the PRF key HKDF-Expand-SHA256(``K``,
  ``"tritonkv umac mac key v1" | len(N) | N``, 32 bytes) (:func:`transfer_keys`).
- **NH (the universal hash).** A tensor's bytes, in memory order, are cut in blocks of 4096 bytes
  (the last zero-padded) and read as little-endian 32-bit words ``m``. For each block and each
  Toeplitz iteration ``t`` in 0, 1 (the key shifted by 4 words = 16 bytes per iteration, as RFC
  4418's L1 does): ``NH_t = sum over 8-word groups g, j = 0..3 of ((m[8g+j] + k[8g+j+4t]) mod
  2**32) * ((m[8g+j+4] + k[8g+j+4+4t]) mod 2**32) mod 2**64`` (:func:`nh_hash`). Two 64-bit
  outputs per 4 KiB: 1/256 of the payload.
- **PRF.** The tag is HMAC-SHA256 under the PRF key, truncated to 16 bytes, over a label, the
  nonce, the number of tensors and, per tensor, its byte count and its NH outputs in block order
  (:func:`payload_tag`). The NH outputs never leave the process; only the tag travels.

Bound: NH with ``T`` Toeplitz iterations over 32-bit words is ``2**(-32 T)``-almost-universal on
equal-length inputs; lengths are bound by the PRF. A forgery succeeds with probability at most
``2**-64 + 2**-128`` per attempt (plus HMAC-SHA256's distance from a random function), i.e.
below ``2**-63.9``.

Where it runs: Triton (one program per block, a launch of its own over the tensor), the C
library :mod:`tritonkv._cpu_umac` on the CPU (torch twin where it cannot be built), the torch twin
:func:`nh_hash_torch` (any device) and the NumPy reference :func:`nh_hash_numpy`: the same bits.
:func:`tritonkv.pack_kv` and :func:`tritonkv.unpack_kv` (``nh_key``, ``nh_out``) give NH of the
packed tensor as they write or read it: fused into the Triton copy kernel where head rows are
whole 32-byte groups from 32 to 4096 bytes moved as 4- or 8-byte integers, else :func:`nh_hash`
after the copy (and on the CPU).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import numpy as np
import torch

from . import _cpu_umac
from ._dispatch import use_triton
from ._umac_core import (
    CHUNK_BYTES,
    ITERATIONS,
    TAG_BYTES,
    derive_entry_nh_key,
    derive_keys,
    nh_numpy,
    nh_torch,
    num_chunks,
    prf_tag,
)
from ._umac_triton import nh_triton

__all__ = [
    "CHUNK_BYTES",
    "ITERATIONS",
    "TAG_BYTES",
    "TagMismatch",
    "TransferKeys",
    "check_payload_tag",
    "check_tag",
    "entry_keys",
    "nh_hash",
    "nh_hash_numpy",
    "nh_hash_torch",
    "payload_tag",
    "tag_of_outputs",
    "transfer_keys",
]


class TagMismatch(ValueError):
    """A payload's tag is not the one its sender computed: bytes changed, reordered, cut short,
    or the payload belongs to another transfer."""


class TransferKeys:
    """The NH key and PRF key of one transfer (:func:`transfer_keys`), or an entry's NH key
    alone (:func:`entry_keys`: ``mac_key`` None, no tag under it); the NH key is copied to a
    device once per device it is used on."""

    def __init__(self, nh_key: np.ndarray, mac_key: bytes | None, nonce: bytes):
        self.nh_key = nh_key  # [KEY_WORDS] uint32
        self.mac_key = mac_key
        self.nonce = nonce
        self._on: dict[torch.device, torch.Tensor] = {}

    def nh_key_on(self, device: torch.device) -> torch.Tensor:
        """``[KEY_WORDS]`` int32 NH key on ``device``: to a GPU from pinned memory without
        blocking, in the current stream's order (a copy from pageable memory would wait on the
        host for the work queued on that stream, e.g. vLLM's forward pass, when called on
        vLLM's step)."""
        device = torch.device(device)
        key = self._on.get(device)
        if key is None:
            key = torch.from_numpy(self.nh_key.view(np.int32).copy())
            if device.type == "cuda":
                key = key.pin_memory().to(device, non_blocking=True)
            else:
                key = key.to(device)
            self._on[device] = key
        return key

    def __repr__(self) -> str:  # never the keys
        return f"TransferKeys(nonce={len(self.nonce)} bytes)"


def transfer_keys(session_key: bytes, nonce: bytes) -> TransferKeys:
    """The keys of the transfer ``nonce`` under ``session_key`` (see the module docstring).

    Args:
        session_key: at least 32 bytes, held only by the two ends (e.g. a session's direction key).
        nonce: 1 to 64 bytes, never used twice under one ``session_key`` (e.g. a frame counter).

    Raises:
        TypeError, ValueError: either is not bytes of those lengths.
    """
    nh_key, mac_key = derive_keys(session_key, nonce)
    return TransferKeys(nh_key, mac_key, nonce)


def entry_keys(secret: bytes | None, entry_key: str) -> TransferKeys:
    """The NH key of the stored entry ``entry_key`` under the deployment's ``secret``
    (:func:`~tritonkv._umac_core.derive_entry_nh_key`): what a producer hashes an entry with as
    it packs it, before any session exists, and what the consumer that asked for that key
    hashes it with as it receives or unpacks it. Its tags are made under a transfer's PRF key
    (:func:`tag_of_outputs` with that transfer's :func:`transfer_keys`); it has none of its own.

    Args:
        secret: the shared secret (None: none; the key is then anyone's).
        entry_key: the entry's key (1 to 1024 UTF-8 bytes).

    Raises:
        TypeError, ValueError: not a str of that length, or a secret that is not bytes.
    """
    if not isinstance(entry_key, str):
        raise TypeError(f"entry_key: expected str, got {type(entry_key).__name__}")
    nh_key = derive_entry_nh_key(secret or b"", entry_key.encode())
    return TransferKeys(nh_key, None, b"entry")


def _flat_bytes(data: torch.Tensor) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"data: expected a tensor, got {type(data).__name__}")
    return data.detach().contiguous().reshape(-1).view(torch.uint8)


def _split(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole blocks of ``flat`` (uint8) as int32 words, and the last partial block
    zero-padded to a whole one (None if there is none)."""
    full = flat.numel() // CHUNK_BYTES * CHUNK_BYTES
    head = flat[:full]
    if head.storage_offset() % 4 or head.data_ptr() % 4:
        head = head.clone()
    tail = None
    if full < flat.numel():
        tail = torch.zeros(CHUNK_BYTES, dtype=torch.uint8, device=flat.device)
        tail[: flat.numel() - full] = flat[full:]
        tail = tail.view(torch.int32)
    return head.view(torch.int32), tail


def nh_hash(data: torch.Tensor, key: TransferKeys) -> torch.Tensor:
    """NH of ``data``'s bytes under ``key``, on ``data``'s device: Triton where Triton runs
    (``tritonkv.use_triton``), else the C library on the CPU, else the torch twin.

    Args:
        data: any tensor, any dtype (its contiguous form's bytes; a strided tensor is copied).
        key: the transfer's keys.

    Returns:
        ``[ceil(num_bytes / 4096), ITERATIONS]`` int64 (uint64 bit patterns) on ``data``'s
        device.
    """
    flat = _flat_bytes(data)
    head, tail = _split(flat)
    if use_triton(flat.device):
        run = lambda words: nh_triton(words, key.nh_key_on(flat.device))
    elif flat.device.type == "cpu" and _cpu_umac.native() is not None:
        lib = _cpu_umac.native()
        run = lambda words: _cpu_umac.nh_native(lib, words, key.nh_key)
    else:
        run = lambda words: nh_torch(words, key.nh_key_on(flat.device))
    return _join(run, head, tail)


def _join(run, head: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
    out = run(head)
    return out if tail is None else torch.cat([out, run(tail)])


def nh_hash_torch(data: torch.Tensor, key: TransferKeys) -> torch.Tensor:
    """:func:`nh_hash` by the torch twin (the oracle of the Triton kernel; any device)."""
    head, tail = _split(_flat_bytes(data))
    return _join(lambda words: nh_torch(words, key.nh_key_on(words.device)), head, tail)


def nh_hash_numpy(data: torch.Tensor, key: TransferKeys) -> np.ndarray:
    """:func:`nh_hash` by the NumPy reference: ``[n, ITERATIONS]`` uint64 on the host."""
    raw = _flat_bytes(data).cpu().numpy()
    padded = np.zeros(num_chunks(raw.size) * CHUNK_BYTES, dtype=np.uint8)
    padded[: raw.size] = raw
    return nh_numpy(padded.view("<u4"), key.nh_key)


def payload_tag(key: TransferKeys, tensors: Sequence[torch.Tensor]) -> bytes:
    """The 16-byte tag of ``tensors`` (in this order) for the transfer ``key``: NH of each on
    its device, the outputs brought to the host at once (one synchronisation on a GPU), then
    the PRF.

    Args:
        key: the transfer's keys (:func:`transfer_keys`).
        tensors: the payload's tensors, any dtypes and devices.

    Returns:
        :data:`TAG_BYTES` bytes.
    """
    if isinstance(tensors, torch.Tensor):
        raise TypeError("tensors: expected a sequence of tensors, got one tensor")
    parts = [(t.numel() * t.element_size(), nh_hash(t, key)) for t in tensors]
    return tag_of_outputs(key, parts)


def tag_of_outputs(key: TransferKeys, parts: Sequence[tuple[int, torch.Tensor]]) -> bytes:
    """The tag from NH outputs computed already: :func:`payload_tag` of tensors whose byte
    counts and :func:`nh_hash` outputs ``parts`` holds, in order. NH of a tensor is the
    concatenation of NH of its slices cut at multiples of :data:`CHUNK_BYTES` (blocks are
    independent), so a receiver may hash pieces as they land.

    Args:
        key: the transfer's keys.
        parts: ``(num_bytes, outputs)`` per tensor, outputs ``[n, ITERATIONS]`` int64 on any
            device (brought to the host at once).

    Returns:
        :data:`TAG_BYTES` bytes.
    """
    if key.mac_key is None:
        raise TypeError("key: an entry's NH key has no PRF key; tag under a transfer's keys")
    host = [o.cpu() if o.device.type != "cpu" else o for _, o in parts]
    raw = [o.numpy().view(np.uint64).astype("<u8").tobytes() for o in host]
    return prf_tag(key.mac_key, key.nonce, [(n, r) for (n, _), r in zip(parts, raw, strict=True)])


def check_payload_tag(key: TransferKeys, tensors: Sequence[torch.Tensor], tag: bytes) -> None:
    """Compare ``tensors``' tag with ``tag`` (constant time).

    Raises:
        TagMismatch: they differ (a changed, reordered, truncated or foreign payload).
        TypeError: ``tag`` is not bytes.
    """
    check_tag(payload_tag(key, tensors), tag, len(tensors))


def check_tag(got: bytes, tag: bytes, num_tensors: int) -> None:
    """Compare a computed tag ``got`` (:func:`payload_tag`, :func:`tag_of_outputs`) with the
    sender's ``tag`` in constant time; TagMismatch if unlike, TypeError if ``tag`` is not bytes."""
    if not isinstance(tag, (bytes, bytearray)):
        raise TypeError(f"tag: expected bytes, got {type(tag).__name__}")
    if not hmac.compare_digest(bytes(tag), got):
        raise TagMismatch(
            f"payload authentication failed: the tag of {num_tensors} tensor(s) differs from "
            "the sender's (changed, reordered, truncated or another transfer's bytes)"
        )
