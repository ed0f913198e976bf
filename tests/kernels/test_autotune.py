"""Autotuning leaves no trace in a call's results: the first launch of each key, which times
every config by running the kernel again and again, gives the same packed rows, cache writes and
digest as any later launch.

On a GPU the autotuner times 13 configs (tritonkv._autotune); here each copy kernel gets two,
and a stand-in for ``do_bench`` runs a config three times as the real one runs it many: without
the autotuner's ``restore_value`` the digest's lane sums of those runs add up (7 launches' worth
instead of 1). On CPU tensors under the interpreter, and on CUDA tensors (the ``gpu`` variants,
in ``bench/gpu_check.sh``, whose tests otherwise run with one config and never tune).
"""

from __future__ import annotations

import pytest
import torch
import triton
from support.kv_cases import DEVICES, bits

from tritonkv import (
    _hidden_triton,
    _kv_triton,
    kv_digest,
    layouts,
    pack_hidden,
    pack_kv,
    pack_kv_torch,
    unpack_hidden,
    unpack_kv,
)
from tritonkv.digest import digest_hex, packed_digest

RUNS_PER_CONFIG = 3
SENTINEL = -7.0


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def _layers(device: str, fill: float | None = None) -> list:
    """Two flash-attention layers ``[2, 5 blocks, 4, 2 heads, 8]`` fp32: random, or ``fill``."""
    g = torch.Generator().manual_seed(0)
    raws = [torch.randn(2, 5, 4, 2, 8, generator=g) for _ in range(2)]
    if fill is not None:
        raws = [torch.full_like(r, fill) for r in raws]
    return [layouts.flash_attn(r.to(device)) for r in raws]


@pytest.fixture
def tuning(monkeypatch):
    """Both copy kernels tune again at their next launch of any key, over two configs, each
    timed by running it ``RUNS_PER_CONFIG`` times; yields the number of timing runs so far."""
    monkeypatch.setenv("TRITONKV_KERNELS", "triton")
    runs = []
    for launch in (_kv_triton._KV_COPY, _hidden_triton._HIDDEN_COPY):
        autotuner = launch.kernel
        configs = [triton.Config({"BLOCK_T": b}, num_warps=4) for b in (16, 8)]

        def bench(fn, quantiles=None):
            for _ in range(RUNS_PER_CONFIG):
                fn()
                runs.append(1)
            return [float(len(runs))] * 3  # the first config timed is the fastest

        monkeypatch.setattr(autotuner, "configs", configs)
        monkeypatch.setattr(autotuner, "do_bench", bench)
        monkeypatch.setattr(autotuner, "cache", {})
        monkeypatch.setattr(launch, "configs", {})
    return runs


def test_the_first_kv_launch_of_a_key_gives_the_right_digest(tuning, device) -> None:
    layers = _layers(device)
    slots = torch.tensor([3, 17, -1, 0, 19, 8, 9, 10, 11, 5], dtype=torch.int64, device=device)
    qsl = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    packed, _, d_pack = pack_kv(layers, slots, qsl, digest=True)
    assert len(tuning) == 2 * RUNS_PER_CONFIG  # it did tune (else this test shows nothing)
    want = digest_hex(packed_digest(packed))
    assert digest_hex(d_pack) == want
    dst_layers = _layers(device, SENTINEL)
    d_unpack = unpack_kv(packed, dst_layers, slots, qsl, digest=True)
    assert digest_hex(d_unpack) == want
    assert digest_hex(kv_digest(layers, slots, qsl)) == want
    assert len(tuning) == 3 * 2 * RUNS_PER_CONFIG  # pack, unpack, digest-only: a key each
    again, _, d_again = pack_kv(layers, slots, qsl, digest=True)  # tuned: one launch
    assert len(tuning) == 3 * 2 * RUNS_PER_CONFIG
    assert torch.equal(bits(again), bits(packed)) and digest_hex(d_again) == want
    # the tuning runs of the unpack wrote the same rows: the cache holds them, once
    check = pack_kv(dst_layers, slots, qsl)[0]
    assert torch.equal(bits(check), bits(packed))


def test_the_first_hidden_launch_of_a_key_gives_the_right_digest(tuning, device) -> None:
    hidden = torch.randn(11, 12, generator=torch.Generator().manual_seed(3)).to(device)
    qsl = torch.tensor([0, 4, 11], dtype=torch.int32, device=device)
    packed, _, d_pack = pack_hidden(hidden, qsl, digest=True)
    assert len(tuning) == 2 * RUNS_PER_CONFIG
    want = digest_hex(packed_digest(packed))
    assert digest_hex(d_pack) == want
    dst = torch.zeros_like(hidden)
    assert digest_hex(unpack_hidden(packed, dst, qsl, digest=True)) == want
    assert torch.equal(bits(dst), bits(hidden))


def test_tuning_never_writes_the_callers_slot_mapping(tuning, device) -> None:
    """Without the digest, the pointer the autotuner puts back after each timing run is the
    call's own index, not the caller's slot mapping: vLLM's may be written by another stream
    meanwhile, or be an inference-mode tensor, which a write outside that mode refuses."""
    layers = _layers(device)
    with torch.inference_mode():
        slots = torch.tensor([3, 17, -1, 0, 19, 8, 9, 10, 11, 5], dtype=torch.int64, device=device)
    qsl = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    packed, _ = pack_kv(layers, slots, qsl)
    assert len(tuning) == 2 * RUNS_PER_CONFIG
    assert torch.equal(bits(packed), bits(pack_kv_torch(layers, slots, qsl)[0]))


def test_the_hidden_kernel_skips_configs_that_would_spill() -> None:
    """Tiles over 128 elements per thread are left out of the tuning (at hidden size 4096, 64
    tokens by 1024 columns on 4 warps is 512 a thread); where none fits, the smallest stays."""
    configs = [
        triton.Config({"BLOCK_T": t}, num_warps=w)
        for t in (4, 8, 16, 32, 64)
        for w in (2, 4, 8)
        if not (t >= 32 and w == 2)
    ]
    fit = _hidden_triton.configs_that_fit(configs, {}, BLOCK_H=1024)
    kept = {(c.kwargs["BLOCK_T"], c.num_warps) for c in fit}
    assert kept == {(4, 2), (8, 2), (4, 4), (8, 4), (16, 4), (4, 8), (8, 8), (16, 8), (32, 8)}
    assert _hidden_triton.configs_that_fit(configs, {}, BLOCK_H=16) == configs
    [least] = _hidden_triton.configs_that_fit(configs[:6], {}, BLOCK_H=1 << 20)
    assert (least.kwargs["BLOCK_T"], least.num_warps) == (4, 8)
