"""How registered caches map to tritonkv views and what a producer can send
(:mod:`connector.vllm_connector.cache_views`), without vLLM."""

from __future__ import annotations

import pytest
import torch
from support.connector_sides import HEAD_SIZE, NHD, OPAQUE, caches, consumer, producer

from connector.vllm_connector.cache_views import layer_views


@pytest.mark.parametrize(
    "shape,use_mla,expected",
    [
        ((2, 6, 16, 2, 8), False, "flash_attn"),
        ((6, 2, 16, 2, 8), False, "flashinfer"),
        ((6, 16, 576), True, "mla"),
        ((6, 2, 16, 16), False, "vllm_cpu"),  # on vLLM's CPU platform: CPU_ATTN's layout
        ((6, 3, 16, 5), False, "opaque_pages"),  # unknown interior: whole pages
    ],
)
def test_layer_views_by_shape(shape, use_mla, expected):
    head_size = 576 if use_mla else 8
    cache = torch.zeros(shape, dtype=torch.bfloat16)
    (k, v), name = layer_views(cache, head_size, 16, use_mla=use_mla, on_cpu=True, isa="vec")
    assert name == expected
    assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    assert (v is None) == (expected in ("mla", "opaque_pages"))


def test_layer_views_refuses_what_it_cannot_copy():
    cache = torch.zeros(16, 6, 5).transpose(0, 1)  # pages not contiguous, unknown layout
    with pytest.raises(ValueError, match="unsupported KV cache layout"):
        layer_views(cache, 8, 16, use_mla=False, on_cpu=True, isa="vec")


def test_layers_of_unlike_caches_are_refused_at_start():
    """One transfer holds every layer alike: caches that differ (DeepSeek-V3.2 registers its
    indexer caches beside the MLA ones) are refused when registered, not at the first save."""
    tensors = caches(NHD, num_layers=1) + caches((2, 6, 4, 1, HEAD_SIZE), num_layers=1)
    with pytest.raises(ValueError, match="differ in shape or dtype"):
        producer(tensors, 4)


def _block_inner_flashinfer():
    """A FlashInfer-shaped ``[B, 2, N, H, D]`` cache whose memory has blocks inside: a block's
    page is spread over the whole tensor."""
    return torch.zeros(2, 4, 6, 2, HEAD_SIZE, dtype=torch.bfloat16).permute(2, 0, 1, 3, 4)


@pytest.mark.parametrize(
    "kv_format,make_cache,match",
    [
        ("tokens", lambda: torch.zeros(OPAQUE), "cannot address this cache: unknown layout"),
        ("pages", _block_inner_flashinfer, "one range of memory"),
    ],
)
def test_a_kv_format_the_cache_cannot_give_is_refused_at_start(kv_format, make_cache, match):
    from connector.vllm_connector.config import ConnectorConfig

    with pytest.raises(ValueError, match=match):
        producer([make_cache()], 4, kv_format=kv_format)
    # a consumer takes what comes
    consumer([make_cache()], 4, cfg=ConnectorConfig(kv_format=kv_format)).shutdown()
