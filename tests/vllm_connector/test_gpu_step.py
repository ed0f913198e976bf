"""The worker sides' GPU path on CPU tensors (support.fake_streams stands in for CUDA's streams
and events): nothing in vLLM's step reads the device or synchronises, the work is ordered by
events, an entry is stored and a load counted only once its event completed, and device memory
stays within ``gpu_memory_bytes`` (a transfer past it, or whose allocation fails, is that
transfer's failure: recomputed). The ``gpu`` test at the end does a save and a load on a GPU
under ``torch.cuda.set_sync_debug_mode("error")``, and tests/vllm_connector/test_two_workers.py
two processes driving the sides as vLLM does."""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch
from support.connector_sides import (
    DIGEST,
    HEAD_SIZE,
    NHD,
    SENTINEL,
    bits,
    caches,
    consumer,
    fake_client,
    producer,
)
from support.fake_streams import FakeStreams, gpu_busy, no_host_reads
from support.kvstore import deliver

import connector.integrity as integrity_mod
import connector.vllm_connector.consumer as consumer_mod
import connector.vllm_connector.producer as producer_mod
from connector.kvstore import KVBuffer
from connector.streams import DeviceBudget, DeviceBudgetExceeded, gpu_budget_line
from connector.vllm_connector.config import ConnectorConfig
from connector.vllm_connector.metadata import LoadSpec, SaveSpec

BLOCK_SIZE = 4
TID = "ab" * 16
NUM_TOKENS = 10  # 3 blocks of 4, the last one partly
SRC_BLOCKS, DST_BLOCKS = [4, 1, 3], [2, 5, 0]
MODULES = (producer_mod, consumer_mod, integrity_mod)
# caches(NHD): 2 layers of bf16, 2 KV heads of 8: one token row is 2 * 2 * 2 * 8 * 2 bytes.
ROW_BYTES = 128


def _producer(fake, cfg):
    """A producer on fake streams over random caches on the fake device, and its buffer:
    ``(producer, buffer, its cache tensors)``."""
    src = caches(NHD, seed=1)
    prod = producer(src, BLOCK_SIZE, cfg=cfg, streams=fake)
    for t in src:
        fake.on_device(t)
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    return prod, buffer, src


def _save(fake, cfg, faults=""):
    """A producer on fake streams, its buffer, and one prompt's save launched (under the
    audit): ``(producer, buffer, its cache tensors, the audit's violations)``."""
    prod, buffer, src = _producer(fake, cfg)
    spec = SaveSpec("p", TID, SRC_BLOCKS, NUM_TOKENS, prompt_digest=DIGEST, debug_fault=faults)
    with no_host_reads(fake, MODULES) as violations:
        prod.wait_for_save([spec])
    return prod, buffer, src, list(violations)


def _load_spec(faults=""):
    return LoadSpec(
        "c",
        TID,
        "h",
        1,
        DST_BLOCKS,
        0,
        NUM_TOKENS - 1,
        NUM_TOKENS,
        prompt_digest=DIGEST,
        debug_fault=faults,
    )


def _consumer(fake, buffer, cfg):
    dst = caches(NHD, seed=None)
    for t in dst:
        fake.on_device(t)
    cons = consumer(
        dst,
        BLOCK_SIZE,
        cfg=cfg,
        streams=fake,
        connect=lambda host, port: fake_client(partial(deliver, buffer)),
    )
    return cons, dst


def _positions(tensors, blocks, count):
    """``[layers, 2, count, heads, head_size]`` int16 of prompt positions ``[0, count)``."""
    b = bits(tensors)  # [layers, 2, num_blocks, block_size, heads, head_size]
    rows = [b[:, :, blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] for p in range(count)]
    return torch.stack(rows, dim=2)


