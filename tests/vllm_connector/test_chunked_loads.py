"""The overlapped flow's chunks, from the producer's plan (:mod:`~connector.vllm_connector.saves`)
through its worker's saves to a consumer's loads (no vLLM): bit-exact for any prefill schedule,
local hit and wire format; each chunk loaded as soon as it is stored; a chunk whose meta lies,
a discard or an abort while chunks are still to come."""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.connector_sides import (
    DIGEST,
    NHD,
    SENTINEL,
    ServedProducer,
    bits,
    caches,
    consumer,
    fake_client,
    poll_loads,
    producer,
)
from support.kvstore import deliver
from support.vllm_fixtures import captured_log

from connector.kvstore import KVBuffer, KVServer, chunk_key
from connector.serve.launch import free_port_run
from connector.vllm_connector.config import ConnectorConfig
from connector.vllm_connector.handoff import prompt_digest
from connector.vllm_connector.metadata import CHUNK_FIELDS, Chunk, LoadSpec, SaveSpec
from connector.vllm_connector.saves import SavePlan

pytestmark = pytest.mark.timeout(120)

BLOCK_SIZE, NUM_BLOCKS = 4, 6  # NHD: [2, 6 blocks, 4 tokens, 2 heads, 8]
TID = "a" * 32
PROMPT = list(range(30))


def _chunk_saves(num_tokens: int, schedule: list[int], src_blocks: list[int]) -> list[SaveSpec]:
    """The saves a producer's plan makes for a ``num_tokens`` prompt whose proxy chose ``TID``,
    prefilled ``schedule`` tokens a step (then the rest), in blocks ``src_blocks``; bound to
    :data:`DIGEST` as the other worker tests' entries are."""
    plan = SavePlan(BLOCK_SIZE)
    request = SimpleNamespace(
        request_id="p",
        kv_transfer_params={"do_remote_decode": True, "transfer_id": TID},
        prompt_token_ids=PROMPT[:num_tokens],
        num_prompt_tokens=num_tokens,
        num_computed_tokens=0,
    )
    plan.watch(request)
    blocks = SimpleNamespace(get_block_ids=lambda _r: (src_blocks,))
    saves = []
    for scheduled in [*schedule, num_tokens]:
        left = num_tokens - request.num_computed_tokens
        if left <= 0:
            break
        step = SimpleNamespace(
            num_scheduled_tokens={"p": min(scheduled, left)}, kv_connector_block_state=blocks
        )
        saves += plan.step(step)[0]
        request.num_computed_tokens += min(scheduled, left)
    assert saves[-1].chunk.final and saves[0].prompt_digest == prompt_digest(PROMPT[:num_tokens])
    for s in saves:
        s.prompt_digest = DIGEST
    return saves


def _load(req_id: str, port: int, dst_blocks, start: int, num_tokens: int, wait_s=0.0):
    return LoadSpec(
        req_id,
        TID,
        "127.0.0.1",
        port,
        dst_blocks,
        start,
        num_tokens - 1 - start,
        num_tokens,
        prompt_digest=DIGEST,
        fingerprint="fp",
        wait_s=wait_s,
        chunked=True,
    )


def _slot(blocks, p: int) -> int:
    return blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE


