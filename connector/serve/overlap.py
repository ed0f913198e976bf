"""The proxy's overlapped flow (``--overlap``): what it knows of each prefill server, and the
two calls of an overlapped request.

In the overlapped flow the decode request leaves with the prefill request, so its hand-off is
written by the proxy: the prefill server's *site* (where its KV server listens, its TP size,
fingerprint and hand-off protocol), learnt from an earlier sequential hand-off of that server,
plus a transfer id the proxy mints and gives the producer too. :class:`Sites` keeps one site per
prefill URL: a server without one is served sequentially (its first request, or after it failed),
and one that saved under another id than the proxy's (a producer that cannot take a chosen id)
is never overlapped again. :class:`Overlap` makes an overlapped request's two calls at once: the
decode answer goes back to the router as soon as it came (a stream's first bytes); the prefill
answer is read on a task of its own and checked (:meth:`Sites.confirm`). A prefill that failed
before the decode answer came sends the decode request again without a hand-off (the decode
server would otherwise wait for the KV up to its ``prefill_wait_s``); one that failed later is
only logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from ..logs import get_logger, short_id
from .bodies import handoff_params
from .exchange import Exchange, Failure

logger = get_logger("proxy")

#: A decode answer: the response, headers read, and for a 2xx stream its first bytes (else None).
Answer = tuple[aiohttp.ClientResponse, bytes | None]

#: The keys of a hand-off that describe its producer, not its prompt (what a site holds).
SITE_KEYS = (
    "do_remote_prefill",
    "protocol",
    "remote_host",
    "remote_port",
    "fingerprint",
    "tp_size",
)
#: Copied too when the producer gives them (a site signature: a producer with a secret).
_OPTIONAL_KEYS = ("tritonkv_version", "site_signature")
#: What the consumer completes from its own prompt: ``connector.vllm_connector.handoff.OVERLAP``
#: (the proxy imports no tritonkv; a test checks that both are one key).
OVERLAP = "overlap"


def site_of(kv: dict[str, Any] | None) -> dict[str, Any] | None:
    """The site of a producer's hand-off ``kv``: its :data:`SITE_KEYS` (and
    ``tritonkv_version``), or None when it is no tritonkv hand-off that names them all."""
    if (
        not isinstance(kv, dict)
        or kv.get("do_remote_prefill") is not True
        or not isinstance(kv.get("protocol"), str)
        or not kv["protocol"].startswith("tritonkv-")
        or any(key not in kv for key in SITE_KEYS)
    ):
        return None
    return {key: kv[key] for key in (*SITE_KEYS, *_OPTIONAL_KEYS) if key in kv}


def overlap_params(site: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The decode request's ``kv_transfer_params`` of an overlapped request: ``site``, the
    proxy's ``transfer_id`` and ``"overlap": true`` (the consumer adds ``num_tokens`` and
    ``prompt_digest`` of its own prompt)."""
    return {**site, "transfer_id": transfer_id, OVERLAP: True}


class Sites:
    """The site of each prefill server, as its last hand-off said it (see the module docstring)."""

    def __init__(self) -> None:
        self._sites: dict[str, dict[str, Any]] = {}
        self._refused: set[str] = set()  # servers that do not save under the proxy's id

    def get(self, url: str) -> dict[str, Any] | None:
        """The site of ``url`` (None: serve it sequentially)."""
        return self._sites.get(url)

    def learn(self, url: str, kv: dict[str, Any] | None) -> None:
        """Remember the site of a hand-off ``kv`` that prefill server ``url`` gave."""
        site = site_of(kv)
        if site is None or url in self._refused:
            return
        if self._sites.get(url) != site:
            logger.info(
                "prefill %s: KV at %s:%s (tp_size %s); its next requests overlap prefill and "
                "decode",
                url,
                site["remote_host"],
                site["remote_port"],
                site["tp_size"],
            )
        self._sites[url] = site

    def forget(self, url: str) -> None:
        """``url`` failed (it may come back elsewhere): its next request goes sequential."""
        self._sites.pop(url, None)

    def confirm(self, url: str, kv: dict[str, Any] | None, transfer_id: str) -> str:
        """Check the answer of an overlapped prefill of ``url``, which was asked to save under
        ``transfer_id``; learn its site again. Returns what went wrong ("" if nothing): no
        hand-off, or one under another id (then ``url`` is never overlapped again)."""
        if kv is None:
            return "it returned no kv_transfer_params"
        if kv.get("transfer_id") != transfer_id:
            self._refused.add(url)
            self._sites.pop(url, None)
            return (
                "it saved the KV under another transfer id than the proxy's (a producer that "
                "does not take the proxy's id, or refused it); its requests go sequential from "
                "now on"
            )
        self.learn(url, kv)
        return ""


