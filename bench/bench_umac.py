"""Payload authentication's cost: the keyed hash (:mod:`tritonkv.umac`) against the keyless
digest (:mod:`tritonkv.digest`) and a plain copy of the same packed KV, in one run.

Providers, each over the same packed tensor (a packed KV of ``bench_kv.MODELS``, ``tokens``
tokens, random bits), timed in interleaved rounds on a CPU (``common.cpu_bench_interleaved``,
ratios the median of per-round ratios) or ``do_bench`` on a GPU:

- ``copy``: ``dst.copy_(packed)`` into a buffer allocated once (the bytes' memory traffic);
- ``digest``: ``tensor_digest(packed)``, the keyless digest as its own pass (where pack and
  unpack compute it, it is fused into their copy instead);
- ``nh``: the keyed hash's universal layer, ``umac.nh_hash`` (the pass over the bytes);
- ``tag``: ``umac.payload_tag`` with the transfer's key derivation: what the sender and the
  receiver each add to a process-group payload (a separate pass; not fused into pack/unpack).

Printed, and written to ``--out``: per provider p50 ms and GB/s (bytes read / p50), and
``tag_over_copy`` = tag / copy (the cost of authenticating, as a fraction of a copy of the same
bytes; ``1.0`` means one more copy's time). Checked before timing: the copy is bit-exact, NH
equals the NumPy reference on the first 16 MiB, the tag equals the host's. The first lines name the host, the commit, the date,
what computed the digest and the NH layer, and the load average.

Run: ``python -m bench.bench_umac [--tokens 4096] [--model llama3-8b] [--out PATH]`` (the kept
CPU result: ``bench/results/cpu-avx512/umac.txt``; ``bench/gpu_check.sh`` runs it on a GPU and
prints into its log). ``--dry-run``: tiny sizes (checks the script).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from bench import common
from bench.bench_kv import MODELS
from tritonkv import _cpu_digest, _cpu_umac, umac
from tritonkv.digest import tensor_digest

SESSION_KEY = bytes(range(32))


def packed_kv(model_name: str, tokens: int, device: torch.device) -> torch.Tensor:
    """A packed KV tensor of ``tokens`` tokens of ``model_name`` (``[layers, 2, tokens, heads,
    head_size]``; latent caches ``[layers, 1, ...]``), random bits."""
    m = MODELS[model_name]
    kv = 1 if m.mla else 2
    shape = (m.num_layers, kv, tokens, m.num_kv_heads, m.head_size)
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=m.dtype).element_size()
    gen = torch.Generator(device=device).manual_seed(0)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen, device=device)
    return raw.view(m.dtype).view(shape)


def check(packed: torch.Tensor, fns: dict, dst: torch.Tensor) -> None:
    """Before timing: the copy (into ``dst``) is bit-exact, NH of the first 16 MiB equals the
    NumPy reference, and the tag is the same on the host copy (AssertionError otherwise)."""
    fns["copy"]()
    assert torch.equal(dst.view(torch.uint8), packed.view(torch.uint8)), "copy differs"
    keys = umac.transfer_keys(SESSION_KEY, b"check")
    head = packed.reshape(-1).view(torch.uint8)[: 16 << 20]
    got = umac.nh_hash(head, keys).cpu().numpy().view("<u8")
    assert (got == umac.nh_hash_numpy(head, keys)).all(), "NH differs from the reference"
    assert umac.payload_tag(keys, [packed]) == umac.payload_tag(keys, [packed.cpu()]), "tag"


def providers(packed: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """The timed calls by name, and the copy's destination."""
    dst = torch.empty_like(packed)
    nonce = iter(range(1 << 62))
    keys = umac.transfer_keys(SESSION_KEY, b"bench")
    fns = {
        "copy": lambda: dst.copy_(packed),
        "digest": lambda: tensor_digest(packed),
        "nh": lambda: umac.nh_hash(packed, keys),
        "tag": lambda: umac.payload_tag(
            umac.transfer_keys(SESSION_KEY, next(nonce).to_bytes(8, "little")), [packed]
        ),
    }
    return fns, dst


def run(model: str, tokens: int, quick: bool) -> list[str]:
    device = common.bench_device()
    threads = common.set_threads() if device.type == "cpu" else None
    packed = packed_kv(model, tokens, device)
    nbytes = packed.numel() * packed.element_size()
    fns, dst = providers(packed)
    check(packed, fns, dst)
    for fn in fns.values():  # warm-up (and the C libraries' first build)
        fn()
    st = common.stamp()
    load0 = os.getloadavg()
    lines = [
        f"{st.device} | torch {st.torch}, triton {st.triton} | {st.git_sha} | {st.date}",
        f"digest computed by: {_cpu_digest.backend() if device.type == 'cpu' else 'triton'}; "
        f"NH by: {_cpu_umac.backend() if device.type == 'cpu' else 'triton'}"
        + (f"; {threads} threads" if threads else ""),
        f"packed KV: {model}, {tokens} tokens, {nbytes / 2**20:.0f} MiB",
    ]
    if device.type == "cpu":
        rounds: dict[str, list[float]] = {}
        budget = 1.0 if quick else 6.0
        times = common.cpu_bench_interleaved(fns, budget_s=budget, rounds=rounds)
        ratio = {n: common.paired_ratio(rounds[n], rounds["copy"]) for n in fns}
    else:
        times = {n: common.bench(fn, quick=quick) for n, fn in fns.items()}
        ratio = {n: times[n][0] / times["copy"][0] for n in fns}
    for name in fns:
        p50 = times[name][0]
        lines.append(
            f"{name:7s} p50 {p50:9.3f} ms  {nbytes / p50 / 1e6:7.2f} GB/s  x copy {ratio[name]:.3f}"
        )
    load1 = os.getloadavg()
    lines.append(
        f"tag_over_copy: {ratio['tag']:.3f} (goal <= 1.05 x copy for the fused case; this is a "
        "separate pass)"
    )
    lines.append(
        "load average (1, 5, 15 min) at the start: "
        + " ".join(f"{x:.1f}" for x in load0)
        + ", at the end: "
        + " ".join(f"{x:.1f}" for x in load1)
    )
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="shorter timing")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes: checks the script")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.tokens <= 0:
        raise ValueError(f"--tokens: expected a positive int, got {args.tokens}")
    model, tokens = ("tiny", 64) if args.dry_run else (args.model, args.tokens)
    lines = run(model, tokens, args.quick or args.dry_run)
    text = "\n".join(f"bench_umac: {line}" for line in lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
