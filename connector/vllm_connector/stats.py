"""The connector's transfer figures per stats interval, without vLLM.

:class:`TransferStats` is what the producer and the consumer record into (and the scheduler side
its refusals); the facade's ``TritonKVStats`` (vLLM's ``KVConnectorStats``) carries
:meth:`TransferStats.take`'s dict and merges and reduces it with :func:`merge` and :func:`reduce`,
and ``TritonKVPromMetrics`` shows it on vLLM's ``/metrics`` as :data:`PROM` says.

The dict is flat, so that vLLM can carry it between processes as it is: sums (``"loads"``,
``"bytes_loaded"``, ...), counts by a bounded reason (``"load_failed:timeout"``; every reason is
one of :data:`LOAD_FAILURES`, :data:`LOAD_REFUSALS` or :data:`SAVE_FAILURES`), per-transfer
milliseconds (lists), and gauges per TP rank (``"gauge:buffer_bytes@0"``: the last value wins).
"""

from __future__ import annotations

from ..integrity import DigestMismatch
from ..kvstore import BufferFullError, KeyMissError
from ..transport import (
    AuthError,
    PeerDeadError,
    PipeClosedError,
    ProtocolError,
    RemoteError,
    TransferTimeout,
)

#: Why a load that was tried did not complete (the consumer recomputes the prompt, or, under
#: vLLM's ``kv_load_failure_policy`` ``fail``, fails the request).
LOAD_FAILURES = ("digest", "auth", "timeout", "peer_dead", "missing", "protocol", "other")
#: Why the scheduler side refused a hand-off before any load: it was malformed or is not this
#: prompt's or engine's (``handoff``), it names a producer this consumer may not load from
#: (``producer``), or this engine cannot use loaded KV (``engine``).
LOAD_REFUSALS = ("handoff", "producer", "engine")
#: Why a save did not store its entry (the decode side recomputes).
SAVE_FAILURES = ("buffer_full", "too_large", "other")
#: Gauges, each the sum over TP ranks of every rank's last value.
GAUGES = ("buffer_bytes", "buffer_entries")
SUMS = (
    "saves",
    "loads",
    "save_failures",  # every save_failed reason together
    "load_failures",  # every load_failed reason together (refusals are not loads)
    "digest_failures",  # load_failed:digest, under the name it has always had
    "auth_failures",
    "entries_expired",
    "hidden_saves",
    "hidden_save_failures",
    "hidden_tokens_saved",
    "bytes_saved",
    "bytes_loaded",
    "tokens_saved",
    "tokens_loaded",
)
TIMINGS = ("pack_ms", "network_ms", "unpack_ms")

#: What vLLM's ``/metrics`` shows (:class:`PromMetrics`), per engine, by name: help text and
#: the figures' key. Counters are ``vllm:tritonkv_<name>_total``; the two outcome counters carry
#: labels ``outcome`` (``ok``, ``failed``, ``refused``) and ``reason`` (``none`` for ok, else one
#: of :data:`LOAD_FAILURES`, :data:`LOAD_REFUSALS`, :data:`SAVE_FAILURES`).
PROM_COUNTERS = {
    "bytes_saved": ("Bytes of KV saved (packed entries, every TP rank).", "bytes_saved"),
    "bytes_loaded": ("Bytes of KV loaded into the cache (every TP rank).", "bytes_loaded"),
    "tokens_saved": ("Prompt tokens saved, counted on every TP rank.", "tokens_saved"),
    "tokens_loaded": ("Prompt tokens loaded, counted on every TP rank.", "tokens_loaded"),
    "entries_expired": ("Entries dropped unclaimed after ttl_s.", "entries_expired"),
    "hidden_saves": ("Requests whose hidden states were taken.", "hidden_saves"),
    "auth_failures": ("Connections refused: the peer failed authentication.", "auth_failures"),
    "digest_failures": ("Loads whose integrity digest did not match.", "digest_failures"),
    "load_failures": ("Loads that failed for any reason, digest included.", "load_failures"),
}
PROM_OUTCOMES = {
    "loads": "Loads by outcome and reason, on every TP rank (refusals: once per request).",
    "saves": "Saves by outcome and reason, on every TP rank.",
}
#: ``vllm:tritonkv_<name>_seconds``: help text and the timing's key (milliseconds recorded).
PROM_HISTOGRAMS = {
    "save_pack": ("Time to pack a prompt's KV on the producer.", "pack_ms"),
    "load_network": ("Time to receive an entry from its producer.", "network_ms"),
    "load_unpack": ("Time to write a received entry into the cache.", "unpack_ms"),
}
#: ``vllm:tritonkv_<name>``: the sum over TP ranks of each rank's last value.
PROM_GAUGES = {
    "buffer_bytes": "Bytes the producer's buffers hold (entries not yet claimed).",
    "buffer_entries": "Entries the producer's buffers hold.",
}
#: Histogram buckets in seconds: 0.1 ms .. 10 s.
SECONDS_BUCKETS = (
    1e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)


