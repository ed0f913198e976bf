"""Loads over real KV servers in this process (no vLLM): authenticated connections, and
producer and consumer ranks of unequal tensor-parallel sizes."""

from __future__ import annotations

import time

import pytest
import torch
from support.connector_sides import (
    DIGEST,
    HEAD_SIZE,
    NHD,
    SENTINEL,
    TRANSPORT,
    bits,
    caches,
    consumer,
    producer,
)
from support.transport import settled_stat

from connector.serve.launch import free_port_run
from connector.vllm_connector.config import ConnectorConfig
from connector.vllm_connector.metadata import DiscardSpec, LoadSpec, SaveSpec
from connector.vllm_connector.tp_mapping import rank_heads

SECRET = b"unit-test-shared-secret-01234567"


def test_loads_over_authenticated_connections_and_a_wrong_secret_recomputes():
    """A consumer holding the producer's secret loads; one holding another fails the load (its
    blocks are recomputed), and the producer's stats count the failed authentication."""
    src, dst = caches(NHD), caches(NHD, seed=None)
    port = free_port_run(1)
    cfg = ConnectorConfig(kv_format="tokens", transport=TRANSPORT)
    prod = producer(src, 4, cfg=cfg, engine_port=port, secret=SECRET)
    prod.serve()
    try:
        prod.wait_for_save(
            [
                SaveSpec("p", "t1", [5, 1, 3], 10, prompt_digest=DIGEST),
                SaveSpec("p2", "t2", [5, 1, 3], 10, prompt_digest=DIGEST),
            ]
        )
        for transfer_id, secret, errors in (("t1", b"x" * 32, {0, 4, 2}), ("t2", SECRET, set())):
            cons = consumer(
                caches(NHD, seed=None) if errors else dst,
                4,
                cfg=ConnectorConfig(transport=TRANSPORT),
                secret=secret,
            )
            cons.start_load_kv(
                [
                    LoadSpec(
                        "c",
                        transfer_id,
                        "127.0.0.1",
                        port,
                        [0, 4, 2],
                        0,
                        9,
                        10,
                        prompt_digest=DIGEST,
                    )
                ]
            )
            assert cons.get_block_ids_with_load_errors() == errors
            cons.shutdown()
        prod.sample_stats()
        stats = prod.stats.take()
        assert stats["auth_failures"] == 1 and stats["saves"] == 2
        assert not torch.equal(bits(dst), torch.full_like(bits(dst), SENTINEL))  # t2 landed
    finally:
        prod.shutdown()


def _tp_producers(global_caches, producer_tp, base, transfer="t1", save=True):
    """Producer ranks of TP ``producer_tp`` (each with its KV heads of ``global_caches``, NHD
    ``[2, B, N, H, D]``), serving on ``base + rank``, each having saved a 10-token prompt (unless
    not ``save``: :func:`_save`)."""
    heads_total = global_caches[0].shape[3]
    ranks = []
    for rank in range(producer_tp):
        h = rank_heads(heads_total, producer_tp, rank)
        tensors = [c[:, :, :, h.start : h.stop].clone() for c in global_caches]
        cfg = ConnectorConfig(kv_format="tokens", transport=TRANSPORT)
        conn = producer(tensors, 4, cfg=cfg, tp_rank=rank, engine_port=base)
        conn.serve()
        if save:
            _save(conn, transfer)
        ranks.append(conn)
    return ranks


def _save(producer_rank, transfer="t1"):
    producer_rank.wait_for_save([SaveSpec("p", transfer, [5, 1, 3], 10, prompt_digest=DIGEST)])


def _tp_consumer(global_caches, consumer_tp, rank):
    heads_total = global_caches[0].shape[3]
    h = rank_heads(heads_total, consumer_tp, rank)
    tensors = [
        torch.full_like(c[:, :, :, h.start : h.stop], 0)
        .view(torch.int16)
        .fill_(SENTINEL)
        .view(torch.bfloat16)
        for c in global_caches
    ]
    conn = consumer(
        tensors,
        4,
        cfg=ConnectorConfig(transport=TRANSPORT),
        tp_rank=rank,
        tp_size=consumer_tp,
        total_kv_heads=heads_total,
    )
    return conn, tensors, h


