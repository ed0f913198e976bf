"""The frame codec of the tritonkv transport: bytes to headers and back, never a socket.

No pickle anywhere: a frame is a fixed little-endian prefix, a length-capped body and, optionally, a
payload. Every header is validated (magic, version, kind, lengths, dtype code, rank, shape, byte
count, caps) before the receiver allocates anything.

Frame layout (all integers little-endian)::

    prefix   12 bytes  "<4sBBHI"  magic b"TKVT" | version u8 | kind u8 | flags u16 | body_len u32
    body     body_len bytes (body_len <= limits.max_body_bytes)
             u16 key_len   | key   (UTF-8, <= limits.max_key_bytes)
             u32 meta_len  | meta  (UTF-8 JSON object, flat, <= limits.max_meta_bytes)
             u16 n_tensors (<= limits.max_tensors), then per tensor:
                 u16 name_len | name (UTF-8, unique, non-empty)
                 u8 dtype code | u8 ndim (<= limits.max_ndim) | u8 tensor flags
                 ndim × i64 dims (each >= 0; product of non-zero dims <= max_message_bytes)
                 u64 nbytes (must equal numel × itemsize)
    payload  sum(nbytes) bytes (<= limits.max_message_bytes), either right after the body on the
             same socket (frame flag ``FLAG_INLINE``) or on the data process group (see pipe.py),
             in the chunk order given by :func:`plan_chunks`, each chunk on the process group
             as one operation per piece (:func:`pieces`).

On a connection, a session tag follows the body, and another an inline payload
(:mod:`connector.transport.session`); the codec itself knows nothing of them.

Example: a DATA frame for key ``"req-7"`` carrying one bf16 tensor ``k`` of shape ``[2, 3]`` has the
body ``05 00 'req-7' | 02 00 00 00 '{}' | 01 00 | 01 00 'k' | 03 02 00 | 2 i64 3 i64 | 12 u64``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import struct
from dataclasses import dataclass, field

import torch

from .errors import ProtocolError

MAGIC = b"TKVT"
VERSION = 5  # 5: a process-group payload's umac tag follows its header's tag (session.py);
# 4: process-group payload chunks travel in pieces (see pieces); 3: frames carry session tags
# (session.py); 2: kinds from APP_KIND_MIN up are the pipe user's

PREFIX = struct.Struct("<4sBBHI")
PREFIX_SIZE = PREFIX.size  # 12

FLAG_INLINE = 0x1  # payload follows the body on the control socket
KNOWN_FLAGS = FLAG_INLINE

TFLAG_PACKED = 0x1  # tensor travels inside the packed chunk (see plan_chunks)
# A process-group payload's tensor whose umac hash is under the NH key of the frame's key as a
# stored entry (tritonkv.umac.entry_keys), computed when it was packed, not the frame's own NH key
# (session.py). Never on an inline payload.
TFLAG_ENTRY_NH = 0x2
KNOWN_TFLAGS = TFLAG_PACKED | TFLAG_ENTRY_NH

PACK_ALIGN = 64  # byte alignment of every tensor inside a packed chunk
#: Largest process-group operation: a chunk travels in pieces of this size (the last one shorter),
#: so that copying a device tensor to or from host memory overlaps the network.
PIECE_BYTES = 16 << 20


# ----------------------------------------------------------------------------------------------
# Kinds, dtypes, limits
# ----------------------------------------------------------------------------------------------
class Kind(enum.IntEnum):
    """The pipe's own frame kinds. Codes from :data:`APP_KIND_MIN` to 255 belong to the pipe's
    user (the KV store's requests and replies, :class:`connector.kvstore.protocol.Op`): the codec
    passes them through as plain ints; any other code is refused."""

    HELLO = 1  # client → server: {"proto", "transport"}
    HELLO_ACK = 2  # server → client: {"transport", "limit.*"}
    ERROR = 6  # either way: {"error"}
    BYE = 11  # either way: clean goodbye, no body content
    MSG = 12  # a message of a pipe user that has no kinds of its own
    RENDEZVOUS = 13  # either way, in the handshake: the process group's store (rendezvous.py)


APP_KIND_MIN = 32  # first frame kind code a pipe user may define


def kind_name(kind: int) -> str:
    """``HELLO``, ... for the pipe's kinds; ``kind 33`` for a pipe user's."""
    return kind.name if isinstance(kind, enum.Enum) else f"kind {kind}"


def _dtype(name: str) -> torch.dtype | None:
    return getattr(torch, name, None)


# Fixed codes: never renumber, only append.
_DTYPE_CODES: dict[int, torch.dtype | None] = {
    1: torch.float32,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.float64,
    5: torch.int8,
    6: torch.uint8,
    7: torch.int16,
    8: torch.int32,
    9: torch.int64,
    10: torch.bool,
    11: _dtype("float8_e4m3fn"),
    12: _dtype("float8_e5m2"),
    13: _dtype("float8_e4m3fnuz"),
    14: _dtype("float8_e5m2fnuz"),
    15: _dtype("uint16"),
    16: _dtype("uint32"),
    17: _dtype("uint64"),
    18: torch.complex64,
    19: torch.complex128,
}
CODE_TO_DTYPE: dict[int, torch.dtype] = {c: d for c, d in _DTYPE_CODES.items() if d is not None}
DTYPE_TO_CODE: dict[torch.dtype, int] = {d: c for c, d in CODE_TO_DTYPE.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """Wire code of ``dtype``; TypeError for dtypes the wire cannot carry."""
    try:
        return DTYPE_TO_CODE[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} cannot travel on the wire; expected one of "
            f"{sorted(str(d) for d in DTYPE_TO_CODE)}"
        ) from None


@dataclass(frozen=True)
class FrameLimits:
    """Caps applied to every received header before any allocation (sender checks them too)."""

    max_body_bytes: int = 1 << 20  # header body (key + meta + tensor table)
    max_key_bytes: int = 1024
    max_meta_bytes: int = 64 << 10
    max_tensors: int = 4096
    max_ndim: int = 8
    max_name_bytes: int = 256
    max_message_bytes: int = 4 << 30  # payload of one frame (sum of tensor bytes)

    def __post_init__(self):
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"FrameLimits.{name}: expected a positive int, got {value!r}")
            top = _LIMIT_FIELD_MAX.get(name)
            if top is not None and value > top:
                raise ValueError(
                    f"FrameLimits.{name}: expected <= {top} (its header field's range), got {value}"
                )


# the largest value each header field can carry (u8 rank, u16 key/name lengths and tensor count,
# u32 body and meta lengths)
_LIMIT_FIELD_MAX = {
    "max_body_bytes": 0xFFFFFFFF,
    "max_key_bytes": 0xFFFF,
    "max_meta_bytes": 0xFFFFFFFF,
    "max_tensors": 0xFFFF,
    "max_ndim": 0xFF,
    "max_name_bytes": 0xFFFF,
}


DEFAULT_LIMITS = FrameLimits()
_LIMIT_KEY = "limit."


def limits_meta(limits: FrameLimits) -> dict[str, int]:
    """HELLO / HELLO_ACK meta announcing what this end accepts, e.g. ``{"limit.max_ndim": 8}``."""
    return {_LIMIT_KEY + name: getattr(limits, name) for name in FrameLimits.__dataclass_fields__}


def limits_from_meta(meta: dict, default: FrameLimits) -> FrameLimits:
    """The limits a peer announced with :func:`limits_meta` (``default`` for those it left out,
    e.g. a raw client); ProtocolError if they are not valid limits."""
    given = {
        name: meta[_LIMIT_KEY + name]
        for name in FrameLimits.__dataclass_fields__
        if _LIMIT_KEY + name in meta
    }
    try:
        return dataclasses.replace(default, **given)
    except ValueError as e:
        raise ProtocolError(f"peer announced invalid limits: {e}") from None


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a frame: name, wire dtype code, shape, payload bytes, tensor flags."""

    name: str
    code: int
    shape: tuple[int, ...]
    nbytes: int
    tflags: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return CODE_TO_DTYPE[self.code]

    @property
    def packed(self) -> bool:
        return bool(self.tflags & TFLAG_PACKED)

    @property
    def entry_nh(self) -> bool:
        return bool(self.tflags & TFLAG_ENTRY_NH)


@dataclass(frozen=True)
class Header:
    """A decoded, validated frame header."""

    kind: Kind | int  # an int from APP_KIND_MIN up: the pipe user's kind
    flags: int
    key: str
    meta: dict
    specs: tuple[TensorSpec, ...] = field(default_factory=tuple)

    @property
    def inline(self) -> bool:
        return bool(self.flags & FLAG_INLINE)

    @property
    def payload_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


# ----------------------------------------------------------------------------------------------
# Metadata: a flat JSON object, length-capped
# ----------------------------------------------------------------------------------------------
_META_TYPES = (int, float, str, bool, type(None))


def encode_meta(meta: dict | None, limits: FrameLimits = DEFAULT_LIMITS) -> bytes:
    """JSON bytes of a flat ``{str: int|float|str|bool|None}`` dict; ValueError/TypeError if not."""
    if meta is None:
        return b"{}"
    if not isinstance(meta, dict):
        raise TypeError(f"meta: expected a dict or None, got {type(meta).__name__}")
    for k, v in meta.items():
        if not isinstance(k, str):
            raise TypeError(f"meta keys: expected str, got {type(k).__name__} ({k!r})")
        if not isinstance(v, _META_TYPES):
            raise TypeError(
                f"meta[{k!r}]: expected int, float, str, bool or None, got {type(v).__name__}"
            )
    try:
        raw = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()
    except ValueError as e:
        raise ValueError(f"meta: expected finite numbers, got {e}") from None
    if len(raw) > limits.max_meta_bytes:
        raise ValueError(f"meta: expected <= {limits.max_meta_bytes} JSON bytes, got {len(raw)}")
    return raw


def _reject_constant(name: str):
    raise ValueError(f"non-finite number {name}")


def decode_meta(raw: bytes) -> dict:
    try:
        meta = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"meta is not valid UTF-8 JSON: {e}") from None
    except RecursionError:  # e.g. 60000 '[': nested far too deep for a flat object
        raise ProtocolError("meta: expected a flat JSON object, got deeply nested JSON") from None
    if not isinstance(meta, dict):
        raise ProtocolError(f"meta: expected a JSON object, got {type(meta).__name__}")
    for k, v in meta.items():
        if not isinstance(v, _META_TYPES):
            raise ProtocolError(f"meta[{k!r}]: expected a scalar, got {type(v).__name__}")
        if isinstance(v, float) and not math.isfinite(v):  # e.g. 1e999: senders never send it
            raise ProtocolError(f"meta[{k!r}]: expected a finite number, got {v}")
    return meta