@pytest.mark.parametrize("digest", [True, False], ids=["digest", "no-digest"])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kv_format", ["tokens", "pages"])
def test_the_step_never_reads_the_device_and_work_is_ordered_by_events(
    monkeypatch, digest, async_load, kv_format
):
    monkeypatch.setenv("TRITONKV_KERNELS", "triton")  # the GPU's path, under the interpreter
    cfg = ConnectorConfig(kv_format=kv_format, digest=digest, async_load=async_load)
    fake = FakeStreams()
    prod, buffer, src, violations = _save(fake, cfg)
    assert violations == []
    # ordering: the pack waited for vLLM's stream, vLLM's stream waits for the pack
    [ready] = fake.side.waited
    assert ready.stream is fake.vllm
    assert [ev.stream for ev in fake.vllm.waited] == [fake.side]
    # nothing is stored before the pack's event completed, nor device memory let go
    time.sleep(0.05)
    assert TID not in buffer and prod.budget.in_use > 0
    fake.complete_all()
    assert prod.flush(10)
    assert TID in buffer and prod.budget.in_use == 0
    assert prod.stats.peek()["saves"] == 1
    stored = buffer.stats()
    assert stored["entries"] == 1

    cons, dst = _consumer(fake, buffer, cfg)
    with no_host_reads(fake, MODULES) as violations:
        cons.start_load_kv([_load_spec()])
    if async_load:
        cons._loading["c"][2].result(10)  # the load, on a load thread
    with no_host_reads(fake, MODULES) as more:
        finished = cons.get_finished()  # launched the async unpack: not finished before its event
    assert violations + more == [] and finished is None
    assert cons.stats.peek()["loads"] == 0 and cons.budget.in_use > 0
    fake.complete_all()
    with no_host_reads(fake, []) as violations:
        finished = cons.get_finished()
        errors = cons.get_block_ids_with_load_errors()
    assert [v for v in violations if "synchronize" in v] == []
    assert errors == set()
    assert finished == ({"c"} if async_load else None)
    assert cons.stats.peek()["loads"] == 1 and cons.budget.in_use == 0
    got = _positions(dst, DST_BLOCKS, NUM_TOKENS - 1)
    assert torch.equal(got, _positions(src, SRC_BLOCKS, NUM_TOKENS - 1))
    if kv_format == "tokens":  # position 9 (block 0, offset 1) is vLLM's to compute
        assert torch.all(bits(dst)[:, :, 0, 1] == SENTINEL)
    cons.shutdown()
    prod.shutdown()


@pytest.mark.parametrize("resident", [True, False], ids=["device-entry", "host-entry"])
def test_an_entry_already_on_the_device_is_unpacked_where_it_is(monkeypatch, resident):
    """An entry of a device-resident buffer in this process (``buffer_memory`` device, e.g.
    kv_both's own) is unpacked from where it is: no copy through the host (on a GPU that was a
    blocking copy on vLLM's step), no device memory of the load's; a host entry is copied."""
    monkeypatch.setenv("TRITONKV_KERNELS", "triton")
    cfg = ConnectorConfig(kv_format="tokens")
    fake = FakeStreams(auto_complete=True)
    prod, buffer, src, _ = _save(fake, cfg)
    assert prod.flush(10) and TID in buffer
    copies = []
    real_to_device = consumer_mod.GpuLoad.to_device
    monkeypatch.setattr(
        consumer_mod.GpuLoad,
        "to_device",
        lambda load, t: copies.append(t) or real_to_device(load, t),
    )

    def get(key, **kw):
        tensors, meta = deliver(buffer, key, **kw)
        if resident:
            fake.on_device(tensors["kv"])
        return tensors, meta

    dst = [fake.on_device(t) for t in caches(NHD, seed=None)]
    cons = consumer(dst, BLOCK_SIZE, cfg=cfg, streams=fake, connect=lambda h, p: fake_client(get))
    cons.start_load_kv([_load_spec()])
    assert cons.get_block_ids_with_load_errors() == set()
    assert len(copies) == (0 if resident else 1)
    got = _positions(dst, DST_BLOCKS, NUM_TOKENS - 1)
    assert torch.equal(got, _positions(src, SRC_BLOCKS, NUM_TOKENS - 1))
    assert cons.stats.peek()["loads"] == 1 and cons.budget.in_use == 0
    cons.shutdown()
    prod.shutdown()


