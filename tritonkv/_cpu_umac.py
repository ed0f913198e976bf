"""The NH layer of :mod:`tritonkv.umac` on the CPU (its own pass over a tensor's bytes; the
copies of pack and unpack compute it themselves, :mod:`tritonkv._cpu_digest`): ``_native/nh.c``,
built on first use by :mod:`tritonkv._native_build` and loaded with ctypes.
On x86-64, clones for AVX-512, AVX2 and the portable loop are picked by the CPU (ifunc). A loaded
library is checked against the NumPy reference first; where none builds, NH takes the torch twin
(after one warning). Payloads of :data:`~tritonkv._cpu.PARALLEL_MIN_BYTES` or more are split
over the twins' copy threads (ctypes releases the GIL; blocks are independent).
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from . import _cpu
from ._native_build import Unavailable, load_or_build
from ._umac_core import CHUNK_WORDS, ITERATIONS, KEY_WORDS, SHIFT_WORDS, nh_numpy

__all__ = ["backend", "native", "nh_native"]

SOURCE = Path(__file__).with_name("_native") / "nh.c"
FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11")
ABI = 1

_lock = threading.Lock()
_loaded: tuple[ctypes.CDLL | None, str] | None = None


def native() -> ctypes.CDLL | None:
    """The loaded library, built on first use; None (after one warning) where it cannot be."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                _loaded = (_load(), "native")
            except (Unavailable, OSError) as why:
                warnings.warn(
                    f"tritonkv: the native NH hash is unavailable ({why}); payload "
                    "authentication on the CPU takes the torch twin (several times slower)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                _loaded = (None, f"torch ({why})")
        return _loaded[0]


def backend() -> str:
    """``"native"``, or ``"torch (why)"`` where the library cannot be had."""
    native()
    return _loaded[1]


def _reset() -> None:
    """Forget the loaded library (tests: re-read the environment on the next call)."""
    global _loaded
    with _lock:
        _loaded = None


def nh_native(lib: ctypes.CDLL, words: torch.Tensor, key: np.ndarray) -> torch.Tensor:
    """NH of whole blocks by the C library.

    Args:
        lib: :func:`native`'s library.
        words: ``[n * CHUNK_WORDS]`` int32, contiguous, on the CPU.
        key: ``[KEY_WORDS]`` uint32 (contiguous).

    Returns:
        ``[n, ITERATIONS]`` int64 on the CPU.
    """
    n = words.numel() // CHUNK_WORDS
    out = torch.empty((n, ITERATIONS), dtype=torch.int64)
    key = np.ascontiguousarray(key, dtype=np.uint32)
    workers = min(_cpu.MAX_WORKERS, torch.get_num_threads())
    if n * CHUNK_WORDS * 4 < _cpu.PARALLEL_MIN_BYTES or workers < 2:
        lib.tkv_nh(words.data_ptr(), n, key.ctypes.data, out.data_ptr())
        return out
    step = -(-n // workers)

    def run(start: int) -> None:
        count = min(step, n - start)
        at = words.data_ptr() + 4 * start * CHUNK_WORDS
        lib.tkv_nh(at, count, key.ctypes.data, out.data_ptr() + 8 * ITERATIONS * start)

    futures = [_cpu._executor().submit(run, s) for s in range(step, n, step)]
    run(0)
    for future in futures:
        future.result()
    return out


def _load() -> ctypes.CDLL:
    return load_or_build(SOURCE, "nh", (FLAGS,), _open)


def _open(path: Path) -> ctypes.CDLL:
    """Load ``path`` and check it: its ABI and constants, and NH against the NumPy reference."""
    try:
        lib = ctypes.CDLL(str(path))
        constants = (lib.tkv_nh_abi(), lib.tkv_nh_chunk_words(), lib.tkv_nh_iterations())
        constants += (lib.tkv_nh_shift_words(),)
        lib.tkv_nh.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        lib.tkv_nh.restype = None
    except (OSError, AttributeError) as exc:
        raise Unavailable(f"{path} does not load: {exc}") from None
    if constants != (ABI, CHUNK_WORDS, ITERATIONS, SHIFT_WORDS):
        raise Unavailable(f"{path} has ABI and constants {constants}")
    rng = np.random.default_rng(0)
    probe = rng.integers(0, 1 << 32, 3 * CHUNK_WORDS, dtype=np.uint32)
    key = rng.integers(0, 1 << 32, KEY_WORDS, dtype=np.uint32)
    got = nh_native(lib, torch.from_numpy(probe.view(np.int32)), key).numpy().view(np.uint64)
    if not np.array_equal(got, nh_numpy(probe, key)):
        raise Unavailable(f"{path} fails the self-check (NH differs from the reference)")
    return lib
