"""The P/D router behind :mod:`connector.serve.proxy`: its settings and the calls to the upstream
vLLM servers ("servers": prefill and decode) for each client request.

A generation request goes through small steps, each raising :class:`Failure` with the answer for
the client when it cannot go on: its id and body admitted within the bounds of
:mod:`connector.serve.guards`, the body checked, the prefill call, the hand-off taken from its answer, the decode
call, then the decode answer relayed whole or as a stream. With ``overlap``, a prefill server
whose site is known (:mod:`connector.serve.overlap`) gets its request at the same time as the
decode server, both with a transfer id minted here; the prefill's answer is read on a task of
its own (to learn the site again, or forget it), and the decode answer goes to the client as soon
as it starts. The bodies sent and the error bodies are
built by the pure functions of :mod:`connector.serve.bodies`; what the client sees for each failure
is listed in :mod:`connector.serve.proxy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from ..logs import get_logger, short_id
from .bodies import InvalidBody, client_body, decode_body, encode, handoff_params, prefill_body
from .exchange import Exchange, Failure, error_response, first_bytes, relay_stream, relay_whole
from .guards import BodyRefused, read_body, request_id, shows_details, shows_errors
from .overlap import Overlap, overlap_params

logger = get_logger("proxy")

# Client headers passed on to both servers: credentials and W3C trace context (vLLM's tracing
# continues the client's trace from them).
_FORWARDED = ("Authorization", "traceparent", "tracestate")


@dataclass(frozen=True)
class ProxyConfig:
    """Settings of one proxy instance.

    Attributes:
        prefill_urls: Base URLs of the prefill servers (e.g. ``http://10.0.0.1:8100``).
        decode_urls: Base URLs of the decode servers.
        timeout_s: Limit for one whole decode call, streamed generation included.
        prefill_timeout_s: Limit for one whole prefill call; None means ``timeout_s``.
        connect_timeout_s: Limit for opening a connection to any server.
        health_timeout_s: Limit for each server's ``/health`` and for ``/v1/models``.
        max_request_bytes: The largest client body accepted (413 beyond).
        body_timeout_s: Limit for receiving a client's whole body (408 beyond).
        max_concurrent_requests: The most client requests in flight at once (503 beyond).
        health_details: Whether any client (not only a loopback one) may ask ``/health`` for
            the servers' URLs and errors.
        overlap: Send each request to its prefill and its decode server at once, once that
            prefill server's site is known (see the module docstring); False: prefill, then
            decode.
    """

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    timeout_s: float = 600.0
    prefill_timeout_s: float | None = None
    connect_timeout_s: float = 5.0
    health_timeout_s: float = 5.0
    max_request_bytes: int = 32 * 2**20
    body_timeout_s: float = 60.0
    max_concurrent_requests: int = 512
    health_details: bool = False
    overlap: bool = False

    def __post_init__(self) -> None:
        """Validates the URLs and limits.

        Raises:
            ValueError: No prefill or no decode URL, a URL without http(s) scheme, or a limit <= 0.
        """
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("at least one prefill and one decode URL are required")
        for url in (*self.prefill_urls, *self.decode_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server URL must start with http:// or https://: {url!r}")
        limits = (
            self.timeout_s,
            self.connect_timeout_s,
            self.health_timeout_s,
            self.body_timeout_s,
        )
        if any(t <= 0 for t in limits) or (
            self.prefill_timeout_s is not None and self.prefill_timeout_s <= 0
        ):
            raise ValueError("timeouts must be > 0")
        if self.max_request_bytes < 1 or self.max_concurrent_requests < 1:
            raise ValueError(
                "max_request_bytes and max_concurrent_requests must be >= 1, got "
                f"{self.max_request_bytes} and {self.max_concurrent_requests}"
            )

    @property
    def prefill_limit_s(self) -> float:
        """The effective prefill timeout in seconds."""
        return self.timeout_s if self.prefill_timeout_s is None else self.prefill_timeout_s


def _strip(url: str) -> str:
    """Returns ``url`` without trailing slashes."""
    return url.rstrip("/")


class PDRouter:
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
        self._overlap = Overlap(self._prefill_call, self._answer)

    async def start(self) -> None:
        """Opens the outbound session (call inside the serving event loop)."""
        # No connection cap: a capped pool would make requests wait for a slot inside their timeout.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        self._session = aiohttp.ClientSession(connector=connector, trust_env=False)

    async def close(self) -> None:
        """Cancels the overlapped prefill calls still running; closes the outbound session."""
        await self._overlap.close()
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
            raise RuntimeError("PDRouter.start() was not called")
        return self._session

    def _timeout(self, total_s: float) -> aiohttp.ClientTimeout:
        """Returns an aiohttp timeout with the given total and the configured connect limit."""
        return aiohttp.ClientTimeout(total=total_s, connect=self.config.connect_timeout_s)

    def _failure(
        self, exc: BaseException, stage: str, url: str, limit_s: float, details: bool = True
    ) -> Failure:
        """Wraps an outbound exception into a :class:`Failure` (see ``describe_failure``)."""
        return Failure.of(exc, stage, url, limit_s, self.config.connect_timeout_s, details)

    async def _get(self, stage: str, url: str, path: str, details=True) -> tuple[int, bytes, Any]:
        """GETs ``url + path`` within the health timeout.

        Returns:
            ``(status, body, content type)``.

        Raises:
            Failure: The server could not be reached in time.
        """
        limit = self.config.health_timeout_s
        try:
            async with self.session.get(url + path, timeout=self._timeout(limit)) as resp:
                return resp.status, await resp.read(), resp.headers.get("Content-Type")
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._failure(exc, stage, url, limit, details) from exc

    async def health(self, request: Request) -> JSONResponse:
        """Checks every server's ``/health``.

        Args:
            request: The client's request: ``?details=1`` from a loopback client (from anyone
                with ``health_details``) adds each server's state to the answer.

        Returns:
            200 ``{"status": "ok"}`` when all answer 2xx, else 503 with ``"status": "unhealthy"``;
            with details, ``servers`` lists each one's role, URL, ``ok`` and status or error.
        """
        servers = [("prefill", u) for u in self._prefill_urls] + [
            ("decode", u) for u in self._decode_urls
        ]

        async def probe(role: str, url: str) -> dict[str, Any]:
            try:
                status, _, _ = await self._get("health", url, "/health")
            except Failure as failure:
                return {"role": role, "url": url, "ok": False, "error": failure.summary}
            return {"role": role, "url": url, "ok": 200 <= status < 300, "status": status}

        states = await asyncio.gather(*(probe(r, u) for r, u in servers))
        ok = all(s["ok"] for s in states)
        body: dict[str, Any] = {"status": "ok" if ok else "unhealthy"}
        if shows_details(request, anyone=self.config.health_details):
            body["servers"] = states
        return JSONResponse(body, status_code=200 if ok else 503)

    async def models(self, request: Request) -> Response:
        """Forwards ``GET /v1/models`` to the next decode server."""
        url = next(self._decode_rr)
        try:
            details = shows_errors(request, anyone=self.config.health_details)
            status, body, ctype = await self._get("models", url, "/v1/models", details)
        except Failure as failure:
            return failure.response
        return Response(body, status_code=status, media_type=ctype)

    async def generate(self, request: Request, path: str) -> Response:
        """Serves one completions or chat completions request: prefill, then decode.

        Args:
            request: The client's request.
            path: ``/v1/completions`` or ``/v1/chat/completions``.

        Returns:
            The decode server's response (relayed as a stream when the client asked to stream), or
            an error response as described in the module docstring.
        """
        admitted = await _admit(request, self.config)
        if isinstance(admitted, Response):
            return admitted
        req_id, raw = admitted
        # Starlette does not cancel a handler whose client left: race the work against the
        # disconnect, so that the servers' connections close and vLLM aborts the request
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
                logger.warning("req %s: the client left; server calls cancelled", req_id)
        if work.cancelled():
            return Response(status_code=499, headers={"X-Request-Id": req_id})
        return work.result()

    async def _generate(self, request: Request, path: str, req_id: str, raw: bytes) -> Response:
        """:meth:`generate`'s work once the body is read: prefill, hand-off, decode."""
        ex = Exchange(req_id, path, _upstream_headers(request, req_id))
        ex.details = shows_errors(request, anyone=self.config.health_details)
        decode = None
        try:
            body = client_body(raw, path)
            ex.prefill_url = next(self._prefill_rr)
            site = self._overlap.sites.get(ex.prefill_url) if self.config.overlap else None
            if site is None:
                prefill = encode(prefill_body(body, path))
            else:
                ex.transfer_id, ex.overlapped = uuid.uuid4().hex, True
                prefill = encode(prefill_body(body, path, ex.transfer_id))
                decode = encode(decode_body(body, overlap_params(site, ex.transfer_id)))
                alone = encode(decode_body(body, None))
        except ValueError as exc:  # InvalidBody, or encode's refusal
            msg = (
                str(exc)
                if isinstance(exc, InvalidBody)
                else f"request body cannot be passed on ({exc}): expected a JSON object nested "
                "less deeply"
            )
            param = exc.param if isinstance(exc, InvalidBody) else None
            response = error_response(400, msg, "BadRequestError", param=param)
            response.headers["X-Request-Id"] = req_id
            return response
        stream = bool(body.get("stream"))
        try:
            if decode is None:
                prefill_raw = await self._prefill(ex, prefill)
                decode = self._handoff(ex, prefill_raw, body)
                resp, first = await self._answer(ex, decode, stream)
            else:
                resp, first = await self._overlap.dispatch(ex, prefill, decode, alone, stream)
            limits = (self.config.timeout_s, self.config.connect_timeout_s)
            if first is not None:
                return relay_stream(ex, resp, first, *limits)
            return await relay_whole(ex, resp, *limits)
        except Failure as failure:
            failure.response.headers.update(ex.id_header)
            return failure.response
        except asyncio.CancelledError:  # the client left: its overlapped prefill is not wanted
            if ex.prefill_task is not None:
                ex.prefill_task.cancel()
            raise

    async def _prefill_call(self, ex: Exchange, body: bytes) -> tuple[int, bytes, str | None]:
        """Calls ``ex``'s prefill server; returns ``(status, body, content type)``.

        Raises:
            Failure: The call failed (502/504); the server is forgotten as an overlap site.
        """
        url, limit = ex.prefill_url, self.config.prefill_limit_s
        t0 = time.perf_counter()
        try:
            async with self.session.post(
                url + ex.path, data=body, headers=ex.headers, timeout=self._timeout(limit)
            ) as resp:
                status = resp.status
                raw = await resp.read()
                ctype = resp.headers.get("Content-Type")
        except (TimeoutError, aiohttp.ClientError) as exc:
            self._overlap.sites.forget(url)
            failure = self._failure(exc, "prefill", url, limit, ex.details)
            logger.warning("req %s prefill %s: %s", ex.req_id, url, failure.summary)
            raise failure from exc
        ex.prefill_ms = (time.perf_counter() - t0) * 1e3
        return status, raw, ctype

    async def _prefill(self, ex: Exchange, body: bytes) -> bytes:
        """Calls ``ex``'s prefill server; returns its 2xx response body.

        Raises:
            Failure: The call failed (502/504), or the server answered non-2xx (that answer).
        """
        url = ex.prefill_url
        status, raw, ctype = await self._prefill_call(ex, body)
        if not 200 <= status < 300:
            logger.warning(
                "req %s prefill %s answered %d in %.1f ms; decode not called",
                ex.req_id,
                url,
                status,
                ex.prefill_ms,
            )
            response = Response(raw, status_code=status, media_type=ctype, headers=ex.id_header)
            raise Failure(response, f"{status} from prefill {url}")
        return raw

    def _handoff(self, ex: Exchange, prefill_raw: bytes, body: dict[str, Any]) -> bytes:
        """The decode request: the client's ``body`` with the prefill response's
        ``kv_transfer_params`` (none when null or absent), encoded.

        Raises:
            Failure: 502, the response is not a JSON object with an object or null hand-off
                that can be passed on.
        """
        url = ex.prefill_url
        kv, decode = _decode_request(ex, prefill_raw, body)
        if kv is None:
            logger.warning(
                "req %s prefill %s returned no kv_transfer_params; the decode server will "
                "recompute the prompt",
                ex.req_id,
                url,
            )
        elif not kv.get("do_remote_prefill") and not self._warned_no_remote_prefill:
            self._warned_no_remote_prefill = True
            logger.warning(
                "prefill %s returned kv_transfer_params without do_remote_prefill=true; passed on "
                "unchanged, but vLLM's decode-side cleanup of rejected transfers keys on it",
                url,
            )
        ex.transfer_id = kv.get("transfer_id") if kv else None
        if self.config.overlap:
            self._overlap.sites.learn(url, kv)
        return decode

    async def _answer(
        self, ex: Exchange, body: bytes, stream: bool
    ) -> tuple[aiohttp.ClientResponse, bytes | None]:
        """Calls the next decode server: its response, headers read, and for a 2xx stream its
        first bytes too (else None).

        Raises:
            Failure: The server could not be reached, or did not answer in time.
        """
        resp = await self._decode_call(ex, body)
        if not (stream and 200 <= resp.status < 300):
            return resp, None
        return resp, await first_bytes(
            ex, resp, self.config.timeout_s, self.config.connect_timeout_s
        )

    async def _decode_call(self, ex: Exchange, body: bytes) -> aiohttp.ClientResponse:
        """Starts the call to the next decode server; returns its response, headers read.

        Raises:
            Failure: The server could not be reached or did not answer in time.
        """
        url = ex.decode_url = next(self._decode_rr)
        limit = self.config.timeout_s
        ex.decode_t0 = time.perf_counter()
        try:
            return await self.session.post(
                url + ex.path, data=body, headers=ex.headers, timeout=self._timeout(limit)
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            failure = self._failure(exc, "decode", url, limit, ex.details)
            logger.warning(
                "req %s prefill %s %.1f ms transfer_id %s; decode %s: %s",
                ex.req_id,
                ex.prefill_url,
                ex.prefill_ms,
                short_id(ex.transfer_id),
                url,
                failure.summary,
            )
            raise failure from exc


def _upstream_headers(request: Request, req_id: str) -> dict[str, str]:
    """The headers sent to both servers for one client request."""
    headers = {"Content-Type": "application/json", "X-Request-Id": req_id}
    for name in _FORWARDED:
        value = request.headers.get(name)
        if value:
            headers[name] = value
    return headers


def _decode_request(
    ex: Exchange, prefill_raw: bytes, body: dict[str, Any]
) -> tuple[dict[str, Any] | None, bytes]:
    """The prefill answer's hand-off and the decode request made of it (see
    :meth:`PDRouter._handoff`); Failure (502, logged) when it cannot be passed on."""
    try:
        kv = handoff_params(prefill_raw)
        return kv, encode(decode_body(body, kv))
    except ValueError:
        msg = (
            f"prefill server {ex.prefill_url} returned a body that is not a JSON object with an "
            "object or null kv_transfer_params that can be passed on"
        )
        logger.warning("req %s: %s", ex.req_id, msg)
        if ex.details:
            response = error_response(
                502, msg, "BadGateway", stage="prefill", server=ex.prefill_url
            )
        else:
            shown = (
                "the prefill server's answer cannot be passed on (the proxy's log has the details)"
            )
            response = error_response(502, shown, "BadGateway", stage="prefill")
        raise Failure(response, msg) from None


async def _admit(request: Request, config: ProxyConfig) -> tuple[str, bytes] | Response:
    """The request's id and body, or the answer refusing the body (408, 413, 499)."""
    req_id, refused = request_id(request.headers.get("x-request-id"), f"pd-{uuid.uuid4().hex}")
    if refused is not None:
        logger.warning(
            "req %s: not the client's X-Request-Id %s (expected 1-128 of A-Z a-z 0-9 . _ : -)",
            req_id,
            refused,
        )
    try:
        raw = await read_body(request, config.max_request_bytes, config.body_timeout_s)
    except BodyRefused as exc:
        logger.warning("req %s: %d, %s", req_id, exc.status, exc)
        return exc.response(req_id)
    except ClientDisconnect:
        logger.warning("req %s: the client left while sending its body", req_id)
        return Response(status_code=499, headers={"X-Request-Id": req_id})
    return req_id, raw


async def _disconnected(request: Request) -> None:
    """Returns when the client of ``request`` (whose body was read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
