"""Where a P/D producer leg's milliseconds go, segment by segment, from vLLM's own calls.

``python -m bench.timeline [--setups tritonkv,nixl-tuned] [--lengths 64,900] [--reps 9]
[--rounds 2]`` starts each setup as ``bench.bench_pd`` does, with :mod:`bench.timeline_hook` in
every server process (a ``sitecustomize.py`` on ``PYTHONPATH``; NIXL's chains
``bench/nixl_tuned/sitecustomize.py`` after it), sends ``bench.producer_leg``'s legs, and splits
each producer leg by the timestamps of the producer's processes (medians, ms; :data:`SEGMENTS`).
A diagnostic: the hook's own cost (a line written per call) is in every segment.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path

from connector.serve.demo import make_prompt, vocabulary
from connector.serve.launch import Cluster
from connector.serve.tiny_model import build_tiny_llama

from . import bench_pd
from .bench_pd import MAX_MODEL_LEN, PAUSE_S, _body, make_prompts, post
from .cores import thread_cpu

#: (segment, the event that ends it); each event is looked for after the previous one.
SEGMENTS = (
    ("client -> API server add_request (HTTP, tokenizing)", "api_add>"),
    ("API server -> engine core", "core_add>"),
    ("engine core add_request -> worker starts the step", "exec>"),
    ("forward pass (with the connector's save)", "exec<"),
    ("sampling and update_from_output", "update<"),
    ("engine core -> API server's output", "api_out<"),
)
REPO = Path(__file__).resolve().parent.parent


def site_dirs(root: Path) -> Path:
    """Write the ``sitecustomize.py`` files under ``root``; the one for plain servers' dir
    (``root / "nixl_tuned"`` holds NIXL's, for ``bench_pd.BENCH = root``)."""
    hook = f"import sys\nsys.path.insert(0, {str(REPO)!r})\nimport bench.timeline_hook\n"
    (root / "plain").mkdir(parents=True)
    (root / "plain" / "sitecustomize.py").write_text(hook)
    (root / "nixl_tuned").mkdir()
    nixl = (bench_pd.BENCH / "nixl_tuned" / "sitecustomize.py").read_text()
    (root / "nixl_tuned" / "sitecustomize.py").write_text(hook + nixl)
    return root / "plain"


def read_events(logdir: Path, pids) -> list[tuple[float, str]]:
    """The events of processes ``pids`` in time order."""
    out = []
    for pid in pids:
        path = logdir / f"{pid}.log"
        if path.exists():
            for line in path.read_text().splitlines():
                t, event = line.split()
                out.append((float(t), event))
    return sorted(out)


def split_leg(events: list[tuple[float, str]], t0: float, t1: float) -> list[float] | None:
    """One leg sent at ``t0`` and answered at ``t1`` as :data:`SEGMENTS` (ms) plus the last one
    (API server's output -> client); None when an event is missing."""
    marks, at = [t0], t0
    for _, event in SEGMENTS:
        at = next((t for t, e in events if e == event and at <= t <= t1), None)
        if at is None:
            return None
        marks.append(at)
    marks.append(t1)
    return [(b - a) * 1e3 for a, b in itertools.pairwise(marks)]


def table(splits: dict[tuple[str, int], list[list[float]]]) -> list[str]:
    """Median of each segment per (setup, length)."""
    names = [name for name, _ in SEGMENTS] + ["API server -> client", "total"]
    lines = []
    for (setup, n), legs in sorted(splits.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cols = [statistics.median(leg[i] for leg in legs) for i in range(len(names) - 1)]
        cols.append(statistics.median(sum(leg) for leg in legs))
        lines.append(f"{setup} {n} tokens ({len(legs)} legs):")
        lines += [f"  {name:55} {v:8.2f}" for name, v in zip(names, cols, strict=True)]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", default="tritonkv,nixl-tuned")
    parser.add_argument("--lengths", default="64,900")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="tkv-timeline-"))
    logdir = workdir / "events"
    logdir.mkdir()
    os.environ["TKV_TIMELINE_DIR"] = str(logdir)
    os.environ["PYTHONPATH"] = str(site_dirs(workdir / "site"))
    bench_pd.BENCH = workdir / "site"  # NIXL's setups take nixl_tuned/ from here
    model = build_tiny_llama(workdir / "model", max_position_embeddings=MAX_MODEL_LEN)
    words = vocabulary(model)
    prompts = make_prompts(words, lengths, args.reps, [])
    labels = args.setups.split(",")
    splits = collections.defaultdict(list)
    for r in range(args.rounds):
        for label in labels if r % 2 == 0 else labels[::-1]:
            with Cluster(workdir) as cluster:
                setup = bench_pd.start_setup(label, cluster, model, workdir, print)
                legs = []
                for n in lengths:
                    for prompt in [make_prompt(words, n, 10**6 + n)] + prompts.legs[n]:
                        time.sleep(PAUSE_S)
                        t0 = time.time()
                        pre = post(
                            setup.producer.url,
                            _body(prompt, 1, kv_transfer_params={"do_remote_decode": True}),
                        )
                        t1 = time.time()
                        time.sleep(PAUSE_S)
                        dec = post(
                            setup.consumer.url, _body(prompt, 1, kv_transfer_params=pre.kv_params)
                        )
                        if pre.error or dec.error:
                            raise RuntimeError(f"{label}: {pre.error or dec.error}")
                        legs.append((n, t0, t1))
                    legs.pop(-args.reps - 1)  # the warm-up leg
                pids = [tid for tid, _ in thread_cpu(setup.producer.popen.pid)]  # (+ threads)
                events = read_events(logdir, pids)
            for n, t0, t1 in legs:
                split = split_leg(events, t0, t1)
                if split is not None:
                    splits[label, n].append(split)
    print("\n".join(table(splits)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
