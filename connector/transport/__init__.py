"""The transport: frames, authentication, the tensor pipe and its listener (no vLLM, no KV).

What other rooms use is exported here; the modules behind these names may move.
"""

from .errors import (
    BufferFullError,
    ClientBusyError,
    KeyMissError,
    PeerDeadError,
    PipeClosedError,
    ProtocolError,
    RemoteError,
    TransferError,
    TransferTimeout,
    error_text,
)
from .frame import DEFAULT_LIMITS, FrameLimits, Kind, encode_header, spec_of
from .pipe import Message, PipeListener, TensorPipe, check_timeout, connect_pipe, send_error_frame

__all__ = [
    "DEFAULT_LIMITS",
    "BufferFullError",
    "ClientBusyError",
    "FrameLimits",
    "KeyMissError",
    "Kind",
    "Message",
    "PeerDeadError",
    "PipeClosedError",
    "PipeListener",
    "ProtocolError",
    "RemoteError",
    "TensorPipe",
    "TransferError",
    "TransferTimeout",
    "check_timeout",
    "connect_pipe",
    "encode_header",
    "error_text",
    "send_error_frame",
    "spec_of",
]
