"""Launch configs for the copy kernels, how the autotuner times them, and tuned launches.

``TRITONKV_AUTOTUNE=0`` (read when tritonkv is imported) keeps one default config, as the
interpreter always does.
"""

from __future__ import annotations

import os

import triton

from ._dispatch import interpreter_lock, interpreting


def autotune_configs(**fixed) -> list[triton.Config]:
    """Launch configs for the copy kernels: tokens per program × warps.

    One config (16 tokens, 4 warps) when interpreting, or when ``TRITONKV_AUTOTUNE=0`` is set
    before tritonkv is imported (no tuning pauses, e.g. for correctness tests); otherwise 13,
    among which Triton's autotuner picks per key at the key's first launch. One pipeline stage:
    the kernels have no loop whose loads could be pipelined.

    Args:
        fixed: extra constexprs every config carries (none today; kept for kernels that tile a
            second dimension).
    """
    if interpreting() or os.environ.get("TRITONKV_AUTOTUNE", "1").strip() == "0":
        return [triton.Config({"BLOCK_T": 16, **fixed}, num_warps=4)]
    return [
        triton.Config({"BLOCK_T": block_t, **fixed}, num_warps=warps, num_stages=1)
        for block_t in (4, 8, 16, 32, 64)
        for warps in (2, 4, 8)
        if not (block_t >= 32 and warps == 2)
    ]


def autotune_bench(fn, quantiles=None):
    """How the autotuner times a config: 5 ms warm-up, 25 ms of runs (Triton's default, 25 + 100
    ms, makes the first launch of each key pause for seconds on a serving GPU)."""
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


class TunedLaunch:
    """Launches of an autotuned kernel that skip the autotuner's per-call work once a key is tuned.

    Triton's autotuner rebuilds its key from every argument on every launch (a dict of all of
    them and the dtype of each tensor): on an H200 host that was about a tenth of a small call's
    host time. The first launch of each ``key`` goes through the autotuner, which times the
    configs and picks one; later launches of that key pass the picked config to the JIT function
    directly, as the autotuner itself would. ``key`` must hold everything the autotuner's key
    holds (its ``key`` arguments and the dtypes of the tensor arguments).
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.configs: dict[tuple, triton.Config] = {}

    def __call__(self, key: tuple, grid, *args, **kwargs) -> tuple[object, triton.Config]:
        """Launch; return what the JIT function's launch returned (its compiled kernel, which a
        :class:`~tritonkv._launch.DirectLaunch` can relaunch) and the config it ran with."""
        config = self.configs.get(key)
        with interpreter_lock():
            if config is None:
                compiled = self.kernel[grid](*args, **kwargs)
                config = self.configs[key] = self.kernel.best_config
            else:
                self.kernel.best_config = config  # what the autotuner reports for the last launch
                compiled = self.kernel.fn[grid](*args, **kwargs, **config.all_kwargs())
        return compiled, config
