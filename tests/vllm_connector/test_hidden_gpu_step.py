"""The hidden states' GPU path on CPU tensors (support.fake_streams stands in for CUDA's streams
and events), by the KV path's rules (tests/vllm_connector/test_gpu_step.py): nothing in vLLM's
step reads the device or synchronises, the pack is ordered by events, nothing is published or
written before the pack's event completed, device memory stays within ``gpu_memory_bytes``, and
a pack that never completes, a request past the budget or an allocation failure is that
request's failure; for files and the network, several requests in one step, chunked prefill.
The ``gpu`` test at the end does the same on a GPU under ``torch.cuda.set_sync_debug_mode``."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch
from support.fake_streams import FakeStreams, gpu_busy, no_host_reads
from support.kvstore import deliver

from connector import integrity
from connector.hidden import worker as hs
from connector.hidden.files import HiddenFileWriter, read_hidden_file
from connector.hidden.scheduler import HiddenDiscard, HiddenSaveSpec, HiddenScheduler
from connector.kvstore import KVBuffer
from connector.streams import DeviceBudget
from connector.vllm_connector.stats import TransferStats

SHAPE = (12, 2, 4, 8)  # num_blocks, num_hidden_states, block_size, hidden_size
BLOCK_SIZE = SHAPE[2]
ROW_BYTES = SHAPE[1] * SHAPE[3] * 4  # one token's hidden states, fp32
SENTINEL = -7.0  # every slot no request owns
MODULES = (hs, integrity)
WAYS = ["files", "network", "both"]
DIGEST = "5" * 32  # the prompt digest the hand-made specs bind their entries to


def _cache() -> torch.Tensor:
    """Sentinels, but distinct values in blocks 1.. (token-outer memory, as on a GPU)."""
    b, h, n, d = SHAPE
    cache = torch.arange(b * n * h * d, dtype=torch.float32).reshape(b, n, h, d).permute(0, 2, 1, 3)
    cache[0] = SENTINEL
    return cache


def _expected(cache: torch.Tensor, spec: HiddenSaveSpec) -> torch.Tensor:
    pos = torch.arange(spec.num_tokens)
    return cache[torch.tensor(spec.block_ids)[pos // BLOCK_SIZE], :, pos % BLOCK_SIZE]


def _spec(name: str, blocks: list[int], num_tokens: int, tmp_path, way: str, fault: str = ""):
    path = str(tmp_path / f"{name}.safetensors") if way != "network" else None
    ids = [(7 * p + len(name)) % 500 for p in range(num_tokens)]
    return HiddenSaveSpec(
        name, f"t-{name}", blocks, num_tokens, ids, path, debug_fault=fault, prompt_digest=DIGEST
    )


class _Rig:
    """A HiddenWorker on fake streams with a "device" cache, its buffer, writer and budget."""

    def __init__(self, way: str, *, budget_bytes: int = 1 << 20, digest: bool = True):
        if way != "network":  # (a GPU machine's dry run may lack it: vLLM brings it)
            pytest.importorskip("safetensors", reason="the files way needs safetensors")
        self.fake = FakeStreams()
        self.cache = self.fake.on_device(_cache())
        self.buffer = KVBuffer(1 << 22) if way != "files" else None
        self.writer = HiddenFileWriter(1 << 22) if way != "network" else None
        self.stats = TransferStats()
        self.budget = DeviceBudget(budget_bytes)
        self.worker = hs.HiddenWorker(
            self.cache,
            tp_rank=0,
            writer=self.writer,
            buffer=(lambda: self.buffer) if self.buffer is not None else None,
            stats=self.stats,
            digest=digest,
            streams=self.fake,
            budget=self.budget,
        )

    def save(self, specs, discards=()) -> list[str]:
        """``worker.save`` under the audit; its violations."""
        with no_host_reads(self.fake, MODULES) as violations:
            self.worker.save(specs, discards)
        return list(violations)

    def delivered(self, spec: HiddenSaveSpec, way: str) -> list[dict]:
        """What each way out holds for ``spec`` (file, then buffer entry)."""
        got = []
        if way != "network":
            got.append(read_hidden_file(spec.path, timeout_s=10))
        if way != "files":
            tensors, meta = deliver(self.buffer, spec.transfer_id, digest=spec.prompt_digest)
            integrity.check_hidden(meta, tensors, "receipt", "")
            got.append(tensors)
        return got

    def close(self) -> None:
        self.worker.shutdown()
        if self.buffer is not None:
            self.buffer.close()


def _request(req_id: str, prompt: list[int]):
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=prompt,
        num_prompt_tokens=len(prompt),
        num_computed_tokens=0,
        kv_transfer_params=None,
    )


def _step(scheduled: dict[str, int], blocks: dict[str, list[int]]):
    state = SimpleNamespace(get_block_ids=lambda rid: (blocks[rid],) if rid in blocks else None)
    return SimpleNamespace(num_scheduled_tokens=scheduled, kv_connector_block_state=state)


@pytest.mark.parametrize("way", WAYS)
def test_the_step_never_reads_the_device_and_nothing_leaves_before_the_pack(
    monkeypatch, tmp_path, way
) -> None:
    """A prompt chunked over three steps and one finishing in the last: the scheduler names
    both in that step only, one pack takes both on the side stream after vLLM's event, vLLM's
    stream waits for it, nothing is in the buffer or on disk (the lock held) and the device
    memory stays counted until the pack's event completed; then both are delivered, bit-exact,
    with their digests, and the memory is let go."""
    monkeypatch.setenv("TRITONKV_KERNELS", "triton")  # the GPU's path, under the interpreter
    rig = _Rig(way)
    sched = HiddenScheduler(
        block_size=BLOCK_SIZE,
        group=0,
        storage_path=str(tmp_path) if way != "network" else None,
        serve_at=("h", 1) if way != "files" else None,
    )
    long, short = _request("long", list(range(100, 110))), _request("short", [5, 6, 7])
    blocks = {"long": [4, 1, 3], "short": [6]}
    sched.watch(long)
    for chunk in (4, 4):  # chunked prefill: no save before the last chunk, nothing launched
        specs = sched.build_meta(_step({"long": chunk}, blocks))["hidden_saves"]
        assert specs == [] and rig.save(specs) == [] and rig.fake.events == []
        long.num_computed_tokens += chunk
    sched.watch(short)
    specs = sched.build_meta(_step({"long": 2, "short": 3}, blocks))["hidden_saves"]
    assert [s.req_id for s in specs] == ["long", "short"]
    assert rig.save(specs) == []
    [ready] = rig.fake.side.waited
    assert ready.stream is rig.fake.vllm
    assert [ev.stream for ev in rig.fake.vllm.waited] == [rig.fake.side]
    time.sleep(0.05)
    assert rig.budget.in_use == 13 * ROW_BYTES
    if rig.buffer is not None:
        assert len(rig.buffer) == 0
    for spec in specs:
        if spec.path is not None:
            assert not os.path.exists(spec.path)
            with pytest.raises(TimeoutError):  # its lock is held meanwhile
                read_hidden_file(spec.path, timeout_s=0.05)
    # the publisher's device digests and the writer's host ones run at once on two threads:
    # not under Triton's interpreter, which is not thread-safe (on a GPU the host's are the CPU's)
    monkeypatch.delenv("TRITONKV_KERNELS")
    rig.fake.complete_all()
    assert rig.worker.flush(10)
    assert rig.budget.in_use == 0 and rig.budget.peak == 13 * ROW_BYTES
    for spec in specs:
        want = _expected(rig.cache, spec)
        assert not (want == SENTINEL).any()
        for got in rig.delivered(spec, way):
            assert torch.equal(got["hidden_states"].view(torch.int32), want.view(torch.int32))
            assert got["token_ids"].tolist() == spec.token_ids
    figures = rig.stats.take()
    assert (figures["hidden_saves"], figures["hidden_save_failures"]) == (2, 0)
    rig.close()


def test_the_audit_sees_the_host_path_read_the_device(tmp_path) -> None:
    """The negative control: the same save without streams (the CPU path, which digests on
    the host, off the step) on a "device" cache is flagged."""
    rig = _Rig("network")
    worker = hs.HiddenWorker(rig.cache, tp_rank=0, writer=None, buffer=lambda: rig.buffer)
    with no_host_reads(rig.fake, MODULES) as violations:
        worker.save([_spec("a", [2], 3, tmp_path, "network")])
        assert worker.flush(10)
    assert any("digests read on the host" in v for v in violations), violations
    worker.shutdown()
    rig.close()


@pytest.mark.parametrize("way", WAYS)
def test_a_pack_that_never_completes_fails_its_requests_and_keeps_its_memory(tmp_path, way) -> None:
    rig = _Rig(way)
    rig.worker._publisher_thread().publish_timeout_s = 0.05
    stuck = _spec("stuck", [2, 3], 6, tmp_path, way)
    assert rig.save([stuck]) == []
    assert rig.worker.flush(10)
    if rig.buffer is not None:
        assert stuck.transfer_id not in rig.buffer
    if stuck.path is not None:  # no file, an .error, the lock released
        with pytest.raises(RuntimeError, match="its pack failed: TimeoutError"):
            read_hidden_file(stuck.path, timeout_s=2)
    assert rig.stats.peek()["hidden_save_failures"] == 1
    # the GPU may still write its output: kept, and counted, until its event completes
    assert rig.budget.in_use == 6 * ROW_BYTES and len(rig.worker._publisher.stuck) == 1
    rig.worker._publisher.publish_timeout_s = 10
    later = _spec("later", [5], 2, tmp_path, way)
    assert rig.save([later]) == []
    rig.fake.complete_all()
    assert rig.worker.flush(10)
    assert rig.budget.in_use == 0 and rig.worker._publisher.stuck == []
    assert len(rig.delivered(later, way)) == (2 if way == "both" else 1)
    rig.close()


@pytest.mark.parametrize("way", ["files", "network"])
def test_past_the_budget_or_out_of_memory_fails_that_request_only(tmp_path, way) -> None:
    """One request of a step past ``gpu_memory_bytes`` is refused before allocating, one whose
    allocation fails (the ``alloc_fail`` hook) fails alone: the step's others are delivered."""
    rig = _Rig(way, budget_bytes=8 * ROW_BYTES)
    fake = rig.fake
    fake.auto_complete = True
    small = _spec("small", [1], 3, tmp_path, way)
    big = _spec("big", [2, 3, 4], 12, tmp_path, way)  # 12 rows: past the budget of 8
    oom = _spec("oom", [5], 2, tmp_path, way, fault="alloc_fail")
    other = _spec("other", [6], 3, tmp_path, way)
    rig.worker.save([small, big, oom, other])  # (its events complete at once: no audit)
    assert rig.worker.flush(10)
    assert rig.budget.refusals == 1 and rig.budget.in_use == 0
    for spec in (small, other):
        (got,) = rig.delivered(spec, way)
        assert torch.equal(got["hidden_states"], _expected(rig.cache, spec))
    for spec in (big, oom):
        if way == "files":
            with pytest.raises(RuntimeError, match=r"gpu_memory_bytes|alloc_fail"):
                read_hidden_file(spec.path, timeout_s=2)
        else:
            assert spec.transfer_id not in rig.buffer
    figures = rig.stats.take()
    assert (figures["hidden_saves"], figures["hidden_save_failures"]) == (2, 2)
    rig.close()


