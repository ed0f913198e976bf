"""Kernel demo: pack the prefills of a mixed prefill+decode batch, unpack them into another cache.

``python -m tritonkv.demo`` (what ``make demo`` runs until the connector demo lands). It builds a
bf16 paged cache shaped like a small Llama (FlashAttention layout, NHD), a flat batch of two
prefills and three decodes with CUDA-graph padding at the end, packs the two prefills by query
offsets, unpacks them into a second, empty cache, and checks every byte. It runs on a GPU when
there is one (one Triton launch for all layers), else on the torch twin.
"""

from __future__ import annotations

import argparse
import time

import torch

from tritonkv import layouts, pack_kv, unpack_kv, use_triton


def _build(device, num_layers, num_blocks, block_size, num_kv_heads, head_size, gen):
    shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    caches = [
        torch.randn(shape, generator=gen).to(device, torch.bfloat16) for _ in range(num_layers)
    ]
    return caches, [layouts.flash_attn(c) for c in caches]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prefill", type=int, nargs="+", default=[700, 333])
    parser.add_argument("--decodes", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    block_size, num_kv_heads, head_size, num_blocks = 16, 8, 128, 256
    gen = torch.Generator().manual_seed(0)
    _, src = _build(args.device, args.layers, num_blocks, block_size, num_kv_heads, head_size, gen)

    # The flat batch: prefills first, then one token per decode, then 5 padding tokens (slot -1).
    query_lens = args.prefill + [1] * args.decodes
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    slots, qsl = [], [0]
    for qlen in query_lens:
        need = -(-qlen // block_size)
        table, blocks = blocks[:need], blocks[need:]
        start = (len(slots) * 7) % block_size if qlen == 1 else 0  # decodes land mid-block
        slots += [
            table[(start + i) // block_size] * block_size + (start + i) % block_size
            for i in range(qlen)
        ]
        qsl.append(qsl[-1] + qlen)
    slots += [-1] * 5
    slot_mapping = torch.tensor(slots, device=args.device)
    query_start_loc = torch.tensor(qsl, device=args.device, dtype=torch.int32)
    prefill_ids = list(range(len(args.prefill)))
    print(f"batch: query lengths {query_lens} + 5 padding tokens ({len(slots)} flat tokens)")
    print(f"packing sequences {prefill_ids} by query offsets {qsl}")

    _, dst = _build(args.device, args.layers, num_blocks, block_size, num_kv_heads, head_size, gen)
    for k, v in dst:
        k.zero_(), v.zero_()
    pack_kv(src, slot_mapping, query_start_loc, prefill_ids)  # warm-up (Triton compiles/autotunes)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    packed, cu_seqlens = pack_kv(src, slot_mapping, query_start_loc, prefill_ids)
    sync()
    t1 = time.perf_counter()
    unpack_kv(packed, dst, slot_mapping, query_start_loc, prefill_ids)
    sync()
    t2 = time.perf_counter()

    exact = untouched_ok = True
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        for s, d in ((sk, dk), (sv, dv)):
            for seq in prefill_ids:
                sel = slot_mapping[qsl[seq] : qsl[seq + 1]]
                b, o = sel // block_size, sel % block_size
                exact &= torch.equal(s[b, :, o].view(torch.int16), d[b, :, o].view(torch.int16))
            untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=args.device)
            untouched[slot_mapping[: qsl[len(prefill_ids)]]] = False
            flat = d.transpose(1, 2).reshape(-1, num_kv_heads, head_size)
            untouched_ok &= bool((flat[untouched] == 0).all())
    nbytes = packed.numel() * packed.element_size()
    if use_triton(torch.device(args.device)):
        kernels = "Triton kernels, one launch for all layers"
        kernels += "" if args.device.startswith("cuda") else " (CPU interpreter: slow by design)"
    else:
        kernels = "torch twin"
    print(
        f"packed {tuple(packed.shape)} bf16, cu_seqlens {cu_seqlens.tolist()}, {nbytes / 2**20:.1f} MiB"
    )
    print(f"kernels: {kernels}")
    print(
        f"pack   {1e3 * (t1 - t0):8.3f} ms  {2 * nbytes / (t1 - t0) / 1e9:7.2f} GB/s (read + write)"
    )
    print(
        f"unpack {1e3 * (t2 - t1):8.3f} ms  {2 * nbytes / (t2 - t1) / 1e9:7.2f} GB/s (read + write)"
    )
    print(
        f"bit-exact: {'yes' if exact else 'NO'}; other slots untouched: {'yes' if untouched_ok else 'NO'}"
    )
    return 0 if exact and untouched_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
