"""What one :class:`~connector.transport.pipe.TensorPipe` and its threads share (part of the pipe,
not exported): one condition, the error that broke the pipe, whether the peer is gone, counters."""

from __future__ import annotations

import collections
import threading

from .errors import PeerDeadError, PipeClosedError, TransferError


class _PipeState:
    """State of one pipe shared by its caller and its sender, reader and waiter threads.

    Every field is read and written under ``cond``, which is also what each of them waits on.

    Attributes:
        peer: ``"host:port"`` of the other end, for error messages.
        cond: The pipe's one condition.
        fatal: The first error that broke the pipe, or None.
        peer_gone: ``"bye"`` or ``"eof"`` once the reader saw the peer leave, else None.
        closing: ``close`` has begun.
        closed: ``close`` let go of the threads (the waiter ends on it).
        max_payload: The most payload bytes a received header may announce (None: only the
            limits); set by :meth:`~connector.transport.pipe.TensorPipe.expect_payload`.
        counters: ``msgs_sent``, ``bytes_sent``, ``msgs_received``, ``bytes_received``,
            ``send_timeouts``, ``recv_timeouts``.
    """

    def __init__(self, peer: str):
        self.peer = peer
        self.cond = threading.Condition()
        self.fatal: TransferError | None = None
        self.peer_gone: str | None = None
        self.closing = False
        self.closed = False
        self.max_payload: int | None = None
        self.counters: collections.Counter[str] = collections.Counter()

    def set_fatal(self, err: TransferError) -> None:
        """Break the pipe with ``err`` (the first error stays) and wake every waiter."""
        with self.cond:
            if self.fatal is None:
                self.fatal = err
            self.cond.notify_all()

    def raise_fatal(self, key: str | None = None) -> None:
        """Raise a fresh copy of the error that broke the pipe, if any."""
        f = self.fatal
        if f is None:
            return
        new = f.with_context(peer=self.peer, key=key)
        new.detail = f"pipe is broken: {f.detail}"
        new.args = (new._format(),)
        raise new

    def gone_error(self, key: str | None, waited: float) -> TransferError:
        """The error for a peer that left: PipeClosedError after its goodbye, else PeerDeadError."""
        if self.peer_gone == "bye":
            return PipeClosedError("peer closed the pipe", peer=self.peer, key=key, waited_s=waited)
        return PeerDeadError(
            "peer died (connection closed without goodbye)",
            peer=self.peer,
            key=key,
            waited_s=waited,
        )

    def check_usable(self, key: str | None, unread: bool) -> None:
        """Raise unless the pipe can still be used: not closed, not broken, and its peer still
        there or messages of it still ``unread``. Holds ``cond``."""
        if self.closing or self.closed:
            raise PipeClosedError("pipe is closed", peer=self.peer, key=key)
        self.raise_fatal(key)
        if self.peer_gone is not None and not unread:
            raise self.gone_error(key, 0.0)
