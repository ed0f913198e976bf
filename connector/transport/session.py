"""The framing of an authenticated session: every frame after the authentication carries a tag.

Once both ends authenticated (:mod:`connector.transport.auth`), each direction of the connection
has a key of its own (:func:`~connector.transport.auth.session_keys`) and a frame counter that
starts at 0. A frame then travels as::

    prefix | body | tag (16 bytes) [| inline payload | payload tag (16 bytes)]

    h           = HMAC-SHA256(key, counter (u64 LE) | prefix | body)
    tag         = first 16 bytes of h
    payload tag = first 16 bytes of h continued over the inline payload's bytes

The payload tag is there only when the header announces an inline payload of at least one byte.
The receiver checks the tag before it decodes the body (the prefix is checked first: it says
how many bytes to read, within the limits), and the payload tag before the message reaches
anyone. A rewritten byte, a frame spliced in from another session, one dropped, replayed or
reordered (the counter) fails the check: ProtocolError, and the connection is closed.

A payload on the process group is authenticated by :mod:`tritonkv.umac` (a keyed universal
hash, UMAC-style) instead: its 16-byte tag follows the header's tag on the socket::

    prefix | body | tag (16 bytes) | umac tag (16 bytes)      (payload on the process group)

    keys     = tritonkv.umac.transfer_keys(key, "pg payload" | counter (u64 LE))
    umac tag = tritonkv.umac.payload_tag(keys, the message's tensors in header order)

(a tensor marked ``TFLAG_ENTRY_NH`` in the header enters the PRF with its NH under its stored
entry's key instead, computed when it was packed: ``tritonkv.umac.entry_keys``, ``frame.py``)

so every frame's payload has keys of its own (the session's direction key is fresh per
connection, the counter unique within it), and the receiver checks the tag once the payload
arrived, before ``recv`` returns it (:class:`PayloadAuthError`, a ProtocolError: the connection
is closed). ``docs/authentication.md`` has the construction and its forgery bound.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading

from tritonkv import umac

from .errors import ProtocolError

TAG_BYTES = 16
_COUNTER = struct.Struct("<Q")
PAYLOAD_NONCE = b"pg payload"  # the umac nonce of a frame's payload: this, then its counter


class FrameMac:
    """The running MAC of one frame: its header tag, then its payload tag."""

    def __init__(self, key: bytes, counter: int, header: bytes):
        self._h = hmac.new(key, _COUNTER.pack(counter) + header, hashlib.sha256)
        self.counter = counter

    def header_tag(self) -> bytes:
        return self._h.copy().digest()[:TAG_BYTES]

    def update(self, payload) -> None:
        """Continue over payload bytes (bytes or a buffer), in the order they travel."""
        self._h.update(payload)

    def payload_tag(self) -> bytes:
        return self._h.digest()[:TAG_BYTES]

    def check_header(self, tag: bytes, what: str) -> None:
        if not hmac.compare_digest(tag, self.header_tag()):
            raise ProtocolError(_failed(what, self.counter))

    def check_payload(self, tag: bytes, what: str) -> None:
        if not hmac.compare_digest(tag, self.payload_tag()):
            raise ProtocolError(_failed(f"inline payload of {what}", self.counter))


def _failed(what: str, counter: int) -> str:
    return (
        f"frame authentication failed on {what} (frame {counter} of the session): rewritten, "
        "spliced, replayed or out of order; closing the connection"
    )


class Session:
    """One end's view of an authenticated session: the key and counter of each direction.

    ``sending(header)`` / ``receiving(header)`` start the MAC of the next frame of their direction
    (counters advance in call order: one writer and one reader at a time, as a pipe has; a lock
    keeps the counters whole if not).
    """

    def __init__(self, send_key: bytes, recv_key: bytes):
        self._send_key = send_key
        self._recv_key = recv_key
        self._sent = 0
        self._received = 0
        self._lock = threading.Lock()

    @classmethod
    def pair(cls, connector_to_listener: bytes, listener_to_connector: bytes, *, listener: bool):
        """The session of the listener's end (``listener=True``) or of the connector's."""
        if listener:
            return cls(listener_to_connector, connector_to_listener)
        return cls(connector_to_listener, listener_to_connector)

    def sending(self, header: bytes) -> FrameMac:
        with self._lock:
            counter, self._sent = self._sent, self._sent + 1
        return FrameMac(self._send_key, counter, header)

    def receiving(self, header: bytes) -> FrameMac:
        with self._lock:
            counter, self._received = self._received, self._received + 1
        return FrameMac(self._recv_key, counter, header)

    def token(self, label: bytes) -> bytes:
        """16 bytes only this end of this session can make for ``label`` (its sending key)."""
        return hmac.new(self._send_key, label, hashlib.sha256).digest()[:TAG_BYTES]

    def peer_token_ok(self, label: bytes, token: bytes) -> bool:
        """Whether ``token`` is the peer's :meth:`token` for ``label`` (constant time)."""
        expected = hmac.new(self._recv_key, label, hashlib.sha256).digest()[:TAG_BYTES]
        return hmac.compare_digest(token, expected)

    def payload_keys(self, counter: int, *, sending: bool) -> umac.TransferKeys:
        """The :mod:`tritonkv.umac` keys of the process-group payload of frame ``counter`` of
        this end's sending (``sending=True``) or receiving direction."""
        key = self._send_key if sending else self._recv_key
        return umac.transfer_keys(key, PAYLOAD_NONCE + _COUNTER.pack(counter))

    def seal(self, header: bytes) -> bytes:
        """``header`` with its tag, for a frame without inline payload."""
        return header + self.sending(header).header_tag()
