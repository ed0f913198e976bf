"""The transfer's integrity digest, end to end (``digest`` and ``digest_write_back`` options).

The producer's pack computes the digest of the packed KV in its copy (:mod:`tritonkv.digest`) and
stores it in the entry's meta (:func:`entry_meta`): ``kv_digest`` for the whole entry and, for
token rows of more than one head, ``kv_head_digests``, one per head, since a consumer of another
TP size loads a slice of the heads and checks each of its heads apart (:func:`expected`). An
entry whose pack computed its NH (:func:`tritonkv.nh_in_copy`) has no ``kv_digest``: every whole
delivery of it is checked against that NH (its payload's tag, or the KV server's check before an
inline send), which covers the same bytes under a key. The consumer's unpack computes the digest
of what it read (:func:`check_read`); with ``digest_write_back`` the slots just written are read
again through slots derived anew from the block table (:func:`check_write_back`). A mismatch
raises :class:`DigestMismatch`, which the consumer turns into a failed load (recomputed, warned
once, counted). An entry without a digest (a producer with ``digest`` off) is loaded unchecked.

A hidden-state entry (``extract_hidden_states``) carries one digest per tensor
(:data:`HIDDEN_DIGEST_KEYS`, :func:`hidden_meta`), of each request's own tensors; its readers
check them on receipt (:func:`check_hidden`).

Test hooks (``debug_allow_corrupt`` only): a request's ``"tritonkv_debug_fault"`` param, a
comma-separated list of :data:`FAULTS`, injects faults the digest must catch (:func:`faults`).
No vLLM import.
"""

from __future__ import annotations

import torch

from tritonkv import kv_digest
from tritonkv.digest import digests_hex, head_digests, tensor_digest

from .transport import pinned_host

DIGEST_KEY = "kv_digest"  # entry meta: 16 hex digits of the whole packed KV
HEAD_DIGESTS_KEY = "kv_head_digests"  # entry meta: 16 hex digits per head, concatenated
# (token rows, > 1 head; meta values are scalars)
HEX_LEN = 16

Expected = str | list[str] | None  # whole-entry digest, per-head digests of a slice, or none


# flip_bit (producer): one bit of the saved entry flips after the digest was taken (flip_bit);
# wrong_slot (consumer): every loaded row is written one slot on (an off-by-one slot mapping);
# no_digest (consumer): this load is not checked (the switch off, for the negative control).
# alloc_fail (either): the device allocation of this transfer fails as out of memory would.
# short_window (consumer): a sliding-window group's first loaded block stays unwritten (a window
# one block short).
# state_after_last (producer): a model with state groups computes the whole prompt, so its state
# is h(N), one token late (the boundary shifted by one).
FAULTS = ("flip_bit", "wrong_slot", "no_digest", "alloc_fail", "short_window", "state_after_last")


def faults(params, allowed: bool) -> str:
    """The ``tritonkv_debug_fault`` of a request's ``params`` (``""``: none, or not ``allowed``);
    unknown names are ignored."""
    value = params.get("tritonkv_debug_fault") if allowed and isinstance(params, dict) else None
    if not isinstance(value, str):
        return ""
    return ",".join(f for f in value.split(",") if f in FAULTS)


