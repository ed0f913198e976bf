"""Direct launches (:mod:`tritonkv._launch`) pass exactly what Triton's own launch passes.

Checked without a GPU: a child process compiles the kernels for sm_90 and launches them into a
recording stub driver (``tests/support/direct_launches.py``), once through ``JITFunction.run`` and
once directly, with the same arguments; the GPU tests run the same path for real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INDEX_OUT_PTR = 8 + 2  # grid (3), stream, function, metadata, 2 hooks; then out_ptr is argument 2


@pytest.fixture(scope="module")
def report() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITONKV_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests" / "support")])
    run = subprocess.run(
        [sys.executable, str(REPO / "tests" / "support" / "direct_launches.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_direct_launches_are_on_for_this_triton(report):
    assert report["direct_enabled"], "this Triton's JITFunction.run no longer reads as mirrored"


def test_direct_copy_launch_passes_what_the_jit_launch_passes(report):
    """Every op variant, two layouts, three selections (rows 19, 18, 20), the packed tensor
    16-byte aligned and 8 bytes off: the second, direct launch equals the first, argument for
    argument, and runs no JIT binding."""
    assert len(report["cases"]) == 2 * 3 * 2 * 3
    for case in report["cases"]:
        what = {k: case[k] for k in ("layout", "ids", "shift", "unpack", "digest")}
        first, second = case["first"], case["second"]
        assert len(first["launches"]) == 1, what
        assert second["jit_runs"] == 0, what
        assert second["launches"] == first["launches"], what


def test_direct_launch_of_another_call_passes_what_its_jit_launch_passes(report):
    """A call with other values of the same specialisation (other rows, index tensors, packed
    strides) reuses the first call's kernel directly, with its own arguments: those its own JIT
    launch passes."""
    assert len(report["other_calls"]) == 2 * 2
    for case in report["other_calls"]:
        direct, jit = case["direct"], case["jit"]
        assert (direct["jit_runs"], jit["jit_runs"]) == (0, 1), case
        assert direct["launches"] == jit["launches"], case


def test_a_new_specialisation_goes_through_the_jit_first(report):
    """A packed tensor 8 bytes off 16-byte alignment (another Triton specialisation) is not
    launched with the aligned call's kernel: its first copy runs the JIT."""
    for case in report["cases"]:
        assert case["first"]["jit_runs"] >= 1, case


def test_second_call_of_the_public_ops_goes_direct(report):
    """pack_kv / unpack_kv with a prepared handle: two launches (index, copy), no JIT binding."""
    assert len(report["calls"]) == 4
    for call in report["calls"]:
        assert (call["launches"], call["jit_runs"]) == (2, 0), call


def test_direct_index_launch_passes_what_the_jit_launch_passes(report):
    jit, direct = report["index"]
    assert (jit["jit_runs"], direct["jit_runs"]) == (1, 0)
    for launch in (jit, direct):
        assert launch["args"][INDEX_OUT_PTR] == launch["out_address"]
    strip = lambda args: args[:INDEX_OUT_PTR] + args[INDEX_OUT_PTR + 1 :]
    assert strip(direct["args"]) == strip(jit["args"])


def test_direct_launch_feeds_registered_launch_hooks(report):
    """With a launch hook registered (as profilers do), the direct launch hands it the launch's
    metadata as Triton's own launch does (first launch: JIT; second: direct)."""
    if report["hooked"] is None:
        pytest.skip("this Triton's launch hooks are not a HookChain")
    assert report["hooked"] == ["_seq_index_kernel"] * 2
