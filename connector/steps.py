"""Which requests a scheduler step computes prompt tokens of (read from vLLM's ``SchedulerOutput``).

Shared by the KV saves (:mod:`connector.vllm_connector.saves`) and the hidden-state scheduler
(:mod:`connector.hidden.scheduler`). No vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def prompt_steps(scheduler_output, watched: dict, done) -> Iterator[tuple[str, Any, Any, int]]:
    """``(request id, request, block ids per cache group or None, end)`` of every request in
    ``watched`` (request id -> request), not in ``done``, of which this step computes prompt
    tokens: once it ran, prompt positions ``[0, end)`` are in the cache (``scheduler_output`` is
    vLLM's ``SchedulerOutput``, before the step advanced ``num_computed_tokens``)."""
    block_state = scheduler_output.kv_connector_block_state
    for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
        request = watched.get(req_id)
        if request is None or req_id in done:
            continue
        start, prompt_len = request.num_computed_tokens, request.num_prompt_tokens
        if start < prompt_len:
            groups = block_state.get_block_ids(req_id) if block_state is not None else None
            yield req_id, request, groups, min(start + scheduled, prompt_len)


def finishing_prompts(scheduler_output, watched: dict, done) -> Iterator[tuple[str, Any, Any]]:
    """``(request id, request, block ids per cache group or None)`` of the requests of
    :func:`prompt_steps` whose last prompt token this step computes."""
    for req_id, request, groups, end in prompt_steps(scheduler_output, watched, done):
        if end == request.num_prompt_tokens:
            yield req_id, request, groups
