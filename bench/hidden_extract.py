"""Hidden-state extraction in process (GPU): tritonkv's one launch for a step's requests against
the per-request copies of vLLM's ExampleHiddenStatesConnector, in one run.

A step in which ``num_seqs`` requests of ``num_tokens / num_seqs`` prompt tokens finish, from the
hidden-state cache ``[num_blocks, num_hidden_states, block_size, hidden_size]`` (an EAGLE-3 setup
for Llama-3.1-8B: 3 layers of 4096, bf16, blocks of 16) until every request's hidden states are
in pinned host memory (wall time, the device synchronised at the end):

==================  =========================================================================
provider            what runs for the step
==================  =========================================================================
example             what ExampleHiddenStatesConnector does per request (vLLM 0.32,
                    ``example_hidden_states_connector.py``, ``_submit_async_write``): the slot
                    mapping of its whole blocks built on the host and copied to the device, an
                    advanced-indexing gather of those slots cut to its tokens, a pinned host
                    tensor of that shape, a non-blocking copy into it; on a stream of its own
                    that waits for an event of the compute stream
tritonkv            one ``pack_kv`` launch over all the step's slots (by query offsets) into one
                    device tensor, one copy of it to pinned host memory
tritonkv-worker     the connector's own path (``HiddenWorker.save``, then its ``flush``): the
                    pack on its side stream, the publisher thread's per-request digests and
                    copy, each request's entry put in a KV buffer (then claimed); no disk, no
                    network
==================  =========================================================================

Figures: hidden-state tokens per second, and each provider's speed-up over ``example`` (the
median over interleaved rounds of the per-round ratio, :func:`bench.common.paired_ratio`). Run
with ``TRITONKV_AUTOTUNE=0`` (``bench/gpu_check.sh`` does: one launch config, no tuning pauses)
tritonkv's figures are without tuning.

    python -m bench.hidden_extract [--out FILE] [--dry-run] [--budget-s 2]

``--dry-run`` runs tiny sizes on the CPU (checks the script, not the GPU path).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import tritonkv
from bench.common import cpu_bench_interleaved, paired_ratio
from connector.hidden.scheduler import HiddenSaveSpec
from connector.hidden.worker import HiddenWorker
from connector.kvstore import KVBuffer
from connector.transport import host_empty

# (num_hidden_states, hidden_size, dtype, block_size, tokens per step)
GPU_SETUP = (3, 4096, torch.bfloat16, 16, 4096)
CPU_SETUP = (2, 64, torch.float32, 16, 256)
NUM_SEQS = (1, 8, 64, 256)  # requests finishing in the step (tokens split evenly)
DIGEST = "0" * 32  # the prompt digest every entry is bound to (the scheduler's, in vLLM)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Step:
    """One step's requests over a hidden-state cache, and each provider as a callable."""

    def __init__(self, setup, num_seqs: int, device: torch.device, seed: int = 0):
        heads, hidden, dtype, block_size, total = setup
        self.device, self.block_size = device, block_size
        per_seq = total // num_seqs
        self.lengths = [per_seq] * num_seqs
        need = -(-per_seq // block_size)
        num_blocks = need * num_seqs + 3
        g = torch.Generator().manual_seed(seed)
        self.cache = torch.randn(num_blocks, heads, block_size, hidden, generator=g).to(
            device=device, dtype=dtype
        )
        order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        self.blocks = [order[i * need : (i + 1) * need] for i in range(num_seqs)]
        self.layers = tritonkv.prepare_kv([(self.cache, None)])
        self.worker = HiddenWorker(self.cache, tp_rank=0, writer=None, buffer=self._buffer)
        self.buffer = KVBuffer(4 * total * heads * hidden * self.cache.element_size() + (1 << 20))
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._round = 0

    def _buffer(self):
        return self.buffer

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def _slots(self, i: int, whole_blocks: bool) -> torch.Tensor:
        blocks = torch.tensor(self.blocks[i], dtype=torch.int64)
        offsets = torch.arange(self.block_size, dtype=torch.int64)
        slots = (blocks[:, None] * self.block_size + offsets[None, :]).flatten()
        return slots if whole_blocks else slots[: self.lengths[i]]

    def example(self) -> list[torch.Tensor]:
        """Per request: slots to the device, a gather, a pinned host tensor, a copy."""
        out = []
        on_gpu = self.copy_stream is not None
        if on_gpu:
            ready = torch.cuda.Event()
            ready.record()
            self.copy_stream.wait_event(ready)
        for i, n in enumerate(self.lengths):
            slots = self._slots(i, whole_blocks=True)
            with torch.cuda.stream(self.copy_stream) if on_gpu else contextlib.nullcontext():
                slots = slots.to(self.device, non_blocking=True)
                rows = self.cache[slots // self.block_size, :, slots % self.block_size][:n]
                host = torch.empty_like(rows, device="cpu", pin_memory=on_gpu)
                host.copy_(rows, non_blocking=True)
            out.append(host)
        _sync(self.device)
        return out

    def tritonkv(self) -> list[torch.Tensor]:
        """One pack of every request's rows, one copy to pinned host memory."""
        slots = torch.cat([self._slots(i, whole_blocks=False) for i in range(len(self.lengths))])
        bounds = [0]
        for n in self.lengths:
            bounds.append(bounds[-1] + n)
        heads, hidden = self.cache.shape[1], self.cache.shape[3]
        out = torch.empty(
            (1, 1, bounds[-1], heads, hidden), dtype=self.cache.dtype, device=self.device
        )
        qsl = torch.tensor(bounds, dtype=torch.int64)
        packed, _ = tritonkv.pack_kv(
            self.layers, slots.to(self.device, non_blocking=True), qsl, out=out
        )
        rows = packed[0, 0]
        host = host_empty(rows.numel() * rows.element_size()).view(rows.dtype).view(rows.shape)
        host.copy_(rows, non_blocking=True)
        _sync(self.device)
        return [host[bounds[i] : bounds[i + 1]] for i in range(len(self.lengths))]

    def tritonkv_worker(self) -> list[torch.Tensor]:
        """The connector's path: save, flush, claim each entry (a checkout)."""
        self._round += 1
        specs = [
            HiddenSaveSpec(
                f"r{i}", f"{self._round:016x}{i:016x}", b, n, [1] * n, None, prompt_digest=DIGEST
            )
            for i, (b, n) in enumerate(zip(self.blocks, self.lengths, strict=True))
        ]
        self.worker.save(specs)
        if not self.worker.flush(30):
            raise TimeoutError("the hidden worker did not deliver within 30 s")
        out = []
        for spec in specs:
            with self.buffer.checkout(spec.transfer_id, digest=DIGEST) as lease:
                out.append(lease.tensors["hidden_states"])
        return out

    def close(self) -> None:
        self.worker.shutdown()
        self.buffer.close()


def check(step: Step) -> None:
    """Every provider's rows are the cache's, bit for bit (else the figures mean nothing)."""
    as_ints = lambda t: t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    want = []
    for i in range(len(step.lengths)):
        slots = step._slots(i, whole_blocks=False).to(step.device)
        want.append(step.cache[slots // step.block_size, :, slots % step.block_size].cpu())
    for name in ("example", "tritonkv", "tritonkv_worker"):
        got = getattr(step, name)()
        if not all(torch.equal(as_ints(w), as_ints(g)) for w, g in zip(want, got, strict=True)):
            raise AssertionError(f"{name}: rows differ from the cache's")


def run(dry_run: bool, budget_s: float) -> list[str]:
    device = torch.device("cpu" if dry_run or not torch.cuda.is_available() else "cuda")
    setup = CPU_SETUP if device.type == "cpu" else GPU_SETUP
    heads, hidden, dtype, block_size, total = setup
    row_bytes = heads * hidden * torch.empty((), dtype=dtype).element_size()
    lines = [
        f"== hidden-state extraction in process on {device} "
        f"({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}): "
        f"{heads} x {hidden} {str(dtype).removeprefix('torch.')} per token "
        f"({row_bytes} bytes), blocks of {block_size}, {total} tokens per step",
        "| requests | tokens each | provider | tokens/s (p50) | ms p50 | vs example |",
        "|---|---|---|---|---|---|",
    ]
    for num_seqs in NUM_SEQS:
        step = Step(setup, num_seqs, device)
        try:
            check(step)
            fns = {"example": step.example, "tritonkv": step.tritonkv,
                   "tritonkv-worker": step.tritonkv_worker}  # fmt: skip
            rounds: dict[str, list[float]] = {}
            q = cpu_bench_interleaved(fns, budget_s=budget_s, min_reps=5, rounds=rounds)
            for name in fns:
                ratio = paired_ratio(rounds["example"], rounds[name])
                lines.append(
                    f"| {num_seqs} | {step.lengths[0]} | {name} | "
                    f"{step.num_tokens / q[name][0] * 1e3:,.0f} | {q[name][0]:.3f} | "
                    f"{ratio:.2f} x |"
                )
        finally:
            step.close()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--budget-s", type=float, default=2.0, help="timed seconds per case")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    lines = run(args.dry_run, 0.2 if args.dry_run else args.budget_s)
    lines.append(f"(in {time.perf_counter() - t0:.1f} s)")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
