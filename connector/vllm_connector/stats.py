"""The worker's transfer figures per stats interval, without vLLM.

:class:`TransferStats` is what the producer and the consumer record into; the facade's
``TritonKVStats`` (vLLM's ``KVConnectorStats``) carries :meth:`TransferStats.take`'s dict and
merges and reduces it with :func:`merge` and :func:`reduce`.
"""

from __future__ import annotations

# Counters that make an interval worth reporting (the rest are sums and timings).
COUNTS = (
    "saves",
    "loads",
    "save_failures",
    "load_failures",
    "auth_failures",
    "hidden_saves",
    "hidden_save_failures",
    "digest_failures",
)
# Counters that vLLM's Prometheus endpoint shows (the facade's ``TritonKVPromMetrics``), each as
# ``vllm:tritonkv_<key>_total``, with its help text.
PROM_COUNTERS = {
    "digest_failures": "Loads whose integrity digest did not match (recomputed by vLLM).",
    "load_failures": "Loads that failed for any reason, digest mismatches included (recomputed).",
    "auth_failures": "Transfers refused because the peer failed authentication.",
}


def empty_stats() -> dict:
    """One interval's figures: counts and byte/token sums plus per-transfer milliseconds."""
    return {
        "saves": 0,
        "loads": 0,
        "save_failures": 0,
        "load_failures": 0,
        "auth_failures": 0,
        "digest_failures": 0,  # loads whose digest check failed (also in load_failures)
        "hidden_saves": 0,  # requests whose hidden states were taken (extract_hidden_states)
        "hidden_save_failures": 0,
        "hidden_tokens_saved": 0,
        "bytes_saved": 0,
        "bytes_loaded": 0,
        "tokens_saved": 0,
        "tokens_loaded": 0,
        "pack_ms": [],
        "fetch_ms": [],
        "unpack_ms": [],
    }


class TransferStats:
    """The figures of one rank since the last :meth:`take` (see :func:`empty_stats`)."""

    def __init__(self):
        self._data = empty_stats()

    def record_save(self, *, nbytes: int, num_tokens: int, pack_ms: float) -> None:
        self._data["saves"] += 1
        self._data["bytes_saved"] += nbytes
        self._data["tokens_saved"] += num_tokens
        self._data["pack_ms"].append(pack_ms)

    def record_load(self, *, nbytes: int, num_tokens: int, fetch_ms: float, unpack_ms: float):
        self._data["loads"] += 1
        self._data["bytes_loaded"] += nbytes
        self._data["tokens_loaded"] += num_tokens
        self._data["fetch_ms"].append(fetch_ms)
        self._data["unpack_ms"].append(unpack_ms)

    def record_hidden_save(self, *, num_tokens: int) -> None:
        """One request's hidden states taken (apart from the KV figures)."""
        self._data["hidden_saves"] += 1
        self._data["hidden_tokens_saved"] += num_tokens

    def record_hidden_failure(self) -> None:
        self._data["hidden_save_failures"] += 1

    def record_save_failure(self) -> None:
        self._data["save_failures"] += 1

    def record_load_failure(self) -> None:
        self._data["load_failures"] += 1

    def record_digest_failure(self) -> None:
        self._data["digest_failures"] += 1

    def record_auth_failures(self, count: int) -> None:
        self._data["auth_failures"] += count

    def peek(self) -> dict:
        """A copy of the figures so far, which go on counting."""
        return {k: list(v) if isinstance(v, list) else v for k, v in self._data.items()}

    def take(self) -> dict:
        """The figures so far, which start anew."""
        data, self._data = self._data, empty_stats()
        return data


def merge(into: dict, other: dict) -> dict:
    """Add ``other``'s figures to ``into`` (sums added, timings appended); returns ``into``."""
    for key, value in other.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)
        else:
            into[key] = into.get(key, 0) + value
    return into


def reduce(data: dict) -> dict[str, int | float]:
    """Counts and sums as they are, each timing list as its mean (``avg_<key>``, ms)."""
    out: dict[str, int | float] = {}
    for key, value in data.items():
        if isinstance(value, list):
            out[f"avg_{key}"] = round(sum(value) / len(value), 3) if value else 0.0
        else:
            out[key] = value
    return out


def is_empty(data: dict) -> bool:
    """Whether nothing was saved, loaded or refused in the interval."""
    return not any(data.get(key) for key in COUNTS)