def flip_bit(packed: torch.Tensor) -> None:
    """Flip one bit of ``packed``, in place: the top exponent bit of a float in the first row of
    the first layer (prompt position 0, or the first block's page: always loaded), one whose
    magnitude is in ``[1, 2)`` where there is one, so that it becomes inf or NaN and the answer
    must change if it lands (else that of the largest one; a byte's top bit but one for
    integer caches)."""
    row = packed[0, 0, 0].reshape(-1)
    if not row.dtype.is_floating_point or row.element_size() not in (2, 4, 8):
        row.view(torch.uint8)[row.numel() * row.element_size() // 2] ^= 0x40
        return
    magnitude = row.detach().abs().float().nan_to_num(0.0)
    in_range = ((magnitude >= 1) & (magnitude < 2)).nonzero()
    at = int(in_range[0]) if in_range.numel() else int(magnitude.argmax())
    row[at : at + 1].view(torch.uint8)[-1] ^= 0x40  # little-endian: the last byte holds the
    # sign and the top exponent bits


def shifted_slots(slots: torch.Tensor, first: int, stop: int) -> torch.Tensor:
    """``slots`` with row ``p`` of ``[first, stop - 1)`` sent to row ``p + 1``'s slot and row
    ``stop - 1`` not written: a slot mapping off by one (row ``first``'s slot keeps stale KV)."""
    out = slots.clone()
    out[first : stop - 1] = slots[first + 1 : stop]
    out[stop - 1] = -1
    return out


# what each check compares the producer's digest with
_SEEN = {
    "read": "this consumer read",
    "write-back": "this consumer finds in its cache",
    "receipt": "this reader received",  # hidden states over the network (connector.hidden.reader)
    "write": "the file writer was given",  # hidden states, before a file's rename
    "file": "the file holds",  # hidden states, read back from a file
}


class DigestMismatch(ValueError):
    """A transfer's bytes differ from what the producer packed (``check``: which check;
    ``subject``: what the message starts with, e.g. which request's)."""

    def __init__(self, check: str, sent: str, got: str, what: str = "KV", subject: str = ""):
        self.check = check
        super().__init__(
            f"{subject}digest check {check!r} failed: the producer packed {what} with digest "
            f"{sent}, {_SEEN[check]} {got}"
        )


def entry_meta(packed: torch.Tensor, digest: torch.Tensor | None, kv_format: str) -> dict:
    """The meta fields a producer stores with ``packed`` (``[num_layers, 1 or 2, rows, heads,
    head_size]``) whose pack returned ``digest`` (None: it computed none, the entry's NH checks
    it whole)."""
    digests = digest_tensors(packed, digest, kv_format)
    return {} if digests is None else meta_from_digests(digests, digest is not None)


def digest_tensors(
    packed: torch.Tensor, digest: torch.Tensor | None, kv_format: str
) -> torch.Tensor | None:
    """``[n, 2]`` int64 on ``packed``'s device, launched without a host synchronisation: the
    pack's ``digest`` of the whole entry (unless None), then, for token rows of more than one
    head, one digest per head (a consumer may load a slice of the heads); None if neither."""
    rows = [] if digest is None else [digest.unsqueeze(0)]
    if kv_format == "tokens" and packed.shape[3] > 1:  # one pass on the CPU (head_digests)
        rows.append(head_digests(packed))
    return torch.cat(rows) if rows else None


def meta_from_digests(digests: torch.Tensor, whole: bool = True) -> dict:
    """The meta fields of :func:`digest_tensors`' digests (read on the host: give a host copy
    on a GPU); ``whole``: whether the first is the whole entry's."""
    values = digests_hex(list(digests))
    meta = {DIGEST_KEY: values.pop(0)} if whole else {}
    if values:
        meta[HEAD_DIGESTS_KEY] = "".join(values)
    return meta


def expected(meta: dict, heads: tuple[int, int] | None) -> Expected:
    """What a load must match: the entry's digest (``heads`` None: the whole entry), the digests
    of heads ``heads[0] .. heads[1] - 1`` (a slice), or None when the producer sent none.

    Raises:
        ValueError: the meta's digest fields are malformed.
    """
    if heads is None:
        value = meta.get(DIGEST_KEY)
        if value is not None and not _is_hex(value):
            raise ValueError(f"entry's {DIGEST_KEY} is malformed: {value!r}")
        return value
    joined = meta.get(HEAD_DIGESTS_KEY)
    if joined is None:
        return None
    if not isinstance(joined, str) or len(joined) % HEX_LEN:
        raise ValueError(f"entry's {HEAD_DIGESTS_KEY} is malformed")
    values = [joined[i : i + HEX_LEN] for i in range(0, len(joined), HEX_LEN)]
    if not all(_is_hex(v) for v in values):
        raise ValueError(f"entry's {HEAD_DIGESTS_KEY} is malformed")
    if not 0 <= heads[0] < heads[1] <= len(values):
        raise ValueError(f"entry has {len(values)} head digests, the load wants heads {heads}")
    return values[heads[0] : heads[1]]


def _is_hex(value) -> bool:
    return (
        isinstance(value, str)
        and len(value) == HEX_LEN
        and all(c in "0123456789abcdef" for c in value)
    )


def read_digests(want: Expected, packed: torch.Tensor, read: torch.Tensor | None) -> torch.Tensor:
    """``[n, 2]`` int64 on ``packed``'s device, without a host synchronisation: what the unpack
    read (``read``: its digest, for a whole entry), or for a slice of heads (``want`` a list)
    the digest of each head of ``packed``."""
    if isinstance(want, str):
        return read.unsqueeze(0)
    return head_digests(packed)[: len(want)]


def write_back_digests(
    packed: torch.Tensor,
    views,
    block_ids: list[int],
    block_size: int,
    first: int,
    stop: int,
    offset: int = 0,
) -> torch.Tensor:
    """``[2, 2]`` int64 on ``packed``'s device, without a host synchronisation: the digest of
    the received rows of positions ``[first, stop)`` (row ``i`` is position ``offset + i``),
    then that of those positions read back from ``views`` through slots derived again from
    ``block_ids`` (not the slot mapping the unpack wrote through)."""
    slots = torch.tensor(
        [block_ids[p // block_size] * block_size + p % block_size for p in range(first, stop)],
        dtype=torch.int64,
    )
    sent = tensor_digest(packed[:, :, first - offset : stop - offset])
    return torch.stack(
        [sent, kv_digest(views, pinned_host(slots).to(packed.device, non_blocking=True))]
    )


def compare(check: str, want: Expected, digests: torch.Tensor, row: int) -> None:
    """Compare the digests of one check, rows ``row ..`` of ``digests`` (:func:`read_digests`
    for ``check`` ``"read"``, :func:`write_back_digests` for ``"write-back"``; on the host, or
    this reads them there), with ``want``. DigestMismatch if unlike."""
    if check == "write-back":
        sent, got = digests_hex(list(digests[row : row + 2]))
        if got != sent:
            raise DigestMismatch("write-back", sent, got)
        return
    if isinstance(want, str):
        got = digests_hex([digests[row]])[0]
        if got != want:
            raise DigestMismatch("read", want, got)
        return
    got = digests_hex(list(digests[row : row + len(want)]))
    for j, (sent, seen) in enumerate(zip(want, got, strict=True)):
        if seen != sent:
            raise DigestMismatch("read", sent, seen, what=f"head {j} of the slice")


def check_read(want: Expected, packed: torch.Tensor, read: torch.Tensor | None) -> None:
    """Compare what the unpack read (``read``: its digest, for a whole entry) with ``want``;
    for a slice of heads, each head of ``packed`` is digested here. DigestMismatch if unlike."""
    if want is not None:
        compare("read", want, read_digests(want, packed, read), 0)


def check_write_back(packed: torch.Tensor, *where) -> None:
    """:func:`write_back_digests` of ``where`` (its arguments after ``packed``), compared here.

    Raises:
        DigestMismatch: the cache does not hold those rows there (e.g. a wrong destination slot).
    """
    digests = write_back_digests(packed, *where)
    compare("write-back", None, digests, 0)


#: a hidden-state entry's digests, in its KV-buffer meta and in its file's safetensors header
#: (``__metadata__``, which readers of the tensors ignore): tensor name -> key of its 16 hex digits
HIDDEN_DIGEST_KEYS = {"hidden_states": "hidden_states_digest", "token_ids": "token_ids_digest"}


def hidden_meta(hidden_digest: str, token_ids_digest: str) -> dict[str, str]:
    """The digest fields of a hidden-state entry (16 hex digits each): its ``hidden_states``'
    digest, computed from the pack's output, and that of its ``token_ids``."""
    return {
        HIDDEN_DIGEST_KEYS["hidden_states"]: hidden_digest,
        HIDDEN_DIGEST_KEYS["token_ids"]: token_ids_digest,
    }


def check_hidden(meta: dict, tensors: dict[str, torch.Tensor], check: str, subject: str) -> None:
    """Compare each of ``tensors`` (on the host) whose digest ``meta`` holds with it; nothing to
    compare when ``meta`` holds none (a producer with ``digest`` off).

    Raises:
        DigestMismatch: a tensor differs from what the producer packed (``check``: which check,
            ``subject``: the message's start, naming the request).
        ValueError: a digest field is malformed.
    """
    for name, key in HIDDEN_DIGEST_KEYS.items():
        want = meta.get(key)
        if want is None or name not in tensors:
            continue
        if not _is_hex(want):
            raise ValueError(f"{subject}its {key} is malformed: {want!r:.40}")
        got = digests_hex([tensor_digest(tensors[name])])[0]
        if got != want:
            raise DigestMismatch(check, want, got, what=name, subject=subject)
