"""What one client can make the P/D proxy hold, write or show, bounded: requests in flight, body
bytes and seconds, the request id taken into logs and headers, and who sees the servers' details.

The proxy's clients are strangers (see README "Security"): everything here assumes the client is
hostile. The limits are set on the command line (:mod:`connector.serve.proxy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from ..logs import get_logger
from .bodies import error_body

logger = get_logger("proxy")

# A client's X-Request-Id is used only when it is made of these, at most 128 of them.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Seconds a client refused for concurrency is told to wait (Retry-After).
RETRY_AFTER_S = 1


class BodyRefused(Exception):
    """The client's body is refused before it is parsed: over the size limit (413) or not all
    received in time (408).

    Attributes:
        status: 413 or 408.
        extra: The limit, as a field of the error body (``max_request_bytes`` or ``timeout_s``).
    """

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.extra = extra

    def response(self, req_id: str) -> JSONResponse:
        """The answer; it closes the connection, so the rest of the body is never read."""
        err_type = "RequestTooLarge" if self.status == 413 else "RequestTimeout"
        return JSONResponse(
            error_body(self.status, str(self), err_type, **self.extra),
            status_code=self.status,
            headers={"Connection": "close", "X-Request-Id": req_id},
        )


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """Reads the client's body, refusing it as soon as it is over ``max_bytes`` or late.

    A ``Content-Length`` over the limit is refused before anything is read; a body without one
    (chunked) is refused at the chunk that passes the limit, so at most ``max_bytes`` plus one
    chunk is ever held. A client trickling its body holds a slot at most ``timeout_s``.

    Args:
        request: The client's request (its body not read yet).
        max_bytes: The most bytes accepted.
        timeout_s: The most seconds for receiving the whole body.

    Returns:
        The whole body.

    Raises:
        BodyRefused: The body is over the limit (413) or not received within ``timeout_s`` (408).
        starlette.requests.ClientDisconnect: The client left before sending all of it.
    """
    too_large = BodyRefused(
        413,
        f"request body is over the limit of {max_bytes} bytes: expected at most {max_bytes} bytes",
        max_request_bytes=max_bytes,
    )
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared[:20]) > max_bytes:
        raise too_large

    async def read() -> bytes:
        body = bytearray()
        async with contextlib.aclosing(request.stream()) as chunks:
            async for chunk in chunks:
                if len(body) + len(chunk) > max_bytes:
                    raise too_large
                body += chunk
        return bytes(body)

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        msg = f"request body not received within {timeout_s:g} s: expected all of it by then"
        raise BodyRefused(408, msg, timeout_s=timeout_s) from None


def request_id(header: str | None, minted: str) -> tuple[str, str | None]:
    """The id of one request: the client's ``X-Request-Id`` when it is safe, else ``minted``.

    Safe means 1 to 128 characters of ``A-Z a-z 0-9 . _ : -``: such an id cannot break a log line
    or grow a header sent to the servers.

    Args:
        header: The client's ``X-Request-Id`` value, or None.
        minted: The id to use instead (``pd-<hex>``).

    Returns:
        ``(id, refused)``: ``refused`` is the client's value, cut to 40 characters of its
        ``repr``, when it was given and not used; None otherwise.
    """
    if not header:
        return minted, None
    if _REQUEST_ID.fullmatch(header):
        return header, None
    text = repr(header)
    return minted, text if len(text) <= 40 else f"{text[:37]}..."


def is_loopback(host: str | None) -> bool:
    """Tells whether a client address is a loopback one (``127.0.0.0/8``, ``::1``, mapped IPv4).

    Args:
        host: The client's address as the server saw it, or None (unknown).

    Returns:
        True only for a loopback IP address.
    """
    try:
        ip = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def shows_errors(request: Request, anyone: bool) -> bool:
    """Tells whether this client may see, in an error body, which server failed and how (its
    URL, the error): a loopback client, or any with ``--health-details``. Others get the stage
    and the status; the proxy's log has the rest."""
    return anyone or is_loopback(request.client.host if request.client else None)


def shows_details(request: Request, anyone: bool) -> bool:
    """Tells whether ``/health`` shows this client the servers' URLs and errors.

    Args:
        request: The client's ``/health`` request; details need ``?details=1`` (or ``true``).
        anyone: Whether every client may see them (``--health-details``); else only loopback ones.

    Returns:
        True when asked for, by a client allowed to see them.
    """
    asked = request.query_params.get("details", "").lower() in ("1", "true")
    return asked and shows_errors(request, anyone)


class InFlightLimit:
    """ASGI middleware answering 503 (``Retry-After``) while ``limit`` requests are in flight.

    A request is in flight from its arrival until the app has answered it completely: a stream
    until its last chunk is sent or its client leaves. Every HTTP request counts (``/health`` and
    ``/v1/models`` too); a refused one reaches no server.

    Args:
        app: The ASGI app to guard.
        limit: The most requests in flight at once.
    """

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0
        self._refused = 0  # since the last warning
        self._warned_at = float("-inf")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            self._warn()
            msg = (
                f"the proxy is serving its limit of {self.limit} concurrent requests; "
                f"retry in {RETRY_AFTER_S} s"
            )
            response = JSONResponse(
                error_body(503, msg, "ServiceUnavailable", max_concurrent_requests=self.limit),
                status_code=503,
                # closed: a body sent with the request is not read, and a flood must reconnect
                headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
            )
            await response(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    def _warn(self) -> None:
        """Logs the refusals at most once a second (a flood must not flood the log too)."""
        self._refused += 1
        now = time.monotonic()
        if now - self._warned_at >= 1.0:
            logger.warning(
                "refused %d request(s) with 503: %d in flight (--max-concurrent-requests)",
                self._refused,
                self.in_flight,
            )
            self._refused = 0
            self._warned_at = now
