"""A consumer rank's loads and discards against fake and real producers (no vLLM): which thread
does what, back-off from a producer that timed out, discards off the worker's thread."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from support.connector_sides import DIGEST, NHD, caches, consumer, fake_client
from support.kvstore import deliver
from support.vllm_fixtures import captured_log

import connector.transport.threads as threads_mod
import connector.vllm_connector.consumer as consumer_mod
from connector.kvstore import ClientBusyError, KeyMissError, KVBuffer, KVClient, KVServer
from connector.serve.launch import free_port_run
from connector.transport import PipeClosedError, TransferTimeout
from connector.vllm_connector.config import ConnectorConfig
from connector.vllm_connector.metadata import DiscardSpec, LoadSpec
from tritonkv import layouts, pack_kv


@pytest.fixture
def transfer_cpu():
    """One CPU of this process for the transfer threads, for the test's duration."""
    before = threads_mod.transfer_cpus()
    cpu = max(os.sched_getaffinity(0))
    threads_mod.set_transfer_cpus([cpu])
    yield cpu
    threads_mod.set_transfer_cpus(before)


def test_async_load_receives_on_a_thread_unpacks_on_the_worker_thread(monkeypatch, transfer_cpu):
    """The load thread only loads, on the transfer CPUs when set; the unpack (torch copies: on
    CPU an OpenMP team on another thread slows every team in the process) runs in get_finished, on
    the worker's thread. A failed load still reports its request, with its blocks in the same
    step's load errors."""
    block_size, num_blocks = 4, 6
    src = torch.randint(-(2**15), 2**15, (2, num_blocks, block_size, 2, 8), dtype=torch.int16)
    dst = torch.full_like(src, 12345)  # sentinel: rows outside the load must keep it
    src_layers = [layouts.flash_attn(src)]
    prompt_slots = torch.tensor([8, 9, 10, 11, 20, 21])  # blocks 2 and 5 of a 6-token prompt
    packed, _ = pack_kv(src_layers, prompt_slots)

    threads = {"receive": set(), "unpack": set()}
    cpus = {"main": os.sched_getaffinity(0), "receive": set()}

    def get(transfer_id, **request):
        threads["receive"].add(threading.current_thread())
        cpus["receive"] |= os.sched_getaffinity(0)
        if transfer_id == "gone":
            raise ValueError("unknown transfer id")
        return {"kv": packed}, {"kv_format": "tokens"}

    real_unpack = consumer_mod.unpack_kv

    def unpack(*args, **kwargs):
        threads["unpack"].add(threading.current_thread())
        return real_unpack(*args, **kwargs)

    monkeypatch.setattr(consumer_mod, "unpack_kv", unpack)
    conn = consumer(
        [dst],
        block_size,
        cfg=ConnectorConfig(async_load=True),
        connect=lambda host, port: fake_client(get),
    )
    spec = dict(
        host="h", port=1, block_ids=[2, 5], start=0, count=5, num_tokens=6, prompt_digest=DIGEST
    )
    conn.start_load_kv(
        [LoadSpec("ok", "t1", **spec), LoadSpec("bad", "gone", **{**spec, "block_ids": [3, 4]})]
    )
    finished, errors, deadline = set(), set(), time.monotonic() + 10
    while finished != {"ok", "bad"} and time.monotonic() < deadline:
        finished |= conn.get_finished() or set()
        errors |= conn.get_block_ids_with_load_errors()
        time.sleep(0.01)
    conn.shutdown()
    assert finished == {"ok", "bad"}, f"loads reported finished: {finished}"
    assert errors == {3, 4}, f"blocks of the failed load: {errors}"
    assert threading.main_thread() not in threads["receive"]
    assert threads["unpack"] == {threading.main_thread()}
    assert cpus["receive"] == {transfer_cpu} and os.sched_getaffinity(0) == cpus["main"]
    by_slot_src, by_slot_dst = src.view(2, -1, 2, 8), dst.view(2, -1, 2, 8)  # [K/V, slot, H, D]
    want = torch.full_like(by_slot_dst, 12345)
    want[:, prompt_slots[:5]] = by_slot_src[:, prompt_slots[:5]]
    assert torch.equal(by_slot_dst, want), "loaded rows (and only those) must match the source"


def test_a_producer_that_timed_out_is_not_asked_again_for_a_while():
    """Sync loads stall the whole decode batch: after one load from a producer's port times out,
    the step's other loads from that port fail at once (and are recomputed) until
    connect_timeout_s has passed; other ports (another engine on the host) and hosts are still
    asked. The memory of such ports is bounded."""
    block_size = 4
    src = torch.randint(-(2**15), 2**15, (2, 6, block_size, 2, 8), dtype=torch.int16)
    packed, _ = pack_kv([layouts.flash_attn(src)], torch.arange(4))  # a 4-token prompt
    asked = []

    def client(host, port):
        def get(transfer_id, **request):
            asked.append((host, port))
            if host == "slow":
                raise TransferTimeout("deadline passed", peer=f"{host}:{port}", key=transfer_id)
            if host == "busy":  # this worker's own requests held the client: the producer is fine
                raise ClientBusyError("client busy", peer=f"{host}:{port}", key=transfer_id)
            return {"kv": packed}, {"kv_format": "tokens"}

        return fake_client(get)

    conn = consumer(
        [torch.zeros_like(src)],
        block_size,
        cfg=ConnectorConfig(connect_timeout_s=0.3),
        connect=client,
    )

    def load(*addrs):
        conn.start_load_kv(
            [
                LoadSpec(f"r{i}", "t", h, p, [i], 0, 3, 4, prompt_digest=DIGEST)
                for i, (h, p) in enumerate(addrs)
            ]
        )
        return conn.get_block_ids_with_load_errors()

    slow, other_port, fine, busy = ("slow", 1), ("slow", 9), ("fine", 2), ("busy", 3)
    assert load(slow, other_port, fine, slow, busy, busy) == {0, 1, 3, 4, 5}
    assert asked == [slow, other_port, fine, busy, busy], "a port that timed out was asked again"
    asked.clear()
    time.sleep(0.35)
    assert load(slow) == {0}
    assert asked == [slow], "the port was not asked again after connect_timeout_s"
    for port in range(2000):
        conn.backoff.timed_out(("slow", port), "x")
    assert len(conn.backoff._down) == conn.backoff.max_addrs


def test_releases_drop_unused_entries_on_the_producer_off_the_worker_thread():
    """Each rank asks ``port + rank`` to discard a discarded transfer, on a thread of its own; a
    producer that is gone is logged, never raised; shutdown closes every client."""
    base = free_port_run(2)
    buffer = KVBuffer(1 << 20)
    server = KVServer(buffer, "127.0.0.1", base + 1, transport="gloo")
    for key in ("unused", "kept", "late"):
        buffer.put(key, {"kv": torch.zeros(4)}, digest=DIGEST)
    callers, clients = [], []

    def connect(host, port):  # on the thread that discards
        callers.append(threading.current_thread())
        clients.append(KVClient(host, port, transport="gloo", connect_timeout_s=5.0))
        return clients[-1]

    # rank 1 of TP 2 asks producer rank 1 of TP 2
    conn = consumer(caches(NHD), 4, tp_rank=1, tp_size=2, connect=connect)
    remote_discards = [
        DiscardSpec("unused", "127.0.0.1", base, 2, prompt_digest=DIGEST),
        DiscardSpec(
            "elsewhere", "127.0.0.1", free_port_run(2), 2, prompt_digest=DIGEST
        ),  # nobody listens
    ]
    try:
        conn.start_load_kv([], remote_discards)
        conn.wait_for_discards()
        with pytest.raises(KeyMissError, match="discarded"):
            deliver(buffer, "unused", digest=DIGEST)
        assert torch.equal(deliver(buffer, "kept", digest=DIGEST)[0]["kv"], torch.zeros(4))
        assert len(set(callers)) == 1 and callers[0] is not threading.current_thread()
        conn.shutdown()
        conn.discard(
            [DiscardSpec("late", "127.0.0.1", base, 2, prompt_digest=DIGEST)]
        )  # e.g. a batch still running
        assert torch.equal(deliver(buffer, "late", digest=DIGEST)[0]["kv"], torch.zeros(4)), (
            "discarded after shutdown"
        )
        for client in clients:
            with pytest.raises(PipeClosedError, match="client is closed"):
                client.discard("late", timeout_s=1.0, digest=DIGEST)
    finally:
        conn.shutdown()
        server.close()
        buffer.close()


def test_a_pull_presents_the_digest_and_caps_the_reply_at_what_this_rank_expects():
    """max_bytes comes from this rank's own caches: NHD bf16, 2 layers, 2 heads of 8: a token row
    is 2 × 2 × 2 × 8 × 2 = 128 bytes (1280 for 10 tokens); whole pages, which this cache can take
    too, hold the prompt's 3 blocks × 4 rows of 128 bytes = 1536: the larger is the cap."""
    asked = []

    def get(transfer_id, **request):
        asked.append(request)
        raise KeyMissError("not there", key=transfer_id)

    conn = consumer(caches(NHD), 4, connect=lambda host, port: fake_client(get))
    conn.start_load_kv([LoadSpec("r", "t", "h", 1, [0, 1, 2], 0, 9, 10, prompt_digest=DIGEST)])
    conn.shutdown()
    assert [(r["digest"], r["max_bytes"]) for r in asked] == [(DIGEST, 1536)]


@pytest.mark.timeout(60)
def test_an_entry_larger_than_this_rank_expects_is_refused_before_it_is_allocated(monkeypatch):
    """A producer (or a relay) that answers a load with more KV than the hand-off's prompt can
    hold here: the consumer refuses the DATA header, allocates nothing for it, and recomputes."""
    buffer = KVBuffer(64 << 20)
    buffer.put("oversized", {"kv": torch.zeros(8 << 20, dtype=torch.uint8)}, digest=DIGEST)
    server = KVServer(buffer, "127.0.0.1", 0, transport="gloo")
    sizes, real = [], torch.empty

    def spy(*args, **kw):
        t = real(*args, **kw)
        sizes.append(t.nbytes)
        return t

    conn = consumer(caches(NHD), 4, cfg=ConnectorConfig(transport="socket"))
    try:
        with captured_log("vllm.tritonkv.connector") as records:
            monkeypatch.setattr(torch, "empty", spy)
            conn.start_load_kv(
                [
                    LoadSpec(
                        "r",
                        "oversized",
                        "127.0.0.1",
                        server.port,
                        [0, 1, 2],
                        0,
                        9,
                        10,
                        prompt_digest=DIGEST,
                    )
                ]
            )
            monkeypatch.setattr(torch, "empty", real)
        assert conn.get_block_ids_with_load_errors() == {0, 1, 2}
        [failed] = [r.getMessage() for r in records]
        assert "ProtocolError" in failed and f"{8 << 20} payload bytes announced" in failed
        assert "expects at most 1536" in failed, failed
        assert max(sizes, default=0) < 1 << 20, f"allocated {max(sizes)} bytes for the reply"
    finally:
        conn.shutdown()
        server.close()
        buffer.close()
