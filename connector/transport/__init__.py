"""The transport: frames, authentication, the tensor pipe and its listener (no vLLM, no KV).

What other rooms use is exported here, and they import it from here; the modules behind these
names may move.
"""

from . import auth
from .auth import MIN_SECRET_BYTES, SECRET_ENV, AuthError, is_loopback, load_secret
from .buffers import host_empty, pinned_host
from .connect import addresses_of, connect_pipe
from .errors import (
    PayloadAuthError,
    PeerDeadError,
    PipeClosedError,
    ProtocolError,
    RemoteError,
    TransferError,
    TransferTimeout,
    error_text,
)
from .frame import APP_KIND_MIN, DEFAULT_LIMITS, FrameLimits, Kind, encode_header, spec_of
from .listener import PipeListener
from .options import TRANSPORTS, PipeOptions, check_timeout, default_transport
from .pipe import Message, TensorPipe
from .receiving import EntryTag
from .sending import goes_inline
from .sockio import send_error_frame
from .threads import (
    name_current_thread,
    parse_cpus,
    pin_current_thread,
    set_transfer_cpus,
    transfer_thread,
)

__all__ = [
    "APP_KIND_MIN",
    "DEFAULT_LIMITS",
    "MIN_SECRET_BYTES",
    "SECRET_ENV",
    "TRANSPORTS",
    "AuthError",
    "EntryTag",
    "FrameLimits",
    "Kind",
    "Message",
    "PayloadAuthError",
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
    "auth",
    "check_timeout",
    "connect_pipe",
    "default_transport",
    "encode_header",
    "error_text",
    "goes_inline",
    "host_empty",
    "is_loopback",
    "load_secret",
    "name_current_thread",
    "parse_cpus",
    "pin_current_thread",
    "pinned_host",
    "send_error_frame",
    "set_transfer_cpus",
    "spec_of",
    "transfer_thread",
]