def empty_stats() -> dict:
    """One interval's figures (see the module docstring): the sums and timings, no reasons yet."""
    return {**dict.fromkeys(SUMS, 0), **{key: [] for key in TIMINGS}}


def load_failure(exc: BaseException) -> str:
    """The :data:`LOAD_FAILURES` reason of a load that raised ``exc``."""
    if isinstance(exc, DigestMismatch):
        return "digest"
    if isinstance(exc, AuthError):
        return "auth"
    if isinstance(exc, TransferTimeout):
        return "timeout"
    if isinstance(exc, (PeerDeadError, PipeClosedError, ConnectionError)):
        return "peer_dead"
    if isinstance(exc, KeyMissError):
        return "missing"
    if isinstance(exc, (ProtocolError, RemoteError)):
        return "protocol"
    return "other"


def save_failure(exc: BaseException) -> str:
    """The :data:`SAVE_FAILURES` reason of a save that raised ``exc``."""
    if isinstance(exc, BufferFullError):
        return "too_large" if "more than" in str(exc) else "buffer_full"
    return "other"


class TransferStats:
    """The figures of one rank (or of the scheduler side) since the last :meth:`take`."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self._data = empty_stats()
        self._gauges_sent: dict[str, int] = {}

    def record_save(self, *, nbytes: int, num_tokens: int, pack_ms: float) -> None:
        self._data["saves"] += 1
        self._data["bytes_saved"] += nbytes
        self._data["tokens_saved"] += num_tokens
        self._data["pack_ms"].append(pack_ms)

    def record_load(self, *, nbytes: int, num_tokens: int, network_ms: float, unpack_ms: float):
        self._data["loads"] += 1
        self._data["bytes_loaded"] += nbytes
        self._data["tokens_loaded"] += num_tokens
        self._data["network_ms"].append(network_ms)
        self._data["unpack_ms"].append(unpack_ms)

    def record_hidden_save(self, *, num_tokens: int) -> None:
        """One request's hidden states taken (apart from the KV figures)."""
        self._data["hidden_saves"] += 1
        self._data["hidden_tokens_saved"] += num_tokens

    def record_hidden_failure(self) -> None:
        self._data["hidden_save_failures"] += 1

    def record_save_failure(self, reason: str = "other") -> None:
        self._count("save_failed", reason, SAVE_FAILURES)
        self._data["save_failures"] += 1

    def record_load_failure(self, reason: str = "other") -> None:
        self._count("load_failed", reason, LOAD_FAILURES)
        self._data["load_failures"] += 1
        if reason == "digest":
            self._data["digest_failures"] += 1

    def record_load_refusal(self, reason: str) -> None:
        self._count("load_refused", reason, LOAD_REFUSALS)

    def record_auth_failures(self, count: int) -> None:
        self._data["auth_failures"] += count

    def record_expired(self, count: int) -> None:
        self._data["entries_expired"] += count

    def set_gauge(self, name: str, value: int) -> None:
        """This rank's current ``name`` (one of :data:`GAUGES`), reported when it changed."""
        if name not in GAUGES:
            raise ValueError(f"gauge: expected one of {GAUGES}, got {name!r}")
        if self._gauges_sent.get(name) != value:
            self._data[f"gauge:{name}@{self.rank}"] = value

    def _count(self, kind: str, reason: str, reasons: tuple[str, ...]) -> None:
        if reason not in reasons:
            raise ValueError(f"{kind} reason: expected one of {reasons}, got {reason!r}")
        key = f"{kind}:{reason}"
        self._data[key] = self._data.get(key, 0) + 1

    def peek(self) -> dict:
        """A copy of the figures so far, which go on counting."""
        return {k: list(v) if isinstance(v, list) else v for k, v in self._data.items()}

    def take(self) -> dict:
        """The figures so far, which start anew."""
        data, self._data = self._data, empty_stats()
        for key, value in data.items():
            if key.startswith("gauge:"):
                self._gauges_sent[key[6:].rsplit("@", 1)[0]] = value
        return data