class Overlap:
    """The overlapped calls of a proxy, and the :class:`Sites` they go to.

    Args:
        prefill_call: ``await prefill_call(ex, body)`` makes ``ex``'s prefill call: ``(status,
            body, content type)``, or :class:`~.exchange.Failure` (logged, the site forgotten).
        answer_call: ``await answer_call(ex, body, stream)`` makes ``ex``'s decode call: the
            response, headers read, and for a 2xx stream its first bytes (else None); or
            :class:`~.exchange.Failure`.
    """

    def __init__(
        self,
        prefill_call: Callable[[Exchange, bytes], Awaitable[tuple[int, bytes, str | None]]],
        answer_call: Callable[[Exchange, bytes, bool], Awaitable[Answer]],
    ) -> None:
        self.sites = Sites()
        self._prefill_call, self._answer_call = prefill_call, answer_call
        self._prefills: set[asyncio.Task] = set()  # prefill calls still running

    async def dispatch(
        self, ex: Exchange, prefill: bytes, decode: bytes, alone: bytes, stream: bool
    ) -> Answer:
        """Starts ``ex``'s prefill call on a task of its own and its decode call (``decode``);
        returns the decode answer (see ``answer_call``).

        A prefill that fails (:meth:`_prefill`) before the decode answer came would leave the
        decode server waiting for a KV that will never come, up to its ``prefill_wait_s``: the
        decode call is closed instead (vLLM aborts the request, ending its wait) and ``alone``
        (the client's body with no hand-off) goes to the next decode server, which computes the
        prompt itself at once. A prefill failure after the answer came is only logged.

        The prefill call (``ex.prefill_task``) is cancelled (its connection closed, so vLLM aborts
        it) when the decode call fails, answers non-2xx or is cancelled (the client left); else it
        runs to its end.

        Raises:
            Failure: The decode server could not be reached or did not answer in time.
        """
        task = ex.prefill_task = asyncio.ensure_future(self._prefill(ex, prefill))
        self._prefills.add(task)
        task.add_done_callback(self._prefills.discard)
        answer = asyncio.ensure_future(self._answer_call(ex, decode, stream))
        out = None
        try:
            await asyncio.wait((answer, task), return_when=asyncio.FIRST_COMPLETED)
            if not answer.done() and not task.cancelled() and task.result():
                answer.cancel()
                (late,) = await asyncio.gather(answer, return_exceptions=True)
                if isinstance(late, tuple):  # it came as it was cancelled: nobody reads it
                    late[0].close()
                logger.warning(
                    "req %s: its overlapped prefill failed before the decode server answered; "
                    "the decode request is sent again without a hand-off (the prompt is "
                    "computed there)",
                    ex.req_id,
                )
                ex.transfer_id = None
                answer = asyncio.ensure_future(self._answer_call(ex, alone, stream))
            out = await answer
        finally:
            if not answer.done():  # cancelled: the client left
                answer.cancel()
            if out is None or not 200 <= out[0].status < 300:
                task.cancel()
        return out

    async def _prefill(self, ex: Exchange, body: bytes) -> str:
        """The prefill call of an overlapped request; what went wrong ("" if nothing), logged:
        the call failed, it answered non-2xx, or its hand-off is not under the proxy's id
        (:meth:`Sites.confirm`, which also learns the site again)."""
        url = ex.prefill_url
        try:
            status, raw, _ = await self._prefill_call(ex, body)
        except Failure as failure:
            return failure.summary  # logged by prefill_call
        problem = "" if 200 <= status < 300 else f"it answered {status}"
        if not problem:
            try:
                problem = self.sites.confirm(url, handoff_params(raw), ex.transfer_id)
            except ValueError:
                problem = "its answer is not a JSON object with an object or null hand-off"
        (logger.warning if problem else logger.debug)(
            "req %s overlapped prefill %s %.1f ms, transfer_id %s%s",
            ex.req_id,
            url,
            ex.prefill_ms,
            short_id(ex.transfer_id),
            f": {problem}" if problem else "",
        )
        return problem

    async def close(self) -> None:
        """Cancels the prefill calls still running and waits for them to end."""
        for task in list(self._prefills):
            task.cancel()
        await asyncio.gather(*self._prefills, return_exceptions=True)
