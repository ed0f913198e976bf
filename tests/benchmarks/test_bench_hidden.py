"""bench/bench_hidden.py without servers: the summary's ratios, and no ratio from a failed row."""

from __future__ import annotations

from bench.bench_hidden import SETUPS, summary


def _row(name, tps, failed=0):
    return {"setup": name, "tokens_per_s": tps, "wall_s": 1.0, "failed": failed}


def test_summary_ratios() -> None:
    rows = [_row("plain", 300.0), _row("tritonkv-net", 150.0), _row("example", 100.0, failed=2)]
    lines = summary(rows)
    assert lines[2] == "| plain | 300.0 | 1.0 | 0 | 1.00 | - |"
    assert lines[3] == "| tritonkv-net | 150.0 | 1.0 | 0 | 0.50 | - |"  # example failed: no ratio
    assert lines[4] == "| example | 100.0 | 1.0 | 2 | - | - |"
    assert SETUPS[0] == "plain" and "example" in SETUPS
