"""One client request on its way through the proxy (:class:`Exchange`), the failure of a step
(:class:`Failure`, carrying the client's answer), and the relay of the decode server's answer to
the client, whole or as a stream (:func:`relay_whole`, :func:`first_bytes` then
:func:`relay_stream`). Used by
:mod:`connector.serve.router` and :mod:`connector.serve.overlap`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..logs import get_logger, short_id
from .bodies import describe_failure, error_body, sse_error

logger = get_logger("proxy")


class Failure(Exception):
    """A step of a request cannot go on; carries the response to give the client."""

    def __init__(self, response: Response, summary: str) -> None:
        super().__init__(summary)
        self.response = response
        self.summary = summary

    @classmethod
    def of(
        cls,
        exc: BaseException,
        stage: str,
        url: str,
        limit_s: float,
        connect_s: float,
        details: bool = True,
    ) -> Failure:
        """The failure of an outbound call that raised ``exc`` (see ``describe_failure``; the
        summary, for the log, always has the details)."""
        shown = describe_failure(exc, stage, url, limit_s, connect_s, details)
        status, msg = describe_failure(exc, stage, url, limit_s, connect_s)[:2]
        return cls(error_response(*shown[:3], **shown[3]), f"{status} {msg}")


def error_response(status: int, message: str, err_type: str, **extra: Any) -> JSONResponse:
    """Returns an error JSONResponse; see :func:`~connector.serve.bodies.error_body`."""
    return JSONResponse(error_body(status, message, err_type, **extra), status_code=status)


@dataclass
class Exchange:
    """One client request on its way through prefill and decode: what its calls and logs need."""

    req_id: str
    path: str
    headers: dict[str, str]  # sent to both servers
    prefill_url: str = ""
    prefill_ms: float = 0.0
    transfer_id: Any = None
    decode_url: str = ""
    decode_t0: float = 0.0  # perf_counter() when the decode call started
    overlapped: bool = False  # the prefill runs beside the decode (its time is logged apart)
    details: bool = True  # the client may see servers' URLs and errors (guards.shows_errors)
    prefill_task: asyncio.Task | None = None  # that prefill call, while it runs

    @property
    def id_header(self) -> dict[str, str]:
        return {"X-Request-Id": self.req_id}

    def log_done(self, status: int, note: str = "") -> None:
        """The request's INFO line, once the decode server answered (or failed)."""
        logger.info(
            "req %s prefill %s %s | decode %s ttfb %.1f ms | transfer_id %s | status %d%s",
            self.req_id,
            self.prefill_url,
            "overlapped" if self.overlapped else f"{self.prefill_ms:.1f} ms",
            self.decode_url,
            (time.perf_counter() - self.decode_t0) * 1e3,
            short_id(self.transfer_id),
            status,
            note,
        )


async def _relay(
    resp: aiohttp.ClientResponse,
    first: bytes,
    ex: Exchange,
    limit_s: float,
    connect_s: float,
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
                msg = describe_failure(exc, "decode", ex.decode_url, limit_s, connect_s)[1]
                end = f"failed: {msg}"
                status, shown, err_type, extra = describe_failure(
                    exc, "decode", ex.decode_url, limit_s, connect_s, ex.details
                )
                yield sse_error(status, shown, err_type, **extra)
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
            ex.req_id,
            end,
            n_bytes,
            (time.perf_counter() - ex.decode_t0) * 1e3,
        )


async def relay_whole(
    ex: Exchange, resp: aiohttp.ClientResponse, limit_s: float, connect_s: float
) -> Response:
    """The decode answer read whole (not streamed, or not 2xx), given back unchanged.

    Raises:
        Failure: Reading it failed or passed the decode limit.
    """
    ctype = resp.headers.get("Content-Type")
    try:
        raw = await resp.read()
    except asyncio.CancelledError:
        resp.close()
        raise
    except (TimeoutError, aiohttp.ClientError) as exc:
        failure = Failure.of(exc, "decode", ex.decode_url, limit_s, connect_s, ex.details)
        ex.log_done(failure.response.status_code, f" ({failure.summary})")
        raise failure from exc
    finally:
        resp.release()
    ex.log_done(resp.status)
    return Response(raw, status_code=resp.status, media_type=ctype, headers=ex.id_header)


async def first_bytes(
    ex: Exchange, resp: aiohttp.ClientResponse, limit_s: float, connect_s: float
) -> bytes:
    """A decode stream's first bytes (the proxy answers only once they came, so a silent server
    still gets 504); the response is closed when they do not come.

    Raises:
        Failure: The first bytes did not come, or not within the decode limit.
    """
    try:
        return await resp.content.readany()
    except (TimeoutError, aiohttp.ClientError, asyncio.CancelledError) as exc:
        resp.close()
        if isinstance(exc, asyncio.CancelledError):
            raise
        failure = Failure.of(exc, "decode", ex.decode_url, limit_s, connect_s, ex.details)
        ex.log_done(failure.response.status_code, f" ({failure.summary})")
        raise failure from exc


def relay_stream(
    ex: Exchange, resp: aiohttp.ClientResponse, first: bytes, limit_s: float, connect_s: float
) -> Response:
    """The decode stream, relayed from its ``first`` bytes (:func:`first_bytes`) on."""
    ex.log_done(resp.status, " (stream started)")
    headers = {**ex.id_header, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(
        _relay(resp, first, ex, limit_s, connect_s),
        status_code=resp.status,
        media_type=resp.headers.get("Content-Type") or "text/event-stream",
        headers=headers,
    )
