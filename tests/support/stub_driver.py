"""Triton's CUDA driver replaced by a recording stub, and tritonkv's device decisions patched so
CPU tensors take the CUDA path: the GPU launch path, exercised without a GPU.

Kernels compile for sm_90 as on an H100/H200; the launcher is a no-op that appends its arguments
to :data:`LAUNCHES`. Everything before the launcher's C call runs as on a GPU host: tritonkv's
Python, Triton's ``JITFunction.run`` (binding, specialisation, cache lookup) or the direct launch
(:mod:`tritonkv._launch`), and the launcher's Python wrapper.
"""

from __future__ import annotations

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
