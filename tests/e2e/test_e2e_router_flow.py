"""End to end as the routers people run drive P/D (vLLM's example proxies, llm-d's routing
sidecar): their exact prefill leg, the producer's ``kv_transfer_params`` passed on unchanged, one
``X-Request-Id`` for both legs (``support.router_client``), and vLLM's default
``kv_load_failure_policy`` (``fail``) on the consumer.

Completions and chat (with ``max_completion_tokens``), the decode leg whole or streamed, each
answer equal to the producer's own answer without a hand-off and each prompt loaded, and both
servers' ``/metrics`` saying what happened (the connector's counters, histograms and gauges
against the transfers' own log lines). Then the ``fail`` policy: a load that fails (a hand-off naming a port where nothing listens, then the
producer killed between the legs) gives that client a clean HTTP error, the consumer lives,
answers the next request, and holds no KV block afterwards.
"""

from __future__ import annotations

import json
import urllib.request
import uuid

import httpx
import pytest
from support.e2e import assert_token_granular_load, metric_sum, settled
from support.router_client import PREFILL_PARAMS, prefill_body, route
from support.vllm_fixtures import requires_vllm

from connector.serve.demo import make_prompt, vocabulary
from connector.serve.launch import Cluster, free_port, free_port_run, transfer_events
from connector.serve.soak import CHAT_TEMPLATE

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_TOKENS = 10


class Servers:
    def __init__(self, cluster: Cluster, producer, consumer, words: list[str]):
        self.cluster, self.producer, self.consumer, self.words = cluster, producer, consumer, words
        self.loaded: list[dict] = []  # the routed requests' load events

    def body(self, path: str, num_tokens: int, seed: int, **extra) -> dict:
        prompt = make_prompt(self.words, num_tokens, seed)
        common = {"model": "tiny", "temperature": 0, "ignore_eos": True, **extra}
        if path == CHAT:
            return {"messages": [{"role": "user", "content": prompt}], **common}
        return {"prompt": prompt, "max_tokens": MAX_TOKENS, **common}

    def plain(self, path: str, body: dict) -> str:
        """The producer's answer to ``body`` with no hand-off: the reference."""
        reply = route_alone(self.producer.url + path, {**body, "stream": False})
        choice = reply["choices"][0]
        return choice["message"]["content"] if path == CHAT else choice["text"]

    def events(self, rid: str) -> dict:
        return transfer_events(self.producer.log_text() + self.consumer.log_text(), rid)


def route_alone(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as reply:
        return json.loads(reply.read())


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_llama_dir):
    cluster = Cluster(tmp_path_factory.mktemp("e2e_router"))
    template = cluster.workdir / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    kv_port = free_port_run(1)
    common = dict(kv_port=kv_port, args=["--chat-template", str(template)])
    try:
        producer = cluster.start_vllm(
            "producer",
            tiny_llama_dir,
            free_port(),
            role="kv_producer",
            cpu="0",
            log_stats=True,  # /metrics: the connector's figures
            **common,
        )
        consumer = cluster.start_vllm(
            "consumer",
            tiny_llama_dir,
            free_port(),
            role="kv_consumer",
            cpu="1",
            log_stats=True,  # /metrics: the KV cache usage gauge
            failure_policy=None,  # vLLM's default: fail
            extra_config={"load_timeout_s": 10.0},
            **common,
        )
        cluster.wait_ready([producer, consumer], progress=lambda *_: None)
    except BaseException:
        cluster.stop()
        raise
    yield Servers(cluster, producer, consumer, vocabulary(tiny_llama_dir))
    cluster.stop()


def test_the_prefill_leg_is_the_routers():
    body = {"model": "m", "prompt": "x", "max_tokens": 9, "max_completion_tokens": 9,
            "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 2,
            "min_completion_tokens": 2}  # fmt: skip
    leg = prefill_body(body)
    assert leg == {"model": "m", "prompt": "x", "max_tokens": 1, "max_completion_tokens": 1,
                   "stream": False, "kv_transfer_params": PREFILL_PARAMS}  # fmt: skip


@pytest.mark.parametrize(
    "path,stream,extra",
    [
        (COMPLETIONS, False, {}),
        (COMPLETIONS, True, {}),
        (CHAT, False, {"max_completion_tokens": MAX_TOKENS}),
        (CHAT, True, {"max_tokens": MAX_TOKENS}),
    ],
    ids=["completions", "completions-streamed", "chat-max-completion-tokens", "chat-streamed"],
)
def test_a_router_driven_request_answers_as_plain_and_loads(servers, path, stream, extra):
    body = servers.body(path, 70, seed=len(path) + stream, **extra)
    rid = f"router-{uuid.uuid4().hex[:12]}"
    routed = route(
        servers.producer.url, servers.consumer.url, path, {**body, "stream": stream}, rid
    )
    assert routed.status == 200, routed.body
    assert routed.handed_off and routed.handed_off.get("do_remote_prefill") is True
    assert routed.text and routed.text == servers.plain(path, body)
    prompt_tokens = int(routed.handed_off["num_tokens"])
    servers.loaded += assert_token_granular_load(servers, rid, prompt_tokens)["loaded"]