# ----------------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------------
def spec_of(name: str, t: torch.Tensor, packed: bool = False, entry_nh: bool = False) -> TensorSpec:
    """TensorSpec describing tensor ``t`` (TypeError for non-tensors and unsupported dtypes)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"tensor name: expected a non-empty str, got {name!r}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")
    return TensorSpec(
        name=name,
        code=dtype_code(t.dtype),
        shape=tuple(int(s) for s in t.shape),
        nbytes=t.numel() * t.element_size(),
        tflags=(TFLAG_PACKED if packed else 0) | (TFLAG_ENTRY_NH if entry_nh else 0),
    )


def _label(name: str) -> str:
    return repr(name) if len(name) <= 40 else f"{name[:40]!r}... ({len(name)} chars)"


def _spec_problem(s: TensorSpec, limits: FrameLimits) -> str | None:
    """Why a receiver applying ``limits`` refuses tensor ``s``, or None. The decoder raises it as
    ProtocolError, a sender (``encode_header(check=True)``) as ValueError.

    Besides rank and byte count, the product of the non-zero dims is capped at
    ``max_message_bytes``: a non-empty tensor always passes (that product is its numel, at most its
    byte count), while an empty one such as ``(0, 2**40, 2**40)`` would overflow torch's stride
    computation when allocated (a cap on each dim alone would not: ``(0, 2**32, 2**32, 2**32)``).
    """
    nb = len(s.name.encode("utf-8"))
    if not 1 <= nb <= limits.max_name_bytes:
        return f"name: expected 1..{limits.max_name_bytes} UTF-8 bytes, got {nb}"
    if s.code not in CODE_TO_DTYPE:
        return f"unknown dtype code {s.code}"
    if len(s.shape) > limits.max_ndim:
        return f"expected ndim <= {limits.max_ndim}, got {len(s.shape)}"
    if s.tflags & ~KNOWN_TFLAGS:
        return f"unknown tensor flags 0x{s.tflags:x}"
    if any(d < 0 for d in s.shape):
        return f"negative dimension in shape {list(s.shape)}"
    itemsize = CODE_TO_DTYPE[s.code].itemsize
    expect = math.prod(s.shape) * itemsize  # Python ints: no overflow
    if s.nbytes != expect:
        return (
            f"byte count {s.nbytes} does not match shape {list(s.shape)} × {itemsize} bytes "
            f"= {expect}"
        )
    if s.nbytes > limits.max_message_bytes:
        return f"expected <= {limits.max_message_bytes} bytes per frame, got {s.nbytes}"
    extent = math.prod(max(d, 1) for d in s.shape)
    if extent > limits.max_message_bytes:
        return (
            f"shape {list(s.shape)}: expected a product of non-zero dims <= "
            f"{limits.max_message_bytes} (limits.max_message_bytes), got {extent}"
        )
    return None


def encode_header(
    kind: int,
    key: str = "",
    meta: dict | bytes | None = None,
    specs: tuple[TensorSpec, ...] | list[TensorSpec] = (),
    flags: int = 0,
    *,
    limits: FrameLimits = DEFAULT_LIMITS,
    check: bool = False,
) -> bytes:
    """Prefix + body bytes. Checks the key/meta caps; with ``check`` (senders), also every other
    limit a receiver applying ``limits`` enforces (ValueError naming expected and given). Without
    it, tests can build headers that a receiver must reject (unknown dtype code, huge nbytes)."""
    if not isinstance(key, str):
        raise TypeError(f"key: expected str, got {type(key).__name__}")
    kb = key.encode("utf-8")
    if len(kb) > limits.max_key_bytes:
        raise ValueError(f"key: expected <= {limits.max_key_bytes} UTF-8 bytes, got {len(kb)}")
    mb = meta if isinstance(meta, bytes) else encode_meta(meta, limits)
    if check:
        _check_specs(key, specs, limits)
    parts = [struct.pack("<H", len(kb)), kb, struct.pack("<I", len(mb)), mb]
    parts.append(struct.pack("<H", len(specs)))
    for s in specs:
        nb = s.name.encode("utf-8")
        parts.append(struct.pack("<H", len(nb)))
        parts.append(nb)
        parts.append(struct.pack("<BBB", s.code, len(s.shape), s.tflags))
        parts.append(struct.pack(f"<{len(s.shape)}q", *s.shape))
        parts.append(struct.pack("<Q", s.nbytes))
    body = b"".join(parts)
    if check and len(body) > limits.max_body_bytes:
        raise ValueError(
            f"message {key!r}: expected a header body (key, meta, tensor table) <= "
            f"{limits.max_body_bytes} bytes (limits.max_body_bytes), got {len(body)}"
        )
    return PREFIX.pack(MAGIC, VERSION, int(kind), flags, len(body)) + body


def _check_specs(key: str, specs, limits: FrameLimits) -> None:
    if len(specs) > limits.max_tensors:
        raise ValueError(
            f"message {key!r}: expected <= {limits.max_tensors} tensors (limits.max_tensors), "
            f"got {len(specs)}"
        )
    total = sum(s.nbytes for s in specs)
    if total > limits.max_message_bytes:
        raise ValueError(
            f"message {key!r}: expected <= {limits.max_message_bytes} payload bytes "
            f"(limits.max_message_bytes), got {total}"
        )
    for s in specs:
        problem = _spec_problem(s, limits)
        if problem is not None:
            raise ValueError(f"message {key!r}, tensor {_label(s.name)}: {problem}")


# ----------------------------------------------------------------------------------------------
# Decoding (validation before allocation)
# ----------------------------------------------------------------------------------------------
def decode_prefix(raw: bytes, limits: FrameLimits = DEFAULT_LIMITS) -> tuple[Kind, int, int]:
    """(kind, flags, body_len) from the 12 prefix bytes; ProtocolError on anything unexpected."""
    if len(raw) != PREFIX_SIZE:
        raise ProtocolError(f"frame prefix: expected {PREFIX_SIZE} bytes, got {len(raw)}")
    magic, version, kind, flags, body_len = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic: expected {MAGIC!r}, got {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported wire version: expected {VERSION}, got {version}")
    if kind in Kind._value2member_map_:
        kind = Kind(kind)
    elif kind < APP_KIND_MIN:
        raise ProtocolError(f"unknown frame kind {kind}")
    if flags & ~KNOWN_FLAGS:
        raise ProtocolError(f"unknown frame flags 0x{flags:x}")
    if body_len > limits.max_body_bytes:
        raise ProtocolError(
            f"header body: expected <= {limits.max_body_bytes} bytes, got {body_len}"
        )
    return kind, flags, body_len


class _BodyCursor:
    """Reads a header body front to back; ProtocolError where it ends too soon."""

    def __init__(self, buf: bytes):
        self.buf = buf
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.buf):
            raise ProtocolError(
                f"header body truncated reading {what}: need {n} bytes at offset {self.pos}, "
                f"body has {len(self.buf)}"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str):
        s = struct.Struct(fmt)
        return s.unpack(self.take(s.size, what))


def _utf8(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(f"{what} is not valid UTF-8") from None


def decode_body(
    kind: Kind, flags: int, body: bytes, limits: FrameLimits = DEFAULT_LIMITS
) -> Header:
    """Validate and decode a header body. Raises ProtocolError naming the offending field."""
    r = _BodyCursor(body)
    (klen,) = r.unpack("<H", "key length")
    if klen > limits.max_key_bytes:
        raise ProtocolError(f"key: expected <= {limits.max_key_bytes} bytes, got {klen}")
    key = _utf8(r.take(klen, "key"), "key")
    (mlen,) = r.unpack("<I", "meta length")
    if mlen > limits.max_meta_bytes:
        raise ProtocolError(f"meta: expected <= {limits.max_meta_bytes} bytes, got {mlen}")
    meta = decode_meta(r.take(mlen, "meta"))
    (ntensors,) = r.unpack("<H", "tensor count")
    if ntensors > limits.max_tensors:
        raise ProtocolError(f"tensor count: expected <= {limits.max_tensors}, got {ntensors}")
    specs = []
    names = set()
    total = 0
    for i in range(ntensors):  # every read is bounded by the body, already capped
        (nlen,) = r.unpack("<H", f"tensor {i} name length")
        name = _utf8(r.take(nlen, f"tensor {i} name"), f"tensor {i} name")
        if name in names:
            raise ProtocolError(f"tensor name {_label(name)} appears twice")
        names.add(name)
        code, ndim, tflags = r.unpack("<BBB", f"tensor {i} dtype/ndim/flags")
        shape = r.unpack(f"<{ndim}q", f"tensor {i} shape")
        (nbytes,) = r.unpack("<Q", f"tensor {i} byte count")
        spec = TensorSpec(name, code, tuple(shape), nbytes, tflags)
        problem = _spec_problem(spec, limits)
        if problem is not None:
            raise ProtocolError(f"tensor {i} {_label(name)}: {problem}")
        total += nbytes
        if total > limits.max_message_bytes:
            raise ProtocolError(
                f"payload: expected <= {limits.max_message_bytes} bytes per frame, header claims "
                f">= {total} (tensor {_label(name)}: {nbytes} bytes)"
            )
        specs.append(spec)
    if r.pos != len(body):
        raise ProtocolError(f"header body has {len(body) - r.pos} trailing bytes")
    if flags & FLAG_INLINE and any(s.entry_nh for s in specs):
        raise ProtocolError("an inline payload's tensor is marked as hashed under its entry key")
    return Header(kind=kind, flags=flags, key=key, meta=meta, specs=tuple(specs))


def decode_header(raw: bytes, limits: FrameLimits = DEFAULT_LIMITS) -> Header:
    """Decode prefix + body given as one bytes object (tests, tools)."""
    kind, flags, body_len = decode_prefix(raw[:PREFIX_SIZE], limits)
    body = raw[PREFIX_SIZE:]
    if len(body) != body_len:
        raise ProtocolError(f"header body: prefix says {body_len} bytes, got {len(body)}")
    return decode_body(kind, flags, body, limits)


# ----------------------------------------------------------------------------------------------
# Payload layout
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chunk:
    """One payload transfer: a single tensor (``index``) or the packed group (``members``)."""

    nbytes: int
    index: int = -1  # single tensor: index into specs
    members: tuple[tuple[int, int], ...] = ()  # packed: (spec index, byte offset) pairs


def _align(n: int) -> int:
    return (n + PACK_ALIGN - 1) // PACK_ALIGN * PACK_ALIGN


def plan_chunks(specs: tuple[TensorSpec, ...] | list[TensorSpec]) -> list[Chunk]:
    """Order in which payload bytes travel, computed identically on both sides.

    First one packed chunk holding every non-empty ``packed`` tensor (each at a 64-byte aligned
    offset, in spec order), then each other non-empty tensor alone, in spec order. Empty tensors
    carry no bytes. Example: specs a(10 B, packed), b(1 MiB), c(3 B, packed) → chunks
    [packed {a@0, c@64} 67 B, b 1 MiB].
    """
    members = []
    off = 0
    for i, s in enumerate(specs):
        if s.packed and s.nbytes > 0:
            off = _align(off)
            members.append((i, off))
            off += s.nbytes
    chunks = [Chunk(nbytes=off, members=tuple(members))] if members else []
    chunks += [
        Chunk(nbytes=s.nbytes, index=i)
        for i, s in enumerate(specs)
        if not s.packed and s.nbytes > 0
    ]
    return chunks


def pieces(nbytes: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of each process-group operation that carries a chunk of ``nbytes``:
    pieces of :data:`PIECE_BYTES`, the last one shorter (none for 0 bytes). Example: 40 MiB →
    [(0, 16 MiB), (16 MiB, 16 MiB), (32 MiB, 8 MiB)]."""
    return [(off, min(PIECE_BYTES, nbytes - off)) for off in range(0, nbytes, PIECE_BYTES)]
