"""The KV store's errors: transport errors (:class:`~connector.transport.TransferError`, naming
the peer, the key and the time waited where known) that only a KV buffer, its server or its
client raise."""

from __future__ import annotations

from ..transport import TransferError, TransferTimeout

__all__ = ["BufferFullError", "ClientBusyError", "KeyMissError"]


class KeyMissError(TransferError):
    """The producer does not hold the key; ``reason`` says why (never put, claimed, evicted...)."""

    def __init__(self, msg: str, *, reason: str = "unknown", **kw):
        super().__init__(f"{msg} (reason: {reason})", **kw)
        self.reason = reason


class BufferFullError(TransferError):
    """The KV buffer could not make room for an entry within the put deadline."""


class ClientBusyError(TransferTimeout):
    """A client's other requests held it past this one's deadline (nothing was sent: the peer may
    be fine)."""
