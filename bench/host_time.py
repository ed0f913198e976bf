"""The host (Python) time of one pack_kv / unpack_kv call on the GPU path, measured on a CPU.

A decode-sized call moves a few MiB, which an H200 copies in microseconds: its cost is the host
work around the launches. This measures that work without a GPU: Triton's driver is replaced by
:class:`StubDriver` (kernels compile for sm_90 as on an H100/H200; the launcher is a no-op that
records its arguments), and tritonkv's three device decisions are patched so CPU tensors take the
path CUDA tensors take (:func:`emulate_gpu_path`: the Triton kernels, no value checks, the index
built by its kernel). Everything else runs as on the GPU host: tritonkv's Python, Triton's
``JITFunction.run`` (binding, specialisation, cache lookup) or the direct launch
(:mod:`tritonkv._launch`), and the launcher's Python wrapper up to the C call. Torch ops on CUDA
tensors cost the host more than on CPU tensors (a few µs each), so the GPU figure of the same
code is higher (``bench/host_overhead.py`` measures it there).

Before and after in one run: the same measurement on another tree's tritonkv (``--baseline``, a
git ref exported to a temporary directory, default ``main``) in a child process.

    python -m bench.host_time [--baseline REF] [--calls N] [--out FILE]

Cases: Llama-3-8B (32 layers, 8 KV heads) and Llama-3-70B at TP 8 (80 layers, 1 KV head), bf16
NHD caches of 16-token blocks, one selected 16-token sequence, ``out=`` given: ``pack_kv`` and
``unpack_kv`` with the views as a list (the plain path) and, where the tree has it, prepared once
with ``prepare_kv``. Each figure is the calling thread's CPU time per call (``time.thread_time``:
on a shared machine, wall time would count the waits for a core), the least over 7 repeats of
``--calls`` back-to-back calls.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = {"llama3-8b": (32, 8), "llama3-70b-tp8": (80, 1)}  # name: (num_layers, num_kv_heads)
HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS, ROWS = 128, 16, 8, 16
REPEATS = 7  # the least of these per figure (other load on the machine only adds time)
LAUNCHES: list[tuple] = []  # every stubbed launch's arguments, in order


class _Launcher:
    """The launcher of one compiled kernel: records what it is called with. (Triton's own,
    ``CudaLauncher``, needs its CUDA helper module: its Python part, a few µs that both paths
    pay alike, is not counted.)"""

    def __init__(self, src, metadata) -> None:
        del src, metadata

    def __call__(self, *args) -> None:
        LAUNCHES.append(args)


class _Utils:
    """The driver's C utilities that a launch reaches: modules load as dummies."""

    def load_binary(self, name, kernel, shared, device):
        del name, kernel, shared, device
        return 1, 1, 32, 0, 1024  # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        del device
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "warpSize": 32}

    def unload_module(self, module) -> None:
        del module


class StubDriver:
    """Triton's CUDA driver as a launch sees it (current device 0, stream 0, sm_90 target), with a
    launcher that records instead of launching."""

    launcher_cls = _Launcher

    def __init__(self) -> None:
        self.utils = _Utils()

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        del device
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def install_stub_driver() -> None:
    """Make :class:`StubDriver` Triton's active driver (before any launch)."""
    from triton.runtime.driver import driver

    driver.set_active(StubDriver())


def emulate_gpu_path() -> None:
    """Make tritonkv's calls on CPU tensors take the path of CUDA tensors: the Triton kernels
    (``use_triton``), no value checks (``checks_enabled``: index tensors on the GPU), and the
    sequence index built by its kernel (``seq_index`` → ``device_seq_index``, after the same type
    checks)."""
    from tritonkv import _index, kv
    from tritonkv._checks import check_index

    def seq_index(query_start_loc, seq_ids, num_tokens, device, *, last_only=False):
        del num_tokens
        check_index("query_start_loc", query_start_loc)
        check_index("seq_ids", seq_ids)
        return _index.device_seq_index(query_start_loc, seq_ids, device, last_only)

    kv.use_triton = lambda device: True
    kv.checks_enabled = lambda *tensors: False
    kv.seq_index = seq_index


def _caches(num_layers: int, num_kv_heads: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    shape = (num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_SIZE)  # NHD, one buffer
    raw = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16)
    raw = raw.view(torch.bfloat16)
    return raw, [(raw[i, 0].transpose(1, 2), raw[i, 1].transpose(1, 2)) for i in range(num_layers)]


