"""Fake OpenAI-ish vLLM servers for the P/D proxy tests (no vLLM engine).

Every fake runs an aiohttp app on a loopback port; all of them share one event loop on a daemon
thread. A fake records each body it receives and answers canned JSON. A prefill fake returns fresh
``kv_transfer_params`` per request; a decode fake echoes the ``kv_transfer_params`` it received and
can stream SSE chunks. Behaviour is switched per test through plain attributes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web


class LoopThread:
    """An asyncio event loop running on a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout: float = 10.0) -> Any:
        """Runs a coroutine on the loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Stops the loop and joins the thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass
class Received:
    """One request a fake received."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]  # lower-case names


class FakeServer:
    """A fake prefill or decode server.

    Attributes:
        name: Name put into responses (``served_by``).
        role: ``prefill`` or ``decode``.
        received: Requests received, in order.
        mode: ``ok``; ``error`` (answer ``error_status`` with an error body); ``hang`` (never answer);
            ``stall`` (stream: send the first chunk, then never send more); ``headers`` (stream:
            send the headers, then nothing until the peer leaves); ``no_kv`` (prefill answers
            ``kv_transfer_params: null``).
        error_status: Status used in ``error`` mode.
        healthy: Whether ``/health`` answers 200 (else 503).
        n_chunks: Number of content chunks in a stream.
        gate: When set, a stream waits for it after the first chunk, and a prefill answer
            before it is sent (up to 5 s).
        honor_ids: Whether a prefill fake saves under the ``transfer_id`` its request's
            ``kv_transfer_params`` name (as the connector does), else under a fresh one.
        await_kv: Whether a decode fake holds back its answer to a request whose hand-off says
            ``overlap`` (a stream: after its headers, as vLLM sends them at once) until the peer
            leaves: a consumer waiting for a KV that never comes.
        disconnects: Requests that saw the peer close the connection while hanging or waiting on
            the gate.
        issued: The ``kv_transfer_params`` a prefill fake returned, in order.
    """

    def __init__(self, lt: LoopThread, name: str, role: str) -> None:
        self.lt = lt
        self.name = name
        self.role = role
        self.received: list[Received] = []
        self.issued: list[dict[str, Any]] = []
        self._release: asyncio.Event | None = None
        self.reset()
        self._runner: web.AppRunner | None = None
        self.url = ""

    def reset(self) -> None:
        """Forgets received requests, releases hanging handlers, restores the default behaviour."""
        old = getattr(self, "_release", None)
        if old is not None:
            self.lt.loop.call_soon_threadsafe(old.set)
            self._release = asyncio.Event()
        self.received = []
        self.issued = []
        self.mode = "ok"
        self.error_status = 400
        self.healthy = True
        self.n_chunks = 4
        self.disconnects = 0
        self.gate: asyncio.Event | None = None
        self.honor_ids = True
        self.await_kv = False

    def make_gate(self) -> None:
        """Makes streams wait after their first chunk until :meth:`open_gate`."""
        self.gate = self.lt.run(_make_event())

    def open_gate(self) -> None:
        """Releases streams waiting on the gate."""
        gate = self.gate
        if gate is not None:
            self.lt.loop.call_soon_threadsafe(gate.set)

    def start(self) -> str:
        """Starts serving on a free loopback port.

        Returns:
            The base URL.
        """
        self.url = self.lt.run(self._start())
        return self.url

    def stop(self) -> None:
        """Releases hanging handlers and stops serving."""
        self.lt.run(self._stop())

    async def _start(self) -> str:
        self._release = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(self._runner, sock)
        await site.start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def _stop(self) -> None:
        if self._release is not None:
            self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _hang(self, request: web.Request | None = None) -> None:
        """Waits until released (at most 60 s) or, given ``request``, until its peer closes the
        connection (counted in ``disconnects``)."""
        assert self._release is not None
        end = asyncio.get_running_loop().time() + 60
        while not self._release.is_set() and asyncio.get_running_loop().time() < end:
            if request is not None and (
                request.transport is None or request.transport.is_closing()
            ):
                self.disconnects += 1
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._release.wait(), 0.01)

    async def _health(self, _request: web.Request) -> web.Response:
        if self.mode == "hang":
            await self._hang()
        return web.json_response({}, status=200 if self.healthy else 503)

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "fake-model", "object": "model"}], "by": self.name}
        )

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(
            Received(request.path, body, {k.lower(): v for k, v in request.headers.items()})
        )
        n = len(self.received)
        chat = request.path.endswith("/chat/completions")
        if self.mode == "hang":
            await self._hang(request)
            return web.json_response({})
        if self.mode == "error":
            err = {"error": {"message": f"{self.name} refuses", "type": "BadRequestError"}}
            return web.json_response(err, status=self.error_status)
        if self.role == "prefill":
            if self.gate is not None and not await self._wait_gate(request):
                self.disconnects += 1
                return web.json_response({})
            chosen = (body.get("kv_transfer_params") or {}).get("transfer_id")
            kv: dict[str, Any] | None = None
            if self.mode != "no_kv":
                kv = {
                    "do_remote_prefill": True,
                    "protocol": "tritonkv-3",
                    # 32 hex digits, as the connector's
                    "transfer_id": chosen if chosen and self.honor_ids else uuid.uuid4().hex,
                    "remote_host": "127.0.0.1",
                    "remote_port": 47000 + n,
                    "num_tokens": 5 + n,
                    "prompt_digest": f"{n:032x}",
                    "fingerprint": f"fp{n:04x}",
                    "tp_size": 1,
                    "remote_prefill_cached_tokens": 0,
                }
                self.issued.append(copy.deepcopy(kv))
            return web.json_response(_full(self.name, chat, "P", kv))
        if self.await_kv and (body.get("kv_transfer_params") or {}).get("overlap"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            try:
                if body.get("stream"):
                    await resp.prepare(request)
            except ConnectionResetError:  # the peer left before the headers went out
                self.disconnects += 1
                return resp
            await self._hang(request)
            return resp
        if body.get("stream"):
            return await self._stream(request, chat)
        return web.json_response(_full(self.name, chat, "decoded", body.get("kv_transfer_params")))

    async def _stream(self, request: web.Request, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.mode == "headers":
            await self._hang(request)
            return resp
        for i in range(self.n_chunks):
            await resp.write(sse_chunk(self.name, chat, i))
            if i == 0 and self.mode == "stall":
                await self._hang()
                return resp
            if i == 0 and self.gate is not None and not await self._wait_gate(request):
                self.disconnects += 1
                return resp
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _wait_gate(self, request: web.Request) -> bool:
        """Waits up to 5 s for the gate; False as soon as the peer closed the connection."""
        assert self.gate is not None
        end = asyncio.get_running_loop().time() + 5
        while not self.gate.is_set():
            transport = request.transport
            if transport is None or transport.is_closing():
                return False
            if asyncio.get_running_loop().time() > end:
                raise TimeoutError("stream gate never opened")
            await asyncio.sleep(0.01)
        return True


async def _make_event() -> asyncio.Event:
    return asyncio.Event()


def _full(name: str, chat: bool, text: str, kv: dict[str, Any] | None) -> dict[str, Any]:
    """A non-streaming completions or chat completions response."""
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
        }
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length"}
    return {
        "id": f"{name}-resp",
        "object": "chat.completion" if chat else "text_completion",
        "model": "fake-model",
        "choices": [choice],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        "kv_transfer_params": kv,
        "served_by": name,
    }


def sse_chunk(name: str, chat: bool, i: int) -> bytes:
    """The ``i``-th SSE event of a fake stream."""
    if chat:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": f"tok{i}"}}
    else:
        choice = {"index": 0, "text": f"tok{i}"}
    payload = {"id": f"{name}-stream", "model": "fake-model", "choices": [choice], "seq": i}
    return f"data: {json.dumps(payload)}\n\n".encode()
