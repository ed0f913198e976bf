"""Shared benchmark plumbing: timer, result directory, stamping, the CSV schema, plots, goal summary.

Every benchmark in ``bench/`` records :class:`Row` objects and writes them with :func:`write_csv`,
so all result files share one schema (``COLUMNS``). On a GPU the timer is
``triton.testing.do_bench``; on the CPU it is :func:`cpu_bench`, an equivalent wall-clock timer
(warm-up, then repeats, then the same quantiles).
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import triton

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
QUANTILES = (0.5, 0.2, 0.8)
# The kernels' goals: tokens sweep at >= GOAL_TOKENS tokens, tritonkv >= frac x copy GB/s; seqs
# sweep at GOAL_SEQS sequences, tritonkv >= speedup x faster than loop.
GOAL_TOKENS = 4096
GOAL_SEQS = 32
GOALS = {"cpu": {"frac_copy": 0.7, "vs_loop": 5.0}, "cuda": {"frac_copy": 0.9, "vs_loop": 50.0}}


def on_gpu() -> bool:
    return torch.cuda.is_available()


def bench_device() -> torch.device:
    return torch.device("cuda" if on_gpu() else "cpu")


def device_name() -> str:
    """``cpu`` or the GPU's name as torch reports it (e.g. ``NVIDIA H200``)."""
    return torch.cuda.get_device_name() if on_gpu() else "cpu"