def _metric(url: str, name: str, **labels) -> float:
    return metric_sum(url, f"vllm:tritonkv_{name}", **labels)


def test_metrics_answer_what_happened(servers):
    """After the routed requests above: loads, tokens and bytes as the consumer's log lines
    say, one network and one unpack time each, every save on the producer, nothing left in its
    buffer; then a hand-off of another prompt is refused, counted by its reason."""
    consumer, producer = servers.consumer.url, servers.producer.url
    loads = len(servers.loaded)
    assert loads == 4
    assert settled(lambda: _metric(consumer, "loads_total", outcome="ok"), loads) == loads
    tokens = sum(int(ld["tokens"]) for ld in servers.loaded)
    assert _metric(consumer, "tokens_loaded_total") == tokens
    assert _metric(consumer, "bytes_loaded_total") == sum(int(ld["bytes"]) for ld in servers.loaded)
    assert _metric(consumer, "load_network_seconds_count") == loads
    assert _metric(consumer, "load_unpack_seconds_count") == loads
    assert _metric(consumer, "loads_total", outcome="failed") == 0
    assert settled(lambda: _metric(producer, "saves_total", outcome="ok"), loads) == loads
    assert _metric(producer, "save_pack_seconds_count") == loads
    assert settled(lambda: _metric(producer, "buffer_entries"), 0.0) == 0.0
    body = servers.body(COMPLETIONS, 40, seed=21)
    other = _post(
        servers.producer.url + COMPLETIONS, prefill_body(servers.body(COMPLETIONS, 40, 22))
    )
    reply = _post(
        consumer + COMPLETIONS, {**body, "kv_transfer_params": other.json()["kv_transfer_params"]}
    )
    assert reply.status_code == 200  # refused, recomputed: the answer is the plain one
    assert reply.json()["choices"][0]["text"] == servers.plain(COMPLETIONS, body)
    refused = dict(outcome="refused", reason="handoff")
    assert settled(lambda: _metric(consumer, "loads_total", **refused), 1.0) == 1.0
    # the refused prompt's entry waits for its TTL on the producer: held, as the gauge says
    assert settled(lambda: _metric(producer, "buffer_entries"), 1.0) == 1.0


def _usage(servers) -> float:
    return metric_sum(servers.consumer.url, "vllm:kv_cache_usage_perc")


def _assert_lives_and_holds_nothing(servers) -> None:
    with urllib.request.urlopen(servers.consumer.url + "/health", timeout=10) as reply:
        assert reply.status == 200
    body = servers.body(COMPLETIONS, 30, seed=99)
    after = route_alone(servers.consumer.url + COMPLETIONS, body)
    assert after["choices"][0]["text"] == servers.plain(COMPLETIONS, body)
    assert settled(lambda: _usage(servers), 0.0) == 0.0


def test_under_the_fail_policy_a_failed_load_is_a_clean_error_and_the_engine_lives(servers):
    """A fresh hand-off (the ones above loaded) sent where nothing listens."""
    body = servers.body(COMPLETIONS, 60, seed=7)
    prefill = _post(servers.producer.url + COMPLETIONS, prefill_body(body))
    assert prefill.status_code == 200
    dead = {**prefill.json()["kv_transfer_params"], "remote_port": free_port()}
    reply = _post(servers.consumer.url + COMPLETIONS, {**body, "kv_transfer_params": dead})
    assert reply.status_code >= 400 and "error" in reply.json(), reply.text
    failed = dict(outcome="failed", reason="peer_dead")
    assert settled(lambda: _metric(servers.consumer.url, "loads_total", **failed), 1.0) == 1.0
    _assert_lives_and_holds_nothing(servers)


def test_a_producer_killed_between_the_legs_fails_the_request_cleanly(servers):
    """Last in this module: it stops the producer."""
    body = servers.body(COMPLETIONS, 60, seed=8)
    prefill = _post(servers.producer.url + COMPLETIONS, prefill_body(body))
    assert prefill.status_code == 200
    servers.producer.stop()
    handed_off = prefill.json()["kv_transfer_params"]
    reply = _post(servers.consumer.url + COMPLETIONS, {**body, "kv_transfer_params": handed_off})
    assert reply.status_code >= 400 and "error" in reply.json(), reply.text
    with urllib.request.urlopen(servers.consumer.url + "/health", timeout=10) as health:
        assert health.status == 200
    assert settled(lambda: _usage(servers), 0.0) == 0.0


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, json=body, timeout=300)
