"""What the scheduler side tells the workers each step (plain data: vLLM may serialise it).

The facade wraps a step's lists in its ``TritonKVMetadata`` (vLLM's ``KVConnectorMetadata``
type); these are the items. Each names its entry by transfer id and by ``prompt_digest``
(:func:`.handoff.prompt_digest` of the prompt): the producer binds the entry to it, and its KV
server serves or drops the entry only for a request presenting it. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SaveSpec:
    """Producer worker: pack prompt positions ``[0, num_tokens)`` of ``block_ids`` as
    ``transfer_id``, bound to ``prompt_digest``."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    prompt_digest: str = field(kw_only=True)
    debug_fault: str = field(default="", kw_only=True)  # tests only (integrity.FAULTS)


@dataclass
class LoadSpec:
    """Consumer worker: pull ``transfer_id`` (presenting the hand-off's ``prompt_digest``) and
    write its rows ``[start, start + count)``. ``wait_s`` > 0 (an overlapped hand-off): the
    producer's server may wait that long for the entry to be stored, and the load is async.
    ``fingerprint``: the hand-off's, which the entry's own must equal (None: not checked)."""

    req_id: str
    transfer_id: str
    host: str
    port: int
    block_ids: list[int]
    start: int
    count: int
    num_tokens: int
    producer_tp: int = 1  # the producer's TP size: which of its ranks hold this rank's heads
    corrupt: bool = False
    prompt_digest: str = field(kw_only=True)
    fingerprint: str | None = field(default=None, kw_only=True)
    wait_s: float = field(default=0.0, kw_only=True)
    debug_fault: str = field(default="", kw_only=True)  # tests only (integrity.FAULTS)


@dataclass
class ReleaseSpec:
    """Consumer worker: tell ``host:port + tp_rank`` to drop ``transfer_id`` (presenting the
    hand-off's ``prompt_digest``), which no request here will load."""

    transfer_id: str
    host: str
    port: int
    producer_tp: int = 1
    prompt_digest: str = field(kw_only=True)


def finishing_prompts(scheduler_output, watched: dict, done) -> Iterator[tuple[str, Any, Any]]:
    """``(request id, request, block ids per cache group or None)`` of every request in
    ``watched`` (request id -> request), not in ``done``, whose last prompt token this step
    computes (``scheduler_output`` is vLLM's ``SchedulerOutput``)."""
    block_state = scheduler_output.kv_connector_block_state
    for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
        request = watched.get(req_id)
        if request is None or req_id in done:
            continue
        start, prompt_len = request.num_computed_tokens, request.num_prompt_tokens
        if start < prompt_len <= start + scheduled:
            groups = block_state.get_block_ids(req_id) if block_state is not None else None
            yield req_id, request, groups
