"""Does work on another core slow the model's forward by holding the interpreter lock?

The hidden-state publisher (:mod:`connector.vllm_connector.hidden_states`) works on its own
thread, pinned to another core, while vLLM's next forward runs. On a CPU host that forward is
``transformers``-like PyTorch code: between its native ops it runs Python, which needs the
interpreter lock (GIL). A thread that runs Python meanwhile takes the lock away from it at each
switch interval, and the forward waits for it back ("convoy"); a thread in native code that
releases the lock does not. This measures it, on a tiny Llama (``connector.serve.tiny_model``),
one thread per core:

- ``none``: the forward alone (2 × 256 tokens, ``torch.set_num_threads(1)``, on core 0);
- ``python``: a thread on core 1 burns ``--cpu-ms`` of its own CPU time per step in pure Python
  (dict and list work), started with each forward;
- ``native``: the same CPU time in ``hashlib.sha256`` over 64 KiB chunks (which releases the
  lock);
- ``publisher``: the connector's real save of the step's two 256-token prompts
  (:class:`~connector.vllm_connector.hidden_states.HiddenWorker`, digests on, a KV buffer as the
  way out, its publisher thread on core 1), the pack on the step before the next forward (its
  time not counted), the rest on the publisher thread while that forward runs.

Rounds interleave the modes; each figure is the median forward time over all of a mode's steps,
and the side thread's CPU time per step (``time.thread_time``) says how much work it did.

    python -m bench.gil_convoy [--steps 40] [--rounds 5] [--cpu-ms 0.85] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

MODES = ("none", "python", "native", "publisher")
TOKENS = 256  # per prompt; two prompts a step


def _python_work(budget_s: float) -> None:
    """Pure Python until ``budget_s`` of this thread's CPU time is spent."""
    end = time.thread_time() + budget_s
    while time.thread_time() < end:
        d = {i: i * 3 for i in range(64)}
        sum(v for v in d.values() if v & 1)


_CHUNK = os.urandom(64 << 10)


def _native_work(budget_s: float) -> None:
    """``hashlib`` (the lock released) until ``budget_s`` of this thread's CPU time is spent."""
    end = time.thread_time() + budget_s
    while time.thread_time() < end:
        hashlib.sha256(_CHUNK).digest()


class _Side:
    """A thread on core 1 that does ``work(budget_s)`` each time :meth:`go` is called."""

    def __init__(self, work, budget_s: float) -> None:
        self.work, self.budget_s = work, budget_s
        self.start, self.cpu_s, self.stop = threading.Event(), 0.0, False
        self.idle = threading.Event()
        self.idle.set()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        os.sched_setaffinity(0, {1})
        while True:
            self.start.wait()
            self.start.clear()
            if self.stop:
                return
            t0 = time.thread_time()
            self.work(self.budget_s)
            self.cpu_s += time.thread_time() - t0
            self.idle.set()

    def go(self) -> None:
        self.idle.wait()
        self.idle.clear()
        self.start.set()

    def close(self) -> None:
        self.idle.wait()
        self.stop = True
        self.start.set()
        self.thread.join()


class _Publisher:
    """The connector's save of two prompts a step, into a KV buffer drained after each step."""

    def __init__(self) -> None:
        import torch

        from connector.kvstore import KVBuffer
        from connector.transport.threads import set_transfer_cpus, transfer_cpus
        from connector.vllm_connector.hidden_states import HiddenSaveSpec, HiddenWorker

        self.saved_cpus = transfer_cpus()
        set_transfer_cpus({1})  # the publisher thread, started at the first save
        blocks = 2 * TOKENS // 32
        self.cache = torch.randn(blocks + 1, 2, 32, 128)  # tiny Llama: 2 aux layers, hidden 128
        self.buffer = KVBuffer(1 << 30)
        self.worker = HiddenWorker(self.cache, tp_rank=0, writer=None, buffer=lambda: self.buffer)
        self.spec, self.step = HiddenSaveSpec, 0
        self.ids, self.keys = list(range(TOKENS)), []

    def go(self) -> None:
        half = TOKENS // 32
        specs = []
        for i in range(2):
            blocks = list(range(1 + i * half, 1 + (i + 1) * half))
            specs.append(self.spec(f"r{i}", f"t{self.step}-{i}", blocks, TOKENS, self.ids, None))
        self.step += 1
        self.keys = [s.transfer_id for s in specs]
        self.worker.save(specs)

    def drain(self) -> None:
        if not self.worker.flush(30.0):
            raise TimeoutError("gil_convoy: the publisher did not finish within 30 s")
        for key in self.keys:
            if not self.buffer.drop(key):
                raise RuntimeError(f"gil_convoy: the publisher delivered no entry {key}")

    def close(self) -> None:
        from connector.transport.threads import set_transfer_cpus

        self.worker.shutdown(10.0)
        self.buffer.close()
        set_transfer_cpus(self.saved_cpus)


def _model():
    import torch
    from transformers import AutoModelForCausalLM

    from connector.serve.tiny_model import build_tiny_llama

    path = build_tiny_llama(Path(tempfile.mkdtemp(prefix="gil_convoy_")) / "model")
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.randint(3, 500, (2, TOKENS), generator=torch.Generator().manual_seed(0))
    return model, ids


def run(steps: int, rounds: int, cpu_ms: float) -> dict:
    import torch

    threads, cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {0})
    try:
        return _run(steps, rounds, cpu_ms)
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, cpus)


def _run(steps: int, rounds: int, cpu_ms: float) -> dict:
    import torch

    model, ids = _model()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    side_cpu: dict[str, float] = dict.fromkeys(MODES, 0.0)
    with torch.inference_mode():
        for _ in range(3):
            model(ids)  # warm-up
        for _ in range(rounds):
            for mode in MODES:
                side = {
                    "none": None,
                    "python": lambda: _Side(_python_work, cpu_ms / 1e3),
                    "native": lambda: _Side(_native_work, cpu_ms / 1e3),
                    "publisher": _Publisher,
                }[mode]
                side = side() if side else None
                cpu0 = _publisher_cpu() if mode == "publisher" else 0.0
                for _ in range(steps):
                    if side is not None:
                        side.go()
                    t0 = time.perf_counter()
                    model(ids)
                    times[mode].append(time.perf_counter() - t0)
                    if mode == "publisher":
                        side.drain()
                if side is not None:
                    side_cpu[mode] += _publisher_cpu() - cpu0 if mode == "publisher" else side.cpu_s
                    side.close()
    base = statistics.median(times["none"])
    out = {"steps": steps, "rounds": rounds, "cpu_ms": cpu_ms, "modes": {}}
    for mode in MODES:
        med = statistics.median(times[mode])
        out["modes"][mode] = {
            "forward_ms": round(1e3 * med, 3),
            "slowdown_ms": round(1e3 * (med - base), 3),
            "side_cpu_ms_per_step": round(1e3 * side_cpu[mode] / (steps * rounds), 3),
        }
    return out


def _publisher_cpu() -> float:
    """CPU seconds of the publisher thread so far (``/proc``: it is not ours to time)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            if name.startswith("tritonkv-hidden"):
                fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="forwards per mode and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpu-ms", type=float, default=0.85, help="side CPU time per step")
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("gil_convoy: needs two cores (the forward on 0, the side thread on 1)")
    result = run(args.steps, args.rounds, args.cpu_ms)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