def test_a_drop_waits_for_the_saves_launched_before_it(tmp_path) -> None:
    """An aborted request discarded in the next step while its pack is in flight: once it
    completed, neither its entry nor its files remain."""
    rig = _Rig("both")
    spec = _spec("gone", [2], 3, tmp_path, "both")
    assert rig.save([spec]) == []
    assert rig.save([], [HiddenDiscard(spec.transfer_id, spec.path)]) == []
    rig.fake.complete_all()
    assert rig.worker.flush(10)
    assert len(rig.buffer) == 0 and os.listdir(tmp_path) == []
    rig.close()


@pytest.mark.parametrize("digest", [True, False], ids=["digest", "no-digest"])
def test_a_flipped_bit_is_caught_on_the_gpu_path(tmp_path, digest) -> None:
    """The ``flip_bit`` hook flips a bit of the host copy after the device digest was taken:
    the file writer refuses it (no file under the name), the buffer's entry fails its check;
    with ``digest`` off (the negative control) both deliver the flipped bit unseen."""
    rig = _Rig("both", digest=digest)
    rig.fake.auto_complete = True
    spec = _spec("f", [3, 1], 7, tmp_path, "both", fault="flip_bit")
    rig.worker.save([spec])
    assert rig.worker.flush(10)
    tensors, meta = deliver(rig.buffer, spec.transfer_id, digest=spec.prompt_digest)
    want = _expected(rig.cache, spec)
    if digest:
        with pytest.raises(RuntimeError, match="digest check 'write' failed"):
            read_hidden_file(spec.path, timeout_s=2)
        with pytest.raises(integrity.DigestMismatch, match=r"'receipt' failed.*hidden_states"):
            integrity.check_hidden(meta, tensors, "receipt", "")
    else:
        got = read_hidden_file(spec.path, timeout_s=2)
        for states in (got["hidden_states"], tensors["hidden_states"]):
            differ = (states.view(torch.int32) != want.view(torch.int32)).sum()
            assert differ == 1  # the flip landed, and nothing saw it
    rig.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("way", ["network", "both"])
