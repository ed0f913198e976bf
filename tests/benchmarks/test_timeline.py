"""bench/timeline.py without servers: its sitecustomize files, the hook, and the split of a leg."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench import timeline

EVENTS = [
    (10.001, "api_add>"),
    (10.002, "core_add>"),
    (10.003, "exec>"),
    (10.007, "exec<"),
    (10.008, "update<"),
    (10.009, "exec>"),  # the next step: not part of the split
    (10.0095, "api_out<"),
]


def test_split_leg_takes_each_event_after_the_previous_one():
    split = timeline.split_leg([(9.5, "api_out<"), *EVENTS], 10.0, 10.012)
    assert split == pytest.approx([1.0, 1.0, 1.0, 4.0, 1.0, 1.5, 2.5], abs=1e-6)
    assert timeline.split_leg(EVENTS[:4], 10.0, 10.012) is None  # no update<: no split


def test_table_gives_each_segments_median_and_the_total():
    lines = timeline.table({("tritonkv", 64): [[1.0] * 7, [3.0] * 7, [2.0] * 7]})
    assert lines[0] == "tritonkv 64 tokens (3 legs):"
    assert lines[1].split()[-1] == "2.00" and lines[-1].split()[-1] == "14.00"
    assert len(lines) == 1 + len(timeline.SEGMENTS) + 2


def test_the_hook_times_a_vllm_method_through_sitecustomize(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline.bench_pd, "BENCH", timeline.REPO / "bench")
    site = timeline.site_dirs(tmp_path / "site")
    assert "nixl" in (tmp_path / "site" / "nixl_tuned" / "sitecustomize.py").read_text().lower()
    logs = tmp_path / "events"
    logs.mkdir()
    code = (
        "import vllm.v1.core.sched.scheduler as s, os\n"
        "f = s.Scheduler.update_from_output\n"
        "try:\n    f(None, None, None)\nexcept Exception:\n    pass\n"
        "print(f.__wrapped__ is not f, os.getpid())"
    )
    env = dict(os.environ, PYTHONPATH=str(site), TKV_TIMELINE_DIR=str(logs))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    wrapped, pid = out.stdout.split()[-2:]
    assert wrapped == "True"
    events = timeline.read_events(logs, [int(pid)])
    assert [e for _, e in events] == ["update>", "update<"]  # the call, even one that raised
