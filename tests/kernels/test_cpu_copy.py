"""The CPU twins' row copies (tritonkv._cpu): every primitive bit-exact, the thread runner safe.

The private module is tested directly on purpose: which primitive a row size gets and when copies
go to threads are invisible in the ops' results (those are checked through ``pack_kv_torch``).
"""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch
from support.kv_cases import assert_bits_equal

from tritonkv import _cpu, pack_kv_torch, unpack_kv_torch


def _random_int64(*shape, seed=0):
    """Every bit pattern is possible, NaN payloads of any float view included."""
    return torch.randint(
        -(2**63), 2**63 - 1, shape, dtype=torch.int64, generator=torch.Generator().manual_seed(seed)
    )


# (row width in int64, storage stride between rows): numpy rows, 16-byte rows, odd-width rows
# that stay int64, and rows whose stride forbids the 16-byte view.
ROW_CASES = [(4, 4), (16, 16), (128, 128), (256, 256), (129, 129), (130, 131)]


@pytest.mark.parametrize(("width", "stride"), ROW_CASES, ids=lambda c: str(c))
def test_scatter_writes_exactly_the_indexed_rows(width, stride):
    num_rows = 40
    storage = _random_int64(num_rows * stride + 3, seed=1)
    dst = storage.as_strided((num_rows, width), (stride, 1), 3)
    index = torch.randperm(num_rows, generator=torch.Generator().manual_seed(2))[:25]
    src = _random_int64(25, width, seed=3)
    expected = storage.clone()
    expected.as_strided((num_rows, width), (stride, 1), 3)[index] = src
    copies = _cpu.RowCopies()
    copies.scatter(dst, index, src)
    assert len(copies.numpy_jobs) == (width * 8 <= _cpu.NUMPY_MAX_ROW_BYTES)
    copies.run(_cpu.PARALLEL_MIN_BYTES)
    assert_bits_equal(storage, expected, f"scatter width={width} stride={stride}")


@pytest.mark.parametrize(("width", "stride"), ROW_CASES, ids=lambda c: str(c))
def test_gather(width, stride):
    storage = _random_int64(40 * stride, seed=4)
    src = storage.as_strided((40, width), (stride, 1), 0)
    index = torch.tensor([39, 0, 7, 7, 12])
    out = torch.full((5, width), 0x5A5A, dtype=torch.int64)
    copies = _cpu.RowCopies()
    copies.gather(src, index, out)
    copies.run(0)
    assert_bits_equal(out, src[index], "gather")


def test_scatter_of_narrow_elements():
    """int8 rows (1-byte elements: odd sizes) go through the same paths."""
    dst = torch.zeros(10, 7, dtype=torch.int8)
    src = torch.arange(21, dtype=torch.int8).view(3, 7)
    copies = _cpu.RowCopies()
    copies.scatter(dst, torch.tensor([9, 2, 5]), src)
    copies.run(0)
    expected = torch.zeros(10, 7, dtype=torch.int8)
    expected[[9, 2, 5]] = src
    assert_bits_equal(dst, expected, "int8 scatter")


def _recorder():
    threads, done, lock = [], [], threading.Lock()

    def job(tag, seconds=0.0):
        def run():
            time.sleep(seconds)  # long enough for the chunks to overlap on distinct threads
            with lock:
                threads.append(threading.current_thread().name)
                done.append(tag)

        return run

    return threads, done, job


def test_numpy_copies_use_threads_for_big_batches_torch_copies_never(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    me = threading.current_thread().name
    threads, done, job = _recorder()
    copies = _cpu.RowCopies()
    copies.numpy_jobs += [job(("np", i), 0.05) for i in range(10)]
    copies.torch_jobs += [job(("torch", i)) for i in range(3)]
    copies.run(_cpu.PARALLEL_MIN_BYTES)
    assert sorted(done) == sorted([("np", i) for i in range(10)] + [("torch", i) for i in range(3)])
    on_me = [tag for name, tag in zip(threads, done, strict=True) if name == me]
    assert sorted(on_me) == [("torch", i) for i in range(3)]  # torch ops: the caller's thread
    assert len(set(threads) - {me}) > 1

    threads.clear()
    done.clear()
    copies.run(_cpu.PARALLEL_MIN_BYTES - 1)  # small: everything inline
    assert len(done) == 13 and set(threads) == {me}


def test_run_waits_for_every_thread_before_raising(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    finished = threading.Event()

    def fail():
        raise RuntimeError("copy failed")

    def slow():
        finished.wait(0.2)
        finished.set()

    copies = _cpu.RowCopies()
    copies.numpy_jobs += [fail, slow]
    with pytest.raises(RuntimeError, match="copy failed"):
        copies.run(_cpu.PARALLEL_MIN_BYTES)
    assert finished.is_set()  # the other thread's job had ended when the error surfaced
    copies.numpy_jobs[:] = [lambda: None, fail]  # now raised on the other thread
    with pytest.raises(RuntimeError, match="copy failed"):
        copies.run(_cpu.PARALLEL_MIN_BYTES)


def _round_trip(layers, slots, packed):
    """Unpack (NumPy row copies on threads) into zeroed caches, pack back."""
    target = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in layers]
    unpack_kv_torch(packed, target, slots)
    return pack_kv_torch(target, slots)[0]


def _round_trip_in_child(queue):
    # torch's OpenMP threads don't survive fork() (a torch-wide limit): one intra-op thread here,
    # while RowCopies is told there are two, so it still hands copies to its own threads.
    torch.set_num_threads(1)
    torch.get_num_threads = lambda: 2  # (this child process only)
    layers, slots, expected = _big_case()
    again = _round_trip(layers, slots, expected)
    queue.put(bool(torch.equal(again, expected)))


def _big_case():
    """Enough bytes for RowCopies to use threads: 8 layers, 64 blocks of 16 tokens, HND rows."""
    gen = torch.Generator().manual_seed(5)
    raws = [
        torch.randint(-(2**15), 2**15, (2, 64, 16, 8, 128), dtype=torch.int16, generator=gen)
        for _ in range(8)
    ]
    layers = [(raw[0].transpose(1, 2), raw[1].transpose(1, 2)) for raw in raws]
    blocks = torch.randperm(64, generator=gen)[:40]
    slots = (blocks[:, None] * 16 + torch.arange(16)).reshape(-1)
    expected = torch.stack(
        [torch.stack([raw[p].reshape(-1, 8, 128)[slots] for p in range(2)]) for raw in raws]
    )
    return layers, slots, expected


def test_copy_threads_survive_fork(monkeypatch):
    """A pool made before fork() has no threads in the child: the child must make its own."""
    layers, slots, expected = _big_case()
    assert expected.numel() * 2 >= _cpu.PARALLEL_MIN_BYTES
    packed, _ = pack_kv_torch(layers, slots)
    assert_bits_equal(packed, expected, "pack")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert_bits_equal(_round_trip(layers, slots, packed), expected, "round trip")  # makes the pool
    assert _cpu._pool is not None
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_round_trip_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=60) is True
    finally:
        child.join(timeout=10)
    assert child.exitcode == 0
