"""What the workers' sides (KV and hidden states) need of a GPU: streams and events, and a budget of device memory.

vLLM calls ``wait_for_save``, ``start_load_kv`` and ``get_finished`` on its step. On CUDA none of
them waits for the GPU: work is ordered by events, and the tensors it uses are kept until its
event completes.

- The producer's pack waits for an event recorded on vLLM's stream (the forward pass wrote the
  KV), runs on :attr:`StreamOps.side`, and vLLM's stream waits for the pack's event before it
  runs anything later (which may overwrite the blocks). The entry is copied to pinned host
  memory and published by a thread of ours once the pack's event completed (:class:`Publisher`;
  the producer's KV entries and the hidden states of ``extract_hidden_states`` alike).
- The consumer's copy to the device and its unpack run on vLLM's stream before the forward pass
  (stream order puts attention after them); the received tensors are kept, and the digest
  checked on a host copy of it, once the unpack's event completed (:class:`Pending`).

Events are only ever polled (``query``), with a deadline: CUDA has no timed wait on an event.
:class:`StreamOps` is the one place that speaks ``torch.cuda``; a test replaces it by a
stand-in on CPU tensors (tests/support/fake_streams.py). :class:`DeviceBudget` counts
the device memory tritonkv takes outside vLLM's memory budget. No vLLM import.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .logs import get_logger
from .transport import host_empty, transfer_thread

log = get_logger("connector")

POLL_S = (0.0001, 0.001)  # first and longest sleep between two polls of an event

#: a rank's device memory budget when none is given (the ``gpu_memory_bytes`` default)
DEFAULT_BUDGET_BYTES = 1 << 30


class StreamOps:
    """``torch.cuda``'s streams and events for one CUDA device (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._side = None

    @property
    def side(self):
        """tritonkv's own stream on this device (made on first use)."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def new_stream(self):
        """Another stream of ours on this device."""
        return torch.cuda.Stream(self.device)

    def bind_thread(self) -> None:
        """Make this device the calling thread's current one (a new thread starts on GPU 0)."""
        torch.cuda.set_device(self.device)

    def current(self):
        """The calling thread's current stream on this device (vLLM's, on its step)."""
        return torch.cuda.current_stream(self.device)

    def use(self, stream):
        """Context making ``stream`` current (its allocations belong to it)."""
        return torch.cuda.stream(stream)

    def event(self, stream):
        """A new event recorded on ``stream`` now."""
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor on this device, from the current stream's pool."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def is_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is in this device's memory (a device-resident KV buffer's entry)."""
        return t.device == self.device


class HostOps:
    """The :class:`StreamOps` of a :class:`Publisher` whose jobs are host work done off vLLM's
    step (the CPU): no streams, no events, nothing to wait for."""

    def new_stream(self):
        return None

    def bind_thread(self) -> None:
        pass

    def use(self, stream):
        return contextlib.nullcontext()


def device_streams(device: torch.device) -> StreamOps | None:
    """The :class:`StreamOps` of caches on ``device``: CUDA's, or None (the CPU needs none)."""
    return StreamOps(device) if device.type == "cuda" else None


def wait_events(events, deadline: float) -> bool:
    """Poll ``events`` until every one completed (True) or ``deadline`` (``time.monotonic``)
    passed (False). Never a host synchronisation: ``query`` only."""
    pause = POLL_S[0]
    while not all(ev.query() for ev in events):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, POLL_S[1])
    return True


@dataclass
class Pending:
    """GPU work in flight: ``event`` completes after it; ``keep`` holds the tensors it uses, so
    that none is freed (and reused) under a running copy; ``reserved`` device bytes of the
    :class:`DeviceBudget` it holds until then."""

    event: object
    keep: tuple = ()
    reserved: int = 0
    started: float = field(default_factory=time.perf_counter)

    def done(self) -> bool:
        return self.event is None or self.event.query()


class DeviceBudgetExceeded(MemoryError):
    """An allocation that would take tritonkv's device memory past its budget (refused before
    allocating: that one transfer fails, vLLM recomputes)."""


class DeviceBudget:
    """Device bytes tritonkv may hold outside vLLM's memory budget (``gpu_memory_bytes``): pack
    scratch until its entry reached the host or the buffer, and the consumer's device copies of
    received KV until their unpack completed. Thread-safe; a reservation is released explicitly
    once the work using it completed.

    Args:
        limit_bytes: the budget; an allocation past it raises :class:`DeviceBudgetExceeded`.
    """

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self.in_use = 0
        self.peak = 0
        self.refusals = 0

    def reserve(self, nbytes: int, what: str) -> int:
        """Take ``nbytes`` of the budget for ``what`` (returns ``nbytes``, to release later)."""
        with self._lock:
            self._refuse(nbytes, self.in_use, what)
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
        return nbytes

    def check_room(self, nbytes: int, what: str) -> None:
        """DeviceBudgetExceeded if ``nbytes`` could never fit the budget (memory taken outside
        it: a transport's receive on the device, bounded by the budget but not counted)."""
        with self._lock:
            self._refuse(nbytes, 0, what)

    def _refuse(self, nbytes: int, in_use: int, what: str) -> None:
        if in_use + nbytes > self.limit_bytes:
            self.refusals += 1
            raise DeviceBudgetExceeded(
                f"{what} needs {nbytes} bytes of GPU memory, {in_use} of "
                f"gpu_memory_bytes={self.limit_bytes} are in use: refused (raise "
                "gpu_memory_bytes, lowering --gpu-memory-utilization as the startup log says)"
            )

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.in_use -= nbytes

    def empty(self, ops, shape, dtype: torch.dtype, what: str, fail: bool = False):
        """``(tensor, reserved bytes)``: a tensor from ``ops.empty`` within the budget. ``fail``
        (the ``alloc_fail`` test hook): the allocation fails as a CUDA out-of-memory would."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.reserve(nbytes, what)
        try:
            if fail:
                raise torch.OutOfMemoryError(f"tritonkv test hook alloc_fail: {what}")
            return ops.empty(shape, dtype), nbytes
        except BaseException:
            self.release(nbytes)
            raise


def gpu_budget_line(device: torch.device, budget_bytes: int, buffer_bytes: int) -> str:
    """The startup line that tells an operator how much GPU memory tritonkv takes beside
    vLLM's budget (``buffer_bytes``: producer entries kept on the device, 0 for host ones)."""
    total = budget_bytes + buffer_bytes
    with contextlib.suppress(Exception):
        gpu = torch.cuda.get_device_properties(device).total_memory
        return (
            f"tritonkv will use up to {total / 2**30:.2f} GiB of GPU memory outside vLLM's "
            f"budget: lower --gpu-memory-utilization by {total / gpu:.3f} (gpu_memory_bytes "
            f"{budget_bytes}, device-resident KV buffer {buffer_bytes} bytes, of the GPU's "
            f"{gpu / 2**30:.1f} GiB; with transport nccl, NCCL's own buffers come on top)"
        )
    return (
        f"tritonkv will use up to {total / 2**30:.2f} GiB of GPU memory outside vLLM's budget: "
        f"lower --gpu-memory-utilization by that share of the GPU's memory"
    )


