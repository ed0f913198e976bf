"""Which threads a server's processes run, on which cores (``/proc``), and moving them.

The P/D benchmarks start each vLLM server with its model worker bound to one core (vLLM's
``VLLM_CPU_OMP_THREADS_BIND``); its API server and engine core may run on any. :func:`pin_tree`
confines a whole server to its core (as if each server had a host of its own).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def thread_cpu(pid: int) -> dict[tuple[int, str], tuple[float, int]]:
    """``(tid, name) -> (CPU seconds, last CPU)`` of every thread of ``pid`` and its children."""
    pids, todo = [], [pid]
    while todo:  # children from /proc/<pid>/task/<tid>/children, as ps does
        p = todo.pop()
        pids.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in task.read_text().split()]
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for p in pids:
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[(int(task.name), name)] = (
                (int(fields[11]) + int(fields[12])) / tick,
                int(fields[36]),
            )
    return out


def pin_tree(pid: int, cpus: set[int], only_unpinned_from: set[int] | None = None) -> int:
    """Move every thread of ``pid``'s tree onto ``cpus`` (only those whose affinity is not
    ``only_unpinned_from``, when given); how many moved."""
    moved = 0
    for tid, _ in thread_cpu(pid):
        try:
            if only_unpinned_from is None or os.sched_getaffinity(tid) != only_unpinned_from:
                os.sched_setaffinity(tid, cpus)
                moved += 1
        except OSError:  # the thread ended meanwhile
            pass
    return moved


def confine(servers) -> dict[str, int]:
    """Every thread of each ``(name, pid, cpu)`` server's process tree onto core ``cpu``;
    ``name -> threads moved``."""
    return {name: pin_tree(pid, {cpu}) for name, pid, cpu in servers}
