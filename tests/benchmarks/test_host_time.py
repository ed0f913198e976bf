"""bench/host_time.py end to end, tiny: main's tree and this one measured, every row filled."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_host_time_compares_main_and_this_tree(tmp_path):
    out = tmp_path / "host_time.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITONKV_KERNELS")}
    run = subprocess.run(
        [sys.executable, "-m", "bench.host_time", "--calls", "3", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    text = out.read_text()
    assert f"({REPO / 'tritonkv'})" in text  # 'after' measured this tree, not an installed one
    rows = re.findall(
        r"^(llama3\S+)\s+(\w+)\s+(list|prepared)\s+([\d.]+)\s+([\d.]+)\s+2 -> 2$", text, re.M
    )
    assert len(rows) == 8, text  # 2 cases x 2 ops x 2 ways, each two launches before and after
    assert all(float(before) > 0 and float(after) > 0 for *_, before, after in rows)
