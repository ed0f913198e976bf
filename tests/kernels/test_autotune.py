"""Autotuning leaves no trace in a call's results: the first launch of each key, which times
every config by running the kernel again and again, gives the same packed rows, cache writes and
digest as any later launch.

On a GPU the autotuner times 13 configs (tritonkv._autotune); here, under the interpreter, which
has one config, each copy kernel gets two, and a stand-in for ``do_bench`` runs a config three
times as the real one runs it many: without the autotuner's ``restore_value`` the digest's lane
sums of those runs add up (7 launches' worth instead of 1).
"""

from __future__ import annotations

import pytest
import torch
import triton
from support.kv_cases import bits, like_with_sentinel, make_cache

from tritonkv import (
    _hidden_triton,
    _kv_triton,
    kv_digest,
    pack_hidden,
    pack_kv,
    unpack_hidden,
    unpack_kv,
)
from tritonkv.digest import digest_hex, packed_digest

RUNS_PER_CONFIG = 3


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


def test_the_first_kv_launch_of_a_key_gives_the_right_digest(tuning) -> None:
    raw, layers = make_cache(
        "flash_attn_nhd", torch.float32, head_size=8, num_blocks=5, block_size=4
    )
    slots = torch.tensor([3, 17, -1, 0, 19, 8, 9, 10, 11, 5], dtype=torch.int64)
    qsl = torch.tensor([0, 4, 10], dtype=torch.int32)
    packed, _, d_pack = pack_kv(layers, slots, qsl, digest=True)
    assert len(tuning) == 2 * RUNS_PER_CONFIG  # it did tune (else this test shows nothing)
    want = digest_hex(packed_digest(packed))
    assert digest_hex(d_pack) == want
    dst_raw, dst_layers = like_with_sentinel(raw, "flash_attn_nhd")
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


def test_the_first_hidden_launch_of_a_key_gives_the_right_digest(tuning) -> None:
    hidden = torch.randn(11, 12, generator=torch.Generator().manual_seed(3))
    qsl = torch.tensor([0, 4, 11], dtype=torch.int32)
    packed, _, d_pack = pack_hidden(hidden, qsl, digest=True)
    assert len(tuning) == 2 * RUNS_PER_CONFIG
    want = digest_hex(packed_digest(packed))
    assert digest_hex(d_pack) == want
    dst = torch.zeros_like(hidden)
    assert digest_hex(unpack_hidden(packed, dst, qsl, digest=True)) == want
    assert torch.equal(bits(dst), bits(hidden))