def test_the_audit_sees_a_host_read_of_a_device_tensor():
    """The negative control: the audit is not blind."""
    fake = FakeStreams()
    t = fake.on_device(torch.arange(4))
    with no_host_reads(fake) as violations:
        int(t[1])  # a view of its memory
        t.sum().item()  # a new tensor, not memory of the fake device: unseen
        t.tolist()
    assert len(violations) == 2
    assert "Tensor.__int__" in violations[0] and "Tensor.tolist" in violations[1]


def test_a_corrupted_entry_fails_once_its_unpack_completed():
    cfg = ConnectorConfig(kv_format="tokens", debug_allow_corrupt=True)
    fake = FakeStreams(auto_complete=True)
    prod, buffer, _, _ = _save(fake, cfg, faults="flip_bit")
    assert prod.flush(10) and TID in buffer
    cons, _ = _consumer(fake, buffer, cfg)
    cons.start_load_kv([_load_spec()])
    errors = cons.get_block_ids_with_load_errors()
    assert errors == set(DST_BLOCKS)
    stats = cons.stats.peek()
    # the entry's tag refuses it (the twins' native copy hashed it as it packed it)
    assert (stats["loads"], stats["load_failures"], stats["load_failed:protocol"]) == (0, 1, 1)
    assert cons.budget.in_use == 0


def test_a_save_past_gpu_memory_bytes_is_refused_before_allocating():
    entry = NUM_TOKENS * ROW_BYTES
    cfg = ConnectorConfig(kv_format="tokens", gpu_memory_bytes=entry - 1)
    fake = FakeStreams(auto_complete=True)
    prod, buffer, _, _ = _save(fake, cfg)
    assert prod.flush(10)
    assert TID not in buffer and len(fake.events) == 0, "allocated or launched anyway"
    assert (prod.budget.refusals, prod.budget.in_use) == (1, 0)
    assert prod.stats.peek()["save_failures"] == 1
    small = SaveSpec("q", "cd" * 16, [0], 3, prompt_digest=DIGEST)
    prod.wait_for_save([small])
    assert prod.flush(10) and "cd" * 16 in buffer and prod.budget.in_use == 0


def test_an_allocation_failure_fails_that_save_and_that_load_only():
    cfg = ConnectorConfig(kv_format="tokens", debug_allow_corrupt=True)
    fake = FakeStreams(auto_complete=True)
    prod, buffer, _, _ = _save(fake, cfg, faults="alloc_fail")
    assert prod.flush(10)
    assert TID not in buffer and prod.stats.peek()["save_failures"] == 1
    assert prod.budget.in_use == 0
    prod.wait_for_save([SaveSpec("p", TID, SRC_BLOCKS, NUM_TOKENS, prompt_digest=DIGEST)])
    assert prod.flush(10) and TID in buffer
    cons, _ = _consumer(fake, buffer, cfg)
    cons.start_load_kv([_load_spec(faults="alloc_fail")])
    assert cons.get_block_ids_with_load_errors() == set(DST_BLOCKS)
    assert cons.stats.peek()["load_failures"] == 1 and cons.budget.in_use == 0


def test_a_load_past_gpu_memory_bytes_is_recomputed():
    cfg = ConnectorConfig(kv_format="tokens")
    fake = FakeStreams(auto_complete=True)
    prod, buffer, _, _ = _save(fake, cfg)
    assert prod.flush(10) and TID in buffer
    small = ConnectorConfig(kv_format="tokens", gpu_memory_bytes=ROW_BYTES)
    cons, dst = _consumer(fake, buffer, small)
    cons.start_load_kv([_load_spec()])
    assert cons.get_block_ids_with_load_errors() == set(DST_BLOCKS)
    assert cons.budget.refusals == 1 and cons.budget.in_use == 0
    assert torch.all(bits(dst) == SENTINEL), "a refused load wrote into the cache"


