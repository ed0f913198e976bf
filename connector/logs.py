"""The one logger tree of tritonkv's connector: ``vllm.tritonkv.<component>``.

Under vLLM's own tree on purpose: inside vLLM's processes, where nearly every line is logged,
vLLM configures the ``vllm`` logger, so ours carry its format and process tags and obey
``VLLM_LOGGING_LEVEL``; elsewhere (the proxy, tests, benchmarks) they behave like any library's.
"""

from __future__ import annotations

import logging
import re

ROOT = "vllm.tritonkv"
#: Characters of a key (a transfer id) that go into a log line: a full id is what a GET needs.
SHORT_ID_CHARS = 8
_FULL_ID = re.compile(r"[0-9a-f]{32}")


def get_logger(component: str) -> logging.Logger:
    """The logger of one component (``transport``, ``kvstore``, ``connector``, ``proxy``, ...)."""
    return logging.getLogger(f"{ROOT}.{component}")


def short_id(key) -> str:
    """How a key (a transfer id) goes into a log line: its first :data:`SHORT_ID_CHARS`
    characters and ``…`` (``"0123abcd…"``), non-printable characters escaped first; ``none`` for
    None. The whole id lets its holder load or discard a request's KV, so no log holds it."""
    if key is None:
        return "none"
    text = repr(key)[1:-1] if isinstance(key, str) else repr(key)
    return f"{text[:SHORT_ID_CHARS]}…"


def hide_ids(text: str) -> str:
    """``text`` (an error's message, for a log line) with every 32-hex-digit run, such as a
    transfer id, cut as :func:`short_id` does."""
    return _FULL_ID.sub(lambda m: short_id(m[0]), text)
