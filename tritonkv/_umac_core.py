"""The keyed payload hash's definition as code (the construction in words: :mod:`tritonkv.umac`):
constants, the key schedule, the NumPy reference of the NH layer, its torch twin, and the PRF
that turns NH outputs into a tag.

A leaf: it imports no other tritonkv module, so the Triton kernel (:mod:`tritonkv._umac_triton`),
the C library's loader (:mod:`tritonkv._cpu_umac`) and the public :mod:`tritonkv.umac` all import
it, and none of them another for these pieces.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence

import numpy as np
import torch

CHUNK_BYTES = 4096  # NH block: the payload is hashed in blocks of this many bytes
CHUNK_WORDS = CHUNK_BYTES // 4  # 32-bit words per block
ITERATIONS = 2  # Toeplitz iterations: NH passes, each with the key shifted by SHIFT_WORDS
SHIFT_WORDS = 4  # 16 bytes, as RFC 4418's L1 shifts its key between iterations
KEY_WORDS = CHUNK_WORDS + SHIFT_WORDS * (ITERATIONS - 1)  # 1028 words: 4112 key bytes
KEY_BYTES = 4 * KEY_WORDS
MAC_KEY_BYTES = 32
TAG_BYTES = 16  # the tag: HMAC-SHA256 truncated to 128 bits
MASK32 = 0xFFFFFFFF
LABEL_NH = b"tritonkv umac nh key v1"
LABEL_MAC = b"tritonkv umac mac key v1"
LABEL_TAG = b"tritonkv umac tag v1"
LABEL_ENTRY_SALT = b"tritonkv umac entry salt v1"  # HKDF-Extract's salt for entry NH keys
LABEL_ENTRY = b"tritonkv umac entry nh key v1"
MAX_ENTRY_KEY_BYTES = 1024
MAX_NONCE_BYTES = 64
TWIN_ROWS = 1 << 12  # torch twin: blocks per pass (int64 temporaries of 32 MiB each)

_U64 = struct.Struct("<Q")


def hkdf_expand(prk: bytes, info: bytes, length: int) -> bytes:
    """HKDF-Expand of RFC 5869 with HMAC-SHA256: ``length`` bytes (at most 8160) from the
    pseudorandom key ``prk`` (here a session key, itself the output of a key exchange's HMAC)
    and the context ``info``."""
    if not 0 < length <= 255 * 32:
        raise ValueError(f"length: expected 1 .. 8160 bytes, got {length}")
    out, block, counter = bytearray(), b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return bytes(out[:length])


def check_key_nonce(session_key: bytes, nonce: bytes) -> None:
    """TypeError / ValueError unless ``session_key`` is 32 or more bytes and ``nonce`` 1 to
    :data:`MAX_NONCE_BYTES` bytes."""
    for name, value in (("session_key", session_key), ("nonce", nonce)):
        if not isinstance(value, bytes):
            raise TypeError(f"{name}: expected bytes, got {type(value).__name__}")
    if len(session_key) < 32:
        raise ValueError(f"session_key: expected at least 32 bytes, got {len(session_key)}")
    if not 0 < len(nonce) <= MAX_NONCE_BYTES:
        raise ValueError(f"nonce: expected 1 to {MAX_NONCE_BYTES} bytes, got {len(nonce)}")


def derive_keys(session_key: bytes, nonce: bytes) -> tuple[np.ndarray, bytes]:
    """The transfer's NH key (``[KEY_WORDS]`` uint32, little-endian words of 4112 derived bytes)
    and its PRF key (32 bytes): for each, a 32-byte HKDF-Expand of ``session_key`` with its own
    label and the length-prefixed ``nonce`` (independent keys for every (session key, nonce)
    pair); the NH key is that seed stretched by SHAKE256 (an XOF: one call, where HKDF-Expand
    would take 129 HMACs, 0.35 ms)."""
    check_key_nonce(session_key, nonce)
    context = bytes([len(nonce)]) + nonce
    seed = hkdf_expand(session_key, LABEL_NH + context, 32)
    nh = hashlib.shake_256(seed).digest(KEY_BYTES)
    mac = hkdf_expand(session_key, LABEL_MAC + context, MAC_KEY_BYTES)
    return np.frombuffer(nh, dtype="<u4").astype(np.uint32), mac


def derive_entry_nh_key(secret: bytes, entry_key: bytes) -> np.ndarray:
    """The NH key of a stored entry (``[KEY_WORDS]`` uint32), for a hash computed when the entry
    is packed, before any session exists: HKDF (RFC 5869) with SHA-256, its Extract over
    ``secret`` with the salt :data:`LABEL_ENTRY_SALT`, its Expand to a 32-byte seed with the
    context ``LABEL_ENTRY | len(entry_key) (u16 LE) | entry_key``, stretched by SHAKE256 as in
    :func:`derive_keys`. ``secret`` may be empty (a deployment without one: anyone can compute
    the key, as anyone can compute its session keys)."""
    for name, value in (("secret", secret), ("entry_key", entry_key)):
        if not isinstance(value, bytes):
            raise TypeError(f"{name}: expected bytes, got {type(value).__name__}")
    if not 0 < len(entry_key) <= MAX_ENTRY_KEY_BYTES:
        raise ValueError(
            f"entry_key: expected 1 to {MAX_ENTRY_KEY_BYTES} bytes, got {len(entry_key)}"
        )
    prk = hmac.new(LABEL_ENTRY_SALT, secret, hashlib.sha256).digest()
    context = LABEL_ENTRY + struct.pack("<H", len(entry_key)) + entry_key
    nh = hashlib.shake_256(hkdf_expand(prk, context, 32)).digest(KEY_BYTES)
    return np.frombuffer(nh, dtype="<u4").astype(np.uint32)


def num_chunks(num_bytes: int) -> int:
    """NH blocks of a payload of ``num_bytes`` bytes (the last zero-padded; 0 for none)."""
    return -(-num_bytes // CHUNK_BYTES)


def nh_numpy(words: np.ndarray, key: np.ndarray) -> np.ndarray:
    """The reference NH of whole blocks: ``words`` ``[n * CHUNK_WORDS]`` uint32 (little-endian
    words of the payload), ``key`` ``[KEY_WORDS]`` uint32. Returns ``[n, ITERATIONS]`` uint64:
    for block ``c`` and iteration ``t``, the sum mod 2**64 over its 32-byte groups ``g`` and
    ``j`` in 0..3 of ``(m[8g+j] + k[8g+j+4t] mod 2**32) * (m[8g+j+4] + k[8g+j+4+4t] mod 2**32)``
    (RFC 4418's NH pairing, word ``j`` with word ``j + 4`` of each group)."""
    if words.size % CHUNK_WORDS:
        raise ValueError(f"words: expected whole blocks of {CHUNK_WORDS}, got {words.size}")
    m = words.reshape(-1, CHUNK_WORDS // 8, 2, 4)
    out = np.empty((m.shape[0], ITERATIONS), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for t in range(ITERATIONS):
            k = key[SHIFT_WORDS * t : SHIFT_WORDS * t + CHUNK_WORDS].reshape(-1, 2, 4)
            a = (m[:, :, 0, :] + k[:, 0, :]).astype(np.uint64)  # uint32 adds wrap
            b = (m[:, :, 1, :] + k[:, 1, :]).astype(np.uint64)
            out[:, t] = (a * b).sum(axis=(1, 2), dtype=np.uint64)
    return out


def padding_terms(key: np.ndarray, num_bytes: int) -> tuple[int, int]:
    """What the zero padding of a payload's last block adds to its NH sums: for each iteration
    ``t``, the sum mod 2**64 of ``k[8g+j+4t] * k[8g+j+4+4t]`` over the 32-byte groups ``g`` of
    the last block past ``num_bytes`` (their words are zeros), as uint64 ints; ``(0, 0)`` when
    ``num_bytes`` fills its last block. A kernel that hashes only the payload's bytes adds these
    to the last block's sums.

    Args:
        key: ``[KEY_WORDS]`` uint32 NH key.
        num_bytes: the payload's size, a multiple of 32 (whole groups: a group with payload
            words and padding words is no sum of separate terms).

    Raises:
        ValueError: ``num_bytes`` is negative or not a multiple of 32.
    """
    if num_bytes < 0 or num_bytes % 32:
        raise ValueError(f"num_bytes: expected a non-negative multiple of 32, got {num_bytes}")
    first = num_bytes % CHUNK_BYTES // 32  # the first padding group of the last block
    if first == 0:
        return 0, 0
    k = key.astype(np.uint64)
    out = []
    for t in range(ITERATIONS):
        part = k[SHIFT_WORDS * t : SHIFT_WORDS * t + CHUNK_WORDS].reshape(-1, 2, 4)[first:]
        with np.errstate(over="ignore"):
            out.append(int((part[:, 0, :] * part[:, 1, :]).sum(dtype=np.uint64)))
    return out[0], out[1]


def nh_torch(words: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """:func:`nh_numpy` in torch ops on any device (the twin; int64 arithmetic only: products
    split in 16-bit halves, so nothing relies on signed overflow).

    Args:
        words: ``[n * CHUNK_WORDS]`` int32, the payload's words (bit patterns).
        key: ``[KEY_WORDS]`` int32 on ``words``' device.

    Returns:
        ``[n, ITERATIONS]`` int64 on ``words``' device (the uint64 sums' bit patterns).
    """
    n = words.numel() // CHUNK_WORDS
    out = torch.empty((n, ITERATIONS), dtype=torch.int64, device=words.device)
    k64 = key.to(torch.int64) & MASK32
    for start in range(0, n, TWIN_ROWS):
        stop = min(n, start + TWIN_ROWS)
        part = words[start * CHUNK_WORDS : stop * CHUNK_WORDS].to(torch.int64) & MASK32
        m = part.view(stop - start, CHUNK_WORDS // 8, 2, 4)
        for t in range(ITERATIONS):
            k = k64[SHIFT_WORDS * t : SHIFT_WORDS * t + CHUNK_WORDS].view(-1, 2, 4)
            a = (m[:, :, 0, :] + k[:, 0, :]) & MASK32
            b = (m[:, :, 1, :] + k[:, 1, :]) & MASK32
            x = (a & 0xFFFF) * b  # < 2**48
            y = (a >> 16) * b  # < 2**48; a * b = x + y * 2**16
            low = x + ((y & 0xFFFF) << 16)  # < 2**49
            lo32 = (low & MASK32).flatten(1).sum(1)  # 512 terms < 2**32 each: no overflow
            hi32 = ((y >> 16) + (low >> 32)).flatten(1).sum(1)
            hi = (hi32 + (lo32 >> 32)) & MASK32
            hi = hi - ((hi >> 31) << 32)  # as a signed 32-bit value: hi * 2**32 stays in int64
            out[start:stop, t] = hi * (1 << 32) + (lo32 & MASK32)
    return out


def prf_tag(mac_key: bytes, nonce: bytes, parts: Sequence[tuple[int, bytes]]) -> bytes:
    """The tag: the first :data:`TAG_BYTES` of HMAC-SHA256 under ``mac_key`` over the label,
    the length-prefixed ``nonce``, the number of tensors, then per tensor its byte count (u64
    LE) and its NH outputs (``[n, ITERATIONS]`` uint64 LE, block-major) as bytes."""
    h = hmac.new(mac_key, LABEL_TAG + bytes([len(nonce)]) + nonce, hashlib.sha256)
    h.update(_U64.pack(len(parts)))
    for num_bytes, outputs in parts:
        if len(outputs) != 8 * ITERATIONS * num_chunks(num_bytes):
            raise ValueError(
                f"NH outputs: expected {8 * ITERATIONS * num_chunks(num_bytes)} bytes for "
                f"{num_bytes} payload bytes, got {len(outputs)}"
            )
        h.update(_U64.pack(num_bytes))
        h.update(outputs)
    return h.digest()[:TAG_BYTES]