def test_a_pack_that_never_completes_fails_its_save_and_keeps_its_memory():
    cfg = ConnectorConfig(kv_format="tokens")
    fake = FakeStreams()
    src = caches(NHD, seed=1)
    prod = producer(src, BLOCK_SIZE, cfg=cfg, streams=fake)
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    prod._publisher_thread().publish_timeout_s = 0.05
    prod.wait_for_save([SaveSpec("p", TID, SRC_BLOCKS, NUM_TOKENS, prompt_digest=DIGEST)])
    assert prod.flush(10)
    assert TID not in buffer and prod.stats.peek()["save_failures"] == 1
    # the GPU may still write its output: kept, and counted, until its event completes
    assert prod.budget.in_use == NUM_TOKENS * ROW_BYTES and len(prod._publisher.stuck) == 1
    prod._publisher_thread().publish_timeout_s = 10
    prod.wait_for_save([SaveSpec("q", "cd" * 16, [0], 3, prompt_digest=DIGEST)])
    fake.complete_all()
    assert prod.flush(10) and "cd" * 16 in buffer
    assert prod.budget.in_use == 0 and prod._publisher.stuck == []
    prod.shutdown()


def test_the_budget_counts_and_refuses():
    budget = DeviceBudget(100)
    fake = FakeStreams()
    t, got = budget.empty(fake, (10,), torch.int32, "x")
    assert (got, budget.in_use, t.shape) == (40, 40, (10,))
    with pytest.raises(DeviceBudgetExceeded, match="needs 80 bytes of GPU memory, 40 of"):
        budget.empty(fake, (20,), torch.int32, "y")
    with pytest.raises(torch.OutOfMemoryError):
        budget.empty(fake, (5,), torch.int32, "z", fail=True)
    budget.release(got)
    assert (budget.in_use, budget.peak, budget.refusals) == (0, 60, 1)  # z held 20 briefly


def test_the_startup_line_says_how_much_to_lower_gpu_memory_utilization():
    line = gpu_budget_line(torch.device("cpu"), 1 << 30, 1 << 29)
    assert "tritonkv will use up to 1.50 GiB of GPU memory outside vLLM's budget" in line
    assert "lower --gpu-memory-utilization" in line


@pytest.mark.parametrize(
    ("extra", "device", "on_device"),
    [
        ({}, "cuda", True),  # auto: nccl on CUDA sends device memory
        ({"transport": "gloo"}, "cuda", False),
        ({"transport": "gloo", "buffer_memory": "device"}, "cuda", True),
        ({"buffer_memory": "host"}, "cuda", False),
        ({"buffer_memory": "device"}, "cpu", False),
    ],
)
def test_where_entries_live(extra, device, on_device):
    assert ConnectorConfig.from_extra(extra).entries_on_device(torch.device(device)) is on_device


def test_bad_memory_options_are_refused():
    with pytest.raises(ValueError, match=r"buffer_memory: expected auto\|host\|device, got 'gpu'"):
        ConnectorConfig.from_extra({"buffer_memory": "gpu"})
    with pytest.raises(ValueError, match="gpu_memory_bytes: expected > 0, got 0"):
        ConnectorConfig.from_extra({"gpu_memory_bytes": 0})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("buffer_memory", ["host", "device"])
