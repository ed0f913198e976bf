"""Timestamps of vLLM's request path, in every process that imports this (diagnostic only).

Imported by the ``sitecustomize.py`` that :mod:`bench.timeline` puts on a server's
``PYTHONPATH``: each vLLM module named in :data:`TARGETS` gets its methods wrapped as it is
imported, and every call writes ``<time.time()> <event>>`` on entry and ``<event><`` on return to
``$TKV_TIMELINE_DIR/<pid>.log``. Nothing else changes.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import threading
import time

_lock = threading.Lock()
_out = []


def _log(event: str) -> None:
    with _lock:
        if not _out:
            path = os.path.join(os.environ["TKV_TIMELINE_DIR"], f"{os.getpid()}.log")
            _out.append(open(path, "a", buffering=1))  # noqa: SIM115 (open for the process)
        _out[0].write(f"{time.time():.6f} {event}\n")


def _wrap(cls, name: str, event: str) -> None:
    orig = getattr(cls, name)
    if orig.__code__.co_flags & 0x80:  # a coroutine function

        @functools.wraps(orig)
        async def wrapped(*args, **kwargs):
            _log(event + ">")
            try:
                return await orig(*args, **kwargs)
            finally:
                _log(event + "<")
    else:

        @functools.wraps(orig)
        def wrapped(*args, **kwargs):
            _log(event + ">")
            try:
                return orig(*args, **kwargs)
            finally:
                _log(event + "<")

    setattr(cls, name, wrapped)


#: module -> (class, method, event name)
TARGETS = {
    "vllm.v1.engine.async_llm": [("AsyncLLM", "add_request", "api_add")],
    "vllm.v1.engine.output_processor": [("OutputProcessor", "process_outputs", "api_out")],
    "vllm.v1.engine.core": [("EngineCore", "add_request", "core_add"), ("EngineCore", "step", "core_step")],
    "vllm.v1.core.sched.scheduler": [("Scheduler", "schedule", "sched"), ("Scheduler", "update_from_output", "update")],
    "vllm.v1.worker.gpu_worker": [("Worker", "execute_model", "exec"), ("Worker", "sample_tokens", "sample")],
}  # fmt: skip


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            for cls, method, event in TARGETS[name]:
                _wrap(getattr(module, cls), method, event)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TKV_TIMELINE_DIR"):
    sys.meta_path.insert(0, _Finder())
