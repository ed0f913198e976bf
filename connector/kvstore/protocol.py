"""The KV store's requests and replies: frame kinds of the pipe's user range
(:data:`connector.transport.frame.APP_KIND_MIN` up), carried by a :class:`TensorPipe`, with the
meta keys they use and :class:`Part`, the slice of one tensor a GET may ask for.

Request / reply protocol (one pipe per client, one request at a time)::

    GET key {"wait_ms": w[, "digest": d][, part fields]}  → DATA key tensors entry_meta
                                                          | MISS key {"reason": r}
                                                          | ERROR key {"error": e}
    DISCARD key {["digest": d]}                          → ACK key {"existed": bool}
                                                          | ERROR key {"error": e}

An entry put with a digest (the connector binds each to its prompt's digest) is served, and
discarded, only for a request that presents the same digest (compared in constant time); for any
other request it does not exist: MISS with the reason an unknown key gets, ``existed`` False.
A DISCARD discards every key of the key's group (:func:`group_of`: the chunks of one transfer) and
seals it: parts of it put later are refused (a transfer discarded while its producer still
computes it). Any other kind is answered with ERROR and the connection is closed. Codes 37 and 38 were PUT and
MATCH (removed before 0.1.0); they are not reused while the frame version is 2.
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass

import torch

from ..logs import hide_ids, short_id
from ..transport import APP_KIND_MIN, DEFAULT_LIMITS

__all__ = [
    "CHUNK_SEP",
    "DIGEST",
    "EXISTED",
    "PART_DIM",
    "PART_FIELDS",
    "PART_START",
    "PART_STOP",
    "PART_TENSOR",
    "REASON",
    "WAIT_MS",
    "Op",
    "Part",
    "check_key",
    "chunk_key",
    "group_of",
    "hide_ids",
    "op_name",
    "same_digest",
    "short_id",
]


class Op(enum.IntEnum):
    """Request and reply kinds of the KV store (frame kind codes)."""

    GET = APP_KIND_MIN  # client → server: key, {WAIT_MS[, part fields]}
    DATA = APP_KIND_MIN + 1  # server → client: key, tensors, entry meta
    MISS = APP_KIND_MIN + 2  # server → client: key, {REASON}
    ACK = APP_KIND_MIN + 3  # server → client: the result of a DISCARD, {EXISTED}
    DISCARD = APP_KIND_MIN + 4  # client → server: key


# Meta keys. An ERROR reply carries the transport's {"error": text} (Kind.ERROR, error_text).
WAIT_MS = "wait_ms"  # GET: how long the server may wait for the key to be put (int ms >= 0)
DIGEST = "digest"  # GET, DISCARD: the digest the entry was put with (str; absent: none)
REASON = "reason"  # MISS: why the key is not there ("claimed: ...", "expired: ...", ...)
EXISTED = "existed"  # ACK of DISCARD: whether the server held the key
PART_TENSOR = "part_tensor"  # GET of a Part: the tensor's name
PART_DIM = "part_dim"  # ... the dim sliced
PART_START = "part_start"  # ... first index
PART_STOP = "part_stop"  # ... one past the last index
PART_FIELDS = (PART_TENSOR, PART_DIM, PART_START, PART_STOP)


#: Between a transfer id and a chunk's index in the key of one chunk of that transfer (the
#: overlapped flow publishes a prompt's KV chunk by chunk); the transfer id is the key's group.
CHUNK_SEP = "#"


def chunk_key(transfer_id: str, index: int) -> str:
    """The key of chunk ``index`` of ``transfer_id``: ``"<transfer_id>#<index>"``."""
    return f"{transfer_id}{CHUNK_SEP}{index}"


def group_of(key: str) -> str:
    """The transfer a key belongs to: the part before :data:`CHUNK_SEP` (the key itself when it
    has none)."""
    return key.partition(CHUNK_SEP)[0]


def op_name(kind: int) -> str:
    """``GET``, ... for the store's kinds, the frame kind's name otherwise."""
    try:
        return Op(kind).name
    except ValueError:
        return kind.name if isinstance(kind, enum.Enum) else f"kind {kind}"


def same_digest(held: str | None, given) -> bool:
    """Whether a request's ``given`` digest is the one an entry was put with (``held``; None:
    none, then only a request without one matches). Constant time for strings of one length."""
    if held is None or given is None:
        return held is None and given is None
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(held.encode("utf-8"), given.encode("utf-8", "replace"))


def check_key(key) -> str:
    """``key`` if it is a key the wire carries (1..max_key_bytes UTF-8 bytes); TypeError or
    ValueError saying what was given otherwise."""
    if not isinstance(key, str):
        raise TypeError(f"key: expected str, got {type(key).__name__}")
    if not key or len(key.encode("utf-8")) > DEFAULT_LIMITS.max_key_bytes:
        raise ValueError(
            f"key: expected 1..{DEFAULT_LIMITS.max_key_bytes} UTF-8 bytes, got {len(key)} chars"
        )
    return key


@dataclass(frozen=True)
class Part:
    """One slice of one tensor of an entry: ``tensor.narrow(dim, start, stop - start)``.

    A GET may ask for a part (a consumer rank that holds some of the producer rank's KV heads
    loads only those). The server sends that slice and every other tensor of the entry whole; the
    entry counts as delivered once its parts cover the whole dim. Example: an entry whose ``"kv"``
    is ``[2, 3, 4, 2]`` with heads on dim 2 is claimed after ``Part("kv", 2, 0, 2)`` and
    ``Part("kv", 2, 2, 4)`` were both delivered, by one consumer or two.
    """

    tensor: str
    dim: int
    start: int
    stop: int

    def meta(self) -> dict:
        """The GET meta fields that ask for this part."""
        return dict(zip(PART_FIELDS, (self.tensor, self.dim, self.start, self.stop), strict=True))

    @staticmethod
    def from_meta(meta: dict) -> Part | None:
        """The part a GET's meta asks for; None for the whole entry; ValueError if malformed."""
        if not any(f in meta for f in PART_FIELDS):
            return None
        name, dim, start, stop = (meta.get(f) for f in PART_FIELDS)
        ints = all(type(v) is int for v in (dim, start, stop))
        if not isinstance(name, str) or not ints or not 0 <= start < stop:
            raise ValueError(
                "GET part: expected part_tensor (str) and ints part_dim, part_start < part_stop, "
                f"got {name!r}, {dim!r}, {start!r}, {stop!r}"
            )
        return Part(name, dim, start, stop)

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        """ValueError unless ``tensors`` has this part's tensor with this dim and range."""
        t = tensors.get(self.tensor)
        if t is None or not 0 <= self.dim < t.dim() or self.stop > t.shape[self.dim]:
            shape = None if t is None else tuple(t.shape)
            raise ValueError(
                f"GET part: tensor {self.tensor!r} of shape {shape} has no dim {self.dim} range "
                f"[{self.start}, {self.stop})"
            )

    def cut(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` with this part's tensor replaced by its slice (a contiguous copy), the
        others as they are (call :meth:`check` first)."""
        out = dict(tensors)
        sliced = out[self.tensor].narrow(self.dim, self.start, self.stop - self.start)
        out[self.tensor] = sliced.contiguous()
        return out