def _want(global_caches, heads, positions=range(9)):
    """What a consumer rank's caches must hold: positions of the prompt (producer blocks [5, 1,
    3] -> consumer blocks [0, 4, 2]) for its heads, the sentinel elsewhere."""
    out = []
    for c in global_caches:
        want = torch.full_like(c[:, :, :, heads.start : heads.stop].view(torch.int16), SENTINEL)
        for pos in positions:
            s_block, d_block, off = [5, 1, 3][pos // 4], [0, 4, 2][pos // 4], pos % 4
            want[:, d_block, off] = c[:, s_block, off, heads.start : heads.stop].view(torch.int16)
        out.append(want)
    return torch.stack(out)


@pytest.mark.parametrize("producer_tp,consumer_tp", [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_loads_between_unequal_tensor_parallel_sizes(producer_tp, consumer_tp):
    """Each consumer rank loads exactly its KV heads: from one producer rank (only the heads it
    needs, when that rank holds more) or gathered from several (one unpack each); every rank ends
    with its heads bit-exact and nothing else written, and the producers' entries are claimed
    once all their heads went out."""
    global_caches = caches((2, 6, 4, 4, HEAD_SIZE))  # 4 KV heads
    base = free_port_run(producer_tp)
    producers = _tp_producers(global_caches, producer_tp, base)
    try:
        for rank in range(consumer_tp):
            cons, tensors, heads = _tp_consumer(global_caches, consumer_tp, rank)
            cons.start_load_kv(
                [
                    LoadSpec(
                        "c",
                        "t1",
                        "127.0.0.1",
                        base,
                        [0, 4, 2],
                        0,
                        9,
                        10,
                        producer_tp,
                        prompt_digest=DIGEST,
                    )
                ]
            )
            assert cons.get_block_ids_with_load_errors() == set()
            assert torch.equal(bits(tensors), _want(global_caches, heads)), rank
            data = cons.stats.take()
            per_rank = 2 * 2 * 9 * len(heads) * HEAD_SIZE * 2  # layers, K/V, tokens, heads, D, bf16
            assert data["bytes_loaded"] == per_rank  # its own share, no more
            cons.shutdown()
        for p in producers:
            # every head delivered: claimed (by each producer's sender, after the last byte)
            assert settled_stat(p.buffer, "entries", 0) == 0
    finally:
        for p in producers:
            p.shutdown()


def test_a_dead_producer_rank_fails_the_whole_gather_and_writes_nothing():
    global_caches = caches((2, 6, 4, 2, HEAD_SIZE))
    base = free_port_run(2)
    producers = _tp_producers(global_caches, 2, base)
    producers[1].shutdown()  # rank 1 is gone: its half of the heads cannot come
    try:
        cons, tensors, _ = _tp_consumer(global_caches, 1, 0)
        cons.start_load_kv(
            [LoadSpec("c", "t1", "127.0.0.1", base, [0, 4, 2], 0, 9, 10, 2, prompt_digest=DIGEST)]
        )
        assert cons.get_block_ids_with_load_errors() == {0, 4, 2}
        data = cons.stats.take()
        assert data["loads"] == 0 and data["load_failures"] == 1
        assert torch.equal(bits(tensors), torch.full_like(bits(tensors), SENTINEL))
        cons.shutdown()
    finally:
        producers[0].shutdown()


def test_an_unused_transfer_is_released_on_every_producer_rank():
    """Consumer TP 1, producer TP 2: the one consumer rank asks both producer ranks to discard it."""
    global_caches = caches((2, 6, 4, 2, HEAD_SIZE))
    base = free_port_run(2)
    producers = _tp_producers(global_caches, 2, base)
    try:
        cons, _, _ = _tp_consumer(global_caches, 1, 0)
        cons.discard([DiscardSpec("t1", "127.0.0.1", base, 2, prompt_digest=DIGEST)])
        assert [p.buffer.stats()["discards"] for p in producers] == [1, 1]
        cons.shutdown()
    finally:
        for p in producers:
            p.shutdown()


@pytest.mark.parametrize("producer_tp,consumer_tp", [(2, 1), (1, 2)])
def test_overlapped_loads_between_unequal_tp_sizes(producer_tp, consumer_tp):
    """Overlapped loads (``wait_s``) started before any producer rank stored its entry: every
    consumer rank's loads (gathered from two ranks, or a part of one rank's heads) wait, then
    load their heads bit-exact once the saves came, and every entry is claimed."""
    global_caches = caches((2, 6, 4, 4, HEAD_SIZE))
    base = free_port_run(producer_tp)
    producers = _tp_producers(global_caches, producer_tp, base, save=False)
    consumers = [_tp_consumer(global_caches, consumer_tp, r) for r in range(consumer_tp)]
    try:
        for cons, _, _ in consumers:
            spec = LoadSpec(
                "c", "t1", "127.0.0.1", base, [0, 4, 2], 0, 9, 10, producer_tp,
                prompt_digest=DIGEST, wait_s=20,
            )  # fmt: skip
            cons.start_load_kv([spec])
            assert cons.get_finished() is None
        for p in producers:
            _save(p)
        for cons, tensors, heads in consumers:
            finished, end = None, time.monotonic() + 30
            while finished is None and time.monotonic() < end:
                finished = cons.get_finished()
                time.sleep(0.01)
            assert finished == {"c"}
            assert cons.get_block_ids_with_load_errors() == set()
            assert torch.equal(bits(tensors), _want(global_caches, heads))
        for p in producers:
            assert settled_stat(p.buffer, "entries", 0) == 0
    finally:
        for cons, _, _ in consumers:
            cons.shutdown()
        for p in producers:
            p.shutdown()
