"""The exceptions of the transport: one family, every error a :class:`TransferError` that names
the peer, the key and the time waited where known. The KV store's own errors derive from it
(:mod:`connector.kvstore.errors`)."""

from __future__ import annotations

import copy

#: The most characters of an exception's text that go into an ERROR frame or a log line.
MAX_ERROR_TEXT = 2000


def error_text(exc: BaseException | str) -> str:
    """``exc``'s message cut to :data:`MAX_ERROR_TEXT` characters (for ERROR frames and logs)."""
    return str(exc)[:MAX_ERROR_TEXT]


class TransferError(RuntimeError):
    """Base of every transport error. ``peer``, ``key`` and ``waited_s`` are set when known."""

    def __init__(
        self,
        msg: str,
        *,
        peer: str | None = None,
        key: str | None = None,
        waited_s: float | None = None,
    ):
        self.detail = msg
        self.peer = peer
        self.key = key
        self.waited_s = waited_s
        super().__init__(self._format())

    def _format(self) -> str:
        parts = [self.detail]
        if self.peer is not None:
            parts.append(f"peer={self.peer}")
        if self.key is not None:
            parts.append(f"key={self.key!r}")
        if self.waited_s is not None:
            parts.append(f"waited={self.waited_s:.3f}s")
        return " | ".join(parts)

    def with_context(
        self, *, peer: str | None = None, key: str | None = None, waited_s: float | None = None
    ) -> TransferError:
        """A copy of this error (same type) with peer / key / waited filled in or replaced."""
        new = copy.copy(self)
        new.peer = peer if peer is not None else self.peer
        new.key = key if key is not None else self.key
        new.waited_s = waited_s if waited_s is not None else self.waited_s
        new.args = (new._format(),)
        return new


class TransferTimeout(TransferError):
    """A deadline expired (the pipe that timed out is closed: a late reply cannot desync it)."""


class PeerDeadError(TransferError):
    """The peer went away: socket closed or reset without a goodbye, or its data link broke."""


class PipeClosedError(TransferError):
    """The pipe was closed, locally or by the peer's goodbye."""


class ProtocolError(TransferError):
    """Bytes on the wire broke the format: bad magic/version/kind, bad or oversized header."""


class PayloadAuthError(ProtocolError):
    """A process-group payload failed its authentication (:mod:`tritonkv.umac`): its bytes are
    not what the peer sent (changed, reordered, cut short or another transfer's)."""


class RemoteError(TransferError):
    """The peer answered with an ERROR frame (its message is included)."""


_DEAD_WORDS = (
    "closed by peer",
    "connection reset",
    "pair closure",
    "broken pipe",
    "connection refused",
    "end of file",
    "eof",
)


def classify_failure(
    exc: BaseException, *, peer: str, key: str | None, waited: float
) -> TransferError:
    """A process-group or socket failure as the transport's error: ``exc`` itself if it is a
    :class:`TransferError`, else :class:`TransferTimeout` for a timeout, :class:`PeerDeadError`
    for a closed or reset connection (torch and gloo say so only in their messages, hence the
    words), else :class:`TransferError` naming the exception's type."""
    if isinstance(exc, TransferError):
        return exc
    text = str(exc)
    low = text.lower()
    first_line = text.splitlines()[0][:200] if text else ""
    if isinstance(exc, TimeoutError) or "timed out" in low or "timeout" in low:
        return TransferTimeout(
            f"data transfer timed out ({first_line})", peer=peer, key=key, waited_s=waited
        )
    if isinstance(exc, ConnectionError) or any(w in low for w in _DEAD_WORDS):
        return PeerDeadError(
            f"peer connection broke ({first_line})", peer=peer, key=key, waited_s=waited
        )
    return TransferError(
        f"data transfer failed: {type(exc).__name__}: {text[:300]}",
        peer=peer,
        key=key,
        waited_s=waited,
    )
