"""Overlapped P/D against its goals, at transfer time = prefill time (``bench_pd --link --goal``).

``make bench-pd GOAL=1`` or ``python -m bench.bench_pd --link --goal [--quick] [--chunk-tokens
256] [--goal-rate MBIT] [--clients 1,2] [--setups ...]`` (root only, like the rest of
:mod:`bench.pd_link`, whose namespaces, servers, load and checks it reuses). In one run:

1. every setup's prefill server runs with the same ``--max-num-batched-tokens`` (the chunk size,
   :data:`CHUNK_TOKENS` by default), so a 2048-token prompt is prefilled in the same chunks by
   every one of them (and the overlapped producer publishes one chunk of KV per step);
2. the first P/D setup measures **P**, its producer's prefill time of one 2048-token prompt (a
   request sent to the producer alone, ``max_tokens=1``, median of a few after a warm-up; every
   setup measures its own again and the CSV keeps it), and the **KV bytes** of one request (the
   producer's "saved transfer" log line; the veth's ``tx_bytes`` where there is none);
3. the link is set to ``KV bytes x 8 / P`` (:func:`goal_rate_mbit`), so that the transfer time
   **T** equals P, and the real link that rate stands for is printed (:func:`real_link_gbit`,
   scaled as bench/README.md scales :data:`bench.pd_link.RATES`);
4. every setup runs ``vllm bench serve`` through the proxy (prompts of exactly 2048 tokens,
   fixed seed, :data:`DEFAULTS`' output tokens) at each concurrency; then a fixed subset is sent
   one at a time and compared token for token with colocated's (as :mod:`bench.pd_link` does);
5. from the logs of each point: the consumer's transfer times of the sequential setup (T as the
   link really gives it) and, for the overlapped setups, how many chunks each request's KV was
   published in (:func:`saved_transfers`); a point where some request went in one piece did not
   measure overlap, and the run fails; and from the prefill server's ``/metrics``, its mean
   prefill time during the point (``vllm:request_prefill_time_seconds``, "P load"): what the
   prefill really took beside the load, against P measured alone;
6. the goal ratios (:func:`goal_ratios`): overlap TTFT p50 / (1.2 x max(P, T) + D), D one decode
   step (the sequential setup's ITL p50), goal <= 1; overlap TTFT p50 / NIXL tuned's, goal
   <= 0.75; and sequential / overlap.

Why 256 tokens a chunk: the last chunk's transfer cannot overlap anything (the prefill is over),
so even a perfect pipeline ends at about P + T / n_chunks + D. With 2048 / 512 = 4 chunks that is
1.25 x max(P, T) + D, above the 1.2 x goal by construction; 2048 / 256 = 8 chunks leaves 1.125 x
(8 blocks of 32 tokens a chunk). Smaller chunks cost more engine steps and more loads.

Results, in ``bench/results/<host kind>/``: ``pd-goal.csv`` (a row per setup and concurrency,
load averages before and after each point) and ``pd-goal-summary.txt``, naming host, commit and
date.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from connector.serve.demo import vocabulary
from connector.serve.launch import Cluster, Proc
from connector.serve.tiny_model import build_tiny_llama

from . import netlink, pd_link
from .pd_common import ensure_nixl, loadavg, run_stamp, stamp_line, write_csv

SETUPS = ("colocated", "tritonkv-pag", "tritonkv-overlap", "tritonkv-overlap-tok", "nixl-tuned")
OVERLAP = ("tritonkv-overlap", "tritonkv-overlap-tok")
SEQUENTIAL = "tritonkv-pag"
NIXL = "nixl-tuned"
INPUT_LEN = pd_link.PREFILL_PROBE_TOKENS  # 2048: P is measured on a prompt of this length
CHUNK_TOKENS = 256
BLOCK_SIZE = 32  # connector.serve.launch's --block-size
PROBE_RATE_MBIT = 10_000  # the link while P and the KV bytes are measured (before T = P is set)
METRICS_TIMEOUT_S = 30.0
WARMUPS = 2  # requests through a setup before its points (the overlap proxy's first is sequential)
#: The overlapped flow's goals: TTFT p50 <= GOAL_BOUND x max(P, T) + D and <= GOAL_NIXL x NIXL tuned's.
GOAL_BOUND = 1.2
GOAL_NIXL = 0.75
DEFAULTS = {"clients": (1, 2), "num_prompts": 10, "output_len": 8, "check": 3, "probe_reps": 5}
QUICK = {"clients": (1,), "num_prompts": 3, "output_len": 8, "check": 1, "probe_reps": 2}
#: Real links at the goodput bench/README.md assumes (83 %), Gb/s, to name a scaled rate.
REAL_LINKS = (
    ("10 GbE (TCP)", 8.3),
    ("25 GbE (TCP)", 20.7),
    ("50 GbE (TCP)", 41.5),
    ("100 Gb RDMA", 83.0),
    ("200 Gb RDMA", 166.0),
)


# ------------------------------------------------------------------------ the pure arithmetic


def goal_rate_mbit(kv_bytes: float, prefill_s: float) -> float:
    """The link rate (Mbit/s) at which ``kv_bytes`` take ``prefill_s`` seconds: T = P."""
    if not kv_bytes > 0 or not prefill_s > 0:
        raise ValueError(
            f"kv_bytes and prefill_s: expected positive numbers, got {kv_bytes!r}, {prefill_s!r}"
        )
    return kv_bytes * 8 / prefill_s / 1e6


def transfer_ms(kv_bytes: float, rate_mbit: float) -> float:
    """``kv_bytes`` over ``rate_mbit``, in milliseconds (the link's T)."""
    if not rate_mbit > 0:
        raise ValueError(f"rate_mbit: expected a positive number, got {rate_mbit!r}")
    return kv_bytes * 8 / (rate_mbit * 1e6) * 1e3


def real_link_gbit(rate_mbit: float, prefill_tok_s: float) -> float:
    """The real link (Gb/s) that ``rate_mbit`` stands for, scaled as bench/README.md does: by our
    (KV bytes/token x prefill tok/s) over Llama-3-8B bf16's on one H100."""
    if not prefill_tok_s > 0:
        raise ValueError(f"prefill_tok_s: expected a positive number, got {prefill_tok_s!r}")
    ours = pd_link.KV_BYTES_PER_TOKEN * prefill_tok_s
    real = pd_link.REAL_KV_BYTES_PER_TOKEN * pd_link.REAL_PREFILL_TOK_S
    return rate_mbit * real / ours / 1e3


def real_link_name(gbit: float) -> str:
    """Which of :data:`REAL_LINKS` ``gbit`` is, or which two it lies between."""
    below = [link for link in REAL_LINKS if link[1] <= gbit]
    above = [link for link in REAL_LINKS if link[1] > gbit]
    near = [link for link in REAL_LINKS if abs(link[1] / gbit - 1) <= 0.1]
    if near:
        return f"{near[0][0]} at {near[0][1]:g} Gb/s goodput"
    if below and above:
        (a, ga), (b, gb) = below[-1], above[0]
        return f"between {a} ({ga:g} Gb/s) and {b} ({gb:g} Gb/s)"
    (name, g), where = (below[-1], "above") if below else (above[0], "below")
    return f"{where} {name} ({g:g} Gb/s)"


def _row(rows: list[dict], setup: str, clients: int) -> dict | None:
    return next((r for r in rows if r["setup"] == setup and r["clients"] == clients), None)


def goal_ratios(rows: list[dict], prefill_ms: float, link_ms: float) -> list[dict]:
    """The goal ratios of each overlapped setup at each concurrency (see the module docstring).

    Args:
        rows: the run's rows (:func:`bench.pd_link.row`'s keys), one per setup and concurrency.
        prefill_ms: P. link_ms: T (the link's: KV bytes x 8 / rate).

    Returns:
        One dict per overlapped row: ``setup``, ``clients``, ``ttft_p50_ms``, ``decode_ms`` (D:
        the sequential setup's ITL p50 at that concurrency, else this row's), ``bound_ms``
        (1.2 x max(P, T) + D), ``vs_bound``, ``nixl_ttft_p50_ms``, ``vs_nixl``, ``sequential_ttft_p50_ms``,
        ``sequential_vs_overlap`` (None where a figure is missing).
    """
    out = []
    for r in rows:
        if r["setup"] not in OVERLAP or r["ttft_p50_ms"] is None:
            continue
        seq, nixl = _row(rows, SEQUENTIAL, r["clients"]), _row(rows, NIXL, r["clients"])
        d = (seq or {}).get("itl_p50_ms") or r["itl_p50_ms"] or 0.0
        bound = GOAL_BOUND * max(prefill_ms, link_ms) + d
        nixl_ms = (nixl or {}).get("ttft_p50_ms")
        seq_ms = (seq or {}).get("ttft_p50_ms")
        ttft = r["ttft_p50_ms"]
        out.append(
            {
                "setup": r["setup"],
                "clients": r["clients"],
                "ttft_p50_ms": ttft,
                "decode_ms": d,
                "bound_ms": round(bound, 2),
                "vs_bound": round(ttft / bound, 3),
                "nixl_ttft_p50_ms": nixl_ms,
                "vs_nixl": round(ttft / nixl_ms, 3) if nixl_ms else None,
                "sequential_ttft_p50_ms": seq_ms,
                "sequential_vs_overlap": round(seq_ms / ttft, 3) if seq_ms else None,
            }
        )
    return out


# ------------------------------------------------------------------------------- the logs

_SAVED = re.compile(
    r"tritonkv: saved transfer (?P<transfer>[0-9a-f]{8}…)"
    r"(?: chunk (?P<chunk>\d+) \(positions \d+\.\.\))? for \S+: "
    r"(?P<tokens>\d+) tokens, (?P<bytes>\d+) bytes"
)
_PREFILL = re.compile(
    r"^vllm:request_prefill_time_seconds_(?P<what>sum|count)(?:\{[^}]*\})?\s+(?P<v>\S+)", re.M
)
# (a load's log line gives the time to get the entry, "network" (or "fetch" or "load" in
# older logs), then the unpack's)
_TRANSFER = re.compile(
    r"tritonkv: loaded transfer [0-9a-f]{8}… for .*?, (?:network|fetch|load) (?P<ms>[\d.]+) ms"
)


@dataclass
class Published:
    """One transfer as the producer's log tells it: in how many pieces, how many tokens and bytes."""

    chunks: int = 0
    num_tokens: int = 0
    nbytes: int = 0


def saved_transfers(log_text: str) -> dict[str, Published]:
    """The transfers a producer's log saved, by their short id (a whole save counts one piece)."""
    out: dict[str, Published] = {}
    for m in _SAVED.finditer(log_text):
        p = out.setdefault(m["transfer"], Published())
        p.chunks += 1
        p.num_tokens += int(m["tokens"])
        p.nbytes += int(m["bytes"])
    return out


def chunk_stats(saved: dict[str, Published]) -> dict:
    """Pieces per transfer over ``saved``: ``transfers``, ``chunks_min`` / ``_p50`` / ``_max``,
    ``single_chunk`` (transfers published whole: not overlapped)."""
    counts = sorted(p.chunks for p in saved.values())
    if not counts:
        return {"transfers": 0, "chunks_min": None, "chunks_p50": None, "chunks_max": None,
                "single_chunk": 0}  # fmt: skip
    return {
        "transfers": len(counts),
        "chunks_min": counts[0],
        "chunks_p50": statistics.median(counts),
        "chunks_max": counts[-1],
        "single_chunk": sum(c <= 1 for c in counts),
    }


def transfer_times_ms(log_text: str) -> list[float]:
    """How long (ms) each load a consumer's log reports took to get its entry (before unpacking)."""
    return [float(m["ms"]) for m in _TRANSFER.finditer(log_text)]


def prefill_histogram(metrics_text: str) -> tuple[float, float]:
    """``(sum of seconds, count)`` of vLLM's ``request_prefill_time_seconds`` (every engine)."""
    got = {"sum": 0.0, "count": 0.0}
    for m in _PREFILL.finditer(metrics_text):
        got[m["what"]] += float(m["v"])
    return got["sum"], got["count"]


def prefill_in_load_ms(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The mean prefill time (ms) of the requests between two :func:`prefill_histogram` reads."""
    n = after[1] - before[1]
    return round((after[0] - before[0]) / n * 1e3, 1) if n > 0 else None


def _prefill_now(proc: Proc) -> tuple[float, float]:
    """The prefill histogram of ``proc``'s server now ((0, 0) when it cannot be read)."""
    try:
        with urllib.request.urlopen(proc.url + "/metrics", timeout=METRICS_TIMEOUT_S) as resp:
            return prefill_histogram(resp.read().decode())
    except OSError:  # (urllib's errors and timeouts are OSErrors)
        return 0.0, 0.0


def not_overlapped(row: dict) -> str | None:
    """Why an overlapped setup's ``row`` did not measure overlap (None: it did)."""
    if row["setup"] not in OVERLAP:
        return None
    if not row["transfers"]:
        return "the producer logged no saved transfer"
    if row["single_chunk"]:
        return (
            f"{row['single_chunk']} of {row['transfers']} transfers were published in one piece "
            "(is the producer's prefill chunked?)"
        )
    return None


class _LogMark:
    """What a server's log gained since this mark."""

    def __init__(self, proc: Proc | None):
        self.proc = proc
        self.start = len(proc.log_text()) if proc else 0

    def since(self) -> str:
        return self.proc.log_text()[self.start :] if self.proc else ""


# ---------------------------------------------------------------------------------------- run


def _kv_bytes(setup: pd_link.LinkSetup, link: netlink.Link, url: str, plan: dict, prompt) -> int:
    """One request's KV bytes: the producer's saved-transfer log (else the veth's tx_bytes)."""
    mark, tx0 = _LogMark(setup.producer), link.tx_bytes("producer")
    pd_link.checked_answers(url, [prompt], plan)
    saved = saved_transfers(mark.since())
    if saved:
        return max(p.nbytes for p in saved.values())
    return link.tx_bytes("producer") - tx0


def _point(
    setup: pd_link.LinkSetup, link: netlink.Link, model: Path, clients: int, plan: dict,
    refs: dict, m: dict, p_ms: float, log: Path,
) -> dict:  # fmt: skip
    """One point: ``vllm bench serve`` at ``clients``, then the subset checked; its CSV row.

    ``refs``: the checked ``subset`` and colocated's ``load`` results (by clients) and
    ``answers`` (set here when ``setup`` is colocated); ``m``: the run's measured figures.
    """
    name, url = setup.name, setup.entry.url
    prefill_server = setup.producer or setup.entry
    marks = _LogMark(setup.producer), _LogMark(setup.consumer)
    before, tx0 = loadavg(), link.tx_bytes("producer")
    hist0 = _prefill_now(prefill_server)
    result = pd_link.serve_bench(url, model, clients=clients, plan=plan, log=log)
    tx = link.tx_bytes("producer") - tx0
    in_load = prefill_in_load_ms(hist0, _prefill_now(prefill_server))
    saved, times = saved_transfers(marks[0].since()), transfer_times_ms(marks[1].since())
    answers = pd_link.checked_answers(url, refs["subset"], plan)
    if name == "colocated":
        refs["load"][clients], refs["answers"] = result, answers
    wrong, failed_checks = pd_link.count_wrong(answers, refs["answers"])
    r = pd_link.row(
        name, "-" if name == "colocated" else m["rate_mbit"], clients, result,
        checked=len(answers), wrong=wrong, failed_checks=failed_checks,
        load_text_diffs=pd_link.text_diffs(result, refs["load"].get(clients, {})),
        link_mb_per_req=round(tx / 1e6 / max(1, plan["num_prompts"]), 2),
        prefill_ms=round(p_ms, 1), prefill_in_load_ms=in_load,
        transfer_p50_ms=round(statistics.median(times), 1) if times else None,
        **chunk_stats(saved), load_before=before, load_after=loadavg(),
    )  # fmt: skip
    r["link"] = "-" if name == "colocated" else "T = P"
    return r


def run(args: argparse.Namespace, progress) -> int:
    """The goal measurement (module docstring); 0 when every answer matched and overlap showed."""
    plan = {**(QUICK if args.quick else DEFAULTS), "input_len": INPUT_LEN, "range_ratio": 0}
    if args.clients:
        plan["clients"] = tuple(int(x) for x in args.clients.split(","))
    chunk = args.chunk_tokens
    if not BLOCK_SIZE <= chunk < INPUT_LEN or chunk % BLOCK_SIZE:
        raise ValueError(
            f"--chunk-tokens: expected a multiple of {BLOCK_SIZE} in [{BLOCK_SIZE}, {INPUT_LEN}), "
            f"got {chunk}"
        )
    producer_args = ["--max-num-batched-tokens", str(chunk), "--max-num-seqs", str(min(chunk, 256))]
    setups = [s.strip() for s in (args.setups or ",".join(SETUPS)).split(",") if s.strip()]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        raise ValueError(f"--setups: unknown {unknown}; expected some of {SETUPS}")
    setups = ["colocated", *(s for s in SETUPS[1:] if s in setups)]
    reason = netlink.unavailable()
    if reason:
        print(f"bench_pd --link --goal: cannot make network namespaces here: {reason}")
        return 2
    if NIXL in setups and not ensure_nixl(sys.executable):
        progress("NIXL could not be installed; leaving out nixl-tuned")
        setups.remove(NIXL)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tkv-pdgoal-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(
        workdir / "model", max_position_embeddings=pd_link.MAX_MODEL_LEN, **pd_link.SHAPE
    )
    words = vocabulary(model)
    subset = pd_link.check_prompts(words, plan)
    rows: list[dict] = []
    refs = {"subset": subset, "load": {}, "answers": []}  # colocated's, once it ran
    m = {"chunk_tokens": chunk, "prefill_ms": None, "kv_bytes": None, "rate_mbit": args.goal_rate}
    log = workdir / "bench-serve.log"
    progress(f"goal mode: setups {setups}, chunk {chunk} tokens, plan {plan}; logs in {workdir}")
    with netlink.link(args.goal_rate or PROBE_RATE_MBIT) as link, netlink.entered(link.consumer_ns):
        for name in setups:
            t0 = time.monotonic()
            try:
                with Cluster(workdir) as cluster:
                    setup = pd_link.start_link_setup(
                        name, cluster, model, link, producer_args, log_stats=True
                    )
                    url, prefill_server = setup.entry.url, setup.producer or setup.entry
                    progress(f"{name}: healthy after {time.monotonic() - t0:.0f} s")
                    tok_s = pd_link.prefill_rate(prefill_server.url, words, plan["probe_reps"])
                    p_ms = INPUT_LEN / tok_s * 1e3
                    progress(f"  P = {p_ms:.0f} ms ({tok_s:.0f} tok/s; load {loadavg()})")
                    if name != "colocated" and m["kv_bytes"] is None:
                        m["prefill_ms"] = p_ms
                        m["kv_bytes"] = _kv_bytes(setup, link, url, plan, subset[0])
                        if m["rate_mbit"] is None:
                            m["rate_mbit"] = round(goal_rate_mbit(m["kv_bytes"], p_ms / 1e3), 1)
                            link.set_rate(m["rate_mbit"])
                        progress(
                            f"  KV {m['kv_bytes']} bytes/request -> link {m['rate_mbit']} Mbit/s"
                        )
                    for _ in range(WARMUPS):
                        pd_link.checked_answers(url, subset[:1], plan)
                    for clients in plan["clients"]:
                        rows.append(_point(setup, link, model, clients, plan, refs, m, p_ms, log))
                        r = rows[-1]
                        progress(
                            f"  {name}, {clients} clients: TTFT p50 {r['ttft_p50_ms']} ms, "
                            f"chunks/transfer {r['chunks_p50']}, {r['wrong']} wrong, "
                            f"load {r['load_after']}"
                        )
                        why = not_overlapped(r)
                        if why:
                            progress(f"  {name}: NOT A MEASUREMENT OF OVERLAP: {why}")
            except (OSError, RuntimeError) as e:  # (TimeoutError is an OSError)
                progress(f"{name}: FAILED: {type(e).__name__}: {e}"[:3000])
                if name == "colocated":
                    return 1
            progress(f"{name}: done in {time.monotonic() - t0:.0f} s")
    return report(rows, m, plan, args.outdir)


def report(rows: list[dict], m: dict, plan: dict, outdir: Path) -> int:
    """Write pd-goal.csv and pd-goal-summary.txt under ``outdir``, print the summary; the exit code."""
    stamp = run_stamp()
    # (the run's P as goal_prefill_ms: each row has its own setup's prefill_ms)
    measured = {"chunk_tokens": m["chunk_tokens"], "goal_prefill_ms": m["prefill_ms"]}
    measured |= {"kv_bytes": m["kv_bytes"], "rate_mbit": m["rate_mbit"]}
    outdir.mkdir(parents=True, exist_ok=True)
    write_csv(outdir / "pd-goal.csv", rows, {**measured, **stamp})
    text = stamp_line(stamp) + "\n" + summary(rows, m, plan)
    (outdir / "pd-goal-summary.txt").write_text(text + "\n")
    print(text)
    print("wrote:", outdir / "pd-goal.csv", outdir / "pd-goal-summary.txt")
    wrong = sum(r["wrong"] + r["failed_checks"] for r in rows)
    flat = [r["setup"] for r in rows if not_overlapped(r)]
    print(f"bench_pd --goal: {wrong} wrong or failed checked answers; not overlapped: {flat or 0}")
    return 1 if wrong or flat or m["rate_mbit"] is None else 0


def summary(rows: list[dict], m: dict, plan: dict) -> str:
    """The measured P, KV bytes, link, T and D; one line per point; the goal ratios."""

    def fmt(v):
        return "-" if v is None else f"{v:g}"

    chunk = m["chunk_tokens"]
    lines = [
        f"goal mode: prompts of {INPUT_LEN} tokens, {plan['output_len']} output "
        f"tokens, every prefill server with --max-num-batched-tokens {chunk} "
        f"({INPUT_LEN // chunk} chunks a prompt); model {pd_link.SHAPE}, fp32; load {plan}; "
        "model workers bound to their core, API servers and engine cores free"
    ]
    p, kv, rate = m["prefill_ms"], m["kv_bytes"], m["rate_mbit"]
    if p is None or kv is None or rate is None:
        lines.append("no P/D setup ran: P, the KV bytes and the link rate were not measured")
        t_ms = None
    else:
        t_ms = transfer_ms(kv, rate)
        real = real_link_gbit(rate, INPUT_LEN / (p / 1e3))
        lines += [
            f"P = {p:.0f} ms (the first P/D setup's producer, {INPUT_LEN} tokens, max_tokens=1, "
            f"median); KV = {kv} bytes/request ({kv / INPUT_LEN:.0f} B/token)",
            f"link {rate:g} Mbit/s: T = KV x 8 / rate = {t_ms:.0f} ms (T/P {t_ms / p:.2f}); "
            f"stands for {real:.1f} Gb/s real ({real_link_name(real)})",
        ]
        seq = [
            r["transfer_p50_ms"] for r in rows if r["setup"] == SEQUENTIAL and r["transfer_p50_ms"]
        ]
        if seq:
            lines.append(
                f"T measured: {SEQUENTIAL}'s consumer transfer p50 {', '.join(map(fmt, seq))} ms "
                f"(clients {', '.join(str(r['clients']) for r in rows if r['setup'] == SEQUENTIAL)})"
            )
    lines.append(
        f"{'setup':<21}{'clients':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
        f"{'P ms':>7}{'P load':>7}{'T':>7}{'MB/req':>8}{'chunks':>9}{'wrong':>6}{'diff':>5}{'failed':>7}"
        "  load before / after"
    )
    lines.append(
        "(P ms: the prefill server's 2048-token prefill alone; P load: its mean prefill time "
        "during the point, vLLM's request_prefill_time_seconds; T: the consumer's transfer p50)"
    )
    for r in rows:
        chunks = "-" if not r["transfers"] else f"{r['chunks_min']}-{r['chunks_max']}"
        lines.append(
            f"{r['setup']:<21}{r['clients']:>8}{fmt(r['ttft_p50_ms']):>10}{fmt(r['ttft_p99_ms']):>10}"
            f"{fmt(r['itl_p50_ms']):>9}{fmt(r['itl_p99_ms']):>9}{fmt(r['prefill_ms']):>7}"
            f"{fmt(r['prefill_in_load_ms']):>7}"
            f"{fmt(r['transfer_p50_ms']):>7}{fmt(r['link_mb_per_req']):>8}{chunks:>9}{r['wrong']:>6}"
            f"{r['load_text_diffs']:>5}{(r['failed'] or 0) + r['failed_checks']:>7}  "
            f"{r['load_before']} / {r['load_after']}"
        )
    if t_ms is not None:
        for g in goal_ratios(rows, p, t_ms):
            nixl = "-" if g["vs_nixl"] is None else f"{g['vs_nixl']:g} (goal <= {GOAL_NIXL}: "
            nixl += "" if g["vs_nixl"] is None else f"{_met(g['vs_nixl'] <= GOAL_NIXL)})"
            invalid = not_overlapped(_row(rows, g["setup"], g["clients"]))
            lines.append(
                f"goal, {g['setup']}, {g['clients']} client(s): TTFT p50 {g['ttft_p50_ms']:g} ms / "
                f"({GOAL_BOUND} x max(P, T) + D = {g['bound_ms']:g} ms, D {g['decode_ms']:g}) = "
                f"{g['vs_bound']:g} (goal <= 1: {_met(g['vs_bound'] <= 1)}); / {NIXL} "
                f"{fmt(g['nixl_ttft_p50_ms'])} ms = {nixl}; sequential / overlap "
                f"{fmt(g['sequential_vs_overlap'])}"
                + (" [NOT A MEASUREMENT OF OVERLAP]" if invalid else "")
            )
    for r in rows:
        if r["setup"] in OVERLAP:
            why = not_overlapped(r)
            lines.append(
                f"chunks, {r['setup']}, {r['clients']} client(s): {r['transfers']} transfers, "
                f"{fmt(r['chunks_min'])} / {fmt(r['chunks_p50'])} / {fmt(r['chunks_max'])} chunks "
                f"(min / p50 / max)" + (f": NOT A MEASUREMENT OF OVERLAP: {why}" if why else "")
            )
    return "\n".join(lines)


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def add_args(parser: argparse.ArgumentParser) -> None:
    """The goal mode's options on ``bench_pd``'s parser."""
    parser.add_argument(
        "--goal", action="store_true", help="--link: the overlap measurement (bench/pd_goal.py)"
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=CHUNK_TOKENS,
        help=f"--goal: every prefill server's --max-num-batched-tokens (default {CHUNK_TOKENS})",
    )
    parser.add_argument(
        "--goal-rate",
        type=float,
        default=None,
        help="--goal: the link rate, Mbit/s (default: derived so that T = P)",
    )