def _expected(src, src_blocks, dst_blocks, start, num_tokens, kv_format):
    """The consumer's caches after a load: positions ``[start, num_tokens - 1)`` of the source
    (whole pages: every slot of the blocks from the one holding ``start``), the sentinel
    everywhere else; as int16 bits ``[layer, K/V, slot, H, D]``."""
    want = bits(src).flatten(2, 3)
    out = torch.full_like(want, SENTINEL)
    if kv_format == "pages":
        first, stop = start // BLOCK_SIZE * BLOCK_SIZE, len(dst_blocks) * BLOCK_SIZE
    else:
        first, stop = start, num_tokens - 1
    for p in range(first, stop):
        out[:, :, _slot(dst_blocks, p)] = want[:, :, _slot(src_blocks, p)]
    return out


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(2, NUM_BLOCKS * BLOCK_SIZE - 4),
    schedule=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    hit_blocks=st.integers(0, 5),
    kv_format=st.sampled_from(["tokens", "pages"]),
    order=st.permutations(range(NUM_BLOCKS)),
    data=st.data(),
)
def test_the_chunks_of_any_prefill_schedule_load_bit_exact(
    num_tokens, schedule, hit_blocks, kv_format, order, data
):
    """Any schedule, any block-aligned local hit (chunks inside it are loaded and not written),
    both wire formats: the consumer's caches hold exactly the prompt's positions it loads, every
    other slot the sentinel, and every chunk was claimed."""
    needed = -(-num_tokens // BLOCK_SIZE)
    start = min(hit_blocks * BLOCK_SIZE, (num_tokens - 2) // BLOCK_SIZE * BLOCK_SIZE)
    src_blocks = list(order[:needed])
    dst_blocks = data.draw(st.permutations(range(NUM_BLOCKS)))[:needed]
    src = caches(NHD, seed=3)
    prod = producer(src, BLOCK_SIZE, kv_format=kv_format)
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    saves = _chunk_saves(num_tokens, schedule, src_blocks)
    prod.wait_for_save(saves)
    assert sorted(buffer._table.entries) == sorted(chunk_key(TID, i) for i in range(len(saves)))
    dst = caches(NHD, seed=None)
    conn = consumer(dst, BLOCK_SIZE, connect=lambda h, p: fake_client(partial(deliver, buffer)))
    conn.start_load_kv([_load("c", 1, dst_blocks, start, num_tokens)])
    assert conn.get_block_ids_with_load_errors() == set()
    conn.shutdown()
    assert torch.equal(
        bits(dst).flatten(2, 3),
        _expected(src, src_blocks, dst_blocks, start, num_tokens, kv_format),
    )
    assert len(buffer) == 0 and buffer.stats()["claimed"] == len(saves)


def _lying(meta: dict, how: str) -> dict:
    index, start, stop, final = (meta[key] for key in CHUNK_FIELDS)
    said = {
        "index": [index + 1, start, stop, final],
        "gap": [index, start + 4, stop, final],
        "past_the_prompt": [index, start, 99, True],
        "final_before_the_end": [index, start, stop, True],
        "not_final_at_the_end": [index, start, stop, False],  # of the last chunk
        "bool_index": [True, start, stop, final],  # index 1, as a bool
        "empty": [index, start, start, final],
        "a_string": [index, str(start), stop, final],
        "missing": [index, start, None, final],
    }[how]
    return {**meta, **dict(zip(CHUNK_FIELDS, said, strict=True))}


@pytest.mark.parametrize(
    "how",
    ["index", "gap", "past_the_prompt", "final_before_the_end", "not_final_at_the_end",
     "bool_index", "empty", "a_string", "missing"],
)  # fmt: skip
def test_a_chunk_whose_meta_lies_fails_the_load_and_writes_nothing(how):
    """A chunk's meta (the second's; the last's for its end) says another index, a gap,
    positions past the prompt, an end before the end or none at the end, a bool for an int, no
    positions, a string, or nothing: the load fails naming the chunk, its blocks are recomputed,
    and nothing was written (not even the good chunks before it)."""
    src, dst = caches(NHD, seed=5), caches(NHD, seed=None)
    prod = producer(src, BLOCK_SIZE, kv_format="tokens")
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    prod.wait_for_save(_chunk_saves(10, [4, 4], [0, 1, 2]))
    index = 2 if how == "not_final_at_the_end" else 1
    key = chunk_key(TID, index)
    tensors, meta = deliver(buffer, key, digest=DIGEST)
    buffer.put(key, tensors, _lying(meta, how), digest=DIGEST)
    conn = consumer(dst, BLOCK_SIZE, connect=lambda h, p: fake_client(partial(deliver, buffer)))
    with captured_log("vllm.tritonkv.connector") as logs:
        conn.start_load_kv([_load("c", 1, [3, 4, 5], 0, 10)])
        assert conn.get_block_ids_with_load_errors() == {3, 4, 5}
    conn.shutdown()
    assert any(f"chunk {index} says" in r.getMessage() for r in logs), [
        r.getMessage() for r in logs
    ]
    assert bits(dst).eq(SENTINEL).all()


@pytest.fixture
def served():
    s = ServedProducer(BLOCK_SIZE, seed=11)
    yield s
    s.close()


def _consumer(dst, **cfg):
    return consumer(dst, BLOCK_SIZE, cfg=ConnectorConfig(transport="socket", **cfg))


def _until(what: str, done, wait_s: float = 10.0) -> None:
    end = time.monotonic() + wait_s
    while not done():
        assert time.monotonic() < end, f"{what} did not happen within {wait_s} s"
        time.sleep(0.01)


def test_each_chunk_is_loaded_as_soon_as_it_is_stored(served):
    """The transfer overlaps the prefill: while the producer has stored only its first chunks,
    the consumer has already loaded them (claimed) and waits for the next; the load completes
    with the last, bit-exact."""
    saves = _chunk_saves(14, [4, 4, 4], [5, 0, 3, 1])
    assert [s.chunk for s in saves] == [
        Chunk(0, 0, 4, False),
        Chunk(1, 4, 8, False),
        Chunk(2, 8, 12, False),
        Chunk(3, 12, 14, True),
    ]
    dst = caches(NHD, seed=None)
    conn = _consumer(dst)
    try:
        conn.start_load_kv([_load("c", served.server.port, [2, 4, 0, 1], 0, 14, wait_s=20)])
        for n, spec in enumerate(saves[:-1], start=1):
            served.worker.wait_for_save([spec])
            _until(f"chunk {n - 1}'s load", lambda n=n: served.buffer.stats()["claimed"] == n)
            assert poll_loads(conn, {"c"}, wait_s=0.05) == (set(), set())  # waiting for the next
        served.worker.wait_for_save(saves[-1:])
        assert poll_loads(conn, {"c"}) == ({"c"}, set())
    finally:
        conn.shutdown()
    want = _expected(served.src, [5, 0, 3, 1], [2, 4, 0, 1], 0, 14, "tokens")
    assert torch.equal(bits(dst).flatten(2, 3), want)
    assert len(served.buffer) == 0


def test_a_release_while_chunks_are_to_come_drops_them_and_refuses_the_rest(served):
    """The decode request ends after the first chunk was stored (not yet loaded by anyone): the
    consumer's discard removes it and seals the transfer, so the chunks the prefill stores later
    are refused and the producer's buffer stays empty."""
    saves = _chunk_saves(10, [4, 4], [0, 1, 2])
    served.worker.wait_for_save(saves[:1])
    conn = _consumer(caches(NHD, seed=None))
    try:
        unused = SimpleNamespace(
            transfer_id=TID, host="127.0.0.1", port=served.server.port, producer_tp=1,
            prompt_digest=DIGEST,
        )  # fmt: skip
        conn.discard([unused])
    finally:
        conn.shutdown()
    assert len(served.buffer) == 0
    with captured_log("vllm.tritonkv.connector", logging.INFO) as logs:
        served.worker.wait_for_save(saves[1:])
    assert len(served.buffer) == 0 and served.buffer.stats()["sealed_puts"] == 2
    assert sum("it was discarded or aborted" in r.getMessage() for r in logs) == 2


def test_a_prefill_aborted_between_its_chunks_ends_the_waiting_load_at_once(served):
    """The producer's request is aborted after its first chunk: the worker discards the transfer
    (sealed) in the next step, and the consumer's load of the next chunk ends at once with a
    "discarded" miss instead of waiting out its 30 s; the blocks are recomputed, nothing is
    written, the buffer is empty."""
    saves = _chunk_saves(10, [4, 4], [0, 1, 2])
    dst = caches(NHD, seed=None)
    conn = _consumer(dst)
    try:
        with captured_log("vllm.tritonkv.connector") as logs:
            conn.start_load_kv([_load("c", served.server.port, [3, 4, 5], 0, 10, wait_s=30)])
            served.worker.wait_for_save(saves[:1])
            _until("chunk 0's load", lambda: served.buffer.stats()["claimed"] == 1)
            t0 = time.monotonic()
            served.worker.wait_for_save([], discards=[TID])
            assert poll_loads(conn, {"c"}, wait_s=15) == ({"c"}, {3, 4, 5})
            assert time.monotonic() - t0 < 15
        assert any("discarded" in r.getMessage() for r in logs), [r.getMessage() for r in logs]
        served.worker.wait_for_save(saves[1:])  # the steps already under way when it was aborted
    finally:
        conn.shutdown()
    assert bits(dst).eq(SENTINEL).all()
    assert len(served.buffer) == 0 and served.buffer.stats()["sealed_puts"] == 2


def test_an_idle_step_waits_a_little_for_a_fetch_and_returns_as_soon_as_one_completes(served):
    """A step that computes nothing (vLLM's empty steps while requests wait for remote KV): with
    no load done, ``get_finished`` waits up to its ``idle_wait_s`` instead of returning at once,
    and returns the moment the load completes; a busy step (0) never waits."""
    saves = _chunk_saves(10, [10], [0, 1, 2])
    conn = _consumer(caches(NHD, seed=None))
    try:
        conn.start_load_kv([_load("c", served.server.port, [3, 4, 5], 0, 10, wait_s=30)])
        t0 = time.monotonic()
        assert conn.get_finished(idle_wait_s=0.3) is None
        assert time.monotonic() - t0 >= 0.29, "an idle step did not wait for the load"
        threading.Timer(0.5, served.worker.wait_for_save, [saves]).start()
        t0 = time.monotonic()
        assert conn.get_finished(0.0) is None
        assert conn.get_finished(idle_wait_s=30) == {"c"}
        assert time.monotonic() - t0 < 25, "it waited past the load's completion"
    finally:
        conn.shutdown()
    assert conn.get_finished(idle_wait_s=30) is None  # nothing in flight: nothing to wait for


def test_a_chunk_that_fails_to_save_ends_the_waiting_load_and_the_rest_are_refused(
    served, monkeypatch
):
    """The pack of the second chunk fails on the producer (any failure of one save): the
    transfer's stored chunks are discarded and the rest refused, so the consumer waiting for that
    chunk stops at once (recomputes) instead of waiting out its 30 s, and nothing is left."""
    from connector.vllm_connector import producer as producer_mod

    saves = _chunk_saves(10, [4, 4], [0, 1, 2])
    conn = _consumer(caches(NHD, seed=None))
    try:
        conn.start_load_kv([_load("c", served.server.port, [3, 4, 5], 0, 10, wait_s=30)])
        served.worker.wait_for_save(saves[:1])
        _until("chunk 0's load", lambda: served.buffer.stats()["claimed"] == 1)

        def failing(*args, **kwargs):
            raise RuntimeError("injected: the pack failed")

        monkeypatch.setattr(producer_mod, "pack_kv", failing)
        t0 = time.monotonic()
        served.worker.wait_for_save(saves[1:2])
        assert poll_loads(conn, {"c"}, wait_s=15) == ({"c"}, {3, 4, 5})
        assert time.monotonic() - t0 < 15
        monkeypatch.undo()
        served.worker.wait_for_save(saves[2:])
    finally:
        conn.shutdown()
    stats = served.buffer.stats()
    assert len(served.buffer) == 0 and stats["sealed_puts"] == 1
    assert served.worker.stats.peek()["save_failures"] == 1


def test_a_refused_id_is_sealed_for_that_prompt_only(served):
    """A proxy reused a transfer id another prompt's chunks are stored under: the producer
    refuses it for the second prompt and seals it for that prompt's digest, so the second
    prompt's waiting decode stops at once; the first prompt's chunks stay and load."""
    other = "e7" * 16  # the second prompt's digest
    saves = _chunk_saves(10, [10], [0, 1, 2])
    served.worker.wait_for_save(saves)
    conn = _consumer(caches(NHD, seed=None))
    try:
        waiting = _load("late", served.server.port, [3, 4, 5], 0, 10, wait_s=30)
        waiting.prompt_digest = other
        conn.start_load_kv([waiting])
        assert poll_loads(conn, {"late"}, wait_s=0.2) == (set(), set())
        t0 = time.monotonic()
        served.worker.wait_for_save([], refusals=[(TID, other)])
        assert poll_loads(conn, {"late"}, wait_s=15) == ({"late"}, {3, 4, 5})
        assert time.monotonic() - t0 < 15
        assert len(served.buffer) == 1  # the first prompt's entry
        conn.start_load_kv([_load("first", served.server.port, [3, 4, 5], 0, 10, wait_s=5)])
        assert poll_loads(conn, {"first"}) == ({"first"}, set())
    finally:
        conn.shutdown()
    assert len(served.buffer) == 0


def test_a_chunk_holding_more_rows_than_it_says_is_refused_before_the_next_is_loaded():
    """The second chunk's tensor holds more rows than its positions: the load fails at that
    chunk (nothing written), and the third chunk is never asked for (still in the buffer)."""
    src, dst = caches(NHD, seed=5), caches(NHD, seed=None)
    prod = producer(src, BLOCK_SIZE, kv_format="tokens")
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    prod.wait_for_save(_chunk_saves(10, [4, 4], [0, 1, 2]))
    key = chunk_key(TID, 1)
    tensors, meta = deliver(buffer, key, digest=DIGEST)
    buffer.put(key, {"kv": torch.cat([tensors["kv"]] * 2, dim=2)}, meta, digest=DIGEST)
    conn = consumer(dst, BLOCK_SIZE, connect=lambda h, p: fake_client(partial(deliver, buffer)))
    with captured_log("vllm.tritonkv.connector") as logs:
        conn.start_load_kv([_load("c", 1, [3, 4, 5], 0, 10)])
        assert conn.get_block_ids_with_load_errors() == {3, 4, 5}
    conn.shutdown()
    assert any("entry holds" in r.getMessage() for r in logs), [r.getMessage() for r in logs]
    assert bits(dst).eq(SENTINEL).all()
    assert list(buffer._table.entries) == [chunk_key(TID, 2)]


def test_a_consumer_of_another_tp_size_gathers_each_producer_ranks_chunks():
    """TP 2 → 1: the consumer's rank loads the chunks of both producer ranks (one KV head each),
    each as it is stored, and writes each rank's head of each chunk, bit-exact."""
    base = free_port_run(2)
    ranks = []
    for rank in range(2):
        src = caches((2, NUM_BLOCKS, BLOCK_SIZE, 1, 8), seed=20 + rank)
        worker = producer(src, BLOCK_SIZE, kv_format="tokens", tp_rank=rank)
        buffer = KVBuffer(1 << 24)
        worker.attach_buffer(buffer)
        ranks.append((src, worker, buffer, KVServer(buffer, "127.0.0.1", base + rank)))
    dst = caches(NHD, seed=None)  # 2 KV heads
    conn = consumer(dst, BLOCK_SIZE, cfg=ConnectorConfig(transport="socket"), total_kv_heads=2)
    saves = _chunk_saves(14, [4, 4, 4], [5, 0, 3, 1])
    spec = _load("c", base, [2, 4, 0, 1], 0, 14, wait_s=20)
    spec.producer_tp = 2
    try:
        conn.start_load_kv([spec])
        for spec_ in saves:
            for _, worker, _, _ in ranks:
                worker.wait_for_save([spec_])
        assert poll_loads(conn, {"c"}) == ({"c"}, set())
    finally:
        conn.shutdown()
        for _, _, buffer, server in ranks:
            server.close()
            buffer.close()
    src = [torch.cat([ranks[0][0][i], ranks[1][0][i]], dim=3) for i in range(2)]  # both heads
    want = _expected(src, [5, 0, 3, 1], [2, 4, 0, 1], 0, 14, "tokens")
    assert torch.equal(bits(dst).flatten(2, 3), want)
    assert all(len(buffer) == 0 for _, _, buffer, _ in ranks)