class Publisher:
    """A thread (on the transfer CPUs, if set) that finishes, off vLLM's step and in order, the
    work a step launched on a GPU (or, with :class:`HostOps`, the host work a step left):
    for each job it waits (polling, within ``publish_timeout_s``) for ``job.pending``'s event
    (the pack), then calls ``publish(job, deadline)`` (which copies what it needs to the host
    with :meth:`to_host` and stores it); an exception, or a pack that does not complete in time,
    goes to ``failed(job, exc)`` (that job's failure only). A job's device memory
    (``job.pending.reserved`` of ``budget``) is released once its work completed; a job whose
    work outlived the wait stays referenced, and counted, until then (:attr:`stuck`).

    Args:
        ops: the device's :class:`StreamOps` (or a stand-in).
        budget: the :class:`DeviceBudget` the jobs' reservations belong to.
        publish: ``(job, deadline)``: the job's host side, once its pack completed.
        failed: ``(job, exception)``: the job failed.
        name: the thread's name.
        publish_timeout_s: the most a job's pack and copies may take.
    """

    def __init__(
        self,
        ops,
        budget: DeviceBudget,
        publish: Callable[[object, float], None],
        failed: Callable[[object, BaseException], None],
        *,
        name: str = "tkv-publish",
        publish_timeout_s: float = 30.0,
    ):
        self.ops, self.budget = ops, budget
        self._publish, self._failed = publish, failed
        self.publish_timeout_s = publish_timeout_s
        self._jobs: collections.deque = collections.deque()
        self.copy_stream = None  # made on the thread
        self.stuck: list = []  # jobs whose work outlived publish_timeout_s (kept)
        self._cond = threading.Condition()
        self._busy = False
        self._stopped = False
        self._thread = transfer_thread(self._run, name)  # on transfer_cpus, if set
        self._thread.start()

    def submit(self, job) -> None:
        """Queue ``job`` (anything with a ``pending``: :class:`Pending`, whose event may be None:
        nothing launched to wait for). Never blocks."""
        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()

    def run_here(self, job) -> None:
        """Publish ``job`` on the calling thread now, as the thread would (its failure goes to
        ``failed``; nothing raised). For host work (no event to wait for) that must not queue."""
        self._one(job, time.monotonic() + self.publish_timeout_s)

    def flush(self, timeout_s: float) -> bool:
        """Wait until no job is queued or being published (True) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def to_host(self, job, tensors: list, deadline: float) -> list:
        """Pinned host copies of ``tensors`` (device tensors, or None: kept None), made on the
        copy stream and waited for (polling) until ``deadline``. TimeoutError if they did not
        complete: ``job.pending`` then waits on them (the GPU may still read the job's
        tensors)."""
        with self.ops.use(self.copy_stream):
            out = [
                None
                if t is None
                else host_empty(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
                for t in tensors
            ]
            for host, t in zip(out, tensors, strict=True):
                if t is not None:
                    host.copy_(t, non_blocking=True)
            copied = self.ops.event(self.copy_stream)
        if not wait_events([copied], deadline):
            job.pending.event = copied  # what the GPU may still be doing with its tensors
            raise TimeoutError("its copy to the host did not complete within publish_timeout_s")
        return out

    def let_go(self, job) -> bool:
        """Release ``job``'s device memory once its work completed (True), else nothing."""
        if not job.pending.done():
            return False
        self.budget.release(job.pending.reserved)
        job.pending.reserved = 0
        return True

    def _one(self, job, deadline: float) -> None:
        try:
            events = [job.pending.event] if job.pending.event is not None else []
            if not wait_events(events, deadline):
                raise TimeoutError("its pack did not complete within publish_timeout_s")
            self._publish(job, deadline)
        except Exception as exc:
            self._failed(job, exc)
        finally:  # its tensors stay referenced (and counted) for as long as the GPU may use them
            self.stuck.append(job)
            self.stuck = [j for j in self.stuck if not self.let_go(j)]

    def _run(self) -> None:
        self.ops.bind_thread()
        self.copy_stream = self.ops.new_stream()
        while True:
            with self._cond:
                while not self._jobs and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    self._jobs.clear()
                    self._cond.notify_all()
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self._one(job, time.monotonic() + self.publish_timeout_s)
            finally:
                del job
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