def _per_call_us(fn, calls: int) -> float:
    """CPU time of this thread per call (µs), the least of :data:`REPEATS` runs of ``calls``."""
    fn()
    runs = []
    for _ in range(REPEATS):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        runs.append((time.thread_time() - start) / calls * 1e6)
    return min(runs)


def measure(calls: int) -> dict:
    """µs per call of each case and op in this process's tritonkv, and launches per call."""
    os.environ["TRITONKV_AUTOTUNE"] = "0"  # (the stub cannot time configs; tuned keys go direct)
    os.environ.pop("TRITON_INTERPRET", None)
    install_stub_driver()
    import torch

    import tritonkv

    emulate_gpu_path()
    prepare = getattr(tritonkv, "prepare_kv", None)
    slots = torch.arange(ROWS, dtype=torch.int64)
    qsl = torch.tensor([0, ROWS], dtype=torch.int32)
    ids = torch.tensor([0], dtype=torch.int32)
    index = (slots, qsl, ids)
    results = {"tritonkv": str(Path(tritonkv.__file__).parent), "cases": {}}
    for name, (num_layers, num_kv_heads) in CASES.items():
        _raw, layers = _caches(num_layers, num_kv_heads, seed=1)
        _dst_raw, dst = _caches(num_layers, num_kv_heads, seed=2)
        out = torch.empty(num_layers, 2, ROWS, num_kv_heads, HEAD_SIZE, dtype=torch.bfloat16)
        variants = {"list": (layers, dst)}
        if prepare is not None:
            variants["prepared"] = (prepare(layers), prepare(dst))
        case = {}
        for variant, (src, dest) in variants.items():
            fns = {
                "pack_kv": lambda src=src, out=out: tritonkv.pack_kv(src, *index, out=out),
                "unpack_kv": lambda dest=dest, out=out: tritonkv.unpack_kv(out, dest, *index),
            }
            for op, fn in fns.items():
                fn()
                before = len(LAUNCHES)
                fn()
                launches = len(LAUNCHES) - before
                case[f"{op}/{variant}"] = {"us": _per_call_us(fn, calls), "launches": launches}
                LAUNCHES.clear()
        results["cases"][name] = case
    return results


def _export(ref: str, into: Path) -> str:
    """Write ``ref``'s tritonkv/ into ``into``; return the commit."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", ref], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "archive", commit, "tritonkv"], cwd=REPO, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def _child(tree: Path, calls: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = f"import json, sys; sys.path.insert(0, {str(tree)!r}); sys.path.insert(1, {str(REPO)!r})"
    code += f"; from bench.host_time import measure; print(json.dumps(measure({calls})))"
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200
    )
    if run.returncode:
        raise RuntimeError(f"measuring {tree} failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _head() -> str:
    run = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "tritonkv"], cwd=REPO, text=True, capture_output=True
    ).stdout.strip()
    return run.stdout.strip() + ("+uncommitted" if dirty else "")


def report(before: dict, after: dict, base: str, head: str, calls: int) -> str:
    import torch
    import triton

    lines = [
        "host time per call of the GPU path, measured on a CPU with Triton's launcher stubbed "
        f"(python -m bench.host_time; thread CPU time, least of {REPEATS} x {calls} calls; torch {torch.__version__}, "
        f"triton {triton.__version__}, {os.cpu_count()} CPUs)",
        f"before: {base} (main, {before['tritonkv']})   after: {head} ({after['tritonkv']})",
        "one 16-token sequence, bf16 NHD, out= given, index tensors treated as on the GPU "
        "(no value checks); launches = kernel launches per call",
        "",
        f"{'case':16s} {'op':10s} {'layers as':10s} {'before us':>10s} {'after us':>10s} "
        f"{'launches':>9s}",
    ]
    for name in CASES:
        for op in ("pack_kv", "unpack_kv"):
            was = before["cases"][name][f"{op}/list"]
            for variant in ("list", "prepared"):
                now = after["cases"][name].get(f"{op}/{variant}")
                if now is None:
                    continue
                lines.append(
                    f"{name:16s} {op:10s} {variant:10s} {was['us']:10.1f} {now['us']:10.1f} "
                    f"{was['launches']:>4d} -> {now['launches']}"
                )
    lines.append("")
    lines.append(
        "'before' is main's only path (a list of views); 'after' lists both of this tree's."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="main", help="git ref to compare with (main)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per repeat")
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = _export(args.baseline, Path(tmp))
        before = _child(Path(tmp), args.calls)
    after = _child(REPO, args.calls)
    text = report(before, after, base, _head(), args.calls)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
