"""The hand-off's digest and parsing (:mod:`connector.vllm_connector.handoff`), without vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonkv
from connector.vllm_connector.handoff import (
    MAX_TP_SIZE,
    OVERLAP,
    PROTOCOL,
    build_handoff,
    handoff_problems,
    is_handoff,
    parse_handoff,
    prompt_digest,
    request_digest,
    shown,
    sign_handoff,
    signature_problem,
)
from connector.vllm_connector.metadata import DiscardSpec

TID = "0123456789abcdef" * 2


def _good(**changes) -> dict:
    params = build_handoff(
        transfer_id=TID,
        host="prefill-0.example",
        engine_port=14600,
        num_tokens=3,
        prompt_digest=prompt_digest([1, 2, 3]),
        fingerprint="fp",
        tp_size=2,
    )
    return {**params, **changes}


def test_prompt_digest_tells_prompts_apart():
    assert prompt_digest([1, 2, 3]) == prompt_digest((1, 2, 3))
    assert prompt_digest([1, 2, 3]) != prompt_digest([1, 2, 4])
    assert prompt_digest([1, 2]) != prompt_digest([1, 2, 0])


def _request(tokens=(1, 2, 3), *, lora=None, salt=None, mm=()):
    """What request_digest reads of a vLLM request."""
    return SimpleNamespace(
        prompt_token_ids=list(tokens),
        lora_request=None if lora is None else SimpleNamespace(lora_name=lora, lora_path="/x"),
        cache_salt=salt,
        mm_features=[
            SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=at, length=n))
            for ident, at, n in mm
        ],
    )


def test_the_request_digest_binds_what_else_decides_the_kv():
    """Same token ids under another LoRA adapter, cache_salt or image (or the image elsewhere)
    hold other KV: each gets its own digest; ids alone keep prompt_digest's."""
    plain = request_digest(_request())
    assert plain == prompt_digest([1, 2, 3])
    variants = [
        _request(lora="a"),
        _request(lora="b"),
        _request(salt="tenant-1"),
        _request(salt="tenant-2"),
        _request(mm=[("img-1", 0, 2)]),
        _request(mm=[("img-2", 0, 2)]),
        _request(mm=[("img-1", 1, 2)]),
        _request(mm=[("img-1", 0, 2), ("img-2", 2, 1)]),
        _request(lora="a", salt="tenant-1"),
    ]
    digests = [request_digest(r) for r in variants]
    assert len(set(digests)) == len(variants) and plain not in digests
    assert request_digest(_request(lora="a")) == digests[0]  # deterministic
    assert request_digest(_request(salt="")) == plain  # vLLM's "no salt"


def test_a_built_handoff_parses_back_to_where_its_entry_lives():
    params = _good()
    assert params["protocol"] == PROTOCOL and params["tritonkv_version"] == tritonkv.__version__
    assert params["prompt_digest"] == prompt_digest([1, 2, 3]) and params["num_tokens"] == 3
    assert is_handoff(params)
    assert handoff_problems(params) == []
    assert parse_handoff(params) == DiscardSpec(
        TID, "prefill-0.example", 14600, 2, prompt_digest=params["prompt_digest"]
    )


def test_params_that_are_no_usable_handoff_parse_to_none():
    ours = {"do_remote_prefill": True, "protocol": "tritonkv-1", "transfer_id": "t"}
    assert is_handoff(ours)  # another protocol is still a tritonkv hand-off: refused by name
    assert parse_handoff(ours) is None  # but it says nowhere where its entry lives
    for params in (None, {"do_remote_decode": True}, {**ours, "protocol": "nixl"}):
        assert not is_handoff(params) and parse_handoff(params) is None
    good = _good()
    assert parse_handoff(good) is not None
    assert parse_handoff({**good, "protocol": "tritonkv-1"}) is None
    assert parse_handoff({**good, "tp_size": 0}) is None


