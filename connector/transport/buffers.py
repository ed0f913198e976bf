"""Tensors as wire bytes: :func:`flat_bytes` views; :data:`RECV_POOL`, the pool that hands out
large CPU receive buffers again once nothing references them (pinned when CUDA is there, so
that copies of what was received to a device are fast and can be asynchronous); and the host
buffers that device tensors are staged through on transports that carry host memory only
(gloo, socket; see :mod:`.staging`): :func:`staging_buffer`, from :data:`STAGING_POOL`."""

from __future__ import annotations

import threading

import torch


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """1-D uint8 view of a contiguous tensor (0-dim and bool/fp8/complex included)."""
    return t.reshape(-1).view(torch.uint8)


def _storage_users(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class RecvPool:
    """Reuses large CPU receive buffers once nothing handed out from them is referenced.

    A fresh CPU tensor costs first-touch page faults while the payload lands (here about as long
    as the transfer itself at 64 MiB). Buffers of at least ``min_bytes`` are therefore kept (up to
    ``max_bytes`` in all, per process) and handed out again, as views, once the storage's use count
    shows that every tensor or view the caller had of it is gone. ``max_bytes = 0`` disables it.
    """

    def __init__(self, max_bytes: int = 1 << 30, min_bytes: int = 4 << 20, pinned: bool = False):
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self.pinned = pinned  # page-locked buffers (when CUDA is there): fast, async device copies
        self._lock = threading.Lock()
        self._bufs: list[tuple[torch.Tensor, int]] = []  # (uint8 buffer, idle use count)
        self.hits = 0
        self.misses = 0

    def alloc(self, nbytes: int) -> torch.Tensor | None:
        """A warm uint8 buffer of exactly ``nbytes`` (a view), or None when not pooled."""
        if nbytes < self.min_bytes or nbytes > self.max_bytes:
            return None
        with self._lock:
            best = None
            for buf, idle in self._bufs:
                cap = buf.numel()
                fits = nbytes <= cap <= 2 * nbytes and (best is None or cap < best.numel())
                if fits and _storage_users(buf) == idle:
                    best = buf
            if best is not None:
                self.hits += 1
                return best[:nbytes]
            self.misses += 1
            # make room: drop idle buffers, smallest first, until the new one fits
            held = sum(b.numel() for b, _ in self._bufs)
            if held + nbytes > self.max_bytes:
                idle = sorted(
                    (b.numel(), i) for i, (b, c) in enumerate(self._bufs) if _storage_users(b) == c
                )
                drop = set()
                for size, i in idle:
                    if held + nbytes <= self.max_bytes:
                        break
                    drop.add(i)
                    held -= size
                self._bufs = [x for i, x in enumerate(self._bufs) if i not in drop]
            buf = host_empty(nbytes, self.pinned)
            if held + nbytes <= self.max_bytes:
                self._bufs.append((buf, _storage_users(buf)))
            return buf[:nbytes]


def host_empty(nbytes: int, pinned: bool = True) -> torch.Tensor:
    """``[nbytes]`` uint8 host memory, page-locked when ``pinned`` and CUDA is there (from
    PyTorch's caching host allocator: freed blocks are kept for the next one)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and torch.cuda.is_available())


def pinned_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a contiguous host tensor) in page-locked memory: itself when it is there already,
    is no host tensor or CUDA is not there, else a pinned copy. A copy to a device from pageable
    memory waits for the device's stream to drain first (CUDA's rule for pageable transfers);
    from pinned memory it is asynchronous."""
    if t.device.type != "cpu" or not torch.cuda.is_available() or t.is_pinned():
        return t
    out = host_empty(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


RECV_POOL = RecvPool(pinned=True)
#: Host staging of device tensors (gloo and socket carry host memory only): pinned, reused.
STAGING_POOL = RecvPool(max_bytes=1 << 30, min_bytes=1 << 20, pinned=True)


def staging_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 host buffer of ``nbytes`` to stage device bytes through: pinned when CUDA is
    there, from :data:`STAGING_POOL` when large enough (reused once nothing references it)."""
    buf = STAGING_POOL.alloc(nbytes)
    return buf if buf is not None else host_empty(nbytes, True)
