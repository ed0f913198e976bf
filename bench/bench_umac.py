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

And the pack and unpack of that KV (``tokens`` tokens of a paged cache of the model, in
``bench_kv``'s "tokens" batch: sequences of 512 tokens over shuffled blocks, each followed by an
unselected decode token), each packing into a buffer allocated once:

- ``pack``: ``pack_kv`` alone; ``pack+digest``: with ``digest=True``; ``pack+nh``: with
  ``nh_key`` / ``nh_out`` (what a producer runs: an entry its pack hashed carries no whole-entry
  digest); ``pack+digest+nh``: both. NH is computed by
  the copy itself: the Triton kernel on a GPU, the twins' native copy on the CPU (in its lane
  loops, beside the digest where both are asked);
- ``unpack``: ``unpack_kv`` of the packed tensor into a second cache; ``unpack+digest``,
  ``unpack+nh`` (what a consumer runs for a tagged entry) and ``unpack+digest+nh`` likewise.

Printed, and written to ``--out``: per provider p50 ms and GB/s (bytes read / p50), with the
ratio to the copy (``x copy``) for the passes over the packed tensor, to ``pack`` or ``unpack``
(``x pack``, ``x unpack``) for the pack and unpack rows; and ``tag_over_copy`` = tag / copy (the
cost of authenticating, as a fraction of a copy of the same bytes; ``1.0`` means one more copy's
time). Checked before timing: the copy is bit-exact, NH equals the NumPy reference on the first
16 MiB, the tag equals the host's, and pack and unpack give the same packed bytes and cache writes
with NH as without it, with ``nh_out`` equal to ``umac.nh_hash`` of the packed tensor. The first
lines name the host, the commit, the date, what computed the digest and the NH layer, and the
load average.

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
from bench.bench_kv import MODELS, blocks_needed, make_batch, make_cache
from tritonkv import _cpu_digest, _cpu_umac, pack_kv, umac, unpack_kv
from tritonkv.digest import tensor_digest

SESSION_KEY = bytes(range(32))
# the pack and unpack rows, each as a ratio to the plain op's time in the same rounds
KV_BASES = {
    "pack": "pack",
    "pack+digest": "pack",
    "pack+nh": "pack",
    "pack+digest+nh": "pack",
    "unpack": "unpack",
    "unpack+digest": "unpack",
    "unpack+nh": "unpack",
    "unpack+digest+nh": "unpack",
}


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


class KVOps:
    """A paged cache of ``model_name`` holding the ``tokens`` tokens that ``packed`` packs (the
    source of the pack rows), a second cache (the unpack rows' destination), the batch, and the
    buffers the calls write: one ``out`` for every pack, one ``nh_out`` for every NH."""

    def __init__(self, model_name: str, tokens: int, packed: torch.Tensor):
        m = MODELS[model_name]
        device = packed.device
        num_blocks = blocks_needed(tokens, "tokens", m.block_size)
        table = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1))
        self.batch = make_batch(tokens, "tokens", m.block_size, table, device)
        layout = "latent" if m.mla else "NHD"
        self.src = make_cache(m, layout, num_blocks, device, seed=3)[1]
        self.dst = make_cache(m, layout, num_blocks, device, seed=5)[1]
        self.packed = packed
        self.out = torch.empty_like(packed)
        self.keys = umac.entry_keys(SESSION_KEY, "bench entry")
        chunks = umac.num_chunks(packed.numel() * packed.element_size())
        self.nh_out = torch.empty(chunks, umac.ITERATIONS, dtype=torch.int64, device=device)

    def pack(self, **kw):
        b = self.batch
        return pack_kv(self.src, b.slot_mapping, b.query_start_loc, b.seq_ids, out=self.out, **kw)

    def unpack(self, **kw):
        b = self.batch
        return unpack_kv(self.packed, self.dst, b.slot_mapping, b.query_start_loc, b.seq_ids, **kw)

    def fns(self) -> dict:
        nh = {"nh_key": self.keys, "nh_out": self.nh_out}
        return {
            "pack": lambda: self.pack(),
            "pack+digest": lambda: self.pack(digest=True),
            "pack+nh": lambda: self.pack(**nh),
            "pack+digest+nh": lambda: self.pack(digest=True, **nh),
            "unpack": lambda: self.unpack(),
            "unpack+digest": lambda: self.unpack(digest=True),
            "unpack+nh": lambda: self.unpack(**nh),
            "unpack+digest+nh": lambda: self.unpack(digest=True, **nh),
        }

    def check(self) -> None:
        """With NH, the same packed bytes and cache writes as without, and ``nh_out`` equal to
        :func:`umac.nh_hash` of the packed tensor (AssertionError otherwise)."""
        plain = self.pack()[0].clone()
        self.pack(nh_key=self.keys, nh_out=self.nh_out)
        assert torch.equal(self.out.view(torch.uint8), plain.view(torch.uint8)), "pack+nh"
        assert torch.equal(self.nh_out, umac.nh_hash(plain, self.keys)), "pack's NH"
        self.unpack(nh_key=self.keys, nh_out=self.nh_out)
        assert torch.equal(self.nh_out, umac.nh_hash(self.packed, self.keys)), "unpack's NH"
        b = self.batch
        back = pack_kv(self.dst, b.slot_mapping, b.query_start_loc, b.seq_ids)[0]
        assert torch.equal(back.view(torch.uint8), self.packed.view(torch.uint8)), "unpack"


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
    kv = KVOps(model, tokens, packed)
    kv.check()
    fns |= kv.fns()
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
        base = {n: KV_BASES.get(n, "copy") for n in fns}
        ratio = {n: common.paired_ratio(rounds[n], rounds[base[n]]) for n in fns}
    else:
        times = {n: common.bench(fn, quick=quick) for n, fn in fns.items()}
        base = {n: KV_BASES.get(n, "copy") for n in fns}
        ratio = {n: times[n][0] / times[base[n]][0] for n in fns}
    for name in fns:
        p50 = times[name][0]
        lines.append(
            f"{name:16s} p50 {p50:9.3f} ms  {nbytes / p50 / 1e6:7.2f} GB/s  x {base[name]} "
            f"{ratio[name]:.3f}"
        )
    load1 = os.getloadavg()
    lines.append(
        f"tag_over_copy: {ratio['tag']:.3f} (a separate pass); in the copy: pack+nh (a "
        f"producer's) {ratio['pack+nh']:.3f} x pack, unpack+nh (a consumer's) "
        f"{ratio['unpack+nh']:.3f} x unpack (goal <= 1.05); pack+digest+nh "
        f"{ratio['pack+digest+nh']:.3f} x pack"
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
