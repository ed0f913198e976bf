"""The transport: frames, authentication, the tensor pipe and its listener (no vLLM, no KV).

What other rooms use is exported here; the modules behind these names may move.
"""

from .connect import addresses_of, connect_pipe
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
from .listener import PipeListener
from .options import TRANSPORTS, PipeOptions, check_timeout, default_transport
from .pipe import Message, TensorPipe
from .sockio import send_error_frame

__all__ = [
    "DEFAULT_LIMITS",
    "TRANSPORTS",
    "BufferFullError",
    "ClientBusyError",
    "FrameLimits",
    "KeyMissError",
    "Kind",
    "Message",
    "PeerDeadError",
    "PipeClosedError",
    "PipeListener",
    "PipeOptions",
    "ProtocolError",
    "RemoteError",
    "TensorPipe",
    "TransferError",
    "TransferTimeout",
    "addresses_of",
    "check_timeout",
    "connect_pipe",
    "default_transport",
    "encode_header",
    "error_text",
    "send_error_frame",
    "spec_of",
]