def _cpuinfo() -> tuple[str, set[str]]:
    """This host's CPU model name and feature flags (``/proc/cpuinfo``; empty where unreadable)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
        if flags and model:
            break
    return model, flags


def cpu_kind() -> str:
    """The CPU's kind as result folders name it: ``cpu-amx`` (AMX tiles), ``cpu-avx512``,
    ``cpu-avx2``, else ``cpu-<machine>``."""
    flags = _cpuinfo()[1]
    for flag, kind in (("amx_tile", "amx"), ("avx512f", "avx512"), ("avx2", "avx2")):
        if flag in flags:
            return f"cpu-{kind}"
    return f"cpu-{platform.machine().lower() or 'unknown'}"


def host_kind() -> str:
    """Result folder name for this host: the GPU's short name (``NVIDIA H200`` -> ``h200``), or
    :func:`cpu_kind` without a GPU."""
    if not on_gpu():
        return cpu_kind()
    name = re.sub(r"^nvidia\s+", "", device_name().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def host_description() -> str:
    """What ran the benchmark, for the files it writes: device, CPU model, its kind and core count
    (e.g. ``cpu: AMD EPYC (cpu-avx512, 2 CPUs)``)."""
    model = _cpuinfo()[0]
    return f"{device_name()}: {model} ({cpu_kind()}, {os.cpu_count()} CPUs)"


def results_dir(name: str | None = None) -> Path:
    """``bench/results/<name>``, by default ``<host kind>`` (:func:`host_kind`); made if missing."""
    path = RESULTS / (name or host_kind())
    path.mkdir(parents=True, exist_ok=True)
    return path


def git_sha() -> str:
    """Short commit of the working tree, ``+dirty`` if tritonkv/ or bench/ have local changes."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "tritonkv", "bench/*.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (sha or "unknown") + ("+dirty" if dirty else "")


@dataclass(frozen=True)
class Stamp:
    device: str
    torch: str
    triton: str
    git_sha: str
    date: str


def stamp() -> Stamp:
    return Stamp(
        device=host_description(),
        torch=torch.__version__,
        triton=triton.__version__,
        git_sha=git_sha(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
    )


def set_threads() -> int:
    """Use every core for CPU ops (the timer measures what a CPU deployment would get)."""
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    return threads


# ----------------------------------------------------------------------------------------- timing


def _quantiles(times_ms: Sequence[float], quantiles: Sequence[float]) -> list[float]:
    t = torch.tensor(times_ms, dtype=torch.float64)
    return [float(torch.quantile(t, q)) for q in quantiles]


def cpu_bench(
    fn: Callable[[], object],
    *,
    warmup_s: float = 0.05,
    budget_s: float = 0.4,
    min_reps: int = 5,
    slow_s: float = 0.5,
    max_reps: int = 200,
    warmed: bool = False,
    quantiles: Sequence[float] = QUANTILES,
) -> list[float]:
    """``do_bench``'s CPU equivalent: warm up, repeat, return the ``quantiles`` of the times in ms.

    Warm-up: calls for ``warmup_s`` (at least one, none if ``warmed``: the caller just ran ``fn``).
    Then at least ``min_reps`` timed calls (3 when one call takes over ``slow_s``), more while the
    timed total is under ``budget_s``, at most ``max_reps``.
    """
    start = time.perf_counter()
    while not warmed and time.perf_counter() - start < warmup_s:
        fn()
        warmed = True
    times: list[float] = []
    while True:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        enough = min(min_reps, 3) if times[0] > slow_s * 1e3 else min_reps
        if len(times) >= max_reps or (len(times) >= enough and sum(times) >= budget_s * 1e3):
            break
    return _quantiles(times, quantiles)


def cpu_bench_interleaved(
    fns: dict[str, Callable[[], object]],
    *,
    budget_s: float = 1.5,
    min_reps: int = 7,
    slow_s: float = 0.5,
    max_reps: int = 200,
    quantiles: Sequence[float] = QUANTILES,
    rounds: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Time several providers round-robin (each round calls each once, in a rotating order).

    On a shared CPU, load comes and goes; interleaving exposes every provider to the same load,
    so their ratios stay meaningful (see :func:`paired_ratio`). Callers run each ``fn`` once
    before (the warm-up). At least ``min_reps`` rounds (3 when the first round takes over
    ``slow_s``), more while the total is under ``budget_s``, at most ``max_reps``. Returns each
    provider's ``quantiles`` in ms; ``rounds``, if given, receives each provider's time per round.
    """
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    total, needed = 0.0, min_reps
    for rep in range(max_reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
            total += times[name][-1]
        if rep == 0 and total > slow_s * 1e3:
            needed = min(min_reps, 3)
        if rep + 1 >= needed and total >= budget_s * 1e3:
            break
    if rounds is not None:
        rounds.update(times)
    return {name: _quantiles(t, quantiles) for name, t in times.items()}


def paired_ratio(base_ms: Sequence[float], other_ms: Sequence[float]) -> float:
    """Median over rounds of ``base / other`` (each round's two times taken moments apart).

    A load swing on a shared machine slows both times of a round alike, so the per-round ratio
    is steadier than a ratio of two medians taken over different moments.
    """
    return _quantiles([b / o for b, o in zip(base_ms, other_ms, strict=True)], [0.5])[0]


def bench(
    fn: Callable[[], object], *, quick: bool = False, warmed: bool = False, wall: bool = False
) -> list[float]:
    """p50, p20, p80 in ms of ``fn``: ``triton.testing.do_bench`` on a GPU, :func:`cpu_bench` else.

    ``quick``: shorter runs (GPU: 5 ms warm-up, 20 ms of repeats; CPU: 3 repeats). ``warmed``:
    ``fn`` has just run (CPU: no warm-up call). ``wall`` (GPU): wall time of each call followed
    by a device synchronisation instead, so the host's launch overhead counts in full (do_bench
    times device events after an L2 flush, behind which part of that overhead hides): the
    measure for the small, launch-bound transfers of the seqs sweep.
    """
    if on_gpu() and wall:
        torch.cuda.synchronize()
        fn = _synchronised(fn)
    elif on_gpu():
        warmup, rep = (5, 20) if quick else (25, 100)
        return list(triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=list(QUANTILES)))
    if quick:
        return cpu_bench(fn, warmup_s=0.0, budget_s=0.0, min_reps=3, warmed=warmed)
    return cpu_bench(fn, warmed=warmed)


def _synchronised(fn: Callable[[], object]) -> Callable[[], None]:
    def call() -> None:
        fn()
        torch.cuda.synchronize()

    return call


# ------------------------------------------------------------------------------------------- rows


@dataclass
class Row:
    """One measurement: an op, a sweep, a provider, an x value. ``COLUMNS`` is the CSV schema."""

    op: str
    sweep: str
    provider: str
    x: int
    p50_ms: float
    p20_ms: float
    p80_ms: float
    gbps: float | None  # bytes read + written / p50 time; None where not meaningful
    frac_copy: float | None = None  # gbps / the copy provider's gbps at the same point
    vs_loop: float | None = None  # loop p50 / this p50 (speed-up over the naive loop)
    case: str = ""  # model shape and layout, e.g. llama3-8b/HND
    dtype: str = ""
    bytes: int = 0  # bytes of the packed tensor (moved once read, once written)
    config: str = ""  # winning autotune config (GPU), or which code path ran
    device: str = ""
    torch: str = ""
    triton: str = ""
    git_sha: str = ""
    date: str = ""


COLUMNS = [f.name for f in fields(Row)]


def finish_rows(rows: list[Row], st: Stamp) -> None:
    """Fill ``frac_copy`` / ``vs_loop`` where unset (from the copy and loop rows' p50 at the same
    point; the CPU suite sets them from paired rounds), and stamp every row."""
    by_point: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        by_point.setdefault((r.op, r.sweep, r.case, r.x), {})[r.provider] = r
    for providers in by_point.values():
        copy, loop = providers.get("copy"), providers.get("loop")
        for r in providers.values():
            if r.frac_copy is None and r.gbps is not None and copy is not None and copy.gbps:
                r.frac_copy = r.gbps / copy.gbps
            if r.vs_loop is None and loop is not None and r.p50_ms > 0:
                r.vs_loop = loop.p50_ms / r.p50_ms
            r.device, r.torch, r.triton, r.git_sha, r.date = (
                st.device,
                st.torch,
                st.triton,
                st.git_sha,
                st.date,
            )


def _fmt(value: object) -> object:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return value


def write_csv(rows: Iterable[Row], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: _fmt(v) for k, v in asdict(r).items()})
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------------------------------ plots

STYLES = {"tritonkv": ("tab:blue", "-"), "torch": ("tab:orange", "--"), "loop": ("tab:red", ":")}
STYLES["copy"] = ("black", "-.")
STYLES["digest"] = ("tab:green", "-")
STYLES["write_back"] = ("tab:purple", "--")


def have_matplotlib() -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        return False
    return True


def plot(rows: Sequence[Row], path: Path, title: str) -> Path | None:
    """One PNG for one sweep: per op two rows of panels, a column per case.

    tokens sweep: upper panel GB/s (read + written) per provider, lower the fraction of ``copy``.
    seqs sweep: upper panel p50 ms per provider (p20–p80 shaded), lower the speed-up over ``loop``.
    Returns None (and plots nothing) without matplotlib.
    """
    if not rows or not have_matplotlib():
        return None
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r.op for r in rows))
    cases = {op: list(dict.fromkeys(r.case for r in rows if r.op == op)) for op in ops}
    ncols = max(len(c) for c in cases.values())
    tokens = rows[0].sweep == "tokens"
    fig, axes = plt.subplots(
        2 * len(ops), ncols, figsize=(3.4 * ncols + 0.6, 5.6 * len(ops)), squeeze=False
    )
    for row_pair, op in enumerate(ops):
        for col in range(ncols):
            top, bottom = axes[2 * row_pair][col], axes[2 * row_pair + 1][col]
            if col >= len(cases[op]):
                top.axis("off")
                bottom.axis("off")
                continue
            case = cases[op][col]
            _plot_case([r for r in rows if (r.op, r.case) == (op, case)], top, bottom, tokens)
            top.set_title(f"{op} {case}", fontsize=9)
            if col == 0:
                top.set_ylabel("GB/s (read + written)" if tokens else "ms (p50, p20-p80 shaded)")
                bottom.set_ylabel("fraction of copy" if tokens else "speed-up over loop")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _plot_case(rows: Sequence[Row], top, bottom, tokens: bool) -> None:
    for provider in dict.fromkeys(r.provider for r in rows):
        pts = sorted((r for r in rows if r.provider == provider), key=lambda r: r.x)
        color, style = STYLES.get(provider, (None, "-"))
        xs = [r.x for r in pts]
        if tokens:
            top.plot(xs, [r.gbps for r in pts], style, color=color, marker=".", label=provider)
            if provider != "copy":
                bottom.plot(xs, [r.frac_copy for r in pts], style, color=color, marker=".")
        else:
            top.plot(xs, [r.p50_ms for r in pts], style, color=color, marker=".", label=provider)
            lows, highs = [r.p20_ms for r in pts], [r.p80_ms for r in pts]
            top.fill_between(xs, lows, highs, color=color, alpha=0.15)
            if provider not in ("copy", "loop"):
                bottom.plot(xs, [r.vs_loop for r in pts], style, color=color, marker=".")
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    bottom.axhline(1.0, color="black", lw=0.6)
    if tokens:
        bottom.set_xlabel("packed tokens")
    else:
        top.set_yscale("log")
        bottom.set_yscale("log")
        bottom.set_xlabel("sequences (16 tokens each)")


def title_for(op: str, sweep: str, st: Stamp) -> str:
    return (
        f"{op}, {sweep} sweep | {st.device} | torch {st.torch}, triton {st.triton} | "
        f"{st.git_sha} | {st.date}"
    )


# ---------------------------------------------------------------------------------------- summary


def summary(rows: Sequence[Row], kind: str) -> list[str]:
    """Lines comparing the ``tritonkv`` rows with the goals of ``kind`` (``cpu`` or ``cuda``)."""
    goal = GOALS[kind]
    lines = []
    mine = [r for r in rows if r.provider == "tritonkv"]
    for op, case in dict.fromkeys((r.op, r.case) for r in mine if r.sweep == "tokens"):
        big = [
            r
            for r in mine
            if (r.op, r.case, r.sweep) == (op, case, "tokens")
            and r.x >= GOAL_TOKENS
            and r.frac_copy is not None
        ]
        if big:
            worst = min(big, key=lambda r: r.frac_copy)
            ok = "ok " if worst.frac_copy >= goal["frac_copy"] else "LOW"
            lines.append(
                f"{ok} tokens {op:<12} {case:<22} min over x>={GOAL_TOKENS}: "
                f"{worst.frac_copy:.2f} x copy (at {worst.x}: {worst.gbps:.1f} GB/s; "
                f"goal {goal['frac_copy']})"
            )
    for r in mine:
        if r.sweep == "seqs" and r.x == GOAL_SEQS and r.vs_loop is not None:
            ok = "ok " if r.vs_loop >= goal["vs_loop"] else "LOW"
            lines.append(
                f"{ok} seqs   {r.op:<12} {r.case:<22} at {GOAL_SEQS} seqs: {r.vs_loop:.1f} x loop "
                f"({r.p50_ms:.3f} ms; goal {goal['vs_loop']:g} x)"
            )
    return lines
