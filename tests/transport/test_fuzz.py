"""A short, fixed-seed pass of the coverage-guided fuzz target (``tests/transport/fuzz_wire.py``; `make fuzz`
runs it for 10 minutes): libFuzzer stops with a non-zero exit at the first crash, input slower than
one second, or failed check, and prints the input."""

from __future__ import annotations

import importlib.util
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parent / "fuzz_wire.py"
RUNS = 30000

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("atheris") is None,
    reason="atheris (libFuzzer for Python) has no wheel for this platform; see pyproject's test extra",
)


def test_fuzz_wire_short_fixed_seed_pass(tmp_path):
    corpus = tmp_path / "corpus"
    # Linux carries a process's peak RSS across exec, and libFuzzer reads that peak: a child of
    # this pytest process (vLLM imported: 2 GB and more) starts out "using" the parent's peak.
    # The limit is 2 GiB above it (libFuzzer's default budget, on top of what was inherited).
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    cmd = [sys.executable, str(FUZZ), f"-runs={RUNS}", "-seed=1", "-timeout=10", "-max_len=4096"]
    cmd.append(f"-rss_limit_mb={inherited_mb + 2048}")
    proc = subprocess.run(
        [*cmd, "-print_final_stats=1", str(corpus)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=FUZZ.parent.parent,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert f"Done {RUNS} runs" in out, out[-3000:]
    executed = int(re.search(r"number_of_executed_units: (\d+)", out).group(1))
    assert executed >= RUNS
    assert len(list(corpus.iterdir())) >= 10  # the seeds, and what coverage added
