"""The hand-off's digest and parsing (:mod:`connector.vllm_connector.handoff`), without vLLM."""

from __future__ import annotations

import tritonkv
from connector.vllm_connector.handoff import (
    PROTOCOL,
    build_handoff,
    is_handoff,
    parse_handoff,
    prompt_digest,
)
from connector.vllm_connector.metadata import ReleaseSpec


def test_prompt_digest_tells_prompts_apart():
    assert prompt_digest([1, 2, 3]) == prompt_digest((1, 2, 3))
    assert prompt_digest([1, 2, 3]) != prompt_digest([1, 2, 4])
    assert prompt_digest([1, 2]) != prompt_digest([1, 2, 0])


def test_a_built_handoff_parses_back_to_where_its_entry_lives():
    params = build_handoff(
        transfer_id="t",
        host="10.0.0.1",
        engine_port=14602,
        num_tokens=3,
        prompt_token_ids=[1, 2, 3],
        fingerprint="fp",
        tp_size=2,
    )
    assert params["protocol"] == PROTOCOL and params["tritonkv_version"] == tritonkv.__version__
    assert params["prompt_digest"] == prompt_digest([1, 2, 3]) and params["num_tokens"] == 3
    assert is_handoff(params)
    assert parse_handoff(params) == ReleaseSpec("t", "10.0.0.1", 14602, 2)


def test_params_that_are_no_usable_handoff_parse_to_none():
    ours = {"do_remote_prefill": True, "protocol": "tritonkv-1", "transfer_id": "t"}
    assert is_handoff(ours)  # another protocol is still a tritonkv hand-off: refused by name
    assert parse_handoff(ours) is None  # but it says nowhere where its entry lives
    for params in (None, {"do_remote_decode": True}, {**ours, "protocol": "nixl"}):
        assert not is_handoff(params) and parse_handoff(params) is None
    odd_tp = {**ours, "remote_host": "h", "remote_port": 1, "tp_size": 0}
    assert parse_handoff(odd_tp).producer_tp == 1
