"""The Triton kernels compile for sm_90 (H100/H200) on a machine without a GPU, with 16-byte accesses.

The interpreter never runs Triton's compiler, so without this test a kernel that only fails to
compile (an int argument specialised to 1, a type error) would first show on a GPU. The kernels are
private (``tritonkv._kv_triton``, ``_hidden_triton``, ``_index``), compiled here on purpose.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "compile_sm90.py"
ROOT = SCRIPT.parents[2]  # the checkout whose kernels are compiled (not an installed tritonkv)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kernels_compile_for_sm90_with_vector_accesses(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    run = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=540
    )
    assert run.returncode == 0, run.stderr[-3000:]
    variants = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    copies = [v for v in variants if v["kernel"] in ("kv", "kv-pages", "hidden")]
    index = [v for v in variants if v["kernel"] == "index"]
    digests = [v for v in variants if "digest" in v["kernel"]]
    assert (len(copies), len(index), len(digests)) == (8, 8, 7), run.stdout
    for v in copies:  # the digest off: no atomics, nothing but the copy
        assert not v["atomics"], v
    for v in digests:  # the digest's lane sums land with 64-bit atomic adds
        assert v["cubin_bytes"] > 0
        assert any(op.startswith("atom.global") and "64" in op for op in v["atomics"]), v
        if v["kernel"] not in ("digest-bytes", "digest-words"):  # the copy's 16-byte loads
            assert any(".v2.b64" in op or ".v4.b32" in op for op in v["loads"]), v
    assert all(v["cubin_bytes"] > 0 for v in index)
    (nh,) = [v for v in variants if v["kernel"] == "umac-nh"]  # the keyed payload hash
    assert nh["cubin_bytes"] > 0 and not nh["atomics"] and nh["loads"], nh
    for v in copies:
        assert v["cubin_bytes"] > 0
        # 16-byte vector loads and stores of the copied data (v2 of 8-byte elements).
        assert any(".v2.b64" in op or ".v4.b32" in op for op in v["loads"]), v
        assert any(".v2.b64" in op or ".v4.b32" in op for op in v["stores"]), v


@pytest.mark.parametrize("setting,count", [(None, 13), ("1", 13), ("0", 1)])
def test_autotune_configs_and_the_switch_that_turns_tuning_off(monkeypatch, setting, count):
    """13 launch configs (one pipeline stage each) to tune on a GPU, or the one default config
    with ``TRITONKV_AUTOTUNE=0`` (and always under the interpreter). The configs are internal
    (``tritonkv._autotune``): the ops' results do not depend on them."""
    from tritonkv import _autotune

    monkeypatch.setattr(_autotune, "interpreting", lambda: False)
    if setting is None:
        monkeypatch.delenv("TRITONKV_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("TRITONKV_AUTOTUNE", setting)
    configs = _autotune.autotune_configs()
    assert len(configs) == count
    assert len({str(c) for c in configs}) == count
    if count == 1:
        assert configs[0].kwargs == {"BLOCK_T": 16} and configs[0].num_warps == 4
    else:
        assert all(c.num_stages == 1 for c in configs)
