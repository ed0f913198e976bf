"""The CPU twins' fused copy + digest: the C library (:mod:`tritonkv._cpu_digest`) against a numba
version of the same work, in one run, on the same buffers.

The numba candidate is written here (not in the package): kernels compiled with ``cache=True``,
``parallel=True`` for the threaded copies, bit-exact with the C (asserted on every case before
it is timed, and against the NumPy reference). It covers what the connector runs: the lane loop
over contiguous bytes (a hidden-state file's check, a slice's ``tensor_digest``) and the packing
and unpacking of whole-word rows of a paged cache (vLLM's NHD layout, padding rows included).

Cases, each timed in interleaved rounds (C, numba, C, numba, ...; medians):

- ``lanes``: the digest of a contiguous tensor, 2 KiB to 64 KiB (the per-call overhead counts);
- ``pack`` / ``unpack``: a fused gather / scatter of packed sizes 2 KiB .. 256 MiB, one thread
  and the copy threads the C uses (``min(4, torch threads)``).

Also measured: ``import numba``'s time in a fresh process, and the kernels' first call with an
empty cache (JIT) and from the cache (a second process).

Run: ``python -m bench.bench_cpu_copy [--quick] [--out PATH]`` (the kept results:
``bench/results/<host kind>/cpu-copy-digest.txt``); the result file holds the host, the load
average, the commit and the date. The outcome, and why the C stays: :mod:`tritonkv._cpu_digest`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import intrinsic

from tritonkv import _cpu, _cpu_digest
from tritonkv._digest_core import FMIX_1, FMIX_2, KEY, MASK, SEED, lanes_numpy

REPO = Path(__file__).resolve().parent.parent
U32 = np.uint32
_KEY, _SEED, _F1, _F2 = U32(KEY), U32(SEED), U32(FMIX_1), U32(FMIX_2)
KIB, MIB = 1 << 10, 1 << 20
LANE_SIZES = (2 * KIB, 8 * KIB, 64 * KIB)
COPY_SIZES = (2 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
LAYER = ["not used"]  # numba's threading layer, as its threaded worker reports it
NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 128, 16  # bf16: rows of 1 KiB a view, K and V


# ----------------------------------------------------------------------- the numba candidate


@intrinsic
def _words_at(typingctx, address):
    """A ``uint32*`` at an integer address (the caller keeps the memory alive)."""
    sig = types.CPointer(types.uint32)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.uint32)))

    return sig, codegen


@njit(cache=True, inline="always")
def _run(src, dst, n, first, copy):
    """Lane sums of the ``n`` words of ``src`` at positions ``first, ...``; with ``copy`` each
    word is stored to ``dst`` as it is read (one pass)."""
    a = U32(0)
    b = U32(0)
    k0 = U32(first * _KEY + _SEED)
    for j in range(n):
        w = src[j]
        if copy:
            dst[j] = w
        k = U32(k0 + U32(j) * _KEY)
        h = U32(w ^ k)
        h = U32(h ^ (h >> U32(16)))
        h = U32(h * _F1)
        h = U32(h ^ (h >> U32(13)))
        h = U32(h * _F2)
        h = U32(h ^ (h >> U32(16)))
        a = U32(a + h)
        b = U32(b + U32(h * U32(k | U32(1))))
    return a, b


@njit(cache=True)
def nb_lanes(address, nbytes, first):
    """Lane sums of the ``nbytes`` bytes at ``address`` (a last partial word zero-padded)."""
    n = nbytes // 4
    words = numba.carray(_words_at(address), n)
    a, b = _run(words, words, n, first, False)
    if nbytes % 4:
        last = np.zeros(1, np.uint32)
        tail = numba.carray(_words_at(address + 4 * n), 1).view(np.uint8)  # bytes in reach
        last.view(np.uint8)[: nbytes % 4] = tail[: nbytes % 4]
        ta, tb = _run(last, last, 1, first + n, False)
        a, b = U32(a + ta), U32(b + tb)
    return a, b


@njit(cache=True)
def _rows(unpack, bases, strides, slots, num_rows, block_size, heads, head_words, packed, g0, g1):
    """Lane sums of the packed rows ``[g0, g1)`` (view-major), copied between the views and
    ``packed`` (an address; 0: pack digest-only) on the way; heads of whole words, each head's
    elements contiguous; slot -1: a zero row packed, nothing unpacked."""
    row_words = heads * head_words
    zero = np.zeros(row_words, np.uint32)
    a = U32(0)
    b = U32(0)
    for g in range(g0, g1):
        v = g // num_rows
        slot = slots[g - v * num_rows]
        pos = g * row_words
        q = numba.carray(_words_at(packed + 4 * pos), row_words) if packed else zero
        if slot < 0:
            if not unpack and packed:
                q[:] = 0
            ra, rb = _run(q, q, row_words, pos, False)
            a, b = U32(a + ra), U32(b + rb)
            continue
        blk = slot // block_size
        row = bases[v] + blk * strides[v, 0] + (slot - blk * block_size) * strides[v, 2]
        runs, run_words = (1, row_words) if strides[v, 1] == 4 * head_words else (heads, head_words)
        for h in range(runs):
            c = numba.carray(_words_at(row + h * strides[v, 1]), run_words)
            qh = q[h * run_words : (h + 1) * run_words]
            at = pos + h * run_words
            if unpack:
                ra, rb = _run(qh, c, run_words, at, True)
            elif packed:
                ra, rb = _run(c, qh, run_words, at, True)
            else:
                ra, rb = _run(c, c, run_words, at, False)
            a, b = U32(a + ra), U32(b + rb)
    return a, b


@njit(cache=True, parallel=True)
def _rows_parallel(
    unpack, bases, strides, slots, num_rows, block, heads, head_words, packed, grain
):
    """:func:`_rows` of every row, grains of ``grain`` rows over numba's threads."""
    total = bases.size * num_rows
    grains = (total + grain - 1) // grain
    sums = np.zeros((grains, 2), np.uint32)
    for i in prange(grains):
        end = min(total, (i + 1) * grain)
        args = (unpack, bases, strides, slots, num_rows, block, heads, head_words, packed)
        sums[i, 0], sums[i, 1] = _rows(*args, i * grain, end)
    return sums.astype(np.uint64).sum(axis=0)


