"""Smoke test of the benchmarks: a tiny configuration end to end on the CPU (no timed assertions).

Every provider's result is checked bit for bit inside the benchmark before it is timed, so a run
that finishes also says the loop / torch / copy baselines and tritonkv agree.
"""

from __future__ import annotations

import csv
import json
import math
import re

import pytest
import torch

from bench import bench_kv, common

PROVIDERS = set(bench_kv.providers("unpack_kv"))  # every line of every plot


def _rows(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == common.COLUMNS
        return list(reader)


def _check_row(row: dict) -> None:
    assert row["provider"] in PROVIDERS
    for col in ("p50_ms", "p20_ms", "p80_ms"):
        value = float(row[col])
        assert math.isfinite(value) and value > 0, (col, row)
    assert float(row["p20_ms"]) <= float(row["p50_ms"]) <= float(row["p80_ms"]), row
    assert int(row["x"]) > 0 and int(row["bytes"]) > 0
    assert row["device"] and row["torch"] and row["triton"] and row["git_sha"] and row["date"]
    if row["sweep"] == "tokens":
        assert float(row["gbps"]) > 0 and float(row["frac_copy"]) > 0, row
    else:
        assert row["gbps"] == "" and row["frac_copy"] == "", row
    assert float(row["vs_loop"]) > 0, row


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU suite's file layout")
def test_cpu_suite_tiny(tmp_path):
    assert bench_kv.main(["--suite", "cpu", "--dry-run", "--outdir", str(tmp_path)]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    for op in ("pack_kv", "unpack_kv", "pack_hidden"):
        for sweep in ("tokens", "seqs"):
            rows = _rows(tmp_path / f"{op}-{sweep}.csv")
            assert {(r["op"], r["sweep"]) for r in rows} == {(op, sweep)}
            assert {r["provider"] for r in rows} == set(bench_kv.providers(op))
            assert len({r["x"] for r in rows}) == 2
            for row in rows:
                _check_row(row)
            copies = [r for r in rows if r["provider"] == "copy" and r["sweep"] == "tokens"]
            assert all(float(r["frac_copy"]) == 1 for r in copies)
            if common.have_matplotlib():
                assert f"{op}-{sweep}.png" in names
    assert "kernels-summary.txt" in names


def test_gpu_check_outputs_dry_run(tmp_path):
    """The gpu-check mode's files (what bench/gpu_check.sh collects), from a tiny CPU run."""
    argv = ["--suite", "gpu-check", "--dry-run", "--only", "pack_kv", "--outdir", str(tmp_path)]
    assert bench_kv.main(argv) == 0
    rows = _rows(tmp_path / "bench.csv")
    assert {r["sweep"] for r in rows} == {"tokens", "seqs"}
    for row in rows:
        _check_row(row)
    configs = json.loads((tmp_path / "autotune.json").read_text())["configs"]
    assert configs and all(isinstance(v, str) for v in configs.values())
    assert "pack_kv" in (tmp_path / "profile.txt").read_text()
    assert len(list(tmp_path.iterdir())) <= 8


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for machines without a GPU")
def test_gpu_check_script_dry_run(tmp_path):
    """bench/gpu_check.sh itself (bash, the steps, the file list) on the CPU with tiny sizes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run(
        [str(script), "--dry-run", str(tmp_path / "out dir")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    files = {p.name for p in (tmp_path / "out dir").iterdir()}
    assert {"gpu_check.log", "pytest.log", "workers.log", "host_overhead.txt", "bench.csv",
            "autotune.json", "profile.txt"} <= files  # fmt: skip
    assert len(files) <= 10
    log = (tmp_path / "out dir" / "gpu_check.log").read_text()
    assert "gpu tests: passed" in log and "(exit 0)" in log
    assert "bench_umac: tag_over_copy" in log  # the keyed payload hash's step
    assert "pack_kv" in (tmp_path / "out dir" / "host_overhead.txt").read_text()


def test_gpu_check_keeps_what_it_measured_when_a_step_fails(tmp_path, monkeypatch, capsys):
    """A step that raises (here the first plan) is reported and the run goes on: the other
    plans' rows, the launch check and the files are still written, and the exit status is 1."""
    real_run = bench_kv.Runner.run

    def run(self, plan):
        if plan.sweep == "tokens":
            raise RuntimeError("boom")
        return real_run(self, plan)

    monkeypatch.setattr(bench_kv.Runner, "run", run)
    argv = ["--suite", "gpu-check", "--dry-run", "--only", "pack_kv", "--outdir", str(tmp_path)]
    assert bench_kv.main(argv) == 1
    assert "FAILED steps (1): pack_kv tokens tiny/NHD" in capsys.readouterr().out
    rows = _rows(tmp_path / "bench.csv")
    assert rows and {r["sweep"] for r in rows} == {"seqs"}
    assert "pack_kv" in (tmp_path / "profile.txt").read_text()


def test_suites_are_well_formed():
    for name in ("cpu", "gpu", "gpu-check"):
        plans = bench_kv.suite(name)
        assert plans and all(p.model in bench_kv.MODELS for p in plans)
        assert {p.op for p in plans} == {"pack_kv", "unpack_kv", "pack_hidden"}
        cases = {(p.model, p.layout) for p in plans if p.op == "pack_kv" and p.sweep == "tokens"}
        assert set(bench_kv.KV_CASES) <= cases
    assert max(bench_kv.suite("gpu")[0].xs) == 32768
    assert max(bench_kv.suite("cpu")[0].xs) <= 8192
    cpu_cases = {(p.model, p.layout) for p in bench_kv.suite("cpu")}
    assert {("llama3-8b", "vllm_cpu"), ("llama3-8b", "vllm_cpu_pages")} <= cpu_cases


@pytest.mark.parametrize("layout", ["vllm_cpu", "vllm_cpu_pages"])
@pytest.mark.parametrize("op", ["pack_kv", "unpack_kv"])
def test_vllm_cpu_case_points_check_every_provider(op, layout):
    """The vllm-cpu layout cases: building a point runs all four providers and compares bits."""
    plan = bench_kv.Plan(op, "tokens", "tiny", layout, (64,))
    point = bench_kv.CaseBuffers(plan, torch.device("cpu")).point(64)
    assert set(point.fns) == set(bench_kv.providers(op)) and point.bytes == 64 * 4 * 2 * 2 * 64 * 2


def test_batch_layout_is_block_by_block():
    """Consecutive tokens of a sequence share blocks; unselected 1-token decodes sit in between."""
    table = torch.tensor([5, 2, 7, 0, 3, 1, 6, 4])
    batch = bench_kv.make_batch(40, "tokens", 16, table, "cpu")
    assert batch.query_start_loc.tolist() == [0, 40, 41]
    assert batch.seq_ids.tolist() == [0]
    slots = batch.slot_mapping.tolist()
    assert slots[:16] == list(range(80, 96)) and slots[16:32] == list(range(32, 48))
    assert slots[32:40] == list(range(112, 120)) and slots[40] == 8 * 16


def test_paired_ratio_follows_each_round_not_the_medians():
    # Four of five rounds the provider took twice copy's time (0.5 x copy); the medians of the two
    # columns come from different rounds and would say 2 x copy.
    copy = [1.0, 1.0, 4.0, 4.0, 4.0]
    mine = [2.0, 2.0, 2.0, 8.0, 8.0]
    assert common.paired_ratio(copy, mine) == 0.5
    assert sorted(copy)[2] / sorted(mine)[2] == 2.0
    assert common.paired_ratio(copy, copy) == 1.0


def test_host_kind_names_the_widest_cpu_feature(monkeypatch):
    """Result folders are named by host kind: AMX before AVX-512 before AVX2, else the machine."""
    monkeypatch.setattr(common, "on_gpu", lambda: False)
    for flags, kind in (
        ({"avx2", "avx512f", "amx_tile"}, "cpu-amx"),
        ({"avx2", "avx512f"}, "cpu-avx512"),
        ({"avx2"}, "cpu-avx2"),
    ):
        monkeypatch.setattr(common, "_cpuinfo", lambda flags=flags: ("Some CPU", flags))
        assert common.host_kind() == kind
    monkeypatch.setattr(common, "_cpuinfo", lambda: ("Some CPU", set()))
    assert common.host_kind().startswith("cpu-") and common.host_kind() != "cpu-"
    assert common.host_description().startswith("cpu: Some CPU (cpu-")
    monkeypatch.setattr(common, "on_gpu", lambda: True)
    monkeypatch.setattr(common, "device_name", lambda: "NVIDIA H200")
    assert common.host_kind() == "h200"


def test_result_folders_are_host_kinds_and_files_name_no_run():
    """bench/results/ holds one folder per host kind, and no file is named by a run."""
    for folder in common.RESULTS.iterdir():
        assert folder.is_dir(), folder
        assert folder.name.startswith("cpu-") or folder.name.isalnum(), folder
        for path in folder.rglob("*"):
            assert path.is_file() and not re.search(r"-s\d+|run\d", path.name), path


def test_make_bench_keeps_the_pipe_output_stamped(tmp_path, monkeypatch, capsys):
    """run_all: the kernel suite, then bench_pipe, whose output lands in the host kind's folder
    under a line naming host, commit and date."""
    import subprocess

    from bench import run_all

    monkeypatch.setattr(bench_kv, "main", lambda argv: 0)
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    done = subprocess.CompletedProcess([], 0, stdout="pipe/raw throughput ratio at 64 MiB: 1.2\n")
    monkeypatch.setattr(run_all.subprocess, "run", lambda *a, **k: done)
    assert run_all.main() == 0
    text = (tmp_path / common.host_kind() / "pipe.txt").read_text().splitlines()
    assert text[0].startswith("# bench_pipe | ") and common.git_sha() in text[0]
    assert text[1] == "pipe/raw throughput ratio at 64 MiB: 1.2"
    assert "pipe/raw" in capsys.readouterr().out


@pytest.mark.slow
def test_pipe_throughput_measures_every_provider_between_two_processes():
    """bench_pipe's throughput over a real two-process pipe: every provider gives a rate, the
    ``entry`` one included, whose receiver checks each message's tag with the NH outputs it
    computed from the first one it got (a wrong check would end the child and the run)."""
    from bench import bench_pipe

    [(mib, reps, gbps)] = bench_pipe.throughput([1], 1, "gloo", "cpu", "cpu")
    assert (mib, reps) == (1, 32)
    assert set(gbps) == {"raw", "pipe", "pipe_out", "entry"}
    assert all(math.isfinite(g) and g > 0 for g in gbps.values()), gbps
