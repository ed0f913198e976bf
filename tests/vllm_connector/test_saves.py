"""The producer's plan of saves (:mod:`connector.vllm_connector.saves`) over made-up steps: the
chunks of a prompt whose proxy chose its transfer id, for any prefill schedule, and what is
discarded when such a prompt ends early."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.vllm_connector.handoff import prompt_digest
from connector.vllm_connector.metadata import Chunk
from connector.vllm_connector.saves import SavePlan

BLOCK_SIZE = 4
CHOSEN = "c" * 32


def _request(num_tokens: int, transfer_id: str | None = CHOSEN, req_id: str = "r"):
    params = {"do_remote_decode": True}
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
    return SimpleNamespace(
        request_id=req_id,
        kv_transfer_params=params,
        prompt_token_ids=list(range(7, 7 + num_tokens)),
        num_prompt_tokens=num_tokens,
        num_computed_tokens=0,
    )


def _step(plan: SavePlan, request, scheduled: int):
    """One step computing ``scheduled`` tokens of ``request`` (its blocks 100, 101, ...); then
    advances it as vLLM does after the step. Returns the plan's (saves, discards)."""
    blocks = SimpleNamespace(get_block_ids=lambda _r: (list(range(100, 200)),))
    out = SimpleNamespace(
        num_scheduled_tokens={request.request_id: scheduled}, kv_connector_block_state=blocks
    )
    got = plan.step(out)
    request.num_computed_tokens += scheduled
    return got


def _prefill(plan: SavePlan, request, schedule: list[int]):
    """Run ``schedule`` (tokens per step) until the prompt is computed; the saves made."""
    saves = []
    for scheduled in schedule:
        left = request.num_prompt_tokens - request.num_computed_tokens
        if left <= 0:
            break
        saves += _step(plan, request, min(scheduled, left))[0]
    return saves


@settings(max_examples=200, deadline=None)
@given(
    num_tokens=st.integers(1, 60),
    schedule=st.lists(st.integers(1, 20), min_size=1, max_size=80),
)
def test_the_chunks_of_any_prefill_schedule_cover_the_prompt_in_order(num_tokens, schedule):
    """Whatever the schedule: chunks numbered 0.., each from the previous one's end, starts on
    block boundaries, one chunk at most per step, only the last one final and ending at the
    prompt's end, each with the blocks that hold its positions and the prompt's digest."""
    plan, request = SavePlan(BLOCK_SIZE), _request(num_tokens)
    plan.watch(request)
    schedule = [*schedule, num_tokens]  # the prompt ends
    saves = _prefill(plan, request, schedule)
    assert [s.chunk.index for s in saves] == list(range(len(saves)))
    assert [s.chunk.final for s in saves] == [False] * (len(saves) - 1) + [True]
    start = 0
    for s in saves:
        chunk = s.chunk
        assert chunk.start == start and chunk.start % BLOCK_SIZE == 0 and chunk.stop > start
        assert chunk.final or chunk.stop % BLOCK_SIZE == 0
        assert s.block_ids == list(range(100, 100 + -(-chunk.stop // BLOCK_SIZE)))
        assert (s.transfer_id, s.num_tokens) == (CHOSEN, num_tokens)
        assert s.prompt_digest == prompt_digest(request.prompt_token_ids)
        start = chunk.stop
    assert start == num_tokens
    assert plan.finished("r", aborted=False) == CHOSEN
    assert plan.step(SimpleNamespace(num_scheduled_tokens={}, kv_connector_block_state=None)) == (
        [],
        [],
    )


def test_a_step_that_completes_no_block_saves_nothing_and_a_preempted_prompt_resumes():
    plan, request = SavePlan(BLOCK_SIZE), _request(10)
    plan.watch(request)
    assert _step(plan, request, 3)[0] == []  # [0, 3): no whole block
    [first] = _step(plan, request, 3)[0]  # [0, 6): block 0
    assert first.chunk == Chunk(0, 0, 4, False)
    request.num_computed_tokens = 0  # preempted: recomputed from the start
    assert _step(plan, request, 4)[0] == []  # [0, 4): published already
    [last] = _step(plan, request, 6)[0]
    assert last.chunk == Chunk(1, 4, 10, True)


def test_a_prompt_without_a_chosen_id_is_saved_whole_at_its_end_under_a_fresh_id():
    plan, request = SavePlan(BLOCK_SIZE), _request(10, transfer_id=None)
    plan.watch(request)
    assert _step(plan, request, 8)[0] == []
    [spec] = _step(plan, request, 2)[0]
    assert spec.chunk is None and spec.num_tokens == 10 and len(spec.transfer_id) == 32
    assert spec.transfer_id != CHOSEN and plan.finished("r", aborted=False) == spec.transfer_id


def test_a_prompt_aborted_or_ended_between_its_chunks_is_dropped_in_the_next_step():
    """Aborted mid-prefill: no hand-off, and the next step discards its transfer (the worker discards
    and seals every chunk of it). Ended unfinished without an abort: the same."""
    for aborted in (True, False):
        plan, request = SavePlan(BLOCK_SIZE), _request(10)
        plan.watch(request)
        assert len(_step(plan, request, 5)[0]) == 1
        assert plan.finished("r", aborted=aborted) is None
        other = _request(4, transfer_id=None, req_id="o")
        plan.watch(other)
        saves, discards = _step(plan, other, 4)
        assert discards == [CHOSEN] and [s.req_id for s in saves] == ["o"]
        assert _step(plan, other, 0)[1] == []  # said once


def test_a_chosen_id_already_issued_is_refused_and_nothing_of_that_prompt_is_saved():
    plan = SavePlan(BLOCK_SIZE)
    first, second = _request(8), _request(8, req_id="again")
    plan.watch(first)
    assert len(_prefill(plan, first, [8])) == 1
    plan.watch(second)
    assert _prefill(plan, second, [4, 4]) == []
    assert plan.finished("again", aborted=False) is None
    # the worker seals the id for that prompt: its decode side, waiting for it, stops at once
    assert plan.take_refusals() == [(CHOSEN, prompt_digest(second.prompt_token_ids))]
    assert plan.take_refusals() == []
