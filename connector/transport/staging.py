"""Device tensors over the transports that carry host memory (gloo, socket): their bytes move
between the device and pinned host buffers in pieces of at most :data:`PIECE_BYTES`, on streams of
ours, overlapped with the network.

- Sending (:func:`to_host_pieces`): piece k+1 is copied to the host while piece k is
  on the wire. The copies wait for the event the sender recorded on the caller's stream when the
  message was queued (:meth:`DeviceCopies.ready`), so they read what the caller's stream wrote.
- Receiving (:func:`to_device_pieces`): piece k is copied to the device while piece k+1 arrives;
  the copies wait for the caller's stream as it was when the receive began, so they never race
  what it still does with ``out``. The receive returns once every copy completed.

Two pinned buffers per chunk in flight (from :data:`~connector.transport.buffers.STAGING_POOL`),
each refilled only after the copy or the send that used it completed. Events are polled, never
waited on without a deadline (CUDA has no timed wait): a copy that does not complete within the
transfer's deadline raises TimeoutError, and the buffers and tensors it may still touch are kept
for good (:data:`QUARANTINE`, logged) rather than handed out again.

:func:`copies_for` is the one place that decides which tensors are staged (CUDA tensors); a test
replaces it by a stand-in that treats CPU tensors as device tensors and performs each copy only
when its event is waited on (tests/support/fake_copies.py), so a piece sent or read before its
copy completed shows as wrong bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from ..logs import get_logger
from .buffers import staging_buffer
from .frame import pieces

log = get_logger("transport")

POLL_S = (0.00005, 0.002)  # first and longest sleep between two polls of an event
#: What a copy that never completed may still read or write: kept, never handed out again.
QUARANTINE: list[torch.Tensor] = []


class DeviceCopies:
    """Copies between one CUDA device and pinned host memory on two streams of ours (one per
    direction, shared by every pipe of the process), each copy ordered by events."""

    def __init__(self, device: torch.device):
        self.device = device
        self._to_host = torch.cuda.Stream(device)
        self._to_device = torch.cuda.Stream(device)

    def ready(self):
        """An event recorded now on the calling thread's current stream of this device."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after) -> object:
        """Copy ``src`` into ``dst`` (uint8, same size, one of them on the host) on the stream of
        that direction once ``after`` (an event or None) completed; returns the copy's event."""
        stream = self._to_host if dst.device.type == "cpu" else self._to_device
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    def wait(self, event, deadline: float, what: str) -> None:
        """Poll ``event`` until it completed; TimeoutError naming ``what`` at ``deadline``."""
        sleep = POLL_S[0]
        while not event.query():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out waiting for the staging copy of {what}")
            time.sleep(sleep)
            sleep = min(2 * sleep, POLL_S[1])


_COPIES: dict[torch.device, DeviceCopies] = {}


def copies_for(device: torch.device) -> DeviceCopies | None:
    """The staging copies of ``device``'s tensors, or None for host memory (nothing to stage)."""
    if device.type != "cuda":
        return None
    dev = torch.device(
        "cuda", torch.cuda.current_device() if device.index is None else device.index
    )
    copies = _COPIES.get(dev)
    if copies is None:
        copies = _COPIES.setdefault(dev, DeviceCopies(dev))
    return copies


def _settle(copies, events: list, deadline: float, what: str, keep: list[torch.Tensor]) -> None:
    """Wait for the copies still in flight (after a failure) before their buffers go back; those
    that do not complete by ``deadline`` (+1 s) leave ``keep`` in :data:`QUARANTINE`."""
    try:
        for ev in events:
            if ev is not None:
                copies.wait(ev, max(deadline, time.monotonic()) + 1.0, what)
    except Exception:
        QUARANTINE.extend(keep)
        log.error("a staging copy of %s never completed: %d buffers kept for good", what, len(keep))


def copy_all(
    copies, pairs: list[tuple[torch.Tensor, torch.Tensor]], after, deadline: float, what: str
) -> None:
    """Copy each ``(dst, src)`` pair (uint8, same size) on ``copies``' streams after ``after``
    (``copies`` None: at once, on the calling thread's stream); returns once all completed."""
    if copies is None:
        for dst, src in pairs:
            dst.copy_(src)
        return
    pending = [copies.copy(dst, src, after) for dst, src in pairs]
    for i, ev in enumerate(pending):
        try:
            copies.wait(ev, deadline, what)
        except BaseException:
            _settle(copies, pending[i:], deadline, what, [t for pair in pairs for t in pair])
            raise


def _two_buffers(plan: list[tuple[int, int]]) -> tuple[list, list]:
    """The staging buffers of a piece plan (the second one only for two pieces or more) and
    the events of the copies that use them (none yet)."""
    size = plan[0][1]
    return [staging_buffer(size), staging_buffer(size) if len(plan) > 1 else None], [None, None]


def to_host_pieces(
    copies, src: torch.Tensor, after, deadline: float, what: str
) -> Iterator[torch.Tensor]:
    """``src`` (uint8, 1-D, on the device) as host pieces in :func:`~.frame.pieces` order. The
    copy of the next piece is issued before a piece is yielded, so it runs while the caller sends
    this one; a piece's buffer is refilled only after the caller asked for the piece after next
    (it has sent that piece by then)."""
    plan = pieces(src.numel())
    if not plan:
        return
    bufs, events = _two_buffers(plan)

    def issue(k: int) -> None:
        off, n = plan[k]
        events[k % 2] = copies.copy(bufs[k % 2][:n], src[off : off + n], after)

    done = False
    issue(0)
    try:
        for k, (_, n) in enumerate(plan):
            if k + 1 < len(plan):
                issue(k + 1)
            copies.wait(events[k % 2], deadline, what)
            events[k % 2] = None
            yield bufs[k % 2][:n]
        done = True
    finally:
        if not done:
            _settle(copies, events, deadline, what, [b for b in bufs if b is not None] + [src])


def to_device_pieces(
    copies,
    dst: torch.Tensor,
    after,
    receive: Callable[[torch.Tensor], None],
    deadline: float,
    what: str,
) -> None:
    """Fill ``dst`` (uint8, 1-D, on the device) in :func:`~.frame.pieces` order: ``receive``
    fills each host piece from the network, then the piece is copied to the device (after
    ``after``) while the next one arrives; a buffer is refilled only once its copy completed.
    Returns once every copy completed."""
    plan = pieces(dst.numel())
    if not plan:
        return
    bufs, events = _two_buffers(plan)
    done = False
    try:
        for k, (off, n) in enumerate(plan):
            j = k % 2
            if events[j] is not None:  # the copy out of this buffer, two pieces ago
                copies.wait(events[j], deadline, what)
                events[j] = None
            receive(bufs[j][:n])
            events[j] = copies.copy(dst[off : off + n], bufs[j][:n], after)
        last = len(plan) - 1
        for j in ((last + 1) % 2, last % 2):  # in the order they were issued
            if events[j] is not None:
                copies.wait(events[j], deadline, what)
                events[j] = None
        done = True
    finally:
        if not done:
            _settle(copies, events, deadline, what, [b for b in bufs if b is not None] + [dst])
