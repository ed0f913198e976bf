"""bench/bench_cpu_copy.py: its numba candidate is bit-exact with the C library and the NumPy
reference (lanes of odd sizes and unaligned starts; packs and unpacks of NHD and HND caches of
several dtypes and head sizes, padding rows, sentinels), on one thread here and on numba's threads
in a worker process of its own, as the benchmark runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("numba")

from bench import bench_cpu_copy as bench
from tritonkv import _cpu_digest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lib():
    native = _cpu_digest.native()
    if native is None:
        pytest.skip(f"no C library to compare with: {_cpu_digest.backend()}")
    return native


def test_lanes_equal_the_c_and_the_reference(lib):
    bench.check_lanes(lib)


@pytest.mark.parametrize("unpack", [False, True], ids=["pack", "unpack"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize(
    "dtype,heads,head_size,block_size",
    [
        (torch.bfloat16, 4, 128, 16),
        (torch.bfloat16, 3, 6, 4),  # heads of 12 bytes: runs shorter than a vector
        (torch.float32, 1, 5, 1),  # one head: the views' head stride never read
        (torch.uint8, 2, 36, 2),
    ],
    ids=["bf16", "bf16-short-heads", "fp32-one-head", "uint8"],
)
@pytest.mark.parametrize("nbytes", [1, 3000, 70000])
def test_copies_equal_the_c_and_the_reference(
    lib, unpack, layout, dtype, heads, head_size, block_size, nbytes
):
    """copy_fn checks the lanes against the NumPy reference and the bytes against torch indexing
    (sentinel-filled first) before it returns; both implementations pass the same case."""
    case = bench.make_case(
        nbytes, seed=nbytes, layout=layout, heads=heads, head_size=head_size, dtype=dtype,
        block_size=block_size,
    )  # fmt: skip
    for impl in ("c", "numba"):
        bench.copy_fn(impl, lib, case, unpack=unpack, workers=1)


def test_threaded_worker_checks_and_times(lib):
    """The threaded worker (numba's threads, a process of its own): checked copies, timed."""
    cmd = [sys.executable, "-m", "bench.bench_cpu_copy", "--worker", "numba", "--threads", "2"]
    cmd += ["--rounds", "1", "--sizes", "65536"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(out) == {"pack 65536", "unpack 65536", "layer"}
    assert all(out[k] > 0 for k in ("pack 65536", "unpack 65536"))
