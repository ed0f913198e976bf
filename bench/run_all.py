"""What ``make bench`` runs: bench_kv's CPU suite, then the pipe and KV-buffer benchmark
(``bench_pipe --quick``, its output kept as ``pipe.txt``).

On a machine with a GPU it runs bench_kv's GPU suite instead. Results land in
``bench/results/<host kind>/`` (:func:`bench.common.host_kind`). Without a GPU it says how to get
the Triton GPU figures.
"""

from __future__ import annotations

import subprocess
import sys
import time

from . import bench_kv, common

GPU_NOTE = (
    "Triton GPU figures need a GPU: on a machine with one NVIDIA GPU (torch + triton, no vllm\n"
    "needed) run `bench/gpu_check.sh OUTDIR` (tests + a reduced benchmark, < 5 min) or\n"
    "`python -m bench.bench_kv --suite gpu` (every sweep, results under bench/results/<gpu>/)."
)


def main() -> int:
    started = time.monotonic()
    rc = bench_kv.main([])
    print("\n== bench_pipe --quick ==", flush=True)
    cmd = [sys.executable, "-m", "bench.bench_pipe", "--quick"]
    done = subprocess.run(cmd, cwd=common.REPO, stdout=subprocess.PIPE, text=True)
    print(done.stdout, end="")
    rc = rc or done.returncode
    if not done.returncode:  # kept beside the kernels' results, stamped like them
        st = common.stamp()
        head = f"# bench_pipe | {st.device} | {st.git_sha} | {st.date}\n"
        (common.results_dir() / "pipe.txt").write_text(head + done.stdout)
    print(f"\nmake bench: {time.monotonic() - started:.0f} s in all")
    if not common.on_gpu():
        print(GPU_NOTE)
    return rc


if __name__ == "__main__":
    sys.exit(main())
