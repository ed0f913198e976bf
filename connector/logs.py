"""The one logger tree of tritonkv's connector: ``vllm.tritonkv.<component>``.

Under vLLM's own tree on purpose: inside vLLM's processes, where nearly every line is logged,
vLLM configures the ``vllm`` logger, so ours carry its format and process tags and obey
``VLLM_LOGGING_LEVEL``; elsewhere (the proxy, tests, benchmarks) they behave like any library's.
"""

from __future__ import annotations

import logging

ROOT = "vllm.tritonkv"


def get_logger(component: str) -> logging.Logger:
    """The logger of one component (``transport``, ``kvstore``, ``connector``, ``proxy``, ...)."""
    return logging.getLogger(f"{ROOT}.{component}")
