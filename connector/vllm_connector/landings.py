"""A consumer's loads on a GPU between their launch and their verdict (:mod:`connector.streams`).

:class:`GpuLoad` gathers one load's device work while the consumer launches it on vLLM's
stream: the copy of host-staged KV to the device (within the rank's
:class:`~connector.streams.DeviceBudget`), the tensors to keep, the digests to compare and the
payload tags to check with the unpack's NH, copied to the host behind the unpack.
:class:`Landings` holds the launched loads and settles each once its event completed: tags and
digests compared (a mismatch fails the load), tensors and device memory let go.
Nothing here waits for the GPU but :meth:`Landings.settle` with ``wait``, which polls the events
of sync loads whose digests are to be compared (their own unpacks, not the forward pass).
No vLLM import.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import integrity
from ..kvstore import short_id
from ..streams import DeviceBudget, Pending, wait_events
from ..transport import host_empty, pinned_host
from .metadata import LoadSpec


@dataclass
class Landing:
    """A load whose unpack was launched on a GPU: ``checks`` (``(expected, first row in
    digests, check)``, or ``(EntryTag, host copy of the unpack's NH outputs, "tag")``) are
    compared once ``pending`` completed, on ``digests``, a host copy."""

    spec: LoadSpec
    t0: float
    network_ms: float
    nbytes: int
    log_args: tuple
    pending: Pending
    checks: list
    digests: torch.Tensor | None  # [n, 2] int64 on the host
    is_async: bool
    stuck: bool = False  # its unpack outlived the wait for it: failed


class GpuLoad:
    """One load's device work while it is launched (see the module docstring)."""

    def __init__(self, ops, budget: DeviceBudget, spec: LoadSpec):
        self.ops, self.budget, self.spec = ops, budget, spec
        self.keep: list[torch.Tensor] = []
        self.checks: list = []
        self._digests: list[torch.Tensor] = []
        self.reserved = 0

    def to_device(self, packed: torch.Tensor) -> torch.Tensor:
        """A device copy of host-staged ``packed``, on the current stream, within the budget
        (the ``alloc_fail`` test hook fails it). From pinned memory (``packed`` is copied there
        first if it is not): from pageable memory the copy would wait for vLLM's stream."""
        fail = "alloc_fail" in self.spec.debug_fault
        what = f"the load of transfer {short_id(self.spec.transfer_id)}"
        dev, got = self.budget.empty(self.ops, packed.shape, packed.dtype, what, fail)
        self.reserved += got
        packed = pinned_host(packed)
        dev.copy_(packed, non_blocking=True)
        self.keep.append(packed)
        return dev

    def check_tag(self, tag, nh: torch.Tensor) -> None:
        """Check ``tag`` (a :class:`~connector.transport.EntryTag`), at the verdict, with the NH
        outputs ``nh`` the unpack computed, copied to the host behind it."""
        host = host_empty(nh.numel() * 8).view(torch.int64).view(nh.shape)
        host.copy_(nh, non_blocking=True)
        self.keep.append(nh)
        self.checks.append((tag, host, "tag"))

    def check(self, want, packed, read, write_back: tuple | None) -> None:
        """Compare, at the verdict, what the unpack of ``packed`` read (``read``) with ``want``
        (None: no read check), and with ``write_back`` (``(views, block_ids, block_size, first,
        stop, offset)``) what the cache holds there."""
        if want is not None:
            self.checks.append((want, self._rows(), "read"))
            self._digests.append(integrity.read_digests(want, packed, read))
        if write_back is not None:
            self.checks.append((None, self._rows(), "write-back"))
            self._digests.append(integrity.write_back_digests(packed, *write_back))

    def _rows(self) -> int:
        return sum(len(d) for d in self._digests)

    def launch(self, started: float) -> tuple[Pending, list, torch.Tensor | None]:
        """``(pending, checks, host digests)``: the digests copied to the host behind the work
        so far on the current stream, and an event after it all."""
        host = None
        if self._digests:
            found = torch.cat(self._digests)
            host = host_empty(found.numel() * 8).view(torch.int64).view(found.shape)
            host.copy_(found, non_blocking=True)
            self.keep.append(found)
        event = self.ops.event(self.ops.current())
        pending = Pending(event, keep=tuple(self.keep), reserved=self.reserved, started=started)
        self.reserved = 0  # the pending's from here on
        return pending, self.checks, host

    def release(self) -> None:
        """On a failure before :meth:`launch`: give the budget back (nothing was launched that
        reads what it reserved, or the stream orders it before any reuse)."""
        self.budget.release(self.reserved)
        self.reserved = 0


class Landings:
    """The launched loads of one consumer (see the module docstring)."""

    def __init__(self, budget: DeviceBudget, wait_s: float):
        self.budget, self.wait_s = budget, wait_s
        self._landing: list[Landing] = []
        self._stuck: list[Pending] = []  # unpacks that outlived wait_s (kept)

    def add(self, landing: Landing) -> None:
        self._landing.append(landing)

    def settle(
        self,
        wait: bool,
        failed: Callable[[LoadSpec, float, BaseException], None],
        loaded: Callable[[LoadSpec, int, float, tuple], None],
    ) -> list[Landing]:
        """The loads whose unpack completed since the last call, each reported to ``failed``
        or ``loaded``. ``wait``: first wait (polling, up to ``wait_s``) for the sync loads whose
        digests are to be compared; one that does not complete by then fails (its tensors are
        kept)."""
        if wait:
            checked = [s for s in self._landing if s.checks and not s.is_async]
            events = [s.pending.event for s in checked]
            if events and not wait_events(events, time.monotonic() + self.wait_s):
                for landing in checked:
                    landing.stuck = not landing.pending.done()
        settled, still = [], []
        for landing in self._landing:
            if not landing.pending.done() and not landing.stuck:
                still.append(landing)
                continue
            try:
                if landing.stuck:
                    raise TimeoutError("its unpack did not complete within load_timeout_s")
                for want, row, check in landing.checks:
                    if check == "tag":  # want: the EntryTag, row: the NH outputs (host)
                        want.check({"kv": row})
                    else:
                        integrity.compare(check, want, landing.digests, row)
            except Exception as exc:
                failed(landing.spec, landing.t0, exc)
            else:
                unpack_ms = 1e3 * (time.perf_counter() - landing.pending.started)
                loaded(landing.spec, landing.nbytes, unpack_ms, landing.log_args)
            self._stuck.append(landing.pending)  # let go below once done
            settled.append(landing)
        self._landing = still
        stuck, self._stuck = self._stuck, []
        for pending in stuck:
            if pending.done():
                self.budget.release(pending.reserved)
            else:  # its tensors stay referenced for as long as the GPU may use them
                self._stuck.append(pending)
        return settled