# What a client of vLLM's API can put in kv_transfer_params instead of a producer's values.
HOSTILE = {
    "remote_port": [2**63, -1, 0, 65536, 65535, 70000, True, 1.5, "14600", None],
    "tp_size": [2**63, 0, -2, MAX_TP_SIZE + 1, 3000, True, 2.0, "2", None],
    "transfer_id": ["t", "0" * 31, "0" * 33, "G" * 32, TID.upper(), "../" * 11, 7, None],
    "remote_host": ["", "a" * 254, "h\nINJECTED", "h h", "-h", "h..x", "[::1]", 5, None],
    "num_tokens": [0, -3, True, 2.0, "3", None],
    "prompt_digest": ["x", "0" * 31, 5, None],
    "fingerprint": ["f" * 1025, 1, None],
}


@pytest.mark.parametrize(
    ("key", "value"), [(k, v) for k, vs in HOSTILE.items() for v in vs], ids=shown
)
def test_a_hostile_value_in_any_field_is_refused_by_name_before_anything_is_dialed(key, value):
    params = _good(**{key: value})
    problems = handoff_problems(params)
    assert len(problems) == 1 and problems[0].startswith(key), problems
    assert parse_handoff(params) is None  # nothing to dial, nothing to discard
    assert len(problems[0]) < 300  # a client's value is shown cut short, never in full


def test_good_hosts_and_ports_at_the_edges_are_accepted():
    for host in ("10.0.0.1", "::1", "fe80::1", "prefill-0", "p.example.com", "p.example.com."):
        assert handoff_problems(_good(remote_host=host)) == [], host
    assert handoff_problems(_good(remote_port=1)) == []
    assert handoff_problems(_good(remote_port=65534, tp_size=2)) == []  # ranks on 65534, 65535
    assert handoff_problems(_good(remote_port=65535, tp_size=2))  # rank 1 would be past 65535
    assert handoff_problems(_good(tp_size=MAX_TP_SIZE)) == []


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(_good())), JSON, max_size=10))
def test_any_json_a_client_sends_parses_or_is_refused_without_raising(changes):
    params = _good(**changes)
    problems = handoff_problems(params)
    spec = parse_handoff(params)
    if spec is not None:
        assert problems == [] and 1 <= spec.port <= 65536 - spec.producer_tp
        assert 1 <= spec.producer_tp <= MAX_TP_SIZE


SECRET = b"k" * 32


@pytest.mark.parametrize(
    "change",
    [{k: "x"} for k in ("transfer_id", "remote_host", "prompt_digest", "fingerprint")]
    + [{"remote_port": 14601}, {"tp_size": 4}, {"num_tokens": 4}, {"protocol": "tritonkv-0"}],
    ids=lambda c: next(iter(c)),
)
def test_a_signed_handoff_with_any_field_changed_is_refused(change):
    signed = sign_handoff(_good(), SECRET, valid_s=60, now=1000.0)
    assert signature_problem(signed, SECRET, now=1010.0) == ""
    assert "is not the producer's" in signature_problem({**signed, **change}, SECRET, now=1010.0)


def test_a_signature_proves_the_secret_and_expires():
    signed = sign_handoff(_good(), SECRET, valid_s=60, now=1000.0)
    assert "is not the producer's" in signature_problem(signed, b"z" * 32, now=1010.0)
    assert "expired" in signature_problem(signed, SECRET, now=1061.0)
    moved = {**signed, "expires": signed["expires"] + 3600}  # a later expiry is a change too
    assert "is not the producer's" in signature_problem(moved, SECRET, now=1061.0)
    unsigned = _good()
    assert "carries no signature" in signature_problem(unsigned, SECRET)
    assert "carries no signature" in signature_problem({**signed, "signature": 5}, SECRET)


def test_an_overlapped_handoff_needs_its_producers_site_signature():
    """The proxy writes it from an earlier hand-off's site (with its site signature) and a
    transfer id of its own: the site is checked, whatever the id; another site is refused."""
    signed = sign_handoff(_good(), SECRET, valid_s=60, now=1000.0)
    site = {k: signed[k] for k in ("do_remote_prefill", "protocol", "remote_host",
                                   "remote_port", "fingerprint", "tp_size", "site_signature")}  # fmt: skip
    written = {**site, "transfer_id": "f" * 32, OVERLAP: True}
    assert signature_problem(written, SECRET, now=9e9) == ""  # no expiry: it names a producer
    assert "is not the producer's" in signature_problem({**written, "remote_port": 1}, SECRET)
    no_site = {k: v for k, v in written.items() if k != "site_signature"}
    assert "carries no site_signature" in signature_problem(no_site, SECRET)
