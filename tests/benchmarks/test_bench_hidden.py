"""bench/bench_hidden.py without servers: the summary's medians and ratios, and no ratio from a failed row;
bench/hidden_extract.py's dry run (its table, and its bit-exactness check, which can fail)."""

from __future__ import annotations

import argparse
import inspect

import pytest
import torch

from bench import hidden_extract
from bench.bench_hidden import MODELS, SETUPS, setup_label, summary
from connector.serve.tiny_model import build_tiny_llama


def _row(name, tps, failed=0):
    return {"setup": name, "tokens_per_s": tps, "wall_s": 1.0, "failed": failed}


def test_summary_medians_and_ratios() -> None:
    rows = [
        _row("plain", 300.0), _row("plain", 100.0), _row("plain", 200.0),
        _row("tritonkv-net", 150.0), _row("tritonkv-net", 50.0),
        _row("example", 100.0, failed=2),
    ]  # fmt: skip
    lines = summary(rows)
    assert lines[2] == "| plain | 200.0 | 100-300 | 3 | 0 | 1.00 | - | - |"
    # the median of two batches is their mean; example failed: no ratio to it
    assert lines[3] == "| tritonkv-net | 100.0 | 50-150 | 2 | 0 | 0.50 | - | - |"
    assert lines[4] == "| example | 100.0 | 100-100 | 1 | 2 | - | - | - |"
    assert SETUPS[0] == "plain" and "example" in SETUPS and "spec-only" in SETUPS


def test_setup_labels() -> None:
    """NAME, NAME#k (another server of it), tritonkv-...+core0 (its threads on the model's core)."""
    for good in ("tritonkv-files+core0", "tritonkv-net+core0#2", "spec-only#2", "plain"):
        assert setup_label(good) == good
    for bad in ("plain+core0", "nope", "spec-only#a", "tritonkv-files+core1"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected one of"):
            setup_label(bad)


def test_models_are_build_arguments() -> None:
    """Every shape of ``--model`` names only arguments ``build_tiny_llama`` takes; ``pd-link`` is
    not the tiny default."""
    params = inspect.signature(build_tiny_llama).parameters
    for name, shape in MODELS.items():
        assert set(shape) <= set(params), name
    assert MODELS["tiny"] == {}
    assert MODELS["pd-link"]["hidden_size"] != params["hidden_size"].default


def test_hidden_extract_dry_run(tmp_path) -> None:
    out = tmp_path / "hidden.txt"
    assert hidden_extract.main(["--dry-run", "--out", str(out)]) == 0
    rows = [
        line for line in out.read_text().splitlines() if line.startswith("| ") and "x |" in line
    ]
    providers = {line.split(" | ")[2] for line in rows}
    assert providers == {"example", "tritonkv", "tritonkv-worker"}
    assert len(rows) == 3 * len(hidden_extract.NUM_SEQS)


def test_hidden_extract_check_sees_wrong_rows(monkeypatch) -> None:
    """The negative control of the providers' check: a provider that returns other rows."""
    step = hidden_extract.Step(hidden_extract.CPU_SETUP, 8, torch.device("cpu"))
    try:
        hidden_extract.check(step)
        real = step.tritonkv
        monkeypatch.setattr(step, "tritonkv", lambda: [r + 1 for r in real()])
        with pytest.raises(AssertionError, match="tritonkv: rows differ"):
            hidden_extract.check(step)
    finally:
        step.close()
