"""The one logger tree of tritonkv's connector: ``vllm.tritonkv.<component>``.

Under vLLM's own tree on purpose: inside vLLM's processes, where nearly every line is logged,
vLLM configures the ``vllm`` logger, so ours carry its format and process tags and obey
``VLLM_LOGGING_LEVEL``; elsewhere (the proxy, tests, benchmarks) they behave like any library's.
"""

from __future__ import annotations

import logging
import re
import threading
import time

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


class Throttle:
    """At most ``burst`` lines per key in any ``interval_s`` window, for lines a stranger can
    cause (a crafted hand-off, a peer that keeps failing): :meth:`allow` says whether to log one
    now and how many of its kind were held back since the last one logged. At most ``max_keys``
    keys are remembered (the oldest forgotten), so no sender can grow it."""

    def __init__(self, burst: int = 10, interval_s: float = 10.0, max_keys: int = 256):
        self.burst, self.interval_s, self.max_keys = burst, interval_s, max_keys
        self._keys: dict[str, list] = {}  # key -> [window start, logged in it, held back]
        self._lock = threading.Lock()

    def allow(self, key: str, now: float | None = None) -> tuple[bool, int]:
        """``(log it, lines of this key held back before it)``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            state = self._keys.get(key)
            if state is None or now - state[0] >= self.interval_s:
                held = state[2] if state else 0
                if state is None and len(self._keys) >= self.max_keys:
                    self._keys.pop(next(iter(self._keys)))
                self._keys[key] = [now, 1, 0]
                return True, held
            if state[1] < self.burst:
                state[1] += 1
                held, state[2] = state[2], 0
                return True, held
            state[2] += 1
            return False, 0


def held_note(held: int) -> str:
    """What a throttled line adds about the lines of its kind held back before it."""
    return f" ({held} more like it were not logged)" if held else ""
