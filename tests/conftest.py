"""Test setup: Triton runs under its CPU interpreter when no GPU is present.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, so it is set here, before any
test module imports tritonkv.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Session fixtures for tests that run vLLM on a tiny local model (built once per session).
from support.vllm_fixtures import tiny_llama_dir, vllm_env  # noqa: E402, F401


def pytest_configure(config) -> None:
    """``@pytest.mark.timeout`` is pytest-timeout's marker, which ``make setup`` installs; a GPU
    machine running ``bench/gpu_check.sh`` may lack the plugin (its step has a limit of its own):
    declared there too, so that ``--strict-markers`` does not stop the collection."""
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line(
            "markers", "timeout(seconds): a test's time limit (pytest-timeout; not installed)"
        )
