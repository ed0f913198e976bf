"""Where a P/D producer leg's time goes: vLLM's own request histograms and per-thread CPU time.

``python -m bench.producer_leg [--setups tritonkv,nixl-tuned] [--reps 9] [--rounds 1]`` starts
each setup as ``bench.bench_pd`` does (producer core 0, consumer core 1), sends its legs (the
prefill request with ``do_remote_decode`` to the producer, then the decode request to the
consumer, 0.1 s before each) and prints, per prompt length, the client's median producer leg and the producer's own
split of it from its Prometheus histograms (means over the point's requests):
``request_prefill_time`` (scheduled to first token: the forward pass and the connector's save),
``request_queue_time``, and ``e2e_request_latency`` (arrival in the API server to the output);
then each server's busiest threads over the legs (CPU seconds from ``/proc``, and the CPU each
last ran on). A setup name with ``+pin`` (e.g. ``tritonkv+pin``) first moves every thread of the
producer but its model worker's (those not pinned to core 0) onto core 1; with ``+alone`` every
thread of each server goes onto its server's core (as if each had a host of its own). With ``--rounds R`` the
setups start R times each, in alternating order (a slow spell of a shared machine then falls on
each of them), and the end prints each setup's median over all its legs, each round's median,
and the first setup's pooled median over each other's.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from connector.serve.demo import make_prompt, vocabulary
from connector.serve.launch import Cluster
from connector.serve.tiny_model import build_tiny_llama

from .bench_pd import MAX_MODEL_LEN, PAUSE_S, _body, make_prompts, post, start_setup
from .cores import confine, pin_tree, thread_cpu

HISTOGRAMS = ("e2e_request_latency", "request_queue_time", "request_prefill_time")


def histogram_sums(url: str) -> dict[str, tuple[float, float]]:
    """``(sum, count)`` of each of :data:`HISTOGRAMS` on the server at ``url``."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for name in HISTOGRAMS:
        values = []
        for part in ("sum", "count"):
            pattern = rf"^vllm:{name}_seconds_{part}\{{[^}}]*\}}\s+(\S+)"
            values.append(sum(float(v) for v in re.findall(pattern, text, re.M)))
        out[name] = (values[0], values[1])
    return out


def leg(setup, prompt: str) -> float:
    """One P/D request's two legs, 0.1 s before each; the producer leg's wall time (s)."""
    time.sleep(PAUSE_S)
    params = {"kv_transfer_params": {"do_remote_decode": True}}
    prefill = post(setup.producer.url, _body(prompt, 1, **params))
    time.sleep(PAUSE_S)
    decode = post(setup.consumer.url, _body(prompt, 1, kv_transfer_params=prefill.kv_params))
    if prefill.error or decode.error:
        raise RuntimeError(f"{setup.name}: {prefill.error or decode.error}")
    return prefill.elapsed


def run_setup(label: str, workdir: Path, model: Path, prompts, warm, lengths) -> dict[int, list]:
    """One start of setup ``label``: its warm-up legs, then ``prompts``' legs per length
    (printed with the histogram split, then each server's busiest threads); the legs' times."""
    name, _, pin = label.partition("+")
    times = {}
    with Cluster(workdir) as cluster:
        setup = start_setup(name, cluster, model, workdir, print)
        if pin == "pin":
            moved = pin_tree(setup.producer.popen.pid, {1}, only_unpinned_from={0})
            print(f"{label}: moved {moved} threads to core 1")
        elif pin == "alone":
            moved = confine(
                [(s.name, s.popen.pid, c) for s, c in ((setup.producer, 0), (setup.consumer, 1))]
            )
            print(f"{label}: threads confined to their server's core: {moved}")
        elif pin:
            raise SystemExit(f"unknown setup suffix +{pin} (expected +pin or +alone)")
        for n in lengths:  # warm-up
            for prompt in warm[n]:
                leg(setup, prompt)
        before = {p.name: thread_cpu(p.popen.pid) for p in (setup.producer, setup.consumer)}
        t0 = time.monotonic()
        for n in lengths:
            h0 = histogram_sums(setup.producer.url)
            times[n] = [leg(setup, prompt) for prompt in prompts.legs[n]]
            h1 = histogram_sums(setup.producer.url)
            split = {
                k: round(1e3 * (h1[k][0] - h0[k][0]) / max(1.0, h1[k][1] - h0[k][1]), 2)
                for k in HISTOGRAMS
            }
            load = tuple(round(x, 2) for x in os.getloadavg())
            print(
                f"{label} {n} tokens: producer leg median {1e3 * statistics.median(times[n]):.1f}"
                f" ms; producer's histogram means (ms) {split}; load {load}"
            )
        wall = time.monotonic() - t0
        for proc in (setup.producer, setup.consumer):
            after = thread_cpu(proc.popen.pid)
            busy = sorted(
                ((after[k][0] - before[proc.name].get(k, (0.0, 0))[0], k, after[k][1])
                 for k in after),
                reverse=True,
            )[:4]  # fmt: skip
            print(
                f"{label} {proc.name} CPU over {wall:.1f} s of legs: "
                + "; ".join(f"{k[1]}[{k[0]}] {s:.2f} s (cpu {cpu})" for s, k, cpu in busy)
            )
    return times


def summary(times: dict[str, list[dict[int, list]]], lengths) -> list[str]:
    """Per setup and length: the median leg over every round's legs and each round's median;
    then the first setup's pooled median over each other's (the ratio the goal is about)."""
    pooled = {
        (label, n): statistics.median(t for r in rounds for t in r[n])
        for label, rounds in times.items()
        for n in lengths
    }
    lines = []
    for label, rounds in times.items():
        for n in lengths:
            per_round = " / ".join(f"{1e3 * statistics.median(r[n]):.1f}" for r in rounds)
            lines.append(
                f"{label} {n} tokens: {1e3 * pooled[label, n]:.1f} ms (rounds {per_round})"
            )
    first, *others = times
    for label in others:
        ratios = ", ".join(f"{pooled[first, n] / pooled[label, n]:.2f}" for n in lengths)
        lines.append(f"{first} / {label} at {', '.join(map(str, lengths))} tokens: {ratios}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", default="tritonkv,nixl-tuned")
    parser.add_argument("--lengths", default="64,256,900")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        parser.error(f"--rounds and --reps must be at least 1, got {args.rounds}, {args.reps}")
    lengths = [int(x) for x in args.lengths.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="tkv-legs-"))
    model = build_tiny_llama(workdir / "model", max_position_embeddings=MAX_MODEL_LEN)
    words = vocabulary(model)
    prompts = make_prompts(words, lengths, args.reps, [])
    warm = {n: [make_prompt(words, n, 10**6 + 10 * n + i) for i in range(2)] for n in lengths}
    labels = args.setups.split(",")
    times: dict[str, list[dict[int, list]]] = {label: [] for label in labels}
    for r in range(args.rounds):  # the setups alternate: a slow spell hits each of them
        for label in labels if r % 2 == 0 else labels[::-1]:
            times[label].append(run_setup(label, workdir, model, prompts, warm, lengths))
    print("\n".join(["pooled over rounds (medians):", *summary(times, lengths)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
