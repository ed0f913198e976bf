"""What the P/D proxy reads, sends and answers, built without I/O: the client's body checked, the
prefill and decode request bodies, and the error bodies (JSON and SSE) with the mapping of an
outbound failure to a status.

Every function here is pure (no sockets, no event loop), so the tests check them with plain dicts.
"""

from __future__ import annotations

import json
import math
from typing import Any

import aiohttp

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"

# What a JSON value that is not an object is, named for the client (numbers are the rest).
_JSON_KINDS = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
# Fields removed from the prefill body: one sequence, one token, no streaming.
_PREFILL_DROP = ("stream_options", "best_of", "min_tokens")


def is_batch(prompt: Any) -> bool:
    """Tells whether a completions ``prompt`` holds several prompts.

    Args:
        prompt: The ``prompt`` field: a string, a token list, or a list of either.

    Returns:
        True for a list of two or more strings or token lists.
    """
    return (
        isinstance(prompt, list)
        and len(prompt) > 1
        and any(isinstance(p, (str, list)) for p in prompt)
    )


class InvalidBody(ValueError):
    """The client's body cannot be served (answered 400); the message says what was expected.

    Attributes:
        param: The offending field, or None for the body as a whole.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed: expected finite numbers only")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range: expected finite numbers only")
    return value


def _loads(text: str | bytes) -> Any:
    """``json.loads`` refusing NaN and infinities (which JSON does not have).

    Raises:
        ValueError: Not JSON, a non-finite number, or nested too deeply to parse.
    """
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("arrays/objects nested too deeply to parse") from None


def client_body(raw: bytes, path: str) -> dict[str, Any]:
    """Parses and checks the client's body: a UTF-8 JSON object, one prompt for completions.

    Args:
        raw: The body as received.
        path: ``/v1/completions`` or ``/v1/chat/completions``.

    Returns:
        The JSON object.

    Raises:
        InvalidBody: Not UTF-8, not JSON (NaN and infinities included, nesting too deep to
            parse), not an object, or a completions ``prompt`` holding a batch (vLLM returns the
            hand-off of the first prompt only).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidBody(
            f"request body is not UTF-8 (byte {exc.start}): expected a JSON object in UTF-8"
        ) from None
    try:
        body = _loads(text)
    except ValueError as exc:
        raise InvalidBody(
            f"request body is not valid JSON: {exc}; expected a JSON object"
        ) from None
    if not isinstance(body, dict):
        kind = _JSON_KINDS.get(type(body), "a number")
        raise InvalidBody(f"request body is {kind}: expected a JSON object")
    if path == COMPLETIONS and is_batch(body.get("prompt")):
        raise InvalidBody(
            "batched prompts are not supported by disaggregated serving: send one prompt "
            "per request",
            param="prompt",
        )
    return body


def encode(body: dict[str, Any]) -> bytes:
    """Serializes a request body for a server.

    Raises:
        ValueError: It holds a non-finite number, or is nested too deeply to encode (a body that
            only just parsed can still be, the encoder's stack being a little deeper).
    """
    try:
        return json.dumps(body, allow_nan=False).encode()
    except RecursionError:
        raise ValueError("arrays/objects nested too deeply to encode") from None


def prefill_body(body: dict[str, Any], path: str, transfer_id: str | None = None) -> dict[str, Any]:
    """Builds the prefill request body from the client's body.

    ``max_completion_tokens`` is set too where the chat body has it, since vLLM's chat request
    prefers it over ``max_tokens``; ``stream_options`` goes with streaming (only a whole response
    carries ``kv_transfer_params``); ``min_tokens`` would fail vLLM's ``min_tokens <= max_tokens``.

    Args:
        body: The client's JSON object (not modified).
        path: ``/v1/completions`` or ``/v1/chat/completions``.
        transfer_id: The id the producer is to save the KV under (the overlapped flow), or None
            (it mints one).

    Returns:
        A copy with ``max_tokens=1`` (and ``max_completion_tokens=1`` for chat when present),
        ``stream=False``, ``n=1`` when ``n`` was given, no ``stream_options``/``best_of``/
        ``min_tokens``, and ``kv_transfer_params={"do_remote_decode": True}`` (plus
        ``"transfer_id"`` when given).
    """
    out = dict(body)
    for key in _PREFILL_DROP:
        out.pop(key, None)
    out["max_tokens"] = 1
    if path == CHAT_COMPLETIONS and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if "n" in out:
        out["n"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True}
    if transfer_id is not None:
        out["kv_transfer_params"]["transfer_id"] = transfer_id
    return out