def test_on_a_gpu_the_step_never_synchronises(buffer_memory):
    """The real thing: CUDA streams and events, sync-debug mode "error" around the sides'
    calls (after a warm-up round: Triton compiles, tritonkv builds its layer table). Each entry
    comes with its tag, as over a connection: the consumer's unpack computes the NH it is
    checked with (the GPU pack stores no whole-entry digest beside its NH)."""
    cfg = ConnectorConfig(kv_format="tokens", transport="gloo", buffer_memory=buffer_memory)
    src = [c.cuda() for c in caches(NHD, seed=1)]
    prod = producer(src, BLOCK_SIZE, cfg=cfg)
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    dst = [c.cuda() for c in caches(NHD, seed=None)]
    seen, tags = [], []

    def get(key, defer_entry_check=False, **kw):
        got = deliver(buffer, key, defer_entry_check=defer_entry_check, **kw)
        seen.append(got[0]["kv"].device.type)
        tags.append(got[2] if defer_entry_check else None)
        return got

    cons = consumer(dst, BLOCK_SIZE, cfg=cfg, connect=lambda h, p: fake_client(get))
    compute = torch.cuda.Stream()
    for round_no in range(2):
        tid = f"{round_no:032x}"
        spec = SaveSpec("p", tid, SRC_BLOCKS, NUM_TOKENS, prompt_digest=DIGEST)
        load = _load_spec()
        load.transfer_id = tid
        with torch.cuda.stream(compute):
            if round_no:
                torch.cuda.set_sync_debug_mode("error")
            try:
                # the "forward pass" still runs (~1 s of GPU time) when each call returns: a
                # call that waited for vLLM's stream (a sync, or a copy from pageable memory)
                # would return after it. Not in the warm-up round, which may wait: Triton
                # compiles, and the layer table's copy to the device is a blocking one (any
                # stream may use the table next)
                busy = gpu_busy(compute)
                prod.wait_for_save([spec])
                assert not (round_no and busy.query()), "wait_for_save waited for vLLM's stream"
                assert prod.flush(30)
                busy = gpu_busy(compute)
                cons.start_load_kv([load])
                cons.get_finished()
                assert not (round_no and busy.query()), "start_load_kv waited for vLLM's stream"
                errors = cons.get_block_ids_with_load_errors()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert errors == set()
    assert seen == ["cuda" if buffer_memory == "device" else "cpu"] * 2
    assert [t.checked for t in tags] == [["kv"], ["kv"]]
    torch.cuda.synchronize()
    got = _positions([c.cpu() for c in dst], DST_BLOCKS, NUM_TOKENS - 1)
    assert torch.equal(got, _positions([c.cpu() for c in src], SRC_BLOCKS, NUM_TOKENS - 1))
    assert prod.budget.in_use == 0 and cons.budget.in_use == 0
    cons.shutdown()
    prod.shutdown()


@pytest.mark.parametrize(("faults", "fails"), [("", False), ("wrong_slot", True)])
def test_the_write_back_check_runs_once_the_unpack_completed(faults, fails):
    """With ``digest_write_back`` the cache is read back behind the unpack and compared once its
    event completed: an off-by-one slot mapping fails the load, a right one passes."""
    cfg = ConnectorConfig(kv_format="tokens", digest_write_back=True, debug_allow_corrupt=True)
    fake = FakeStreams()
    prod, buffer, _, _ = _save(fake, cfg)
    fake.complete_all()
    assert prod.flush(10) and TID in buffer
    cons, _ = _consumer(fake, buffer, cfg)
    spec = _load_spec(faults=faults)
    cons.start_load_kv([spec])
    assert cons.get_finished() is None and cons.stats.peek()["load_failures"] == 0
    fake.complete_all()
    errors = cons.get_block_ids_with_load_errors()
    stats = cons.stats.peek()
    if fails:
        assert errors == set(DST_BLOCKS) and stats["digest_failures"] == 1
    else:
        assert errors == set() and stats["loads"] == 1