def test_on_a_gpu_the_hidden_step_never_synchronises(tmp_path, way) -> None:
    """The real thing: CUDA streams and events, sync-debug mode "error" around ``save`` (after
    a warm-up round: Triton compiles, tritonkv builds its layer table), which returns while
    vLLM's stream is still busy; files and the buffer bit-exact. (Files need safetensors, which
    comes with vLLM: a GPU machine without it runs the network way only.)"""
    if way == "both":
        pytest.importorskip("safetensors")
    cache = _cache().cuda()
    buffer = KVBuffer(1 << 22)
    writer = HiddenFileWriter(1 << 22) if way == "both" else None
    worker = hs.HiddenWorker(cache, tp_rank=0, writer=writer, buffer=lambda: buffer)
    compute = torch.cuda.Stream()
    specs = []
    for round_no in range(2):
        step = [
            _spec(f"r{round_no}{i}", [1 + 3 * i, 2 + 3 * i], 5 + i, tmp_path, way) for i in range(3)
        ]
        with torch.cuda.stream(compute):
            if round_no:
                torch.cuda.set_sync_debug_mode("error")
            try:
                busy = gpu_busy(compute)  # the "forward pass" still runs when save returns
                worker.save(step)
                assert not (round_no and busy.query()), "save waited for vLLM's stream"
            finally:
                torch.cuda.set_sync_debug_mode("default")
        specs += step
    assert worker.flush(30)
    host = cache.cpu()
    for spec in specs:
        want = _expected(host, spec)
        if writer is not None:
            got = read_hidden_file(spec.path, timeout_s=10)
            assert torch.equal(got["hidden_states"].view(torch.int32), want.view(torch.int32))
        tensors, meta = deliver(buffer, spec.transfer_id, digest=spec.prompt_digest)
        integrity.check_hidden(meta, tensors, "receipt", "")
        assert torch.equal(tensors["hidden_states"].view(torch.int32), want.view(torch.int32))
    assert worker.budget.in_use == 0
    worker.shutdown()
    buffer.close()
