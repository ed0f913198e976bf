"""Where a small pack_kv / unpack_kv call spends its host time (GPU), in one short run.

A decode-sized transfer (one 16-token sequence) moves a few MiB, which an H200 copies in
microseconds, so the call's cost is what the host does around the launch. For each case this
prints the host time per call (enqueue only, averaged over back-to-back calls), the wall time of a
call followed by a device synchronisation, the same for a bare ``copy_`` of the packed bytes, and a
cProfile of the calls (top functions by own time); ``pack_kv`` and ``unpack_kv`` with the views as
a list and prepared once (``tritonkv.prepare_kv``).

    python -m bench.host_overhead [--out FILE] [--dry-run]

``--dry-run`` runs the tiny model on the CPU (checks the script, not the GPU path).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import triton

import tritonkv
from bench.bench_kv import MODELS, blocks_needed, make_batch, make_cache

CASES = [("llama3-8b", "NHD"), ("llama3-70b-tp8", "NHD"), ("mla-576", "latent")]
CALLS = 300


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _per_call_us(fn, device, *, sync_each: bool) -> float:
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
        if sync_each:
            _sync(device)
    enqueued = time.perf_counter()
    _sync(device)
    return (enqueued - start) / CALLS * 1e6


def _profile(fn, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(CALLS):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    lines = text.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    return "\n".join(lines[start : start + top + 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--top", type=int, default=25, help="cProfile rows per case")
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    cases = [("tiny", "NHD")] if args.dry_run else CASES
    report = [
        f"host overhead per call ({CALLS} calls each), device {device}, torch {torch.__version__}, triton {triton.__version__}"
    ]
    for model_name, layout in cases:
        model = MODELS[model_name]
        num_blocks = blocks_needed(1, "seqs", model.block_size)
        block_table = torch.arange(num_blocks - 1)
        _, layers = make_cache(model, layout, num_blocks, device, seed=1)
        _, dst_layers = make_cache(model, layout, num_blocks, device, seed=2)
        batch = make_batch(1, "seqs", model.block_size, block_table, device)
        index = (batch.slot_mapping, batch.query_start_loc, batch.seq_ids)
        out = tritonkv.pack_kv(layers, *index)[0]
        copy_dst = torch.empty_like(out)
        src, dst = tritonkv.prepare_kv(layers), tritonkv.prepare_kv(dst_layers)
        fns = {
            "pack_kv": lambda: tritonkv.pack_kv(layers, *index, out=out),  # noqa: B023
            "unpack_kv": lambda: tritonkv.unpack_kv(out, dst_layers, *index),  # noqa: B023
            "pack_kv prepared": lambda: tritonkv.pack_kv(src, *index, out=out),  # noqa: B023
            "unpack_kv prepared": lambda: tritonkv.unpack_kv(out, dst, *index),  # noqa: B023
            "copy_": lambda: copy_dst.copy_(out),  # noqa: B023
        }
        mib = out.numel() * out.element_size() / 2**20
        report.append(f"\n== {model_name}/{layout}: {model.num_layers} layers, {mib:.2f} MiB")
        for name, fn in fns.items():
            host = _per_call_us(fn, device, sync_each=False)
            wall = _per_call_us(fn, device, sync_each=True)
            report.append(f"  {name:18s} host {host:8.1f} us/call   wall+sync {wall:8.1f} us/call")
        for name in ("pack_kv", "unpack_kv", "pack_kv prepared", "unpack_kv prepared"):
            report.append(f"\n  cProfile {name}, {CALLS} calls, by own time:")
            report.append(_profile(fns[name], args.top))
    hidden = torch.zeros(17, 4096, dtype=torch.bfloat16, device=device)
    qsl = torch.tensor([0, 16, 17], device=device)
    ids = torch.tensor([0], device=device)
    out = tritonkv.pack_hidden(hidden, qsl, ids)[0]
    fn = lambda: tritonkv.pack_hidden(hidden, qsl, ids, out=out)
    host = _per_call_us(fn, device, sync_each=False)
    wall = _per_call_us(fn, device, sync_each=True)
    report.append("\n== pack_hidden, 16 of 17 rows of 4096 bf16")
    report.append(f"  {'pack_hidden':18s} host {host:8.1f} us/call   wall+sync {wall:8.1f} us/call")
    report.append(f"\n  cProfile pack_hidden, {CALLS} calls, by own time:")
    report.append(_profile(fn, args.top))
    text = "\n".join(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
