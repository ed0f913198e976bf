"""The CPU twins' fused copy, digest and NH: a small C library built on first use (ctypes).

On the CPU the twins copy rows with torch and NumPy (:mod:`tritonkv._cpu`); a digest there would be
a second pass over the packed bytes (:func:`tritonkv.digest.packed_digest`, NumPy), which costs
more than the copy. ``_native/copy_digest.c`` copies the rows itself (gather for pack, scatter
for unpack, by the views' byte strides) and adds each chunk's digest terms while the chunk is
still in cache, by the definition of :mod:`tritonkv.digest` (bit-identical lanes). With a key it
also adds the NH terms (:mod:`tritonkv.umac`) of the words its loops move, where token rows are
whole 32-byte groups.

Building: :mod:`tritonkv._native_build` (the compiler, the cache, atomic renames), with plain
``-O3 -shared -fPIC`` (never ``-march=native``: the lane loop has AVX-512 and AVX2 clones, the
widest the CPU supports chosen at run time, :func:`backend` names the one running). A loaded
library is checked against the NumPy references (lanes and NH) first. Where nothing works (no
compiler, ``TRITONKV_NATIVE=0``) the digest takes the NumPy path and NH its own pass, after one
warning naming why.
``TRITONKV_NATIVE_ISA`` (``avx512``, ``avx2`` or ``default``, the portable loop) caps the lane
loop's instruction set (tests run each one the CPU has).

Used by ``pack_kv`` / ``unpack_kv`` / ``kv_digest`` and ``pack_hidden`` / ``unpack_hidden`` with
``digest=True`` on CPU tensors (never by the ``*_torch`` oracles, whose digest stays
:func:`~tritonkv.digest.packed_digest`), and by :func:`~tritonkv.digest.tensor_digest` and
:func:`~tritonkv.digest.head_digests` on the CPU.

Threads: above :data:`~tritonkv._cpu.PARALLEL_MIN_BYTES` the threads of a copy share its rows
(each takes the next :data:`GRAIN_BYTES` or so until none are left), and their lane sums add up
to the digest's, whatever the split. The library is built with OpenMP where the compiler has it
(``-fopenmp``; else without): its ``libgomp.so.1`` is then the one torch loaded, and a copy called
from the main thread runs on torch's own OpenMP team, the threads torch's ops just ran on (a
thread of another pool would have to wait for those, spinning after each op, to leave its core:
measured here, up to a few ms). Otherwise (no OpenMP, another runtime, another calling thread)
the copies run on the twins' copy threads (ctypes releases the GIL), where a call queued for a
thread that never started is cancelled once the calling thread has taken every grain.

Why C and not numba: ``docs/design.md`` (measured by ``bench/bench_cpu_copy.py``).
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import _cpu
from ._digest_core import MASK, finalize_host, lanes_numpy
from ._native_build import Unavailable, load_or_build
from ._umac_core import CHUNK_WORDS, KEY_WORDS, nh_numpy, padding_terms

__all__ = [
    "Native",
    "RowTable",
    "backend",
    "copy_with_digest",
    "head_digests",
    "native",
    "tensor_digest",
]

SOURCE = Path(__file__).with_name("_native") / "copy_digest.c"
FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11")
OPENMP_FLAG = "-fopenmp"  # tried first: copies on torch's OpenMP threads (Native.team)
ABI = 4  # TKV_ABI in the source
DIGEST, STREAM = 1, 2  # tkv_copy_digest's flags (TKV_DIGEST, TKV_STREAM)
#: copies of at least this many packed bytes store with non-temporal stores (the destination's
#: lines bypass the caches: no read for ownership, nothing evicted), which made the 8 MiB and
#: larger packs and unpacks of bench/bench_umac.py faster here (2 MiB: alike)
STREAM_MIN_BYTES = 8 << 20
NH_ROW_BYTES = 32  # NH in the copy: token rows of a multiple of this many bytes (whole groups)
ISA_LEVELS = {"default": 0, "avx2": 1, "avx512": 2}  # TRITONKV_NATIVE_ISA: the widest allowed
GRAIN_BYTES = 256 << 10  # shared work: rows a thread takes at a time (about this many bytes)
MAX_DENSE_ROW_BYTES = 1 << 20  # tensor_digest: a dense tensor is cut in rows of at most this

_lock = threading.Lock()
_loaded: tuple[Native | None, str] | None = None  # (library or None, what runs or why not)

_u32p = ctypes.POINTER(ctypes.c_uint32)


@dataclass(frozen=True)
class RowTable:
    """Byte addressing of the cache views a copy reads or writes (one entry per view).

    ``bases``: ``[num_views]`` int64 address of each view's element ``[0, 0, 0, 0]``;
    ``strides``: ``[num_views, 4]`` int64 byte strides (block, head, token, element); views are
    ``[num_blocks, num_kv_heads, block_size, head_size]`` of ``elem`` bytes per element. The
    addresses of both arrays are taken once (a ctypes pointer a call costs microseconds).
    """

    bases: np.ndarray
    strides: np.ndarray
    block_size: int
    num_kv_heads: int
    head_size: int
    elem: int
    bases_at: int = field(init=False, repr=False)
    strides_at: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("bases", "strides"):
            array = np.ascontiguousarray(getattr(self, name), dtype=np.int64)
            object.__setattr__(self, name, array)  # the addresses below stay this array's
            object.__setattr__(self, f"{name}_at", array.ctypes.data)

    @staticmethod
    def of(views: list[torch.Tensor]) -> RowTable:
        """The table of 4-D ``views`` (same shape and dtype; the caller keeps them alive)."""
        elem = views[0].element_size()
        _, num_kv_heads, block_size, head_size = views[0].shape
        bases = np.array([v.data_ptr() for v in views], dtype=np.int64)
        strides = np.array([[s * elem for s in v.stride()] for v in views], dtype=np.int64)
        return RowTable(bases, strides, block_size, num_kv_heads, head_size, elem)

    @staticmethod
    def of_rows(rows: torch.Tensor) -> RowTable:
        """The table of a ``[num_rows, width]`` tensor with any strides (one view, one token per
        block: slot ``i`` is row ``i``)."""
        elem = rows.element_size()
        stride_row, stride_el = (s * elem for s in rows.stride())
        strides = np.array([[stride_row, 0, 0, stride_el]], dtype=np.int64)
        bases = np.array([rows.data_ptr()], dtype=np.int64)
        return RowTable(bases, strides, 1, 1, rows.shape[1], elem)

    @property
    def row_bytes(self) -> int:
        return self.num_kv_heads * self.head_size * self.elem


class Native:
    """The loaded library (see the module docstring); its calls release the GIL."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        self._lanes = lib.tkv_lanes
        self._lanes.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, _u32p]
        self._lanes.restype = None
        self._copy = lib.tkv_copy_digest
        self._copy.argtypes = [
            ctypes.c_int,  # unpack
            ctypes.c_void_p,  # bases: int64 [num_views]
            ctypes.c_void_p,  # strides: int64 [num_views, 4]
            ctypes.c_int64,  # num_views
            ctypes.c_void_p,  # slots: int64 [num_rows]
            ctypes.c_int64,  # num_rows
            ctypes.c_int64,  # block_size
            ctypes.c_int64,  # num_kv_heads
            ctypes.c_int64,  # head_size
            ctypes.c_int64,  # elem
            ctypes.c_void_p,  # packed (None: digest only)
            ctypes.c_int64,  # total_bytes
            ctypes.c_int64,  # g0
            ctypes.c_int64,  # g1
            ctypes.c_void_p,  # cursor: int64 (None: the rows [g0, g1))
            ctypes.c_int64,  # grain
            ctypes.c_int,  # flags: DIGEST, STREAM
            ctypes.c_void_p,  # nh_key: uint32 [KEY_WORDS] (None: no NH)
            ctypes.c_void_p,  # nh_out: int64 [num_chunks, 2], zeroed
            ctypes.c_void_p,  # lanes: uint32 [2]
        ]
        self._copy.restype = ctypes.c_int
        self._team = lib.tkv_copy_digest_team
        self._team.argtypes = [*self._copy.argtypes[:12], ctypes.c_int64, ctypes.c_int]
        self._team.argtypes += self._copy.argtypes[-4:]  # flags, nh_key, nh_out, lanes
        self._team.restype = ctypes.c_int
        lib.tkv_openmp_runtime.restype = ctypes.c_char_p
        runtime = lib.tkv_openmp_runtime()
        # the copies' threads: torch's own OpenMP team where this build runs on torch's runtime
        self.team = runtime is not None and _torch_runs_on(runtime.decode())
        self._heads = lib.tkv_head_lanes
        self._heads.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 5, _u32p]
        self._heads.restype = ctypes.c_int
        lib.tkv_select.restype = ctypes.c_char_p
        lib.tkv_select.argtypes = [ctypes.c_int]
        lib.tkv_select(_isa_level())  # process-wide, like the library itself
        lib.tkv_isa.restype = ctypes.c_char_p
        self.isa = lib.tkv_isa().decode()  # the lane loops that run

    def lanes(self, data: np.ndarray, first_word: int = 0) -> tuple[int, int]:
        """Lane sums of the bytes of contiguous ``data`` (a last partial word zero-padded), its
        first word at position ``first_word``."""
        return self.lanes_at(data.ctypes.data, data.nbytes, first_word)

    def lanes_at(self, address: int, nbytes: int, first_word: int = 0) -> tuple[int, int]:
        """:meth:`lanes` of the ``nbytes`` bytes at ``address`` (the caller keeps them alive)."""
        out = (ctypes.c_uint32 * 2)()
        self._lanes(address, nbytes, first_word, out)
        return out[0], out[1]

    def segment_lanes(self, rows: torch.Tensor, ranges: list[tuple[int, int]]) -> list[list[int]]:
        """Lane sums of each segment ``rows[a:b]`` of contiguous CPU ``rows`` for ``(a, b)`` in
        ``ranges``, each from position 0: one call of the lane loop per segment, on this thread."""
        row_bytes = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
        out = np.zeros((len(ranges), 2), dtype=np.uint32)
        base, ptr, step = rows.data_ptr(), out.ctypes.data, out.strides[0]
        for i, (a, b) in enumerate(ranges):
            lanes = ctypes.cast(ptr + i * step, _u32p)
            self._lanes(base + a * row_bytes, (b - a) * row_bytes, 0, lanes)
        return out.tolist()

    def head_lanes(self, packed: torch.Tensor, num_heads: int, workers: int = 1) -> np.ndarray:
        """``[num_heads, 2]`` lane sums of each head of contiguous ``packed`` (``[..., num_heads,
        head_size]``, each head whole 32-bit words), in one pass over it."""
        head_bytes = packed.shape[-1] * packed.element_size()
        num_rows = packed.numel() // max(packed.shape[-1] * num_heads, 1)
        step = -(-num_rows // max(workers, 1)) or 1
        starts = list(range(0, num_rows, step))
        lanes = np.zeros((max(len(starts), 1), num_heads, 2), dtype=np.uint32)

        def run(i: int) -> int:
            end = min(starts[i] + step, num_rows)
            out = lanes[i].ctypes.data_as(_u32p)
            return self._heads(
                packed.data_ptr(), num_rows, num_heads, head_bytes, starts[i], end, out
            )

        _check(_on_threads(run, len(starts)))
        return lanes.astype(np.uint64).sum(axis=0) & MASK

    def copy_rows(
        self,
        table: RowTable,
        slots: torch.Tensor,
        packed: torch.Tensor | None,
        *,
        unpack: bool,
        digest: bool,
        total_bytes: int,
        workers: int = 1,
        nh: tuple[np.ndarray, torch.Tensor] | None = None,
        stream: bool | None = None,
    ) -> tuple[int, int]:
        """Copy rows between the views of ``table`` and ``packed``; return the lane sums.

        Args:
            table: the views' :class:`RowTable`.
            slots: ``[num_rows]`` contiguous int64 CPU tensor: the slot of each packed row (-1:
                pack a zero row, unpack nothing).
            packed: ``[num_views, num_rows, row_bytes]`` bytes in memory order, contiguous; None
                (pack only): digest the rows without keeping them.
            unpack: scatter ``packed`` into the views instead of gathering.
            digest: accumulate the lanes (else they stay 0).
            total_bytes: ``num_views * num_rows * row_bytes``.
            workers: this many threads (this one and the twins' copy threads) share the
                rows, in grains of about :data:`GRAIN_BYTES`.
            nh: ``(key, out)``: also add the NH terms of ``packed`` (as written or read; not
                None) under ``key`` (``[KEY_WORDS]`` uint32) to ``out`` (``[num_chunks, 2]``
                contiguous int64, zeroed; a last partial block's padding is the caller's);
                ``table.row_bytes`` a multiple of :data:`NH_ROW_BYTES`.
            stream: whether the copy's stores bypass the caches where aligned (x86 lane loops);
                None: from :data:`STREAM_MIN_BYTES` of ``total_bytes`` on.
        """
        num_views, num_rows = len(table.bases), slots.numel()
        if stream is None:
            stream = total_bytes >= STREAM_MIN_BYTES
        total_rows = num_views * num_rows
        grain = max(GRAIN_BYTES // max(table.row_bytes, 1) // 4 * 4, 4)
        workers = min(max(workers, 1), -(-total_rows // grain))
        # (plain addresses, not ctypes pointers of NumPy arrays: a few µs less per call)
        lanes = (ctypes.c_uint32 * (2 * max(workers, 1)))()  # each thread's (A, B)
        lanes_at = ctypes.addressof(lanes)
        cursor = ctypes.c_int64(0)  # rows taken so far (each call adds its grains)
        shared = ctypes.addressof(cursor) if workers > 1 else None
        if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.device.type != "cpu":
            raise ValueError(
                f"slots: expected a contiguous int64 CPU tensor, got {slots.dtype} "
                f"{slots.device} strides {slots.stride()}"
            )
        args = (
            int(unpack),
            table.bases_at,
            table.strides_at,
            num_views,
            slots.data_ptr() or None,
            num_rows,
            table.block_size,
            table.num_kv_heads,
            table.head_size,
            table.elem,
            None if packed is None else packed.data_ptr(),
            total_bytes,
            0,
            total_rows,
            shared,
            grain,
            (DIGEST if digest else 0) | (STREAM if stream else 0),
            None if nh is None else nh[0].ctypes.data,
            None if nh is None else nh[1].data_ptr(),
        )

        if self.team and workers > 1 and threading.current_thread() is threading.main_thread():
            # (torch's team is the main thread's; another thread would get a team of its own,
            # and while one lives libgomp slows every team: see tritonkv._cpu)
            team_args = (*args[:12], grain, workers, *args[-3:])
            _check([self._team(*team_args, lanes_at)])
        else:

            def run(i: int) -> int:
                return self._copy(*args, lanes_at + 8 * i)

            _check(_on_threads(run, workers, shared=True))
        return sum(lanes[0::2]) & MASK, sum(lanes[1::2]) & MASK


def _on_threads(run, count: int, *, shared: bool = False) -> list[int]:
    """``run(i)`` for ``i < count``: 0 here, the others on the twins' copy threads.

    ``shared``: the calls share one pool of work (:meth:`Native.copy_rows`), so a call that has
    not started once this thread's is done is cancelled (it would find nothing left): a copy
    thread kept off a core, by another process or by torch's OpenMP threads spinning after an op,
    delays nothing.
    """
    if count < 2:
        return [run(0)] if count else []
    futures = [_cpu._executor().submit(run, i) for i in range(1, count)]
    try:
        codes = [run(0)]
    finally:  # never return (or raise) while another thread still copies
        if shared:
            futures = [f for f in futures if not f.cancel()]
        codes += [f.result() for f in futures]
    return codes


def _workers(num_bytes: int) -> int:
    """Threads for a copy or digest of ``num_bytes`` bytes: one below
    :data:`~tritonkv._cpu.PARALLEL_MIN_BYTES`, else up to the copy threads torch allows."""
    if num_bytes < _cpu.PARALLEL_MIN_BYTES:
        return 1
    return min(_cpu.MAX_WORKERS, torch.get_num_threads())


def _check(codes: list[int]) -> None:
    if any(codes):  # -1: no memory; -2: arguments the Python side never passes
        raise MemoryError(f"tritonkv native copy failed (codes {codes})")


def native() -> Native | None:
    """The library, built and loaded on first use; None (after one warning) where it cannot be."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                lib = _load()
                _loaded = (lib, f"native-{lib.isa}")
            except (Unavailable, OSError) as why:  # OSError: an unwritable cache, say
                warnings.warn(
                    f"tritonkv: the native CPU copy+digest is unavailable ({why}); CPU digests "
                    "take the NumPy path (a separate pass, several times the copy's time)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                _loaded = (None, f"numpy ({why})")
        return _loaded[0]


def backend() -> str:
    """What computes digests on the CPU: ``"native-avx512"``, ``"native-avx2"``,
    ``"native-default"`` (the portable lane loop), or ``"numpy (why)"`` (loading it if not done
    yet)."""
    native()
    return _loaded[1]


def _reset() -> None:
    """Forget the loaded library (tests: re-read the environment on the next call)."""
    global _loaded
    with _lock:
        _loaded = None


def _torch_runs_on(runtime: str) -> bool:
    """Whether ``runtime`` (the OpenMP library this build uses) is torch's: torch's parallel
    backend is OpenMP and it is the only libgomp mapped in this process (else a second team
    would compete with torch's, and the copies take the twins' copy threads)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    mapped = {os.path.realpath(line.split()[-1]) for line in maps.splitlines() if "libgomp" in line}
    backend_line = "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()
    return backend_line and mapped == {os.path.realpath(runtime)}


def _isa_level() -> int:
    """``TRITONKV_NATIVE_ISA``: the widest lane loop allowed (unset: the widest the CPU has)."""
    name = os.environ.get("TRITONKV_NATIVE_ISA", "").strip() or "avx512"
    if name not in ISA_LEVELS:
        raise ValueError(f"TRITONKV_NATIVE_ISA: expected one of {sorted(ISA_LEVELS)}, got {name!r}")
    return ISA_LEVELS[name]


def _load() -> Native:
    return load_or_build(SOURCE, "copy_digest", ((*FLAGS, OPENMP_FLAG), FLAGS), _open)


def _open(path: Path) -> Native:
    """Load ``path`` and check it: its ABI, and its lanes against the NumPy reference."""
    try:
        lib = ctypes.CDLL(str(path))
        if lib.tkv_abi() != ABI:
            raise Unavailable(f"{path} has ABI {lib.tkv_abi()}, expected {ABI}")
        lib_native = Native(lib, path)
    except (OSError, AttributeError) as exc:
        raise Unavailable(f"{path} does not load: {exc}") from None
    probe = np.random.default_rng(0).integers(0, 256, 1027, dtype=np.uint8)
    padded = np.concatenate([probe, np.zeros(1, np.uint8)]).view("<u4")
    if lib_native.lanes(probe, 5) != lanes_numpy(padded, 5):
        raise Unavailable(f"{path} fails the self-check (lanes differ from the reference)")
    if not _nh_checks(lib_native):
        raise Unavailable(f"{path} fails the self-check (NH differs from the reference)")
    return lib_native


def _nh_checks(lib: Native) -> bool:
    """Whether the copy's NH of 85 rows of 96 bytes (two 4 KiB blocks, a row across their
    boundary, the last block partial) equals the NumPy reference's less the padding's terms, the
    copy made with streamed stores (some of its vectors aligned, some not) giving the rows."""
    rng = np.random.default_rng(1)
    words = rng.integers(0, 1 << 32, 2 * CHUNK_WORDS, dtype=np.uint32)
    rows = torch.from_numpy(words.view(np.uint8)[: 85 * 96].copy()).view(85, 96)
    key = rng.integers(0, 1 << 32, KEY_WORDS, dtype=np.uint32)
    out = torch.zeros((2, 2), dtype=torch.int64)
    packed = torch.empty_like(rows)
    table, slots = RowTable.of_rows(rows), torch.arange(85, dtype=torch.int64)
    lib.copy_rows(
        table,
        slots,
        packed,
        unpack=False,
        digest=False,
        total_bytes=rows.numel(),
        nh=(key, out),
        stream=True,
    )
    padded = np.zeros(2 * CHUNK_WORDS, dtype=np.uint32)
    padded[: 85 * 24] = words[: 85 * 24]
    want = nh_numpy(padded, key)
    with np.errstate(over="ignore"):
        want[1] -= np.array(padding_terms(key, rows.numel()), dtype=np.uint64)  # the caller's
    return torch.equal(packed, rows) and np.array_equal(out.numpy().view(np.uint64), want)


def copy_with_digest(
    lib: Native,
    table: RowTable,
    slots: torch.Tensor,
    packed: torch.Tensor,
    *,
    unpack: bool,
    store: bool = True,
    digest: bool = True,
    nh: tuple[np.ndarray, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """A twin's copy, the digest of ``packed`` and its NH in one pass (what the twins run on the
    CPU).

    Args:
        lib: :func:`native`.
        table: the cache views' :class:`RowTable`.
        slots: ``[num_rows]`` int32/int64 slot of each packed row (-1: none), on the CPU.
        packed: ``[num_views, ..., num_rows, ...]`` contiguous CPU tensor, view-major, each
            packed row ``table.row_bytes`` bytes (a packed KV or hidden-state tensor).
        unpack: write ``packed`` into the views instead of reading them.
        store: False (pack only): the digest is all that is wanted; ``packed`` is not written.
        digest: compute the digest (else return None).
        nh: ``(key, out)``: overwrite ``out`` (``[num_chunks, 2]`` int64, contiguous) with the
            NH sums of ``packed``'s bytes under ``key`` (``[KEY_WORDS]`` uint32), the padding of
            a last partial block left out; ``table.row_bytes`` a multiple of
            :data:`NH_ROW_BYTES`.

    Returns:
        ``[2]`` int64 digest of ``packed`` (as written, or as read by an unpack), or None.
    """
    num_bytes = packed.numel() * packed.element_size()
    workers = _workers(num_bytes)
    if nh is not None:
        nh[1].zero_()  # the library adds each block's sums into it
    lanes = lib.copy_rows(
        table,
        slots.to(torch.int64).contiguous(),
        packed if store or unpack else None,
        unpack=unpack,
        digest=digest,
        total_bytes=num_bytes,
        workers=workers,
        nh=nh,
    )
    return finalize_host([lanes], num_bytes)[0] if digest else None


def tensor_digest(lib: Native, t: torch.Tensor) -> torch.Tensor:
    """The digest of CPU tensor ``t``'s bytes in memory order of its contiguous form, read where
    they lie: rows of a strided view (one head of a packed tensor, a range of its tokens) are
    digested as they are gathered, with no contiguous copy; a contiguous tensor under
    ``PARALLEL_MIN_BYTES`` in one call of the lane loop (a 2 KiB tensor: 130 -> 55 µs here).

    Args:
        lib: :func:`native`.
        t: any CPU tensor.

    Returns:
        ``[2]`` int64 digest, as :func:`tritonkv.digest.packed_digest` of ``t.contiguous()``.
    """
    num_bytes = t.numel() * t.element_size()
    if num_bytes < _cpu.PARALLEL_MIN_BYTES and t.is_contiguous():  # one call of the lane loop
        return finalize_host([lib.lanes_at(t.data_ptr(), num_bytes)], num_bytes)[0]
    rows = _as_rows(t)
    if rows is None:
        rows = t.contiguous().view(1, -1)
    workers = _workers(num_bytes)
    slots = torch.arange(rows.shape[0], dtype=torch.int64)
    lanes = lib.copy_rows(
        RowTable.of_rows(rows),
        slots,
        None,
        unpack=False,
        digest=True,
        total_bytes=num_bytes,
        workers=workers,
    )
    return finalize_host([lanes], num_bytes)[0]


def _as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[rows, width]`` rows of whole 32-bit words (its trailing dims that are dense, its
    leading ones of one stride) seeing the same elements in the same order; None if it is not."""
    dims = [(n, s) for n, s in zip(t.shape, t.stride(), strict=True) if n != 1]
    width, i = 1, len(dims)
    while i > 0 and dims[i - 1][1] == width:
        i -= 1
        width *= dims[i][0]
    lead = dims[:i]
    if any(lead[j][1] != lead[j + 1][1] * lead[j + 1][0] for j in range(len(lead) - 1)):
        return None
    if t.numel() == 0 or width * t.element_size() % 4:
        return None
    num_rows = math.prod(n for n, _ in lead)
    row_stride = lead[-1][1] if lead else width
    while not lead and width * t.element_size() > MAX_DENSE_ROW_BYTES and width % 2 == 0:
        num_rows, width, row_stride = num_rows * 2, width // 2, width // 2  # ranges for threads
    return t.as_strided((num_rows, width), (row_stride, 1))


def head_digests(lib: Native, packed: torch.Tensor) -> torch.Tensor:
    """The digest of each head of a contiguous CPU ``packed`` (``[..., num_kv_heads, head_size]``,
    heads of whole 32-bit words), as :func:`tensor_digest` of ``packed[..., h, :]``, in one pass.

    Returns:
        ``[num_kv_heads, 2]`` int64.
    """
    num_heads = packed.shape[-2]
    num_bytes = packed.numel() * packed.element_size()
    workers = _workers(num_bytes)
    lanes = lib.head_lanes(packed, num_heads, workers).tolist()
    return finalize_host(lanes, num_bytes // max(num_heads, 1))