@pytest.mark.parametrize("kv_format", ["tokens", "pages"])
def test_chunks_are_packed_stored_and_unpacked_by_events_without_host_reads(monkeypatch, kv_format):
    """The overlapped flow's chunks on the GPU path: each chunk's pack is launched on the step
    and stored (under its chunk key) once its event completed; a chunked load unpacks each at
    its offset, bit-exact, and nothing in the step reads the device."""
    from connector.kvstore import chunk_key
    from connector.vllm_connector.metadata import Chunk

    monkeypatch.setenv("TRITONKV_KERNELS", "triton")
    cfg = ConnectorConfig(kv_format=kv_format)
    fake = FakeStreams()
    prod, buffer, src = _producer(fake, cfg)
    chunks = [Chunk(0, 0, 4, False), Chunk(1, 4, 10, True)]
    for chunk in chunks:
        blocks = SRC_BLOCKS[: -(-chunk.stop // BLOCK_SIZE)]
        spec = SaveSpec("p", TID, blocks, NUM_TOKENS, prompt_digest=DIGEST, chunk=chunk)
        with no_host_reads(fake, MODULES) as violations:
            prod.wait_for_save([spec])
        assert violations == [] and len(buffer) == chunk.index  # not before its event
        fake.complete_all()
        assert prod.flush(10)
    assert sorted(buffer._table.entries) == [chunk_key(TID, 0), chunk_key(TID, 1)]
    cons, dst = _consumer(fake, buffer, cfg)
    spec = _load_spec()
    spec.chunked = True
    with no_host_reads(fake, MODULES) as violations:
        cons.start_load_kv([spec])
    assert violations == []
    fake.complete_all()
    assert cons.get_block_ids_with_load_errors() == set()
    got = _positions(dst, DST_BLOCKS, NUM_TOKENS - 1)
    assert torch.equal(got, _positions(src, SRC_BLOCKS, NUM_TOKENS - 1))
    assert len(buffer) == 0 and cons.stats.peek()["loads"] == 1
    cons.shutdown()
    prod.shutdown()


@pytest.mark.parametrize("on_device", [False, True], ids=["host-entry", "device-entry"])
def test_a_state_row_is_packed_on_the_side_stream_and_stored_once_packed(monkeypatch, on_device):
    """A state group's save takes the KV's GPU path: packed on our stream after vLLM's event,
    no host read on the step (no ``.cpu()`` waiting for the forward pass), stored by the
    publisher only once the pack's event completed, in host memory unless entries live on the
    device, its bytes those of the request's state slot."""
    from connector.vllm_connector.cache_views import StateCaches
    from connector.vllm_connector.metadata import GroupPart

    monkeypatch.setenv("TRITONKV_KERNELS", "triton")
    fake = FakeStreams()
    gen = torch.Generator().manual_seed(5)
    pages = fake.on_device(torch.randint(-128, 128, (6, 40), generator=gen, dtype=torch.int8))
    states = [pages[:, :16], pages[:, 16:40].view(6, 3, 8)]
    kv = caches(NHD, seed=1)
    for t in kv:
        fake.on_device(t)
    groups = [StateCaches(states, BLOCK_SIZE), producer(kv, BLOCK_SIZE).caches]
    prod = producer(kv, BLOCK_SIZE, cfg=ConnectorConfig(kv_format="tokens"), streams=fake)
    prod.groups, prod.entries_on_device = groups, on_device  # as on a GPU with NCCL
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    parts = [GroupPart(0, [3, 1, 4]), GroupPart(1, SRC_BLOCKS)]
    spec = SaveSpec("p", TID, SRC_BLOCKS, NUM_TOKENS, prompt_digest=DIGEST, groups=parts)
    with no_host_reads(fake, MODULES) as violations:
        prod.wait_for_save([spec])
    assert list(violations) == []
    assert len(fake.side.waited) == 2 and {e.stream for e in fake.side.waited} == {fake.vllm}
    time.sleep(0.05)
    assert len(buffer) == 0 and prod.budget.in_use > 0  # nothing stored before the events
    fake.complete_all()
    assert prod.flush(10) and len(buffer) == 2 and prod.budget.in_use == 0
    tensors, meta = deliver(buffer, TID, digest=DIGEST)
    assert meta["kv_format"] == "state" and tensors["kv"].shape == (1, 40)
    assert fake.is_device(tensors["kv"]) == on_device
    slot = 4  # the block of position NUM_TOKENS - 1 in group 0's ids
    assert torch.equal(tensors["kv"].view(torch.int8)[0], pages[slot])
    assert prod.stats.peek()["saves"] == 2
    prod.shutdown()
    buffer.close()


def _tagged_load(fake, prod, buffer, cfg, shape=NHD, tp=None):
    """Once ``prod``'s save completed, load it from ``buffer`` on a consumer on ``fake`` streams
    (caches of ``shape``; ``tp``: its TP rank, size and total KV heads), the entry's tag left to
    it: nothing reads the host on the step, and the tag is checked at the verdict with the NH of
    the unpack. Returns ``(consumer, load-error blocks, its caches)``."""
    fake.complete_all()
    assert prod.flush(10) and TID in buffer
    tags = []

    def get(key, defer_entry_check=False, **kw):
        got = deliver(buffer, key, defer_entry_check=defer_entry_check, **kw)
        tags.append(got[2])
        return got

    dst = [fake.on_device(t) for t in caches(shape, seed=None)]
    connect = lambda h, p: fake_client(get)
    cons = consumer(dst, BLOCK_SIZE, cfg=cfg, streams=fake, connect=connect, **(tp or {}))
    with no_host_reads(fake, MODULES) as violations:
        cons.start_load_kv([_load_spec()])
    assert violations == [] and tags[0].checked == []  # launched, not checked yet
    fake.complete_all()
    cons.get_finished()
    errors = cons.get_block_ids_with_load_errors()
    assert tags[0].checked == ["kv"]
    return cons, errors, dst


@pytest.mark.parametrize("fault", ["", "flip_bit"], ids=["clean", "flipped"])
def test_an_entry_tag_is_checked_at_the_verdict_with_the_nh_of_the_unpack(monkeypatch, fault):
    """A producer whose pack runs in Triton stores its entry's NH; the consumer's unpack
    computes the NH of what it reads in its own launch, copied to the host behind it, and the
    tag is checked at the verdict, not on the step (no host read there). Digest off: a bit
    flipped after the producer's hash fails the load by the tag alone."""
    monkeypatch.setenv("TRITONKV_KERNELS", "triton")
    cfg = ConnectorConfig(kv_format="tokens", digest=False, debug_allow_corrupt=True)
    fake = FakeStreams()
    prod, buffer, src, _ = _save(fake, cfg, faults=fault)
    cons, errors, dst = _tagged_load(fake, prod, buffer, cfg)
    stats = cons.stats.peek()
    if fault:
        assert errors == set(DST_BLOCKS) and stats["load_failed:protocol"] == 1
    else:
        assert errors == set() and stats["loads"] == 1
        got = _positions(dst, DST_BLOCKS, NUM_TOKENS - 1)
        assert torch.equal(got, _positions(src, SRC_BLOCKS, NUM_TOKENS - 1))
    assert cons.budget.in_use == 0
    cons.shutdown()
    prod.shutdown()


@pytest.mark.parametrize("fault", ["", "flip_bit"], ids=["clean", "flipped-in-the-store"])
def test_a_slice_of_heads_is_checked_at_the_verdict_by_its_tag_and_its_head_digests(
    monkeypatch, fault
):
    """Each consumer rank of TP 2 takes one of the producer's two heads: the server hashes the
    slice as it sends it (``delivery_nh``), the unpack computes its NH in its own launch, and
    the tag and the slice's head digests are both checked at the verdict, neither on the step.
    A bit flipped in the store after the pack passes the tag (hashed as stored) and fails the
    head digest of the one rank whose head holds it."""
    monkeypatch.setenv("TRITONKV_KERNELS", "triton")
    cfg = ConnectorConfig(kv_format="tokens", debug_allow_corrupt=True)
    outcomes = []
    for rank in (0, 1):
        fake = FakeStreams()
        prod, buffer, src, _ = _save(fake, cfg, faults=fault)
        tp = {"tp_rank": rank, "tp_size": 2, "total_kv_heads": 2}
        cons, errors, dst = _tagged_load(
            fake, prod, buffer, cfg, (2, 6, BLOCK_SIZE, 1, HEAD_SIZE), tp
        )
        outcomes.append((errors, cons.stats.peek()["digest_failures"]))
        if not errors:
            want = _positions(src, SRC_BLOCKS, NUM_TOKENS - 1)[:, :, :, rank : rank + 1]
            assert torch.equal(_positions(dst, DST_BLOCKS, NUM_TOKENS - 1), want)
        assert cons.budget.in_use == 0
        cons.shutdown()
        prod.shutdown()
    if fault:
        assert sorted(outcomes, key=lambda o: o[1]) == [(set(), 0), (set(DST_BLOCKS), 1)]
    else:
        assert outcomes == [(set(), 0), (set(), 0)]
