"""CPU row-copy primitives by row size: why the torch twins copy the way they do.

    python -m bench.bench_rows [--quick]

The twins reduce pack and unpack to copies of rows (a token, a (token, head) pair or a whole
block) between a cache view and the packed tensor, one op per layer and K/V. This measures each
candidate primitive at the row sizes the benchmark models produce, on as many views and bytes as
llama3-8b at 4k tokens, against ``copy`` (the same bytes, contiguous to contiguous), in paired
rounds (``common.paired_ratio``):

- gather: ``index_select`` (what ``tritonkv._cpu.RowCopies.gather`` runs);
- scatter: ``index_copy_`` on 8-byte integers, ``index_copy_`` and ``index_put_`` on 16-byte
  elements, and NumPy fancy assignment of whole rows seen as ``void`` items on one thread and on
  two threads (``RowCopies.scatter`` picks NumPy on threads up to 256 B rows, 16-byte
  ``index_put_`` above).

Rows: 128 B (fp8, head 128), 256 B (bf16 head), 1152 B (MLA token), 4 KiB (a 16-token block of one
bf16 head), 16 and 32 KiB (blocks of 8 heads). Writes ``bench/results/cpu/rows.csv`` (``op`` is
``rows_gather`` or ``rows_scatter``, ``x`` the row size in bytes, ``frac_copy`` the paired ratio).
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable

import numpy as np
import torch

from . import common
from .common import Row

ROW_BYTES = (128, 256, 1152, 4096, 16384, 32768)
TOTAL_BYTES = 1 << 29  # 512 MiB moved per call, as llama3-8b packs at 4k tokens


def _halves(fn: Callable[[int], object], n: int) -> None:
    """``fn(0 .. n-1)``: the first half on a helper thread, the rest here."""
    helper = threading.Thread(target=lambda: [fn(i) for i in range(n // 2)])
    helper.start()
    for i in range(n // 2, n):
        fn(i)
    helper.join()


def measure(row_bytes: int, total_bytes: int, quick: bool) -> list[Row]:
    """Every primitive at one row size: ``total_bytes`` over 64 views of random row indices."""
    num_views = 64
    width = row_bytes // 8
    rows = max(total_bytes // num_views // row_bytes, 1)
    cache_rows = rows + rows // 16 + 1
    gen = torch.Generator().manual_seed(row_bytes)
    caches = [torch.randint(0, 1 << 30, (cache_rows, width), dtype=torch.int64, generator=gen)]
    caches += [caches[0].clone() for _ in range(num_views - 1)]
    packed = torch.randint(0, 1 << 30, (num_views, rows, width), dtype=torch.int64, generator=gen)
    srcs = packed.unbind(0)
    copy_dst = torch.empty_like(packed)
    index = torch.randperm(cache_rows, generator=gen)[:rows]
    void = np.dtype((np.void, row_bytes))
    np_caches = [c.numpy().view(void)[:, 0] for c in caches]
    np_srcs = [s.numpy().view(void)[:, 0] for s in srcs]
    np_index = index.numpy()
    wide = width % 2 == 0

    def np_set(i: int) -> None:
        np_caches[i][np_index] = np_srcs[i]

    gather = {
        "copy": lambda: copy_dst.copy_(packed),
        "index_select": lambda: [
            torch.index_select(c, 0, index, out=s) for c, s in zip(caches, srcs, strict=True)
        ],
    }
    scatter = {
        "copy": lambda: copy_dst.copy_(packed),
        "index_copy_ 8B": lambda: [
            c.index_copy_(0, index, s) for c, s in zip(caches, srcs, strict=True)
        ],
        "numpy rows": lambda: [np_set(i) for i in range(num_views)],
        "numpy rows 2 threads": lambda: _halves(np_set, num_views),
    }
    if wide:
        c16 = [c.view(torch.complex128) for c in caches]
        s16 = [s.view(torch.complex128) for s in srcs]
        scatter["index_copy_ 16B"] = lambda: [
            c.index_copy_(0, index, s) for c, s in zip(c16, s16, strict=True)
        ]
        scatter["index_put_ 16B"] = lambda: [
            c.index_put_((index,), s) for c, s in zip(c16, s16, strict=True)
        ]
    _check(gather, scatter, caches, packed, index)
    out = []
    nbytes = packed.numel() * 8
    for op, fns in (("rows_gather", gather), ("rows_scatter", scatter)):
        rounds: dict[str, list[float]] = {}
        budget = {"budget_s": 0.0, "min_reps": 3} if quick else {"budget_s": 2.0, "min_reps": 9}
        stats = common.cpu_bench_interleaved(fns, rounds=rounds, **budget)
        for name, (p50, p20, p80) in stats.items():
            out.append(
                Row(
                    op=op,
                    sweep="row_bytes",
                    provider=name,
                    x=row_bytes,
                    p50_ms=p50,
                    p20_ms=p20,
                    p80_ms=p80,
                    gbps=2 * nbytes / (p50 * 1e-3) / 1e9,
                    frac_copy=common.paired_ratio(rounds["copy"], rounds[name]),
                    case=f"{num_views} views x {rows} rows",
                    dtype="int64",
                    bytes=nbytes,
                )
            )
    return out


def _check(gather, scatter, caches, packed, index) -> None:
    """Each primitive once, checked bit for bit (this run is also its warm-up)."""

    def match() -> bool:
        return all(torch.equal(c[index], p) for c, p in zip(caches, packed, strict=True))

    packed.zero_()
    gather["index_select"]()
    if not match():
        raise AssertionError("index_select gathered other rows")
    others = torch.ones(caches[0].shape[0], dtype=torch.bool)
    others[index] = False
    before = caches[0][others].clone()
    for value, (name, fn) in enumerate(scatter.items()):
        packed.fill_(value + 1)  # the copy provider writes elsewhere: it only needs to run
        fn()
        if name != "copy" and not match():
            raise AssertionError(f"{name} scattered wrong rows")
    if not torch.equal(caches[0][others], before):
        raise AssertionError("a scatter wrote rows outside its index")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB per call, 3 rounds")
    args = parser.parse_args(argv)
    threads = common.set_threads()
    total = TOTAL_BYTES // 8 if args.quick else TOTAL_BYTES
    rows: list[Row] = []
    print(f"row copies on {threads} threads, {total >> 20} MiB per call; x copy (paired rounds)")
    for row_bytes in ROW_BYTES:
        got = measure(row_bytes, total, args.quick)
        rows += got
        line = ", ".join(
            f"{r.op[5:]} {r.provider} {r.frac_copy:.2f}" for r in got if r.provider != "copy"
        )
        print(f"{row_bytes:>6} B: {line}", flush=True)
    common.finish_rows(rows, common.stamp())
    path = common.write_csv(rows, common.results_dir("cpu") / "rows.csv")
    print(f"wrote: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
