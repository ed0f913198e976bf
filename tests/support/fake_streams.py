"""A stand-in for :class:`connector.streams.StreamOps` on CPU tensors, and an
audit of host reads of "device" tensors, so that the worker sides' GPU path (launch, events,
publication after completion) runs and is checked without a GPU.

:class:`FakeStreams` records which stream waited for which event; its events complete when the
test says so (:meth:`FakeStreams.complete_all`), so a test sees what happens before and after.
Tensors it allocates, and the registered caches, are "device" tensors: :func:`no_host_reads`
fails on any ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool()``, ``int()`` or
``float()`` of one, on any host read of digests (``digests_hex``), and on any stream or event
synchronisation, while it is active (what ``torch.cuda.set_sync_debug_mode("error")`` checks on
a GPU, and stricter: it also sees reads that stall without a CUDA sync call).
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch


class FakeEvent:
    def __init__(self, streams: FakeStreams, stream: FakeStream):
        self.streams, self.stream = streams, stream
        self.completed = streams.auto_complete or stream.instant

    def query(self) -> bool:
        return self.completed

    def synchronize(self):
        self.streams.violations.append("Event.synchronize")


class FakeStream:
    def __init__(self, streams: FakeStreams, name: str, instant: bool = False):
        self.streams, self.name, self.instant = streams, name, instant
        self.waited: list[FakeEvent] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)

    def synchronize(self):
        self.streams.violations.append(f"Stream.synchronize ({self.name})")

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeStreams:
    """StreamOps' interface on CPU tensors (see the module docstring)."""

    def __init__(self, auto_complete: bool = False):
        self.auto_complete = auto_complete
        self.device = torch.device("cpu")
        self.vllm = FakeStream(self, "vllm")
        self.side = FakeStream(self, "side")
        self.events: list[FakeEvent] = []
        self.device_storages: set[int] = set()
        self.violations: list[str] = []
        self._held: list[torch.Tensor] = []
        self._lock = threading.Lock()

    # the StreamOps interface
    def current(self):
        return self.vllm

    def new_stream(self):
        # the publisher's copies to the host: their events complete at once (the tests hold
        # back the packs', which these follow)
        return FakeStream(self, "copy", instant=True)

    def bind_thread(self) -> None:
        pass

    def use(self, stream):
        return contextlib.nullcontext()

    def event(self, stream):
        ev = FakeEvent(self, stream)
        with self._lock:
            self.events.append(ev)
        return ev

    def empty(self, shape, dtype):
        return self.on_device(torch.empty(shape, dtype=dtype))

    # for tests
    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """Count ``t``'s memory as device memory (returns ``t``); ``t`` is kept, so that its
        address is not reused for a host tensor while the test runs."""
        self.device_storages.add(t.untyped_storage().data_ptr())
        self._held.append(t)
        return t

    def is_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.device_storages

    def complete_all(self) -> None:
        """Every event recorded so far completes (the GPU caught up)."""
        with self._lock:
            for ev in self.events:
                ev.completed = True

    def pending(self) -> int:
        return sum(not ev.completed for ev in self.events)


_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


def _from_triton_interpreter() -> bool:
    """Whether the read comes from Triton's interpreter (it runs the kernels on the host: on a
    GPU there is no such read)."""
    name = sys._getframe(2).f_globals.get("__name__", "")
    return name == "triton" or name.startswith("triton.")


@contextlib.contextmanager
def no_host_reads(fake: FakeStreams, modules=()):
    """Record a violation for each host read of a device tensor of ``fake`` (see the module
    docstring) while active, and register as device tensors the results of ``pack_kv``,
    ``unpack_kv``, ``tensor_digest``, ``segment_digests`` and ``kv_digest`` as the ``modules``
    given call them (by their names in those modules)."""
    patches = []

    def patch(owner, name, value):
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for meth in _READS:
        real = getattr(torch.Tensor, meth)

        def check(t, *a, _real=real, _meth=meth, **kw):
            if fake.is_device(t) and not _from_triton_interpreter():
                caller = sys._getframe(1)
                fake.violations.append(
                    f"Tensor.{_meth} of a device tensor at "
                    f"{caller.f_code.co_filename}:{caller.f_lineno}"
                )
            return _real(t, *a, **kw)

        patch(torch.Tensor, meth, check)

    def digests_read(*a, **kw):
        caller = sys._getframe(1)
        fake.violations.append(
            f"digests read on the host at {caller.f_code.co_filename}:{caller.f_lineno}"
        )
        return real_hex(*a, **kw)

    import tritonkv.digest

    real_hex = tritonkv.digest.digests_hex
    for mod in (tritonkv.digest, *modules):
        if hasattr(mod, "digests_hex"):
            patch(mod, "digests_hex", digests_read)
    patch(torch.cuda, "synchronize", lambda *a, **k: fake.violations.append("cuda.synchronize"))

    def registering(fn):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor):
                    fake.on_device(t)
            return out

        return wrapped

    for mod in modules:
        for name in ("pack_kv", "unpack_kv", "tensor_digest", "segment_digests", "kv_digest"):
            if hasattr(mod, name):
                patch(mod, name, registering(getattr(mod, name)))
    try:
        yield fake.violations
    finally:
        for owner, name, value in reversed(patches):
            setattr(owner, name, value)


def gpu_busy(stream) -> torch.cuda.Event:
    """An event behind about a second of GPU time queued on CUDA ``stream`` now: a call that
    returns before it completes did not wait for the stream (a sync, or a copy from pageable
    memory, would have)."""
    torch.cuda._sleep(2_000_000_000)
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev
