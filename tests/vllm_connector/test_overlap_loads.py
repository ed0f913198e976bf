"""A consumer rank's overlapped loads (``LoadSpec.wait_s`` > 0: the decode request arrived while
the prefill still runs) against a real producer's KV server on loopback, and the clients they
lease (no vLLM): always async, waiting on the server for the entry, each on a connection of its
own, ended at once by the producer's death or by the end of their request."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from support.connector_sides import (
    DIGEST,
    NHD,
    SENTINEL,
    ServedProducer,
    bits,
    caches,
    consumer,
    poll_loads,
)
from support.vllm_fixtures import captured_log

from connector.kvstore import ClientBusyError
from connector.vllm_connector.config import ConnectorConfig
from connector.vllm_connector.metadata import LoadSpec, SaveSpec
from connector.vllm_connector.producer_clients import ProducerClients

pytestmark = pytest.mark.timeout(60)

BLOCK_SIZE, NUM_TOKENS = 4, 10  # a 10-token prompt in blocks [1, 3, 5] on both sides
BLOCKS = [1, 3, 5]


class Producer(ServedProducer):
    def __init__(self):
        super().__init__(BLOCK_SIZE)

    def save(self, transfer_id: str) -> None:
        self.worker.wait_for_save(
            [SaveSpec("p", transfer_id, BLOCKS, NUM_TOKENS, prompt_digest=DIGEST)]
        )


@pytest.fixture
def prod():
    p = Producer()
    yield p
    p.close()


def _spec(
    req_id: str, transfer_id: str, port: int, wait_s: float, fingerprint="fp", blocks=BLOCKS
) -> LoadSpec:
    return LoadSpec(
        req_id,
        transfer_id,
        "127.0.0.1",
        port,
        blocks,
        0,
        NUM_TOKENS - 1,
        NUM_TOKENS,
        prompt_digest=DIGEST,
        fingerprint=fingerprint,
        wait_s=wait_s,
    )


def _consumer(dst, **cfg):
    # sync loads by default: an overlapped one is async all the same
    return consumer(dst, BLOCK_SIZE, cfg=ConnectorConfig(transport="socket", **cfg))


def _slots(blocks):
    return torch.tensor([b * BLOCK_SIZE + i for b in blocks for i in range(BLOCK_SIZE)])


def _loaded_rows_match(src, dst, *dst_blocks) -> bool:
    """Positions 0..NUM_TOKENS-2 of the prompt, in each of ``dst_blocks`` (default BLOCKS),
    equal the source's, every other slot kept the sentinel (compared as int16 bits)."""
    got, want = bits(dst).flatten(2, 3), bits(src).flatten(2, 3)  # [layer, K/V, slot, H, D]
    expected = torch.full_like(got, SENTINEL)
    rows = _slots(BLOCKS)[: NUM_TOKENS - 1]
    for blocks in dst_blocks or (BLOCKS,):
        expected[:, :, _slots(blocks)[: NUM_TOKENS - 1]] = want[:, :, rows]
    return torch.equal(got, expected)


def test_overlapped_loads_wait_for_their_entries_each_on_a_connection_of_its_own(prod):
    """Three loads wait for entries not yet stored; the last one's prefill finishes first and it
    loads while the others still wait (no wait holds its connection or its thread), then the
    next; all bit-exact, and the producer's buffer ends empty: each entry claimed by its load."""
    dst = caches(NHD, seed=None)
    conn = _consumer(dst)
    try:
        conn.start_load_kv([_spec("a", "a" * 32, prod.server.port, wait_s=20)])
        conn.start_load_kv([_spec("never", "0" * 32, prod.server.port, 20, blocks=[0, 2, 4])])
        conn.start_load_kv([_spec("b", "b" * 32, prod.server.port, 20, blocks=[0, 2, 4])])
        assert poll_loads(conn, {"a"}, wait_s=0.3) == (set(), set())  # waiting, not failed
        prod.save("b" * 32)
        assert poll_loads(conn, {"b"}, wait_s=10) == ({"b"}, set())  # while "a" still waits
        prod.save("a" * 32)
        assert poll_loads(conn, {"a"}) == ({"a"}, set())
        conn.clients.end({"never"})
        assert poll_loads(conn, {"never"}, ended={"never"}) == ({"never"}, {0, 2, 4})
    finally:
        conn.shutdown()
    assert _loaded_rows_match(prod.src, dst, BLOCKS, [0, 2, 4])
    stats = prod.buffer.stats()
    assert (stats["entries"], stats["claimed"]) == (0, 2)


def test_a_leased_client_that_loaded_is_kept_for_the_next_load(prod):
    """The connection of a load that loaded is given back and leased again: two waiting loads
    made two connections, the next load none."""
    conn = _consumer(caches(NHD, seed=None))
    try:
        conn.start_load_kv([_spec("x", "c" * 32, prod.server.port, wait_s=20)])
        conn.start_load_kv([_spec("y", "d" * 32, prod.server.port, 20, blocks=[0, 2, 4])])
        assert poll_loads(conn, {"x"}, wait_s=0.3) == (set(), set())
        for key in ("d" * 32, "c" * 32):
            prod.save(key)
        assert poll_loads(conn, {"x", "y"}) == ({"x", "y"}, set())
        conn.start_load_kv([_spec("z", "e" * 32, prod.server.port, wait_s=20)])
        prod.save("e" * 32)
        assert poll_loads(conn, {"z"}) == ({"z"}, set())
    finally:
        conn.shutdown()
    assert prod.server.stats()["connections"] == 2, "two leases, then one reused"


def test_a_prefill_that_never_stores_its_entry_is_recomputed_after_the_wait(prod):
    dst = caches(NHD, seed=None)
    conn = _consumer(dst, prefill_wait_s=0.2)
    try:
        with captured_log("vllm.tritonkv.connector") as logs:
            conn.start_load_kv([_spec("r", "f" * 32, prod.server.port, wait_s=0.2)])
            assert poll_loads(conn, {"r"}) == ({"r"}, set(BLOCKS))
        [failed] = [r.getMessage() for r in logs]
        assert "not put within wait_s=0.2 s" in failed and "3 blocks will be recomputed" in failed
    finally:
        conn.shutdown()
    assert bits(dst).eq(SENTINEL).all(), "a failed load wrote into the cache"


def test_a_producer_killed_while_a_load_waits_fails_the_load_at_once(prod):
    """The producer dies mid-prefill: the load's connection breaks and the load fails (its
    blocks recomputed) without waiting out its 30 s."""
    conn = _consumer(caches(NHD, seed=None))
    try:
        conn.start_load_kv([_spec("r", "1" * 32, prod.server.port, wait_s=30)])
        assert poll_loads(conn, {"r"}, wait_s=0.3) == (set(), set())
        prod.server.close()
        assert poll_loads(conn, {"r"}, wait_s=15) == ({"r"}, set(BLOCKS))
    finally:
        conn.shutdown()


def test_a_request_that_ends_while_its_load_waits_stops_waiting(prod):
    """vLLM reports the request finished (aborted): its waiting load is closed, the load fails
    at once and is reported (so vLLM frees its blocks); the closed client is not leased again
    and the next load from that producer works."""
    dst = caches(NHD, seed=None)
    conn = _consumer(dst)
    try:
        with captured_log("vllm.tritonkv.connector") as logs:
            conn.start_load_kv([_spec("gone", "2" * 32, prod.server.port, wait_s=30)])
            assert poll_loads(conn, {"gone"}, wait_s=0.3) == (set(), set())
            assert poll_loads(conn, {"gone"}, wait_s=15, ended={"gone"}) == ({"gone"}, set(BLOCKS))
        assert any("its request ended while the load waited" in r.getMessage() for r in logs)
        conn.start_load_kv([_spec("next", "3" * 32, prod.server.port, wait_s=20)])
        prod.save("3" * 32)
        assert poll_loads(conn, {"next"}) == ({"next"}, set())
    finally:
        conn.shutdown()
    assert _loaded_rows_match(prod.src, dst)


def test_an_entry_of_another_fingerprint_than_the_handoffs_is_refused(prod):
    """The overlapped hand-off's fingerprint comes from an earlier hand-off of that producer: the
    entry's own must say the same (a producer restarted with another model is recomputed)."""
    dst = caches(NHD, seed=None)
    conn = _consumer(dst)
    try:
        prod.save("4" * 32)
        with captured_log("vllm.tritonkv.connector") as logs:
            conn.start_load_kv([_spec("r", "4" * 32, prod.server.port, 5, fingerprint="other")])
            assert poll_loads(conn, {"r"}) == ({"r"}, set(BLOCKS))
        assert any("fingerprint 'fp' is not the hand-off's 'other'" in r.getMessage() for r in logs)
    finally:
        conn.shutdown()
    assert bits(dst).eq(SENTINEL).all()


def test_leases_are_bounded_per_producer_and_a_failed_one_is_never_reused():
    made, closed = [], []

    class Client:
        def __init__(self, addr):
            self.addr = addr
            made.append(self)

        def close(self):
            closed.append(self)

    clients = ProducerClients(lambda host, port: Client((host, port)), max_leased=2)
    with clients.lease("h", 1, 1.0) as a, clients.lease("h", 1, 1.0) as b:
        assert a is not b
        with (
            pytest.raises(ClientBusyError, match="all 2 leased clients busy"),
            clients.lease("h", 1, 0.05),
        ):
            pass
        with clients.lease("other", 1, 1.0) as c:  # bounded per producer rank
            assert c.addr == ("other", 1)
    with clients.lease("h", 1, 1.0) as again:
        assert again in (a, b)  # given back, reused
    with pytest.raises(RuntimeError), clients.lease("h", 1, 1.0) as failing:
        raise RuntimeError("its load failed")
    assert failing in closed
    waiter_got = []

    def wait_for_one():
        with clients.lease("h", 1, 5.0) as got:
            waiter_got.append(got)

    with clients.lease("h", 1, 1.0) as x, clients.lease("h", 1, 1.0):
        waiter = threading.Thread(target=wait_for_one)
        waiter.start()
        time.sleep(0.05)
        assert waiter_got == []  # both out: it waits
    waiter.join(5)
    assert waiter_got and waiter_got[0] in made and failing not in waiter_got
    assert x in made
    clients.close()
    assert set(made) - {failing} <= set(closed), "close() closes idle leased clients too"