def decode_body(body: dict[str, Any], kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """Builds the decode request body.

    The hand-off is passed on untouched (nothing added, dropped or renamed): the producer sets
    ``do_remote_prefill``, and vLLM's decode side reads fields of its own from it.

    Args:
        body: The client's JSON object (not modified).
        kv_params: The prefill response's ``kv_transfer_params``, or None when it had none.

    Returns:
        A copy of ``body`` whose ``kv_transfer_params`` is ``kv_params`` itself (absent when None).
    """
    out = dict(body)
    if kv_params is None:
        out.pop("kv_transfer_params", None)
    else:
        out["kv_transfer_params"] = kv_params
    return out


def handoff_params(prefill_raw: bytes) -> dict[str, Any] | None:
    """The hand-off in a prefill response body: its top-level ``kv_transfer_params``.

    That is the producer connector's ``request_finished`` value, which vLLM's scheduler may extend
    (``remote_prefill_cached_tokens``); it is returned as is.

    Args:
        prefill_raw: The body of the prefill server's 2xx response.

    Returns:
        The ``kv_transfer_params`` object, or None when it is null or absent.

    Raises:
        ValueError: The body is not a JSON object (NaN and infinities are refused), or the field
            is neither an object nor null.
    """
    try:
        body = _loads(prefill_raw)
    except ValueError:
        body = None
    kv = body.get("kv_transfer_params") if isinstance(body, dict) else None
    if not isinstance(body, dict) or not (kv is None or isinstance(kv, dict)):
        raise ValueError("expected a JSON object with an object or null kv_transfer_params")
    return kv


def error_body(status: int, message: str, err_type: str, **extra: Any) -> dict[str, Any]:
    """Builds an error body shaped like vLLM's ``ErrorResponse``.

    Args:
        status: HTTP status, repeated as ``code``.
        message: Human-readable message.
        err_type: Error type name.
        **extra: Further fields of the ``error`` object (``stage``, ``server``, ``timeout_s``).

    Returns:
        ``{"error": {"message", "type", "param", "code", **extra}}``.
    """
    return {"error": {"message": message, "type": err_type, "param": None, "code": status, **extra}}


def sse_error(status: int, message: str, err_type: str, **extra: Any) -> bytes:
    """Returns an SSE error event followed by the end-of-stream marker (see :func:`error_body`)."""
    payload = json.dumps(error_body(status, message, err_type, **extra))
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()


def describe_failure(
    exc: BaseException,
    stage: str,
    url: str,
    limit_s: float,
    connect_s: float,
    details: bool = True,
) -> tuple[int, str, str, dict[str, Any]]:
    """Classifies an outbound failure.

    Args:
        exc: The exception raised by aiohttp or asyncio.
        stage: ``prefill``, ``decode``, ``models`` or ``health``.
        url: The server's base URL.
        limit_s: The call's total limit in seconds.
        connect_s: The connect limit in seconds.
        details: Whether the client may see the server's URL and the error (a loopback client,
            or any with ``--health-details``); else only the stage and the status, the rest
            being in the proxy's log.

    Returns:
        ``(status, message, error type, extra error fields)``: 504 for timeouts, 502 otherwise.
    """
    if not details:
        timeout = isinstance(exc, TimeoutError)
        status, err_type = (504, "GatewayTimeout") if timeout else (502, "BadGateway")
        msg = (
            f"the {stage} server did not answer in time"
            if timeout
            else f"the {stage} server failed"
        )
        return status, msg + " (the proxy's log has the details)", err_type, {"stage": stage}
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        msg = f"{stage} server {url} did not accept a connection within {connect_s:g} s"
        return 504, msg, "GatewayTimeout", {"stage": stage, "server": url, "timeout_s": connect_s}
    if isinstance(exc, TimeoutError):
        msg = f"{stage} server {url} did not complete within {limit_s:g} s"
        return 504, msg, "GatewayTimeout", {"stage": stage, "server": url, "timeout_s": limit_s}
    detail = str(exc) or type(exc).__name__
    msg = f"{stage} server {url} failed: {detail}"
    return 502, msg, "BadGateway", {"stage": stage, "server": url}
