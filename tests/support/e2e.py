"""Shared pieces of the end-to-end tests: a P/D cluster fixture factory and the comparison helpers.

Each e2e module starts its servers once (module scope) and stops them at its end, so at most one
producer/consumer pair runs at a time on this 2-core machine.
"""

from __future__ import annotations

import re
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from connector.serve.demo import (
    PRODUCER_MAX_BATCHED_TOKENS,
    completion,
    make_prompt,
    start_pd,
    vocabulary,
)
from connector.serve.launch import (
    Cluster,
    Proc,
    free_port,
    free_port_run,
    http_json,
    transfer_events,
)
from connector.serve.overlap import overlap_params, site_of

MAX_TOKENS = 12


def hidden_states_config(layers: list[int]) -> dict:
    """vLLM's ``--speculative-config`` for ``extract_hidden_states`` of ``layers``."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
    }


@dataclass
class PD:
    """A running producer/consumer/proxy trio plus the model's vocabulary."""

    producer: Proc
    consumer: Proc
    proxy: Proc
    words: list[str]
    cluster: Cluster | None = None  # what started them (more servers join it)
    model: Path | None = None
    extra_config: dict | None = None  # the servers' kv_connector_extra_config additions
    near_ties: bool = False  # answers may differ from colocated at a near tie (bfloat16 serving)

    def prompt(self, num_tokens: int, seed: int) -> str:
        return make_prompt(self.words, num_tokens, seed)

    def events(self, request_id: str) -> dict[str, list[dict]]:
        return transfer_events(self.producer.log_text() + self.consumer.log_text(), request_id)

    def colocated(self, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
        """Reference: prefill and decode on one server (the producer, no transfer params)."""
        rid = f"ref-{uuid.uuid4().hex[:12]}"
        return completion(self.producer.url, prompt, max_tokens, rid)["choices"][0]["text"]

    def disaggregated(self, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[str, str, dict]:
        """Through the proxy; returns (text, request id, usage)."""
        rid = f"pd-{uuid.uuid4().hex[:12]}"
        reply = completion(self.proxy.url, prompt, max_tokens, rid)
        return reply["choices"][0]["text"], rid, reply["usage"]

    def prefill_params(self, prompt: str, transfer_id: str | None = None) -> dict:
        """Run only the prefill leg on the producer (under ``transfer_id``, as the overlapped
        flow's proxy asks, when given) and return its kv_transfer_params."""
        params = {"do_remote_decode": True}
        if transfer_id is not None:
            params["transfer_id"] = transfer_id
        reply = completion(
            self.producer.url,
            prompt,
            1,
            f"prefill-{uuid.uuid4().hex[:12]}",
            kv_transfer_params=params,
        )
        return reply["kv_transfer_params"]

    def overlapped(
        self, prompt: str, max_tokens: int = MAX_TOKENS, extra: dict | None = None
    ) -> tuple[str, str, str]:
        """What ``tritonkv-proxy --overlap`` does, by hand: the decode request (with the site of
        an earlier hand-off, a fresh transfer id and ``extra``) and then the prefill request
        under that id, while the decode one waits; returns (text, decode request id, transfer
        id)."""
        site = site_of(self.prefill_params(self.prompt(5, seed=1)))
        transfer_id = uuid.uuid4().hex
        params = {**overlap_params(site, transfer_id), **(extra or {})}
        with ThreadPoolExecutor(1) as pool:
            decode = pool.submit(self.decode_with, prompt, params, max_tokens)
            assert self.prefill_params(prompt, transfer_id)["transfer_id"] == transfer_id
            text, rid = decode.result(timeout=300)
        return text, rid, transfer_id

    def batch_as_colocated(self, lengths: list[int], seed: int) -> list[dict]:
        """Prompts of ``lengths`` tokens through the proxy at once: each answer equals colocated
        and its load was token-granular; returns each one's transfer events."""
        prompts = [self.prompt(n, seed=seed + n) for n in lengths]
        results = run_concurrently(self.disaggregated, [(p,) for p in prompts])
        out = []
        for n, prompt, (text, rid, usage) in zip(lengths, prompts, results, strict=True):
            assert usage["prompt_tokens"] == n
            assert text == self.colocated(prompt), f"{n}-token prompt differs from colocated"
            out.append(assert_token_granular_load(self, rid, n))
        return out

    def assert_corrupted_kv_changes_the_answer(self, seed: int) -> None:
        """Negative control: a hand-off whose KV is scrambled on arrival (the
        ``tritonkv_debug_corrupt`` hook) is loaded and gives another answer than colocated."""
        prompt = self.prompt(60, seed=seed)
        reference = self.colocated(prompt)
        params = self.prefill_params(prompt)
        corrupted, rid = self.decode_with(prompt, {**params, "tritonkv_debug_corrupt": True})
        assert self.events(rid)["loaded"], "the corrupted KV was not loaded"
        assert corrupted != reference

    def decode_with(self, prompt: str, params: dict, max_tokens: int = MAX_TOKENS):
        """Run only the decode leg on the consumer with the given params; (text, request id)."""
        rid = f"decode-{uuid.uuid4().hex[:12]}"
        reply = completion(self.consumer.url, prompt, max_tokens, rid, kv_transfer_params=params)
        return reply["choices"][0]["text"], rid


def start_cluster(workdir: Path, model: Path, **kw) -> tuple[Cluster, PD]:
    cluster = Cluster(workdir)
    try:
        producer, consumer, proxy = start_pd(cluster, model, progress=lambda *_: None, **kw)
    except BaseException:
        cluster.stop()
        raise
    extra = kw.get("extra_config")
    return cluster, PD(producer, consumer, proxy, vocabulary(model), cluster, model, extra)


def more_producers(pd: PD, count: int, dtype: str, proxy_args: list[str] = ()):
    """Start ``count`` more producers of ``pd``'s model (as its own, each on a KV port of its
    own) and a proxy over ``pd.producer`` and them to ``pd.consumer`` (xPyD); returns
    ``(producers, {producer: its KV port}, proxy)``, ``pd.producer`` first."""
    cluster, found = pd.cluster, re.search(r'"port": (\d+)', " ".join(pd.producer.popen.args))
    kv_ports = {pd.producer.name: int(found.group(1))}
    producers = [pd.producer]
    for i in range(count):
        port = free_port_run(1)
        producers.append(
            cluster.start_vllm(
                f"producer{i + 2}", pd.model, free_port(), role="kv_producer", kv_port=port,
                extra_config=pd.extra_config, cpu=str((i + 1) % 2), dtype=dtype,
                args=["--max-num-batched-tokens", str(PRODUCER_MAX_BATCHED_TOKENS)],
            )
        )  # fmt: skip
        kv_ports[producers[-1].name] = port
    proxy = cluster.start_proxy(
        free_port(), [p.url for p in producers], [pd.consumer.url], list(proxy_args),
        name=f"proxy_{len(producers)}p",
    )  # fmt: skip
    cluster.wait_ready([*producers[1:], proxy], timeout_s=600)
    return producers, kv_ports, proxy


_SAVED = re.compile(r"saved transfer (\w+)…[^\n]*? for (\S+):")  # ids are logged short
_LOADED_FROM = re.compile(r"loaded transfer (\w+)… for (\S+): .* from 127\.0\.0\.1:(\d+) ranks")


def loads_by_producer(pd: PD, producers: list[Proc], kv_ports: dict, rids) -> dict[str, str]:
    """Each of request ids ``rids`` -> the producer its consumer loaded it from (one load
    each), checked to be the KV port of the producer that saved its transfer (the one its
    hand-off named)."""
    saved_by = {t: p.name for p in producers for t, _ in _SAVED.findall(p.log_text())}
    loads = _LOADED_FROM.findall(pd.consumer.log_text())
    out = {}
    for rid in rids:  # vLLM logs its own id around the client's: cmpl-<rid>-0-<suffix>
        (transfer, port), *more = [(t, port) for t, r, port in loads if rid in r] or [(None, 0)]
        assert transfer in saved_by and not more, f"{rid}: loads {loads}, saved by {saved_by}"
        assert kv_ports[saved_by[transfer]] == int(port), (rid, saved_by[transfer], port)
        out[rid] = saved_by[transfer]
    return out


#: How close (in nats) the colocated server's two likeliest tokens may be for a bfloat16 answer to
#: differ there (:func:`assert_as_colocated`).
NEAR_TIE = 0.1


def assert_as_colocated(pd: PD, prompt: str, text: str) -> None:
    """``text`` equals the colocated answer to ``prompt``; where ``pd.near_ties`` (bfloat16
    serving) it may instead differ first at an output position where the colocated server's two
    likeliest tokens were within :data:`NEAR_TIE` nats of each other, every word before it equal.
    In bfloat16 a consumer computes the prompt's last token in a decode step, not in the
    prefill, and the rounding may pick the other of two nearly tied tokens: seen on Qwen3-Next
    without any connector, and with vLLM's NixlConnector on the same requests. A difference where
    the reference was sure fails."""
    if not pd.near_ties:
        assert text == pd.colocated(prompt)
        return
    rid = f"ref-{uuid.uuid4().hex[:12]}"
    choice = completion(pd.producer.url, prompt, MAX_TOKENS, rid, logprobs=2)["choices"][0]
    problem = confident_difference(text, choice)
    assert problem is None, problem


def confident_difference(text: str, choice: dict) -> str | None:
    """Why ``text`` is not the answer ``choice`` (an OpenAI completion choice with ``logprobs``
    of its top two tokens) but for a near tie (:func:`assert_as_colocated`), or
    None."""
    if text == choice["text"]:
        return None
    ours, theirs = text.split(), choice["text"].split()  # one token a word
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if at is None:
        return f"{text!r} != {choice['text']!r}"
    top = sorted(choice["logprobs"]["top_logprobs"][at].values(), reverse=True)
    if len(top) >= 2 and top[0] - top[1] < NEAR_TIE:
        return None
    return (
        f"answer differs from colocated at token {at} ({ours[at]!r} vs {theirs[at]!r}), where "
        f"the colocated server's top two log-probabilities were {top}: not a near tie"
    )


def check_overlapped(pd: PD, lengths, seeds, control: tuple[int, int]) -> None:
    """The overlapped flow on ``pd``'s servers: a ``--overlap`` proxy over them (beside
    ``pd.proxy``), answers as :func:`assert_overlapped_as_colocated` checks them, and the
    negative control (:func:`assert_overlapped_corruption_changes_the_answer` of ``control``:
    prompt length and seed); the proxy is stopped after."""
    proxy = pd.cluster.start_proxy(
        free_port(), [pd.producer.url], [pd.consumer.url], ["--overlap"], name="proxy_overlap"
    )
    try:
        pd.cluster.wait_ready([proxy], timeout_s=120)
        assert_overlapped_as_colocated(pd, proxy, lengths, seeds)
        assert_overlapped_corruption_changes_the_answer(pd, *control)
    finally:
        proxy.stop()
        pd.cluster.procs.remove(proxy)


def assert_overlapped_as_colocated(pd: PD, proxy: Proc, lengths, seeds) -> None:
    """A model of several KV cache groups through the ``--overlap`` ``proxy``: a first request
    teaches it the producer's site, then prompts of ``lengths`` (made from ``seeds``) go out
    overlapped, at once. Each
    answer is colocated's (but near ties), each load token-granular and of the proxy's transfer
    id, which the producer saved whole (one entry per group, no chunks); the consumer's own
    counters show the loaded tokens and no failed load."""
    ask = lambda prompt, rid: completion(proxy.url, prompt, MAX_TOKENS, rid)
    ask(pd.prompt(20, seed=seeds[0] - 1), f"site-{uuid.uuid4().hex[:12]}")  # learns the site
    before = external_tokens(pd)
    prompts = [pd.prompt(n, seed=s) for n, s in zip(lengths, seeds, strict=True)]
    rids = [f"ov-{uuid.uuid4().hex[:12]}" for _ in prompts]
    replies = run_concurrently(ask, list(zip(prompts, rids, strict=True)))
    saved = pd.producer.log_text()
    for n, prompt, rid, reply in zip(lengths, prompts, rids, replies, strict=True):
        assert_as_colocated(pd, prompt, reply["choices"][0]["text"])
        events = assert_token_granular_load(pd, rid, n)
        [line] = [x for x in proxy.log_text().splitlines() if f"req {rid} " in x]
        assert "overlapped" in line, line
        tid = line.split("transfer_id ")[1][:9]  # short: 8 hex digits and "…"
        assert [e["transfer"] for e in events["loaded"]] == [tid]
        groups = re.findall(rf"saved transfer {tid} group (\d+) ", saved)
        assert sorted(groups) == ["0", "1"] and f"saved transfer {tid} chunk" not in saved
    want = sum(n - 1 for n in lengths)
    assert settled(lambda: external_tokens(pd) - before, want) == want
    assert metric_sum(pd.consumer.url, "vllm:tritonkv_loads_total", outcome="failed") == 0


def assert_overlapped_corruption_changes_the_answer(pd: PD, n: int, seed: int) -> None:
    """Negative control of the overlapped flow, its decode request sent first: KV scrambled on
    arrival is loaded and answers otherwise than colocated."""
    prompt = pd.prompt(n, seed=seed)
    text, rid, _ = pd.overlapped(prompt, extra={"tritonkv_debug_corrupt": True})
    assert pd.events(rid)["loaded"], "the corrupted KV was not loaded"
    assert text != pd.colocated(prompt)


def hybrid_cluster(tmp_path_factory, build, name: str, dtype: str):
    """A P/D trio serving the tiny model ``build(path)`` makes in ``dtype`` (answers compared
    allowing near ties in bfloat16: :func:`assert_as_colocated`), the consumer's statistics kept
    and the test hooks allowed (the hybrid models' modules): yields it, then stops it."""
    model = build(tmp_path_factory.mktemp(f"tiny_{name}") / "model")
    cluster, trio = start_cluster(
        tmp_path_factory.mktemp(f"e2e_{name}"), model, dtype=dtype, log_stats=True,
        extra_config={"debug_allow_corrupt": True},
    )  # fmt: skip
    trio.near_ties = dtype == "bfloat16"
    yield trio
    cluster.stop()


def external_tokens(pd: PD) -> float:
    """The consumer's prompt tokens loaded from an external transfer (its own counter)."""
    return metric_sum(
        pd.consumer.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )


def assert_token_granular_load(pd: PD, rid: str, prompt_tokens: int) -> dict:
    """The consumer loaded everything but the last prompt token (minus its own prefix-cache hit)."""
    events = pd.events(rid)
    assert not events["failed"], events
    assert len(events["loaded"]) >= 1, f"no load logged for {rid}: {events}"
    for ld in events["loaded"]:  # one per TP rank
        recomputed = prompt_tokens - int(ld["local"]) - int(ld["tokens"])
        assert recomputed == 1, f"{rid}: recomputed {recomputed} prompt tokens, expected 1: {ld}"
    return events


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of Prometheus metric ``name`` over the label sets of the server at ``url`` that
    carry ``labels`` (0.0 where none does: vLLM exports a counter once it moved)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    total = 0.0
    for found, value in re.findall(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", text, re.M):
        if all(f'{key}="{want}"' in found for key, want in labels.items()):
            total += float(value)
    return total


def settled(read, want, timeout_s: float = 20.0):
    """``read()`` once it equals ``want`` (vLLM's stats reach ``/metrics`` a few steps late), or
    its last value after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    got = read()
    while got != want and time.monotonic() < deadline:
        time.sleep(0.5)
        got = read()
    return got


def run_concurrently(fn, args_list):
    with ThreadPoolExecutor(len(args_list)) as pool:
        return list(pool.map(lambda a: fn(*a), args_list))


__all__ = [
    "PD",
    "assert_token_granular_load",
    "http_json",
    "metric_sum",
    "run_concurrently",
    "settled",
    "start_cluster",
]