def merge(into: dict, other: dict) -> dict:
    """Add ``other``'s figures to ``into`` (sums added, timings appended, gauges replaced);
    returns ``into``."""
    for key, value in other.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)
        elif key.startswith("gauge:"):
            into[key] = value
        else:
            into[key] = into.get(key, 0) + value
    return into


def count(data: dict, kind: str) -> int:
    """All counts of ``kind`` (``"load_failed"``, ``"load_refused"``, ``"save_failed"``)."""
    return sum(v for k, v in data.items() if k.startswith(kind + ":"))


def gauges(data: dict) -> dict[str, dict[str, int]]:
    """``{gauge: {rank: value}}`` of the gauges in ``data``."""
    out: dict[str, dict[str, int]] = {}
    for key, value in data.items():
        if key.startswith("gauge:"):
            name, rank = key[6:].rsplit("@", 1)
            out.setdefault(name, {})[rank] = value
    return out


def reduce(data: dict) -> dict[str, int | float]:
    """Counts and sums as they are, each timing list as its mean (``avg_<key>``, ms), each gauge
    as its sum over ranks; refusals also in total (``load_refusals``)."""
    out: dict[str, int | float] = {}
    for key, value in data.items():
        if isinstance(value, list):
            out[f"avg_{key}"] = round(sum(value) / len(value), 3) if value else 0.0
        elif not key.startswith("gauge:"):
            out[key] = value
    out["load_refusals"] = count(data, "load_refused")
    for name, ranks in gauges(data).items():
        out[name] = sum(ranks.values())
    return out


def is_empty(data: dict) -> bool:
    """Whether nothing happened in the interval worth reporting."""
    return not any(value for key, value in data.items() if not key.endswith("_ms")) and not any(
        key.startswith("gauge:") for key in data
    )


class PromMetrics:
    """The figures on vLLM's Prometheus endpoint (see :data:`PROM_COUNTERS` and its siblings).

    Args:
        counter, histogram, gauge: the metric classes vLLM hands connectors (prometheus_client's
            or its multiprocess-safe ones).
        labelnames: vLLM's labels (model name, engine).
        per_engine: vLLM's label values per engine index.
    """

    def __init__(self, counter, histogram, gauge, labelnames, per_engine: dict[int, list]):
        self._per_engine = per_engine

        def each(metric) -> dict:
            return {engine: metric.labels(*values) for engine, values in per_engine.items()}

        self._counters = {
            key: (each(counter(name=f"vllm:tritonkv_{key}", documentation=doc,
                               labelnames=labelnames)), source)
            for key, (doc, source) in PROM_COUNTERS.items()
        }  # fmt: skip
        self._outcomes = {
            key: counter(name=f"vllm:tritonkv_{key}", documentation=doc,
                         labelnames=[*labelnames, "outcome", "reason"])
            for key, doc in PROM_OUTCOMES.items()
        }  # fmt: skip
        self._histograms = {
            key: (each(histogram(name=f"vllm:tritonkv_{key}_seconds", documentation=doc,
                                 labelnames=labelnames, buckets=list(SECONDS_BUCKETS))), source)
            for key, (doc, source) in PROM_HISTOGRAMS.items()
        }  # fmt: skip
        self._gauges = {
            key: each(gauge(name=f"vllm:tritonkv_{key}", documentation=doc,
                            labelnames=labelnames, multiprocess_mode="mostrecent"))
            for key, doc in PROM_GAUGES.items()
        }  # fmt: skip
        self._ranks: dict[tuple[int, str], dict[str, int]] = {}  # each rank's last gauge value

    def observe(self, data: dict, engine: int = 0) -> None:
        """Add one interval's figures (:meth:`TransferStats.take`'s, merged) of ``engine``."""
        for per_engine, source in self._counters.values():
            if value := data.get(source, 0):
                per_engine[engine].inc(value)
        labels = self._per_engine[engine]
        for key, value in data.items():
            if key in ("loads", "saves") and value:
                self._outcomes[key].labels(*labels, "ok", "none").inc(value)
            elif ":" in key and not key.startswith("gauge:") and value:
                kind, reason = key.split(":", 1)
                name = "saves" if kind == "save_failed" else "loads"
                outcome = "refused" if kind == "load_refused" else "failed"
                self._outcomes[name].labels(*labels, outcome, reason).inc(value)
        for per_engine, source in self._histograms.values():
            for ms in data.get(source, ()):
                per_engine[engine].observe(ms / 1e3)
        for name, ranks in gauges(data).items():
            last = self._ranks.setdefault((engine, name), {})
            last.update(ranks)
            self._gauges[name][engine].set(sum(last.values()))
