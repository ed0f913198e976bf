"""A minimal P/D router, driving a producer and a consumer the way vLLM's example proxies and
llm-d's routing sidecar (NIXL "read" mode) do; written here from that flow's description.

The prefill leg is the client's body with ``kv_transfer_params`` = :data:`PREFILL_PARAMS`,
``stream: false``, ``max_tokens: 1`` (and ``max_completion_tokens: 1`` where the body has it),
without ``stream_options``, ``min_tokens`` and ``min_completion_tokens``; the decode leg is the
client's body as it came, plus the producer's ``kv_transfer_params`` passed on unchanged. Both
legs carry one ``X-Request-Id``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
TIMEOUT_S = 300.0


@dataclass
class Routed:
    """What the client got: the decode leg's HTTP status, its text (the streamed deltas joined,
    or the whole answer), its JSON body when not streamed, and the producer's params."""

    status: int
    text: str
    body: dict | None
    handed_off: dict | None


def prefill_body(body: dict) -> dict:
    """The prefill leg's body for the client's ``body``."""
    out = {k: v for k, v in body.items() if k not in _DROPPED}
    out.update(kv_transfer_params=dict(PREFILL_PARAMS), stream=False, max_tokens=1)
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def route(prefill_url: str, decode_url: str, path: str, body: dict, request_id: str) -> Routed:
    """Route one client request (``path``: ``/v1/completions`` or ``/v1/chat/completions``)."""
    headers = {"X-Request-Id": request_id}
    with httpx.Client(timeout=TIMEOUT_S) as client:
        prefill = client.post(prefill_url + path, json=prefill_body(body), headers=headers)
        prefill.raise_for_status()
        handed_off = prefill.json().get("kv_transfer_params")
        decode = {**body, "kv_transfer_params": handed_off}
        if not body.get("stream"):
            reply = client.post(decode_url + path, json=decode, headers=headers)
            data = reply.json()
            return Routed(
                reply.status_code, _answer(data) if reply.is_success else "", data, handed_off
            )
        with client.stream("POST", decode_url + path, json=decode, headers=headers) as reply:
            if not reply.is_success:
                reply.read()
                return Routed(reply.status_code, "", reply.json(), handed_off)
            text = "".join(_deltas(reply.iter_lines()))
            return Routed(reply.status_code, text, None, handed_off)


def _answer(data: dict) -> str:
    choice = data["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _deltas(lines):
    """The text of each server-sent event until ``[DONE]``; an error event raises."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if "error" in event:
            raise RuntimeError(f"error event in the decode stream: {event['error']}")
        for choice in event.get("choices", []):
            if "delta" in choice:  # chat
                yield choice["delta"].get("content") or ""
            else:
                yield choice.get("text") or ""