def nb_copy_rows(table, slots, packed, *, unpack: bool, workers: int) -> tuple[int, int]:
    """The numba twin of :meth:`tritonkv._cpu_digest.Native.copy_rows` (digest on; heads of whole
    words, each head's elements contiguous)."""
    head_words = table.head_size * table.elem // 4
    address = 0 if packed is None else packed.data_ptr()
    args = (int(unpack), table.bases, table.strides, slots.numpy(), slots.numel(), table.block_size)
    args += (table.num_kv_heads, head_words, address)
    if workers < 2:
        a, b = _rows(*args, 0, table.bases.size * slots.numel())
        return int(a), int(b)
    numba.set_num_threads(workers)
    grain = max(_cpu_digest.GRAIN_BYTES // max(table.row_bytes, 1) // 4 * 4, 4)
    a, b = _rows_parallel(*args, grain)
    return int(a) & MASK, int(b) & MASK


# ------------------------------------------------------------------------------ the cases


@dataclass
class Case:
    """A paged cache's K and V views, the rows a copy moves and the packed tensor they go to."""

    kv: torch.Tensor  # [2, ...] the cache storage (both views)
    views: list[torch.Tensor]  # [num_blocks, num_kv_heads, block_size, head_size] each
    table: _cpu_digest.RowTable
    slots: torch.Tensor  # [num_rows] int64, -1: a padding row
    packed: torch.Tensor  # [2, num_rows, num_kv_heads, head_size]
    want: torch.Tensor  # what a pack writes into packed (torch indexing)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


def make_case(
    packed_bytes: int,
    seed: int,
    *,
    layout: str = "nhd",
    heads: int = NUM_KV_HEADS,
    head_size: int = HEAD_SIZE,
    dtype=torch.bfloat16,
    block_size: int = BLOCK_SIZE,
):
    """K and V views of a paged cache (``nhd``: vLLM's GPU layout, a token's heads side by side;
    ``hnd``: each head's tokens side by side) holding twice the packed rows, whole blocks in a
    shuffled order, one padding row among them."""
    elem = torch.empty(0, dtype=dtype).element_size()
    num_rows = max(packed_bytes // (2 * heads * head_size * elem), 1)
    used = -(-num_rows // block_size)
    num_blocks = 2 * used
    gen = torch.Generator().manual_seed(seed)
    inner = (block_size, heads) if layout == "nhd" else (heads, block_size)
    raw = torch.randint(0, 256, (2, num_blocks, *inner, head_size * elem), generator=gen)
    kv = raw.to(torch.uint8).view(dtype)
    views = [kv[i].transpose(1, 2) if layout == "nhd" else kv[i] for i in range(2)]
    order = torch.randperm(num_blocks, generator=gen)[:used]
    slots = (order[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:num_rows]
    if num_rows > 2:
        slots[num_rows // 2] = -1
    want = _gather(views, slots)
    packed = torch.empty((2, num_rows, heads, head_size), dtype=dtype)
    table = _cpu_digest.RowTable.of(views)
    return Case(kv, views, table, slots.to(torch.int64).contiguous(), packed, want)


def _gather(views: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """``[2, num_rows, num_kv_heads, head_size]``: each view's row of each slot (-1: zeros)."""
    num_blocks, heads, block_size, head_size = views[0].shape
    tokens = [v.transpose(1, 2).reshape(num_blocks * block_size, heads, head_size) for v in views]
    rows = torch.stack([t[slots.clamp(min=0)] for t in tokens])
    rows[:, slots < 0] = 0
    return rows


def copy_fn(impl: str, lib, case: Case, *, unpack: bool, workers: int):
    """The copy of ``case`` by ``impl`` (``c`` or ``numba``), after one checked call: the lane
    sums equal the NumPy reference's, a pack writes every packed byte as torch indexing does, an
    unpack writes the rows of the slots and nothing else."""
    if impl == "c":
        kw = dict(unpack=unpack, digest=True, total_bytes=case.nbytes, workers=workers)
        run = partial(lib.copy_rows, case.table, case.slots, case.packed, **kw)
    else:
        run = partial(
            nb_copy_rows, case.table, case.slots, case.packed, unpack=unpack, workers=workers
        )
    bits = case.want.view(torch.uint8)
    want = lanes_numpy(bits.reshape(-1).numpy().view(np.uint32))
    if unpack:
        case.packed.copy_(case.want)
        before = case.kv.view(torch.uint8).clone()
        case.kv.view(torch.uint8).fill_(0x5A)
    else:
        case.packed.view(torch.uint8).fill_(0x5A)  # sentinel: every byte must be written
    lanes = run()
    assert lanes == want, (impl, case.nbytes, unpack, workers, lanes, want)
    if unpack:  # the slots' rows as packed, every other byte still the sentinel
        got = _gather(case.views, case.slots)
        assert torch.equal(got.view(torch.uint8), bits), (impl, "unpack bits")
        written = int(case.kv.view(torch.uint8).ne(0x5A).sum())
        assert written <= int(bits.ne(0x5A).sum()), (impl, "unpack wrote other rows")
        case.kv.view(torch.uint8).copy_(before)
    else:
        assert torch.equal(case.packed.view(torch.uint8), bits), (impl, "pack bits")
    return run


def _interleaved(fns, rounds: int, inner: int, budget_s: float) -> list[float]:
    """Medians (µs a call) of each of ``fns``, in alternating rounds of ``inner`` calls."""
    times = [[] for _ in fns]
    deadline = time.perf_counter() + budget_s
    for _ in range(rounds):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append((time.perf_counter() - start) * 1e6 / inner)
        if time.perf_counter() > deadline and len(times[0]) >= 3:
            break
    return [statistics.median(t) for t in times]


def _inner(nbytes: int) -> int:
    return max(1, min(200, (4 * MIB) // nbytes))


def check_lanes(lib) -> None:
    """numba's lanes equal the C's and the reference's: odd sizes, unaligned starts."""
    data = np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8)
    for n, offset, first in ((0, 0, 0), (3, 1, 5), (1027, 3, (1 << 32) - 3), (4099, 0, 7)):
        view = data[offset : offset + n]
        padded = np.concatenate([view, np.zeros(-n % 4, np.uint8)]).view("<u4")
        want = lanes_numpy(padded, first)
        got = tuple(int(x) for x in nb_lanes(view.ctypes.data, n, first))
        assert got == want == lib.lanes(view, first), (n, offset, got, want)


def lanes_case(lib, nbytes: int, rounds: int) -> dict:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    address = data.data_ptr()
    fns = (lambda: lib.lanes_at(address, nbytes), lambda: nb_lanes(address, nbytes, 0))
    c_us, nb_us = _interleaved(fns, rounds, 50, 5)
    return dict(case="lanes", nbytes=nbytes, threads=1, c_us=c_us, nb_us=nb_us)


def serial_case(lib, nbytes: int, unpack: bool, rounds: int) -> dict:
    """One thread each: both in this process, interleaved."""
    case = make_case(nbytes, seed=nbytes)
    fns = [copy_fn(impl, lib, case, unpack=unpack, workers=1) for impl in ("c", "numba")]
    c_us, nb_us = _interleaved(fns, rounds, _inner(nbytes), 20)
    return dict(
        case="unpack" if unpack else "pack", nbytes=nbytes, threads=1, c_us=c_us, nb_us=nb_us
    )


def threaded_worker(impl: str, sizes: list[int], workers: int, rounds: int) -> None:
    """(A process of its own per implementation: one OpenMP runtime's team never runs beside
    the other's, which slows both.) Prints ``{"pack 1024": us, ...}`` as JSON."""
    lib = _cpu_digest.native()
    out = {}
    for unpack in (False, True):
        for nbytes in sizes:
            case = make_case(
                nbytes, seed=nbytes
            )  # alive while fn runs: the table has its addresses
            fn = copy_fn(impl, lib, case, unpack=unpack, workers=workers)
            fn()
            (us,) = _interleaved([fn], rounds, _inner(nbytes), 20)
            out[f"{'unpack' if unpack else 'pack'} {nbytes}"] = us
    if impl == "numba":
        out["layer"] = numba.threading_layer()
    print(json.dumps(out))


def threaded_cases(sizes: list[int], workers: int, rounds: int, procs: int) -> list[dict]:
    """Each implementation in processes of its own, alternating (C, numba, C, ...); the median
    of the processes' medians."""
    seen = {"c": [], "numba": []}
    for _ in range(procs):
        for impl in seen:
            cmd = [
                sys.executable,
                "-m",
                "bench.bench_cpu_copy",
                "--worker",
                impl,
                "--threads",
                str(workers),
                "--rounds",
                str(rounds),
                "--sizes",
                ",".join(map(str, sizes)),
            ]
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
            if done.returncode:
                raise RuntimeError(f"{impl} worker failed: {done.stderr[-2000:]}")
            seen[impl].append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = []
    LAYER[0] = seen["numba"][0]["layer"]
    for key in seen["c"][0]:
        case, nbytes = key.split()
        c_us, nb_us = (statistics.median(r[key] for r in seen[i]) for i in ("c", "numba"))
        rows.append(dict(case=case, nbytes=int(nbytes), threads=workers, c_us=c_us, nb_us=nb_us))
    return rows


# ------------------------------------------------------------------ import and JIT costs

_FIRST_CALL = """
import time
t0 = time.perf_counter()
import numba
t1 = time.perf_counter()
import numpy as np
from bench import bench_cpu_copy as b
from tritonkv import _cpu_digest
t2 = time.perf_counter()
x = np.zeros(1024, np.uint8)
case = b.make_case(1 << 16, seed=0)
b.nb_lanes(x.ctypes.data, x.size, 0)
for workers in (1, 2):
    b.nb_copy_rows(case.table, case.slots, case.packed, unpack=False, workers=workers)
t3 = time.perf_counter()
_cpu_digest.native().lanes(x)
t4 = time.perf_counter()
print(f"{(t1 - t0) * 1e3:.0f} {(t3 - t2) * 1e3:.0f} {(t4 - t3) * 1e3:.0f}")
"""


def startup_costs() -> dict:
    """``import numba``, and the first calls of numba's kernels (lanes, a copy on one thread and
    on two) and of the C library (its build and load), with empty caches, then from them (a
    second process)."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": f"{cache}/numba", "PYTHONPATH": str(REPO)}
        env["TRITONKV_CACHE_DIR"] = f"{cache}/c"
        for name in ("cold", "cached"):
            run = subprocess.run(
                [sys.executable, "-c", _FIRST_CALL],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
            import_ms, numba_ms, c_ms = run.stdout.split()
            out["import_numba_ms"] = import_ms
            out[f"numba_first_call_{name}_ms"] = numba_ms
            out[f"c_first_call_{name}_ms"] = c_ms
    return out


# --------------------------------------------------------------------------------- report


def _host() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return f"{model}, {os.cpu_count()} cores, {platform.machine()}"


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few sizes and rounds (smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="result file (default: stdout)")
    parser.add_argument("--worker", choices=("c", "numba"), help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=15, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sizes = [int(n) for n in args.sizes.split(",")]
        threaded_worker(args.worker, sizes, args.threads, args.rounds)
        return
    load_at_start = os.getloadavg()
    lib = _cpu_digest.native()
    if lib is None:
        raise SystemExit(f"the C library is unavailable: {_cpu_digest.backend()}")
    check_lanes(lib)
    threads = min(_cpu.MAX_WORKERS, torch.get_num_threads())
    rounds = 3 if args.quick else 15
    copy_sizes = list(COPY_SIZES[:3] if args.quick else COPY_SIZES)
    rows = [lanes_case(lib, n, rounds) for n in LANE_SIZES]
    rows += [serial_case(lib, n, unpack, rounds) for unpack in (False, True) for n in copy_sizes]
    big = [n for n in copy_sizes if n >= _cpu.PARALLEL_MIN_BYTES] or copy_sizes[-1:]
    if threads > 1:  # the C's threads from PARALLEL_MIN_BYTES on
        rows += threaded_cases(big, threads, rounds, procs=1 if args.quick else 3)
    costs = startup_costs()
    lines = [
        "# fused copy + digest on the CPU: C (tritonkv/_cpu_digest.py) vs numba (this file)",
        f"# host: {_host()}; C lane loop: {lib.isa}; OpenMP team: {lib.team}",
        f"# commit: {_commit()}; date: {datetime.date.today().isoformat()}; "
        f"numba {numba.__version__}, threading layer {LAYER[0]}",
        "# load average (1, 5, 15 min) at the start: {:.1f} {:.1f} {:.1f}, at the end: "
        "{:.1f} {:.1f} {:.1f} (other processes share the cores)".format(
            *load_at_start, *os.getloadavg()
        ),
        "# medians of interleaved rounds, µs a call; ratio = numba / C (1.05: numba 5 % slower)",
        f"{'case':<8}{'bytes':>12}{'threads':>8}{'c_us':>12}{'numba_us':>12}{'ratio':>8}"
        f"{'c_GB/s':>9}{'nb_GB/s':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r['case']:<8}{r['nbytes']:>12}{r['threads']:>8}{r['c_us']:>12.1f}"
            f"{r['nb_us']:>12.1f}{r['nb_us'] / r['c_us']:>8.2f}"
            f"{r['nbytes'] / r['c_us'] / 1e3:>9.2f}{r['nbytes'] / r['nb_us'] / 1e3:>9.2f}"
        )
    lines.append("# startup: " + ", ".join(f"{k} {v}" for k, v in costs.items()))
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
