"""bench/bench_umac.py runs (tiny sizes) and checks before it times: its copy, NH against the
NumPy reference and the tag against the host's."""

from __future__ import annotations

import pytest
import torch

from bench import bench_umac


def test_dry_run_prints_every_provider(tmp_path, capsys):
    out = tmp_path / "umac.txt"
    bench_umac.main(["--dry-run", "--out", str(out)])
    text = out.read_text()
    for name in ("copy", "digest", "nh", "tag", "tag_over_copy", "load average"):
        assert name in text
    assert capsys.readouterr().out.strip() == text.strip()


def test_the_check_catches_a_wrong_copy():
    packed = bench_umac.packed_kv("tiny", 16, torch.device("cpu"))
    fns, dst = bench_umac.providers(packed)
    fns["copy"] = lambda: dst.zero_()  # a wrong copy
    with pytest.raises(AssertionError, match="copy differs"):
        bench_umac.check(packed, fns, dst)


def test_bad_tokens_are_refused():
    with pytest.raises(ValueError, match="expected a positive int"):
        bench_umac.main(["--tokens", "0"])
