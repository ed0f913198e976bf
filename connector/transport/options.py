"""What a pipe is carried over and how it is tuned: :data:`TRANSPORTS` and :class:`PipeOptions`.

Transports: ``gloo`` and ``nccl`` move payloads on a 2-rank torch.distributed process group
(``nccl`` for CUDA tensors), ``socket`` inline on the control connection itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .frame import DEFAULT_LIMITS, FrameLimits

TRANSPORTS = ("gloo", "nccl", "socket")


def default_transport(device: str | torch.device) -> str:
    """``nccl`` for CUDA tensors, ``gloo`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def device_uuid(device: str | torch.device) -> str:
    """The UUID of a CUDA device (``"GPU-..."``, as ``nvidia-smi -L`` shows it), else ``""``:
    what two ends compare to tell that they share one GPU (NCCL refuses two ranks on one)."""
    device = torch.device(device)
    if device.type != "cuda":
        return ""
    index = torch.cuda.current_device() if device.index is None else device.index
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


def check_transport(transport: str) -> str:
    """``transport`` if it is one of :data:`TRANSPORTS`, else ValueError naming them."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: expected one of {TRANSPORTS}, got {transport!r}")
    return transport


def check_timeout(name: str, value: float | None, allow_none: bool = False) -> float | None:
    """``value`` as seconds (float) if it is a positive number (or None where allowed), else
    ValueError naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class PipeOptions:
    """Tunables of one :class:`~connector.transport.pipe.TensorPipe`, validated when built.

    Attributes:
        limits: What this end accepts from its peer (announced in the handshake).
        max_inflight_bytes: Payload bytes queued or in flight before ``send`` blocks.
        send_timeout_s: Default deadline of ``send`` (waiting for the in-flight budget).
        recv_timeout_s: Default deadline of ``recv``.
        io_timeout_s: Deadline of one payload write or read, and of ``flush``.
        frame_timeout_s: Deadline of the rest of a frame once its first byte arrived.
        dead_grace_s: How long a broken data link may lag the control socket's EOF.
        close_timeout_s: How long ``close`` waits for queued messages to leave.
        inline_max_bytes: Payloads up to this size travel inline on the control socket.
        pack_max_bytes: Tensors up to this size travel packed in one chunk.
        max_queued_frames: Received messages held before the reader stops reading.
        max_queued_bytes: Received inline payload bytes held before the reader stops reading.
        max_payload_bytes: The most payload bytes a received header may announce from the
            first frame on (None: only ``limits``; 0 for a server whose requests carry none);
            :meth:`~connector.transport.pipe.TensorPipe.expect_payload` changes it later.
    """

    limits: FrameLimits = DEFAULT_LIMITS
    max_inflight_bytes: int = 1 << 30
    send_timeout_s: float = 30.0
    recv_timeout_s: float = 30.0
    io_timeout_s: float = 60.0
    frame_timeout_s: float = 10.0
    dead_grace_s: float = 1.0
    close_timeout_s: float = 5.0
    inline_max_bytes: int = 64 << 10
    pack_max_bytes: int = 1 << 20
    max_queued_frames: int = 64
    max_queued_bytes: int = 64 << 20
    max_payload_bytes: int | None = None

    def __post_init__(self):
        if not isinstance(self.limits, FrameLimits):
            raise TypeError(f"limits: expected FrameLimits, got {type(self.limits).__name__}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s"):
                object.__setattr__(self, f.name, check_timeout(f.name, value))
            elif f.name == "max_payload_bytes":
                if value is not None and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 0
                ):
                    raise ValueError(f"{f.name}: expected an int >= 0 or None, got {value!r}")
            elif f.name != "limits" and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0
            ):
                raise ValueError(f"{f.name}: expected a positive int, got {value!r}")

    def replace(self, **changes) -> PipeOptions:
        """A copy with ``changes`` (field names; TypeError for others)."""
        return dataclasses.replace(self, **changes)


DEFAULT_OPTIONS = PipeOptions()


def check_options(options: PipeOptions | None) -> PipeOptions:
    """``options``, or the defaults for None; TypeError for anything else."""
    if options is None:
        return DEFAULT_OPTIONS
    if not isinstance(options, PipeOptions):
        raise TypeError(f"options: expected PipeOptions, got {type(options).__name__}")
    return options
