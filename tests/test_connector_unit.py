"""Unit tests of the vLLM connector's pieces that need no running engine: config, layouts, stats."""

from __future__ import annotations

import pytest
import torch
from _vllm_fixtures import requires_vllm

pytestmark = requires_vllm


@pytest.fixture(scope="module")
def vc():
    from connector import vllm_connector

    return vllm_connector


def test_config_defaults_and_overrides(vc):
    cfg = vc.ConnectorConfig.from_extra({"port": 15000, "fetch_timeout_s": 3, "backend": "torch"})
    assert (cfg.port, cfg.fetch_timeout_s, cfg.backend) == (15000, 3.0, "torch")
    assert vc.ConnectorConfig.from_extra(None) == vc.ConnectorConfig()
    assert vc.ConnectorConfig().async_load is False


@pytest.mark.parametrize(
    "extra,error,match",
    [
        ({"prot": 1}, ValueError, "unknown keys \\['prot'\\]"),
        ({"port": "14600"}, TypeError, "expected int, got str"),
        ({"port": True}, TypeError, "expected int, got bool"),
        ({"async_load": 1}, TypeError, "expected bool"),
        ({"full_policy": "drop"}, ValueError, "evict\\|wait\\|error"),
        ({"transport": "tcp"}, ValueError, "auto\\|gloo\\|nccl\\|socket"),
        ({"backend": "cuda"}, ValueError, "auto\\|torch\\|triton"),
        ({"fetch_timeout_s": 0}, ValueError, "fetch_timeout_s: expected > 0"),
        ({"port": 70000}, ValueError, "out of range"),
    ],
)
def test_config_rejects_bad_values(vc, extra, error, match):
    with pytest.raises(error, match=match):
        vc.ConnectorConfig.from_extra(extra)


def test_prompt_digest_tells_prompts_apart(vc):
    assert vc.prompt_digest([1, 2, 3]) == vc.prompt_digest((1, 2, 3))
    assert vc.prompt_digest([1, 2, 3]) != vc.prompt_digest([1, 2, 4])
    assert vc.prompt_digest([1, 2]) != vc.prompt_digest([1, 2, 0])


@pytest.mark.parametrize(
    "shape,use_mla,expected",
    [
        ((2, 6, 16, 2, 8), False, "flash_attn"),
        ((6, 2, 16, 2, 8), False, "flashinfer"),
        ((6, 16, 576), True, "mla"),
        ((6, 2, 16, 16), False, "vllm_cpu"),  # this is a CPU platform: CPU_ATTN's layout
        ((6, 3, 16, 5), False, "opaque_pages"),  # unknown interior: whole pages
    ],
)
def test_layer_views_by_shape(vc, shape, use_mla, expected):
    head_size = 576 if use_mla else 8
    cache = torch.zeros(shape, dtype=torch.bfloat16)
    (k, v), name = vc.layer_views(cache, head_size, 16, use_mla=use_mla)
    assert name == expected
    assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    assert (v is None) == (expected in ("mla", "opaque_pages"))


def test_layer_views_refuses_what_it_cannot_copy(vc):
    cache = torch.zeros(16, 6, 5).transpose(0, 1)  # pages not contiguous, unknown layout
    with pytest.raises(ValueError, match="unsupported KV cache layout"):
        vc.layer_views(cache, 8, 16, use_mla=False)


def test_stats_aggregate_and_reduce(vc):
    a, b = vc.TritonKVStats(), vc.TritonKVStats()
    assert a.is_empty()
    a.data["loads"] += 1
    a.data["fetch_ms"].append(2.0)
    b.data["loads"] += 2
    b.data["fetch_ms"].append(4.0)
    merged = a.aggregate(b).reduce()
    assert merged["loads"] == 3 and merged["avg_fetch_ms"] == 3.0
    rebuilt = vc.TritonKVConnector.build_kv_connector_stats(data=a.data)
    assert not rebuilt.is_empty()
