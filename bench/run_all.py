"""What ``make bench`` runs: the CPU suite of bench_kv, the CPU row-copy primitives (bench_rows),
then the pipe/buffer benchmarks if present.

On a machine with a GPU it runs bench_kv's GPU suite instead (results under
``bench/results/<gpu name>/``). Without one it says how to get the Triton GPU figures.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from . import bench_kv, bench_rows, common

GPU_NOTE = (
    "Triton GPU figures need a GPU: on a machine with one NVIDIA GPU (torch + triton, no vllm\n"
    "needed) run `bench/gpu_check.sh OUTDIR` (tests + a reduced benchmark, < 5 min) or\n"
    "`python -m bench.bench_kv --suite gpu` (every sweep, results under bench/results/<gpu>/)."
)


def main() -> int:
    started = time.monotonic()
    rc = bench_kv.main([])
    if not common.on_gpu():
        print("\n== bench_rows ==", flush=True)
        rc = rc or bench_rows.main([])
    pipe = Path(__file__).with_name("bench_pipe.py")
    if pipe.exists():
        print("\n== bench_pipe --quick ==", flush=True)
        done = subprocess.run(
            [sys.executable, "-m", "bench.bench_pipe", "--quick"], cwd=common.REPO
        )
        rc = rc or done.returncode
    else:
        print("\n(bench/bench_pipe.py not present: pipe and buffer benchmarks skipped)")
    print(f"\nmake bench: {time.monotonic() - started:.0f} s in all")
    if not common.on_gpu():
        print(GPU_NOTE)
    return rc


if __name__ == "__main__":
    sys.exit(main())
