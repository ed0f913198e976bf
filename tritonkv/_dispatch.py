"""Which implementation of an op runs: the Triton kernels or the torch twins.

``TRITONKV_KERNELS`` (``auto`` | ``torch`` | ``triton``, read at every call) names the kernels;
``TRITON_INTERPRET=1`` runs the Triton kernels on the CPU under Triton's interpreter.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

KERNELS = ("auto", "torch", "triton")


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_lock():
    """What every Triton launch of tritonkv runs under: under the CPU interpreter a lock, since
    the interpreter patches ``triton.language`` while a kernel runs and two threads' kernels at
    once break each other (a KV server or pipe thread hashing while the step packs); elsewhere
    nothing. (Triton reads ``TRITON_INTERPRET`` when the kernels are defined, and so does this.)"""
    return _LAUNCHES


def use_triton(device: torch.device) -> bool:
    """Pick the kernels for tensors on ``device`` from ``TRITONKV_KERNELS`` (auto|torch|triton).

    ``auto`` (default): Triton kernels for CUDA tensors, the torch twin otherwise. ``triton`` forces
    the Triton kernels (on CPU tensors only valid with ``TRITON_INTERPRET=1``); ``torch`` forces
    the twin.

    Raises:
        ValueError: ``TRITONKV_KERNELS`` holds another value, or ``triton`` is forced on CPU
            tensors without the interpreter.
    """
    choice = os.environ.get("TRITONKV_KERNELS", "auto").strip().lower() or "auto"
    if choice not in KERNELS:
        raise ValueError(f"TRITONKV_KERNELS: expected one of {KERNELS}, got {choice!r}")
    if choice == "torch":
        return False
    if choice == "triton":
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                "TRITONKV_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 set before "
                "tritonkv is imported"
            )
        return True
    return device.type == "cuda"


_LAUNCHES = threading.RLock() if interpreting() else contextlib.nullcontext()
