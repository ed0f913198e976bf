"""Where a P/D producer leg's time goes: vLLM's own request histograms and per-thread CPU time.

``python -m bench.producer_leg [--setups tritonkv,nixl-tuned] [--reps 9]`` starts each setup as
``bench.bench_pd`` does (producer core 0, consumer core 1), sends its legs (the prefill request
with ``do_remote_decode`` to the producer, then the decode request to the consumer, 0.1 s before
each) and prints, per prompt length, the client's median producer leg and the producer's own
split of it from its Prometheus histograms (means over the point's requests):
``request_prefill_time`` (scheduled to first token: the forward pass and the connector's save),
``request_queue_time``, and ``e2e_request_latency`` (arrival in the API server to the output);
then each server's busiest threads over the legs (CPU seconds from ``/proc``, and the CPU each
last ran on). A setup name with ``+pin`` (e.g. ``tritonkv+pin``) first moves every thread of the
producer but its model worker's (those not pinned to core 0) onto core 1.
"""

from __future__ import annotations

import argparse
import contextlib
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


def thread_cpu(pid: int) -> dict[tuple[int, str], tuple[float, int]]:
    """``(tid, name) -> (CPU seconds, last CPU)`` of every thread of ``pid`` and its children."""
    pids, todo = [], [pid]
    while todo:  # children from /proc/<pid>/task/<tid>/children, as ps does
        p = todo.pop()
        pids.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in task.read_text().split()]
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for p in pids:
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[(int(task.name), name)] = (
                (int(fields[11]) + int(fields[12])) / tick,
                int(fields[36]),
            )
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


def pin_off_worker(pid: int) -> int:
    """Move every thread of ``pid``'s tree not pinned to core 0 alone onto core 1; how many."""
    moved = 0
    for tid, _ in thread_cpu(pid):
        try:
            if os.sched_getaffinity(tid) != {0}:
                os.sched_setaffinity(tid, {1})
                moved += 1
        except OSError:  # the thread ended meanwhile
            pass
    return moved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", default="tritonkv,nixl-tuned")
    parser.add_argument("--lengths", default="64,256,900")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="tkv-legs-"))
    model = build_tiny_llama(workdir / "model", max_position_embeddings=MAX_MODEL_LEN)
    words = vocabulary(model)
    prompts = make_prompts(words, lengths, args.reps, [])
    warm = {n: [make_prompt(words, n, 10**6 + 10 * n + i) for i in range(2)] for n in lengths}
    for label in args.setups.split(","):
        name, _, pin = label.partition("+")
        with Cluster(workdir) as cluster:
            setup = start_setup(name, cluster, model, workdir, print)
            if pin:
                print(
                    f"{label}: moved {pin_off_worker(setup.producer.popen.pid)} threads to core 1"
                )
            for n in lengths:  # warm-up
                for prompt in warm[n]:
                    leg(setup, prompt)
            before = {p.name: thread_cpu(p.popen.pid) for p in (setup.producer, setup.consumer)}
            t0 = time.monotonic()
            for n in lengths:
                h0 = histogram_sums(setup.producer.url)
                times = [leg(setup, prompt) for prompt in prompts.legs[n]]
                h1 = histogram_sums(setup.producer.url)
                split = {
                    k: round(1e3 * (h1[k][0] - h0[k][0]) / max(1.0, h1[k][1] - h0[k][1]), 2)
                    for k in HISTOGRAMS
                }
                print(
                    f"{label} {n} tokens: producer leg median {1e3 * statistics.median(times):.1f}"
                    f" ms; producer's histogram means (ms) {split}; load {tuple(round(x, 2) for x in os.getloadavg())}"
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
