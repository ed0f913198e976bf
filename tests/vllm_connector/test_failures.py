"""Nothing one request brings can kill an engine: every failure of one request's save or load
(an entry that can never fit, no memory, a client's hostile numbers) is that request's failure,
logged and counted, and the request is recomputed (no vLLM: the worker sides directly)."""

from __future__ import annotations

import time

import pytest
import torch
from support.connector_sides import DIGEST, NHD, caches, consumer, fake_client, producer
from support.vllm_fixtures import captured_log

import connector.vllm_connector.producer as producer_mod
from connector.kvstore import KVBuffer, short_id
from connector.vllm_connector.consumer import ProducerClients
from connector.vllm_connector.metadata import LoadSpec, SaveSpec

BLOCK_SIZE = 4
# caches(NHD): 2 layers of bf16, 2 KV heads of 8: one token row is 2 * 2 * 2 * 8 * 2 bytes.
ROW_BYTES = 128
TID = "ab" * 16


def _counting_pack(monkeypatch, fail_with=None):
    calls = []

    def pack(*args, **kwargs):
        calls.append(args)
        if fail_with is not None:
            raise fail_with
        return real(*args, **kwargs)

    real = producer_mod.pack_kv
    monkeypatch.setattr(producer_mod, "pack_kv", pack)
    return calls


def test_a_prompt_that_can_never_fit_the_buffer_is_refused_before_packing(monkeypatch):
    """An entry larger than buffer_bytes raised out of wait_for_save and vLLM declared the
    prefill engine dead (every later request got HTTP 500). Now it is refused before anything is
    packed, logged with its size, counted; the next prompt that fits is saved as usual."""
    prod = producer(caches(NHD, seed=1), BLOCK_SIZE, kv_format="tokens")
    buffer = KVBuffer(2 * ROW_BYTES)
    prod.attach_buffer(buffer)
    packs = _counting_pack(monkeypatch)
    with captured_log("vllm.tritonkv.connector") as records:
        prod.wait_for_save(
            [
                SaveSpec("big", TID, [0], 3, prompt_digest=DIGEST),
                SaveSpec("small", "cd" * 16, [1], 2, prompt_digest=DIGEST),
            ]
        )  # 3 rows: 384 bytes > 256; 2 rows: 256 bytes
    assert len(packs) == 1, "the entry that cannot fit was packed anyway"
    assert "cd" * 16 in buffer and TID not in buffer
    stats = prod.stats.peek()
    assert (stats["saves"], stats["save_failures"]) == (1, 1)
    [error] = [r.getMessage() for r in records]
    assert f"could not save transfer {short_id(TID)} for big" in error
    assert (
        f"needs {3 * ROW_BYTES} bytes, more than one entry may hold ({2 * ROW_BYTES} bytes" in error
    )
    assert prod.entry_bytes(SaveSpec("x", TID, [0], 3, prompt_digest=DIGEST)) == 3 * ROW_BYTES


@pytest.mark.parametrize(
    "error",
    [RuntimeError("CUDA out of memory. Tried to allocate 4.00 GiB"), MemoryError()],
    ids=["cuda-oom", "host-oom"],
)
def test_running_out_of_memory_while_packing_fails_that_save_only(monkeypatch, error):
    prod = producer(caches(NHD, seed=1), BLOCK_SIZE, kv_format="tokens")
    buffer = KVBuffer(1 << 20)
    prod.attach_buffer(buffer)
    _counting_pack(monkeypatch, fail_with=error)
    with captured_log("vllm.tritonkv.connector") as records:
        prod.wait_for_save([SaveSpec("r", TID, [0], 3, prompt_digest=DIGEST)])  # must not raise
    assert TID not in buffer and prod.stats.peek()["save_failures"] == 1
    assert type(error).__name__ in records[0].getMessage()
    monkeypatch.undo()
    prod.wait_for_save([SaveSpec("r2", "cd" * 16, [1], 3, prompt_digest=DIGEST)])
    assert "cd" * 16 in buffer


@pytest.mark.parametrize(
    "error",
    [
        OverflowError("Python int too large to convert to C long"),
        RuntimeError("DefaultCPUAllocator: can't allocate memory"),
        MemoryError(),
        KeyError("kv"),
    ],
    ids=["overflow", "oom", "memory-error", "key-error"],
)
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_any_error_of_a_pull_is_that_load_s_failure_and_its_blocks_are_recomputed(
    error, async_load
):
    """remote_port = 2**63 in a client-set hand-off raised OverflowError in the connect, which
    the load's except list did not hold: it left start_load_kv and killed the decode engine."""
    from connector.vllm_connector.config import ConnectorConfig

    def get(transfer_id, **kw):
        raise error

    dst = caches(NHD, seed=None)
    cons = consumer(
        dst,
        BLOCK_SIZE,
        cfg=ConnectorConfig(async_load=async_load),
        connect=lambda host, port: fake_client(get),
    )
    before = torch.stack([c.view(torch.int16) for c in dst]).clone()
    with captured_log("vllm.tritonkv.connector") as records:
        cons.start_load_kv(
            [LoadSpec("r", TID, "h", 1, [2, 3], 0, 7, 8, prompt_digest=DIGEST)]
        )  # must not raise
        deadline = time.monotonic() + 10
        while async_load and not cons.get_finished() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert cons.get_block_ids_with_load_errors() == {2, 3}
    assert cons.stats.peek()["load_failures"] == 1
    assert torch.equal(torch.stack([c.view(torch.int16) for c in dst]), before)  # nothing written
    assert type(error).__name__ in records[-1].getMessage()
    cons.shutdown()


def test_the_producer_client_cache_is_bounded_and_closes_what_it_drops():
    """Hand-offs naming ever new addresses left one KVClient each, never evicted."""
    made, closed = [], []

    def connect(host, port):
        made.append(port)
        return type("C", (), {"close": lambda self, port=port: closed.append(port)})()

    clients = ProducerClients(connect, max_clients=3)
    for port in (1, 2, 3):
        clients.get("h", port)
    clients.get("h", 1)  # used again: now the most recent
    clients.get("h", 4)  # evicts 2, the least recently used
    clients.get("h", 5)  # evicts 3
    assert len(clients) == 3 and closed == [2, 3] and made == [1, 2, 3, 4, 5]
    clients.get("h", 1)
    assert made == [1, 2, 3, 4, 5], "a kept client was made again"
    clients.close()
    assert sorted(closed) == [1, 2, 3, 4, 5]


def test_slots_are_checked_on_the_host_before_any_copy():
    """On a GPU the kernels do not check slots: a block id past the cache would be an illegal
    memory access or a silent overwrite. The worker checks them when it builds them."""
    from support.connector_sides import rank_caches

    views = rank_caches(caches(NHD), BLOCK_SIZE)  # 6 blocks of 4: slots 0..23
    assert views.num_slots == 24
    assert views.slots([5, 1], 0, 8, 8).tolist() == [20, 21, 22, 23, 4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"address slots in \[24, 27\], outside .* \[0, 24\)"):
        views.slots([6], 0, 4, 4)
    with pytest.raises(ValueError, match=r"address slots in \[-4, -1\]"):
        views.slots([-1], 0, 4, 4)
    with pytest.raises(ValueError, match="need 2 blocks of 4, got 1"):
        views.slots([0], 0, 5, 5)
