"""A stand-in for :class:`connector.transport.staging.DeviceCopies` that treats CPU tensors as
device tensors, so that a pipe's staging (pieces, double buffering, event order) runs on this
CPU machine.

Copies behave as on a stream: each is queued and performed only when its event, or a later
one, is waited on; at issue time its destination is overwritten with a sentinel. So a piece sent
before its copy to the host completed, a staging buffer refilled before its copy to the device
ran, or a tensor read before the receive's copies completed, all show as wrong bytes. The
:attr:`FakeCopies.log` lists ``("copy", n)``, ``("wait", n)`` (n: the copy's number) and what the
test adds (``("recv", nbytes)``), in order.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from connector.transport import staging

SENTINEL = 0xA5


class FakeEvent:
    def __init__(self, number: int, after):
        self.number, self.after, self.done = number, after, False


class FakeCopies:
    def __init__(self):
        self.log: list[tuple[str, int]] = []
        self.pending: list[tuple[FakeEvent, torch.Tensor, torch.Tensor]] = []
        self.readies: list[FakeEvent] = []
        self.copies_after: list = []  # the `after` of each copy
        self.fail_waits = False  # a copy that never completes
        self._lock = threading.Lock()
        self._n = 0

    def ready(self):
        ev = FakeEvent(-1 - len(self.readies), None)
        ev.done = True
        self.readies.append(ev)
        return ev

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after):
        assert dst.dtype == src.dtype == torch.uint8 and dst.numel() == src.numel()
        with self._lock:
            ev = FakeEvent(self._n, after)
            self._n += 1
            self.log.append(("copy", ev.number))
            self.copies_after.append(after)
            dst.fill_(SENTINEL)
            self.pending.append((ev, dst, src))
        return ev

    def wait(self, event: FakeEvent, deadline: float, what: str) -> None:
        if self.fail_waits:
            raise TimeoutError(f"timed out waiting for the staging copy of {what}")
        with self._lock:
            self.log.append(("wait", event.number))
            while not event.done:  # stream order: everything queued before it runs first
                ev, dst, src = self.pending.pop(0)
                dst.copy_(src)
                ev.done = True

    def note(self, what: str, n: int) -> None:
        with self._lock:
            self.log.append((what, n))


@contextlib.contextmanager
def staged_cpu_tensors(monkeypatch):
    """While active, every CPU tensor a pipe sends or receives (gloo, socket) is staged through
    one :class:`FakeCopies`, which this yields."""
    fake = FakeCopies()
    monkeypatch.setattr(staging, "copies_for", lambda device: fake)
    yield fake
