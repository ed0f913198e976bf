"""The Triton kernels compile for sm_90 (H100/H200) on a machine without a GPU, with 16-byte accesses.

The interpreter never runs Triton's compiler, so without this test a kernel that only fails to
compile (an int argument specialised to 1, a type error) would first show on a GPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_compile_sm90.py")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kernels_compile_for_sm90_with_vector_accesses(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    run = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=540
    )
    assert run.returncode == 0, run.stderr[-3000:]
    variants = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(variants) == 8, run.stdout
    for v in variants:
        assert v["cubin_bytes"] > 0
        # 16-byte vector loads and stores of the copied data (v2 of 8-byte elements).
        assert any(".v2.b64" in op or ".v4.b32" in op for op in v["loads"]), v
        assert any(".v2.b64" in op or ".v4.b32" in op for op in v["stores"]), v
