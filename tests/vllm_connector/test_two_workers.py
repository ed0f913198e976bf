"""A producer and a consumer process driving the worker sides as vLLM does, through real KV
servers (support.two_workers): bit-exact loads, failures of one transfer recomputed, device
memory let go. On CPU the sides take their GPU path on stand-in streams; the ``gpu`` variant
(bench/gpu_check.sh) runs on one CUDA GPU with ``torch.cuda.set_sync_debug_mode("error")``
around the connector's calls and a CUDA graph reading the loaded blocks."""

from __future__ import annotations

import pytest
import torch
from support.two_workers import ROUNDS, SENTINEL, SIZES, blocks_of, pattern, run

from connector.serve.launch import free_port_run

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["socket", "gloo"])
@pytest.mark.parametrize("device", DEVICES)
def test_two_workers_move_kv_bit_exact_and_survive_allocation_failures(device, transport):
    got, saved = run(device, transport, free_port_run(1))
    count = SIZES[device][5] - 1
    for round_no, (name, _, _, loaded) in enumerate(ROUNDS):
        errors, read = got["rounds"][name]
        blocks = blocks_of(device, round_no, "consumer")
        if loaded:
            assert errors == set(), f"round {name}: load failed"
            want = pattern(device, round_no)[:, :, :count]
            same = read == want
            assert torch.all(same), f"round {name}: {int((~same).sum())} values differ"
        else:
            assert errors == set(blocks), f"round {name}: expected its blocks recomputed"
            assert torch.all(read == SENTINEL), f"round {name}: a failed load wrote KV"
    loaded = sum(r[3] for r in ROUNDS)
    assert (saved["saves"], saved["save_failures"]) == (len(ROUNDS) - 1, 1)
    stats = got["stats"]
    assert (stats["loads"], stats["load_failures"]) == (loaded, len(ROUNDS) - loaded)
    assert got["budget"] == 0, "device memory of settled loads not let go"
