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
