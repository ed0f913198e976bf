"""Direct launches: a compiled Triton kernel launched without Triton's per-call argument binding.

A launch through ``JITFunction.run`` binds every argument by name, specialises each one (type,
divisibility by 16, equality to 1), hashes the result into the kernel cache key and only then
calls the compiled kernel's launcher: on an H200 host that was about 20 µs per launch, half of a
small pack's host time. Where the same launch site (one layer set, one op variant) launches again
with arguments that specialise the same way, that work gives the same compiled kernel every time,
so a :class:`DirectLaunch` keeps it and calls its launcher itself, exactly as ``JITFunction.run``
does (same arguments, in the kernel's parameter order, on the current device's current stream,
with Triton's launch hooks), skipping the binding.

Safety rests on the key a caller files each direct launch under: it must tell apart every call
Triton would specialise differently. :func:`pointer_spec` and :func:`int_spec` give, for the
arguments that change from call to call, at least what Triton's specialisation reads (pointer:
16-byte alignment, the dtype being part of the caller's key; integer: 32/64-bit range, ``== 1``,
divisibility by 16); everything else a launch passes (the layer set's tables and strides, the
constexprs) is fixed for the launch site that holds the entries. A key never seen goes through
``JITFunction.run``, which compiles or finds the kernel, and files it.

Direct launches are used only where they mirror this Triton's own launch call (checked once, on
the source of ``JITFunction.run``), never under the interpreter, and not with
``TRITONKV_DIRECT_LAUNCH=0`` (read when tritonkv is imported).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import triton

from ._dispatch import interpreting

__all__ = ["DIRECT", "DirectLaunch", "int_spec", "pointer_spec"]

# The launch call this module mirrors, as Triton 3.4-3.9's JITFunction.run writes it (whitespace
# aside): where it reads otherwise, launches keep going through JITFunction.run.
_MIRRORED = (
    "kernel.run(grid_0,grid_1,grid_2,stream,kernel.function,kernel.packed_metadata,"
    "launch_metadata,knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,"
    "*bound_args.values())"
)


def _mirrors_this_triton() -> bool:
    try:
        from triton import knobs  # noqa: F401  (3.4+)
        from triton.runtime.jit import JITFunction

        source = inspect.getsource(JITFunction.run)
    except (ImportError, OSError, TypeError):
        return False
    return _MIRRORED in "".join(source.split())


def _enabled() -> bool:
    if interpreting() or os.environ.get("TRITONKV_DIRECT_LAUNCH", "1").strip() == "0":
        return False
    return _mirrors_this_triton()


DIRECT = _enabled()
"""Whether launches may go direct (see the module docstring)."""


def int_spec(value: int) -> int:
    """What Triton's specialisation of an integer argument reads, and more, as bits: ``== 1``,
    divisibility by 16, 32-bit range, 64-bit signed range (one small int: cheap to hash)."""
    return (
        (value == 1)
        | (value % 16 == 0) << 1
        | (-(2**31) <= value < 2**31) << 2
        | (-(2**63) <= value < 2**63) << 3
    )


def pointer_spec(address: int) -> bool:
    """What Triton's specialisation of a pointer argument reads besides its dtype: 16-byte
    alignment."""
    return address % 16 == 0


@dataclass
class DirectLaunch:
    """One compiled kernel and the arguments of the launch that compiled it, ready to relaunch.

    ``args`` holds every parameter in the kernel's order (constexprs too, as ``JITFunction.run``
    passes them); per call, the varying parameters take new values: the runs of consecutive
    parameters ``args[start:stop]`` take ``values[first:first + stop - start]``.
    """

    compiled: object  # triton.compiler.CompiledKernel
    args: list
    runs: tuple[tuple[int, int, int], ...]  # (start, stop, first)
    meta: dict  # the launch's fixed keyword arguments (config constexprs such as BLOCK_T too)
    config: object = None  # the autotuner's config, reported as its best_config on each launch

    @classmethod
    def make(cls, compiled, fn, kwargs: dict, varying: tuple[str, ...], config=None):
        """The direct launch of ``compiled`` (what ``fn.run`` returned for ``kwargs``; ``varying``
        names the parameters that change per call, in the order ``__call__`` gets them), or None
        when direct launches are off, ``compiled`` is not a compiled kernel, ``kwargs`` misses
        a parameter or ``fn`` has pre-run hooks."""
        names = fn.arg_names
        if not DIRECT or not hasattr(compiled, "packed_metadata") or set(names) - set(kwargs):
            return None
        if getattr(fn, "pre_run_hooks", None):  # (run by JITFunction.run before each launch)
            return None
        runs = []
        for first, name in enumerate(varying):
            slot = names.index(name)
            if runs and runs[-1][1] == slot:
                runs[-1][1] += 1
            else:
                runs.append([slot, slot + 1, first])
        # The varying values are left out: the first call's tensors must not be kept alive.
        args = [None if name in varying else kwargs[name] for name in names]
        meta = {k: v for k, v in kwargs.items() if k not in varying}
        return cls(compiled, args, tuple(map(tuple, runs)), meta, config)

    def __call__(self, grid: tuple[int, int, int], values: tuple, device: int) -> None:
        """Launch on ``grid`` on ``device`` (:func:`current_device`) with ``values`` for the
        varying parameters (pointers as tensors or integer addresses), as ``JITFunction.run``
        would."""
        args = self.args.copy()
        for start, stop, first in self.runs:
            args[start:stop] = values[first : first + stop - start]
        stream = triton.runtime.driver.active.get_current_stream(device)
        kernel = self.compiled
        enter = triton.knobs.runtime.launch_enter_hook
        exit_ = triton.knobs.runtime.launch_exit_hook
        # The launcher hands launch_metadata to the hooks alone: none registered, none needed.
        hooked = _hooked(enter) or _hooked(exit_)
        meta = kernel.launch_metadata(grid, stream, *args) if hooked else None
        kernel.run(
            *grid, stream, kernel.function, kernel.packed_metadata, meta, enter, exit_, *args
        )


def _hooked(hook) -> bool:
    """Whether a launch hook does anything: set (a callable, older Triton) or a chain with calls
    (a HookChain, Triton 3.9)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def current_device() -> int:
    """Triton's current device (part of every direct launch's key: a compiled kernel's function
    handle belongs to the device it was loaded on)."""
    return triton.runtime.driver.active.get_current_device()
