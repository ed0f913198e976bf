"""Prefill/decode (P/D) router for disaggregated vLLM serving with the tritonkv connector.

Usage (``tritonkv-proxy`` once tritonkv is installed; ``python -m connector.serve.proxy`` from a checkout)::

    tritonkv-proxy --prefill http://p0:8100 [--prefill http://p1:8100 ...] \\
        --decode http://d0:8200 [--decode http://d1:8200 ...] --port 8000 \\
        [--host 0.0.0.0] [--timeout-s 600] [--prefill-timeout-s S] [--connect-timeout-s 5] \\
        [--health-timeout-s 5] [--shutdown-timeout-s 10] [--max-request-bytes 33554432] \\
        [--body-timeout-s 60] [--max-concurrent-requests 512] [--health-details] \\
        [--overlap] [--log-level info]

Clients talk to the proxy as to one OpenAI-compatible vLLM server; "server" below is always one of
the upstream vLLM servers. Endpoints:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming or not: a prefill on the
  next prefill server, then a decode on the next decode server (two independent round-robins);
* ``GET /v1/models``: forwarded to the next decode server;
* ``GET /health``: 200 ``{"status": "ok"}`` if every server answers its own ``/health`` with a
  2xx status within ``--health-timeout-s``, else 503 ``{"status": "unhealthy"}``. Each server's
  URL and state (``servers``) only for ``/health?details=1`` from a loopback client, or from
  any client with ``--health-details`` (behind a reverse proxy on the same host, every client
  is loopback). The same goes for error bodies: which server failed and how (its URL, the
  error) only for those clients; others get the stage and the status, the log the rest.

Bounds on what a client can make it do (:mod:`connector.serve.guards`): a body over
``--max-request-bytes`` (default 32 MiB) gets 413, a ``Content-Length`` over it before anything
is read; a body not all received within ``--body-timeout-s`` (default 60 s) gets 408; beyond
``--max-concurrent-requests`` (default 512) in flight (streams until they end or the client
leaves, ``/health`` too), 503 with ``Retry-After`` and no server called.

One generation request: (1) the prefill server gets the client's body made a one-token, one-sequence,
unstreamed request asking for a hand-off (:func:`~connector.serve.bodies.prefill_body`); (2) the
top-level ``kv_transfer_params`` of its response is the hand-off, taken as is; (3) the decode server
gets the client's own body with exactly that hand-off (:func:`~connector.serve.bodies.decode_body`),
or without one when the prefill returned none (it then recomputes the prompt; a warning is
logged); (4) the decode response goes back unchanged, a stream relayed chunk by chunk as it arrives.

With ``--overlap`` (off by default) steps (1) and (3) start together once a prefill server's first
sequential hand-off told the proxy where its KV lives (:mod:`connector.serve.overlap`): the
prefill body asks the producer to save under a transfer id the proxy minted
(``kv_transfer_params={"do_remote_decode": true, "transfer_id": ...}``), and the decode body
carries the overlapped hand-off (that producer's address, ``tp_size``, ``fingerprint``,
``protocol``, the same id, ``"overlap": true``), whose load waits for the entry on the decode
server (its ``prefill_wait_s``). The decode answer goes to the client as soon as it starts; the
prefill answer is only read: a failed prefill call makes the next request to that server
sequential again, a producer that saved under another id is never overlapped again (both
logged). A prefill that failed (an error, no hand-off, or one under another id) before the
decode answer came (a stream's first bytes) closes that decode call and sends the client's body
to the next decode server without a hand-off: the prompt is computed there at once instead of
after the decode server's ``prefill_wait_s``. After that, the decode server recomputes the
prompt when its load fails or its wait ends. A decode call that fails or answers non-2xx
cancels the prefill call (vLLM aborts it).

Failures (JSON bodies shaped like vLLM's errors, plus ``stage``, ``server`` and, for timeouts,
``timeout_s``):

* body not UTF-8, not JSON (NaN, infinities and nesting too deep to parse included), not a JSON
  object, or a completions ``prompt`` holding a batch (vLLM returns the hand-off of the first
  prompt only): 400, no server is called;
* prefill answers non-2xx: that status and body go back unchanged; decode is not called;
* prefill answers 2xx but not a JSON object, or its ``kv_transfer_params`` is not an object: 502;
* a server refuses or drops the connection: 502 naming it;
* a server does not connect within ``--connect-timeout-s``, or does not complete within its limit
  (``--prefill-timeout-s``, default ``--timeout-s``, for prefill; ``--timeout-s`` for the whole
  decode, streamed or not): 504 naming it and the limit;
* after a stream started: an SSE event ``data: {"error": {...}}`` then ``data: [DONE]``. The proxy
  waits for the decode stream's first chunk before answering, so a silent decode server still
  yields a 504;
* the client leaves: its server calls are cancelled (their connections close, so vLLM aborts the
  request) and the answer is a 499 nobody reads. Not noticed: a client that pipelines requests on
  one connection and leaves, under uvicorn's httptools parser (only the last one is marked).

Every request has an id (the client's ``X-Request-Id`` when it is 1-128 characters of
``A-Z a-z 0-9 . _ : -``, else a new ``pd-<hex>``), sent to both servers and returned to the
client; the client's ``Authorization`` and W3C trace context (``traceparent``, ``tracestate``) go
to both servers too. One INFO log line per request names both servers, their times and the
``transfer_id``'s first 8 characters (the whole id would let a log reader take that KV).
SIGINT/SIGTERM stop it gracefully (in-flight requests get ``--shutdown-timeout-s``; exit status
0).

This module is the app and the command line; the routing is :mod:`connector.serve.router` (with
:mod:`connector.serve.exchange` and :mod:`connector.serve.overlap`), the bodies
:mod:`connector.serve.bodies`, the bounds :mod:`connector.serve.guards`. They import neither vllm nor tritonkv: only the HTTP stack
vLLM installs (FastAPI and uvicorn to serve, aiohttp to call the servers).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..logs import get_logger
from .bodies import CHAT_COMPLETIONS, COMPLETIONS
from .guards import InFlightLimit
from .router import PDRouter, ProxyConfig

logger = get_logger("proxy")


def create_app(config: ProxyConfig) -> FastAPI:
    """Builds the FastAPI application of one proxy.

    Args:
        config: The proxy settings.

    Returns:
        The app; its lifespan opens and closes the outbound HTTP session.
    """
    proxy = PDRouter(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="tritonkv P/D proxy", lifespan=lifespan)
    app.state.proxy = proxy
    app.add_middleware(InFlightLimit, limit=config.max_concurrent_requests)

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await proxy.generate(request, COMPLETIONS)

    @app.post(CHAT_COMPLETIONS)
    async def chat_completions(request: Request) -> Response:
        return await proxy.generate(request, CHAT_COMPLETIONS)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.models(request)

    @app.get("/health")
    async def health(request: Request) -> Response:
        return await proxy.health(request)

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
        "--connect-timeout-s", type=float, default=5.0, help="limit for connecting to a server"
    )
    p.add_argument(
        "--health-timeout-s",
        type=float,
        default=5.0,
        help="limit for each server's /health probe and for /v1/models",
    )
    p.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=10.0,
        help="grace period for in-flight requests on SIGINT/SIGTERM",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=32 * 2**20,
        metavar="N",
        help="largest request body accepted, in bytes; larger ones get 413, a Content-Length "
        "over it before the body is read (default: 32 MiB; 1M prompt tokens as text are a "
        "few MiB)",
    )
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=60.0,
        help="limit for receiving a client's whole request body; later, 408 (default: 60)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=512,
        metavar="N",
        help="most requests in flight at once, /health included (streams until they end or "
        "the client leaves); beyond, 503 with Retry-After and no server called (default: 512)",
    )
    p.add_argument(
        "--health-details",
        action="store_true",
        help="let any client see the servers' URLs and errors, with /health?details=1 and in "
        "error bodies (default: loopback clients only, and a reverse proxy on this host makes "
        "every client loopback; others get the stage and the status)",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="send each request to its prefill and decode servers at once (the decode server "
        "waits for the KV), once a prefill server's first hand-off said where its KV lives "
        "(default: prefill, then decode)",
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
            max_request_bytes=args.max_request_bytes,
            body_timeout_s=args.body_timeout_s,
            max_concurrent_requests=args.max_concurrent_requests,
            health_details=args.health_details,
            overlap=args.overlap,
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
        "connect %.3g s), at most %d requests of %d bytes in flight, %s",
        args.host,
        args.port,
        ", ".join(config.prefill_urls),
        ", ".join(config.decode_urls),
        config.timeout_s,
        config.prefill_limit_s,
        config.connect_timeout_s,
        config.max_concurrent_requests,
        config.max_request_bytes,
        "prefill and decode overlapped" if config.overlap else "prefill, then decode",
    )
    server.run()
    if not server.started:
        return 1
    names = ", ".join(signal.Signals(s).name for s in received) or "none"
    logger.info("P/D proxy stopped (signal: %s)", names)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
