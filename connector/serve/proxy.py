"""Prefill/decode (P/D) router for disaggregated vLLM serving with the tritonkv connector.

Usage (``tritonkv-proxy`` once tritonkv is installed; ``python -m connector.serve.proxy`` from a checkout)::

    tritonkv-proxy --prefill http://p0:8100 [--prefill http://p1:8100 ...] \\
        --decode http://d0:8200 [--decode http://d1:8200 ...] --port 8000 \\
        [--host 0.0.0.0] [--timeout-s 600] [--prefill-timeout-s S] [--connect-timeout-s 5] \\
        [--health-timeout-s 5] [--shutdown-timeout-s 10] [--log-level info]

Clients talk to the proxy as to one OpenAI-compatible vLLM server. Routes:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming or not;
* ``GET /v1/models``: forwarded to the next decode server;
* ``GET /health``: 200 only if every prefill and decode server answers its own ``/health`` with
  a 2xx status within ``--health-timeout-s``, else 503; the body lists every backend's state.

What one generation request does
--------------------------------
1. **Prefill.** The next prefill server (round-robin) receives the client's JSON body with:
   ``max_tokens = 1`` (and ``max_completion_tokens = 1`` when the chat body has that field, since
   vLLM's chat request prefers it over ``max_tokens``); ``stream = false`` and no
   ``stream_options`` (vLLM's stream chunks have no ``kv_transfer_params`` field, only the full
   response does); ``n = 1`` and no ``best_of`` / ``min_tokens`` (one sequence is enough to compute
   the prompt's KV; ``min_tokens > 1`` would fail vLLM's ``min_tokens <= max_tokens`` check);
   ``kv_transfer_params = {"do_remote_decode": true}``, replacing any the client sent.
2. The prefill response's top-level ``kv_transfer_params`` (the producer connector's
   ``request_finished`` return value, which vLLM's scheduler may extend, e.g. with
   ``remote_prefill_cached_tokens``) is taken as is. Our producer returns e.g.
   ``{"do_remote_prefill": true, "transfer_id": ..., "remote_host": ..., "remote_port": ...,
   "num_tokens": ..., "fingerprint": ...}``.
3. **Decode.** The next decode server (round-robin, independent of the prefill rotation) receives the
   client's original body (original ``max_tokens``, ``stream``, ``stream_options``, ``n``, ...) with
   ``kv_transfer_params`` set to exactly that dict: nothing added, nothing dropped, nothing renamed.
   In particular the proxy does not add ``do_remote_prefill``: the producer sets it (as vLLM's NIXL
   connector does), and vLLM's decode side keys its rejected-request cleanup and its cached-token
   accounting on it, so a producer should return it. If the prefill response carries no
   ``kv_transfer_params`` (null or absent), the decode request goes without that field and the decode
   server recomputes the prompt itself (correct, only slower); a warning is logged.
4. The decode response goes back to the client: its status, content type and body bytes unchanged.
   A streaming (SSE) response is relayed chunk by chunk as the bytes arrive, never buffered whole.

Where vLLM 0.32 defines this (installed source, ``vllm/``):

* requests: ``kv_transfer_params: dict | None`` at the top level of the JSON body,
  ``entrypoints/openai/completion/protocol.py:238`` and ``chat_completion/protocol.py:499``; handed
  to the engine as ``SamplingParams.extra_args["kv_transfer_params"]`` (same files, lines 380-382 and
  747-749) and read back by ``v1/request.py:120``;
* responses: top-level ``kv_transfer_params`` of ``CompletionResponse``
  (``completion/protocol.py:693``, filled at ``completion/serving.py:639,649`` from the first
  prompt's output) and ``ChatCompletionResponse`` (``chat_completion/protocol.py:150``, filled at
  ``chat_completion/serving.py:1203``); the stream chunk types (``CompletionStreamResponse``,
  ``ChatCompletionStreamResponse``) have no such field;
* the value is ``request_finished``'s second return value (``v1/core/sched/scheduler.py:2230``), to
  which the scheduler adds ``remote_prefill_cached_tokens`` when ``do_remote_prefill`` is set
  (lines 2231-2240); NIXL's producer returns ``do_remote_prefill=True`` itself
  (``distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py:279``);
  the decode server's cleanup of rejected transfers runs only when ``do_remote_prefill`` is truthy
  (``entrypoints/generate/base/serving.py:281``);
* the decode server may pop ``prompt_token_ids`` from the params to skip re-tokenising
  (``renderers/online_renderer.py:122``): another reason to pass the dict untouched.

A completions body whose ``prompt`` is a batch (several strings or token lists) is refused with 400:
vLLM returns the ``kv_transfer_params`` of the first prompt only, so a batch cannot be
disaggregated correctly.

Errors (JSON bodies shaped like vLLM's ``{"error": {"message", "type", "param", "code"}}``, plus
``stage``, ``server`` and, for timeouts, ``timeout_s``):

* body not JSON, or not a JSON object, or a batched prompt: 400, no backend is called;
* prefill server answers non-2xx: that status and body go back unchanged; decode is not called;
* prefill answers 2xx but not a JSON object, or ``kv_transfer_params`` is not an object: 502;
* a backend refuses the connection or drops it: 502 naming the server;
* a backend does not connect within ``--connect-timeout-s``, or does not complete within its timeout
  (``--prefill-timeout-s`` for prefill, default ``--timeout-s``; ``--timeout-s`` for decode, which
  covers the whole generation, streamed or not): 504 naming the server and the limit;
* a failure after a stream started (headers already sent): an SSE event
  ``data: {"error": {...}}`` followed by ``data: [DONE]``, as vLLM itself reports stream errors.
  The proxy waits for the decode stream's first chunk before answering, so a decode server that
  never produces output still yields a proper 504.

Every request gets an id: the client's ``X-Request-Id`` header or a new ``pd-<hex>``. It is sent as
``X-Request-Id`` to both backends (vLLM uses it in its own request ids and logs) and returned to the
client. The client's ``Authorization`` header and W3C trace context (``traceparent``,
``tracestate``) are forwarded to both backends. One log line per request
at INFO: id, prefill server and milliseconds, decode server and time to first byte in milliseconds,
``transfer_id`` when the params have one, final status; streams log their end too.

A client that disconnects before its answer is complete has its backend calls cancelled (their
connections close, so vLLM aborts the request), streamed or not. One case goes unnoticed: a client
that pipelines several requests on one connection and then leaves, under uvicorn's default
httptools parser (which marks only the last queued request disconnected); that request then runs
to completion or to its timeout.

SIGINT/SIGTERM stop the server gracefully: no new connections, in-flight requests get up to
``--shutdown-timeout-s`` to finish, the outbound HTTP session is closed, exit status 0.

This module deliberately imports neither vllm nor tritonkv: only the HTTP stack vLLM already
installs (FastAPI + uvicorn to serve, aiohttp to call the backends).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..logs import get_logger

logger = get_logger("proxy")

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"

# Client headers passed on to both backends: credentials and W3C trace context (vLLM's tracing
# continues the client's trace from them).
_FORWARDED = ("Authorization", "traceparent", "tracestate")

# Fields removed from the prefill body: one sequence, one token, no streaming.
_PREFILL_DROP = ("stream_options", "best_of", "min_tokens")


@dataclass(frozen=True)
class ProxyConfig:
    """Settings of one proxy instance.

    Attributes:
        prefill_urls: Base URLs of the prefill servers (e.g. ``http://10.0.0.1:8100``).
        decode_urls: Base URLs of the decode servers.
        timeout_s: Limit for one whole decode call, streamed generation included.
        prefill_timeout_s: Limit for one whole prefill call; None means ``timeout_s``.
        connect_timeout_s: Limit for opening a connection to any backend.
        health_timeout_s: Limit for each backend's ``/health`` and for ``/v1/models``.
    """

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    timeout_s: float = 600.0
    prefill_timeout_s: float | None = None
    connect_timeout_s: float = 5.0
    health_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        """Validates the URLs and limits.

        Raises:
            ValueError: No prefill or no decode URL, a URL without http(s) scheme, or a limit <= 0.
        """
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("at least one prefill and one decode URL are required")
        for url in (*self.prefill_urls, *self.decode_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend URL must start with http:// or https://: {url!r}")
        limits = (self.timeout_s, self.connect_timeout_s, self.health_timeout_s)
        if any(t <= 0 for t in limits) or (
            self.prefill_timeout_s is not None and self.prefill_timeout_s <= 0
        ):
            raise ValueError("timeouts must be > 0")

    @property
    def prefill_limit_s(self) -> float:
        """The effective prefill timeout in seconds."""
        return self.timeout_s if self.prefill_timeout_s is None else self.prefill_timeout_s


class _Failure(Exception):
    """An outbound call failed; carries the JSON response to give the client."""

    def __init__(self, response: JSONResponse, summary: str) -> None:
        super().__init__(summary)
        self.response = response
        self.summary = summary


def _error_body(status: int, message: str, err_type: str, **extra: Any) -> dict[str, Any]:
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


def _error(status: int, message: str, err_type: str, **extra: Any) -> JSONResponse:
    """Returns an error JSONResponse; see :func:`_error_body`."""
    return JSONResponse(_error_body(status, message, err_type, **extra), status_code=status)


def _strip(url: str) -> str:
    """Returns ``url`` without trailing slashes."""
    return url.rstrip("/")


def _is_batch(prompt: Any) -> bool:
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


def prefill_body(body: dict[str, Any], path: str) -> dict[str, Any]:
    """Builds the prefill request body from the client's body.

    Args:
        body: The client's JSON object (not modified).
        path: ``/v1/completions`` or ``/v1/chat/completions``.

    Returns:
        A copy with ``max_tokens=1`` (and ``max_completion_tokens=1`` for chat when present),
        ``stream=False``, ``n=1`` when ``n`` was given, no ``stream_options``/``best_of``/
        ``min_tokens``, and ``kv_transfer_params={"do_remote_decode": True}``.
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
    return out


def decode_body(body: dict[str, Any], kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """Builds the decode request body.

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


def _sse_error(status: int, message: str, err_type: str, **extra: Any) -> bytes:
    """Returns an SSE error event followed by the end-of-stream marker."""
    payload = json.dumps(_error_body(status, message, err_type, **extra))
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()


def _describe_failure(
    exc: BaseException, stage: str, url: str, limit_s: float, connect_s: float
) -> tuple[int, str, str, dict[str, Any]]:
    """Classifies an outbound failure.

    Args:
        exc: The exception raised by aiohttp or asyncio.
        stage: ``prefill``, ``decode``, ``models`` or ``health``.
        url: The backend base URL.
        limit_s: The call's total limit in seconds.
        connect_s: The connect limit in seconds.

    Returns:
        ``(status, message, error type, extra error fields)``: 504 for timeouts, 502 otherwise.
    """
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        msg = f"{stage} server {url} did not accept a connection within {connect_s:g} s"
        return 504, msg, "GatewayTimeout", {"stage": stage, "server": url, "timeout_s": connect_s}
    if isinstance(exc, TimeoutError):
        msg = f"{stage} server {url} did not complete within {limit_s:g} s"
        return 504, msg, "GatewayTimeout", {"stage": stage, "server": url, "timeout_s": limit_s}
    detail = str(exc) or type(exc).__name__
    msg = f"{stage} server {url} failed: {detail}"
    return 502, msg, "BadGateway", {"stage": stage, "server": url}


class PDProxy:
    """The router: owns the outbound HTTP session and the round-robin cursors.

    Args:
        config: The proxy settings.
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._prefill_urls = tuple(_strip(u) for u in config.prefill_urls)
        self._decode_urls = tuple(_strip(u) for u in config.decode_urls)
        self._prefill_rr = itertools.cycle(self._prefill_urls)
        self._decode_rr = itertools.cycle(self._decode_urls)
        self._session: aiohttp.ClientSession | None = None
        self._warned_no_remote_prefill = False

    async def start(self) -> None:
        """Opens the outbound session (call inside the serving event loop)."""
        # No connection cap: a capped pool would make requests wait for a slot inside their timeout.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        self._session = aiohttp.ClientSession(connector=connector, trust_env=False)

    async def close(self) -> None:
        """Closes the outbound session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The open outbound session.

        Raises:
            RuntimeError: :meth:`start` was not called.
        """
        if self._session is None:
            raise RuntimeError("PDProxy.start() was not called")
        return self._session

    def _timeout(self, total_s: float) -> aiohttp.ClientTimeout:
        """Returns an aiohttp timeout with the given total and the configured connect limit."""
        return aiohttp.ClientTimeout(total=total_s, connect=self.config.connect_timeout_s)

    def _failure(self, exc: BaseException, stage: str, url: str, limit_s: float) -> _Failure:
        """Wraps an outbound exception into a :class:`_Failure` with the client response."""
        status, msg, err_type, extra = _describe_failure(
            exc, stage, url, limit_s, self.config.connect_timeout_s
        )
        return _Failure(_error(status, msg, err_type, **extra), f"{status} {msg}")

    async def _get(self, stage: str, url: str, path: str) -> tuple[int, bytes, str | None]:
        """GETs ``url + path`` within the health timeout.

        Returns:
            ``(status, body, content type)``.

        Raises:
            _Failure: The backend could not be reached in time.
        """
        limit = self.config.health_timeout_s
        try:
            async with self.session.get(url + path, timeout=self._timeout(limit)) as resp:
                return resp.status, await resp.read(), resp.headers.get("Content-Type")
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._failure(exc, stage, url, limit) from exc

    async def health(self) -> JSONResponse:
        """Checks every backend's ``/health``.

        Returns:
            200 ``{"status": "ok", "backends": [...]}`` when all answer 2xx, else 503 with
            ``"status": "unhealthy"`` and each backend's state.
        """
        backends = [("prefill", u) for u in self._prefill_urls] + [
            ("decode", u) for u in self._decode_urls
        ]

        async def probe(role: str, url: str) -> dict[str, Any]:
            try:
                status, _, _ = await self._get("health", url, "/health")
            except _Failure as failure:
                return {"role": role, "url": url, "ok": False, "error": failure.summary}
            return {"role": role, "url": url, "ok": 200 <= status < 300, "status": status}

        states = await asyncio.gather(*(probe(r, u) for r, u in backends))
        ok = all(s["ok"] for s in states)
        body = {"status": "ok" if ok else "unhealthy", "backends": states}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def models(self) -> Response:
        """Forwards ``GET /v1/models`` to the next decode server."""
        url = next(self._decode_rr)
        try:
            status, body, ctype = await self._get("models", url, "/v1/models")
        except _Failure as failure:
            return failure.response
        return Response(body, status_code=status, media_type=ctype)

    def _headers(self, request: Request, req_id: str) -> dict[str, str]:
        """Returns the headers sent to both backends for one client request."""
        headers = {"Content-Type": "application/json", "X-Request-Id": req_id}
        for name in _FORWARDED:
            value = request.headers.get(name)
            if value:
                headers[name] = value
        return headers

    async def generate(self, request: Request, path: str) -> Response:
        """Serves one completions or chat completions request: prefill, then decode.

        Args:
            request: The client's request.
            path: ``/v1/completions`` or ``/v1/chat/completions``.

        Returns:
            The decode server's response (relayed as a stream when the client asked to stream), or
            an error response as described in the module docstring.
        """
        req_id = request.headers.get("x-request-id") or f"pd-{uuid.uuid4().hex}"
        raw = await request.body()
        # Starlette does not cancel a handler whose client left: race the work against the
        # disconnect, so that the backends' connections close and vLLM aborts the request
        # instead of generating for nobody until the timeout.
        work = asyncio.ensure_future(self._generate(request, path, req_id, raw))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                logger.warning("req %s: the client left; backend calls cancelled", req_id)
        if work.cancelled():
            return Response(status_code=499, headers={"X-Request-Id": req_id})
        return work.result()

    async def _generate(self, request: Request, path: str, req_id: str, raw: bytes) -> Response:
        """:meth:`generate`'s work once the body is read."""
        id_header = {"X-Request-Id": req_id}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"request body is not valid JSON: {exc}", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "BadRequestError")
        if path == COMPLETIONS and _is_batch(body.get("prompt")):
            return _error(
                400,
                "batched prompts are not supported by disaggregated serving: send one prompt "
                "per request",
                "BadRequestError",
                param="prompt",
            )
        headers = self._headers(request, req_id)

        # Prefill.
        p_url = next(self._prefill_rr)
        p_limit = self.config.prefill_limit_s
        t0 = time.perf_counter()
        try:
            async with self.session.post(
                p_url + path,
                json=prefill_body(body, path),
                headers=headers,
                timeout=self._timeout(p_limit),
            ) as resp:
                p_status = resp.status
                p_raw = await resp.read()
                p_ctype = resp.headers.get("Content-Type")
        except (TimeoutError, aiohttp.ClientError) as exc:
            failure = self._failure(exc, "prefill", p_url, p_limit)
            logger.warning("req %s prefill %s: %s", req_id, p_url, failure.summary)
            failure.response.headers.update(id_header)
            return failure.response
        prefill_ms = (time.perf_counter() - t0) * 1e3
        if not 200 <= p_status < 300:
            logger.warning(
                "req %s prefill %s answered %d in %.1f ms; decode not called",
                req_id,
                p_url,
                p_status,
                prefill_ms,
            )
            return Response(p_raw, status_code=p_status, media_type=p_ctype, headers=id_header)
        try:
            p_json = json.loads(p_raw)
        except (ValueError, UnicodeDecodeError):
            p_json = None
        kv = p_json.get("kv_transfer_params") if isinstance(p_json, dict) else None
        if not isinstance(p_json, dict) or not (kv is None or isinstance(kv, dict)):
            msg = (
                f"prefill server {p_url} returned a body that is not a JSON object with an "
                "object or null kv_transfer_params"
            )
            logger.warning("req %s: %s", req_id, msg)
            response = _error(502, msg, "BadGateway", stage="prefill", server=p_url)
            response.headers.update(id_header)
            return response
        if kv is None:
            logger.warning(
                "req %s prefill %s returned no kv_transfer_params; the decode server will "
                "recompute the prompt",
                req_id,
                p_url,
            )
        elif not kv.get("do_remote_prefill") and not self._warned_no_remote_prefill:
            self._warned_no_remote_prefill = True
            logger.warning(
                "prefill %s returned kv_transfer_params without do_remote_prefill=true; passed on "
                "unchanged, but vLLM's decode-side cleanup of rejected transfers keys on it",
                p_url,
            )
        transfer_id = kv.get("transfer_id") if kv else None

        # Decode.
        d_url = next(self._decode_rr)
        d_limit = self.config.timeout_s
        d_body = decode_body(body, kv)
        stream = bool(body.get("stream"))
        t1 = time.perf_counter()
        try:
            resp = await self.session.post(
                d_url + path, json=d_body, headers=headers, timeout=self._timeout(d_limit)
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            failure = self._failure(exc, "decode", d_url, d_limit)
            logger.warning(
                "req %s prefill %s %.1f ms transfer_id %s; decode %s: %s",
                req_id,
                p_url,
                prefill_ms,
                transfer_id,
                d_url,
                failure.summary,
            )
            failure.response.headers.update(id_header)
            return failure.response

        def log_done(status: int, note: str = "") -> None:
            logger.info(
                "req %s prefill %s %.1f ms | decode %s ttfb %.1f ms | transfer_id %s | status %d%s",
                req_id,
                p_url,
                prefill_ms,
                d_url,
                (time.perf_counter() - t1) * 1e3,
                transfer_id,
                status,
                note,
            )

        d_ctype = resp.headers.get("Content-Type")
        if not stream or not 200 <= resp.status < 300:
            try:
                d_raw = await resp.read()
            except asyncio.CancelledError:
                resp.close()
                raise
            except (TimeoutError, aiohttp.ClientError) as exc:
                failure = self._failure(exc, "decode", d_url, d_limit)
                log_done(failure.response.status_code, f" ({failure.summary})")
                failure.response.headers.update(id_header)
                return failure.response
            finally:
                resp.release()
            log_done(resp.status)
            return Response(d_raw, status_code=resp.status, media_type=d_ctype, headers=id_header)

        # Streaming: wait for the first bytes so that a silent decode server still gets a 504.
        try:
            first = await resp.content.readany()
        except (TimeoutError, aiohttp.ClientError, asyncio.CancelledError) as exc:
            resp.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            failure = self._failure(exc, "decode", d_url, d_limit)
            log_done(failure.response.status_code, f" ({failure.summary})")
            failure.response.headers.update(id_header)
            return failure.response
        log_done(resp.status, " (stream started)")
        relay = self._relay(resp, first, req_id, d_url, d_limit, t1)
        headers_out = {**id_header, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            relay,
            status_code=resp.status,
            media_type=d_ctype or "text/event-stream",
            headers=headers_out,
        )

    async def _relay(
        self,
        resp: aiohttp.ClientResponse,
        first: bytes,
        req_id: str,
        url: str,
        limit_s: float,
        t_start: float,
    ) -> AsyncIterator[bytes]:
        """Yields a decode stream's bytes as they arrive; closes the upstream response at the end.

        If the client goes away the generator is closed, which closes the upstream connection, so
        the decode server sees the disconnect and aborts the request.
        """
        n_bytes = len(first)
        end = "complete"
        try:
            if first:
                yield first
            while True:
                try:
                    chunk = await resp.content.readany()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    status, msg, err_type, extra = _describe_failure(
                        exc, "decode", url, limit_s, self.config.connect_timeout_s
                    )
                    end = f"failed: {msg}"
                    yield _sse_error(status, msg, err_type, **extra)
                    return
                if not chunk:
                    return
                n_bytes += len(chunk)
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            end = "closed by the client"
            raise
        finally:
            resp.close()
            logger.log(
                logging.INFO if end == "complete" else logging.WARNING,
                "req %s stream %s: %d bytes in %.1f ms",
                req_id,
                end,
                n_bytes,
                (time.perf_counter() - t_start) * 1e3,
            )


async def _disconnected(request: Request) -> None:
    """Returns when the client of ``request`` (whose body was read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(config: ProxyConfig) -> FastAPI:
    """Builds the FastAPI application of one proxy.

    Args:
        config: The proxy settings.

    Returns:
        The app; its lifespan opens and closes the outbound HTTP session.
    """
    proxy = PDProxy(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="tritonkv P/D proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await proxy.generate(request, COMPLETIONS)

    @app.post(CHAT_COMPLETIONS)
    async def chat_completions(request: Request) -> Response:
        return await proxy.generate(request, CHAT_COMPLETIONS)

    @app.get("/v1/models")
    async def models() -> Response:
        return await proxy.models()

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    return app


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the command line; see the module docstring."""
    script = Path(sys.argv[0]).name
    p = argparse.ArgumentParser(
        prog=script if script.startswith("tritonkv-") else f"python -m {__package__}.proxy",
        description="OpenAI-compatible prefill/decode router for disaggregated vLLM serving.",
    )
    p.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="prefill server base URL; repeat for several (round-robin)",
    )
    p.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="decode server base URL; repeat for several (round-robin)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="limit for one whole decode call, streamed generation included",
    )
    p.add_argument(
        "--prefill-timeout-s",
        type=float,
        default=None,
        help="limit for one prefill call (default: --timeout-s)",
    )
    p.add_argument(
        "--connect-timeout-s", type=float, default=5.0, help="limit for connecting to a backend"
    )
    p.add_argument(
        "--health-timeout-s",
        type=float,
        default=5.0,
        help="limit for each backend /health probe and for /v1/models",
    )
    p.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=10.0,
        help="grace period for in-flight requests on SIGINT/SIGTERM",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the proxy until SIGINT or SIGTERM.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 after a signal-initiated graceful shutdown.
    """
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = ProxyConfig(
            prefill_urls=tuple(args.prefill),
            decode_urls=tuple(args.decode),
            timeout_s=args.timeout_s,
            prefill_timeout_s=args.prefill_timeout_s,
            connect_timeout_s=args.connect_timeout_s,
            health_timeout_s=args.health_timeout_s,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=False,
            timeout_graceful_shutdown=args.shutdown_timeout_s,
        )
    )
    # uvicorn handles SIGINT/SIGTERM during serve() (graceful shutdown), then restores the previous
    # handlers and re-raises the signal. With these handlers in place, that re-raise only records
    # the signal, so the process exits normally with status 0 instead of dying by the signal.
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    logger.info(
        "P/D proxy on http://%s:%d: prefill %s, decode %s, timeout %.3g s (prefill %.3g s, "
        "connect %.3g s)",
        args.host,
        args.port,
        ", ".join(config.prefill_urls),
        ", ".join(config.decode_urls),
        config.timeout_s,
        config.prefill_limit_s,
        config.connect_timeout_s,
    )
    server.run()
    if not server.started:
        return 1
    names = ", ".join(signal.Signals(s).name for s in received) or "none"
    logger.info("P/D proxy stopped (signal: %s)", names)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
