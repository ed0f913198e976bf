"""The integrity digest end to end in the worker sides, in-process (no sockets, no vLLM): the
producer stores the digest its pack computed, the consumer's unpack checks what it read (and,
with ``digest_write_back``, what landed in its cache); a mismatch is a failed load, recomputed,
warned once (transfer, producer, check) and counted. Each fault has its negative control: with the
check off, the same fault goes unseen and wrong KV lands."""

from __future__ import annotations

import logging
from functools import partial

import pytest
import torch
from support.connector_sides import (
    DIGEST,
    SENTINEL,
    VLLM_CPU,
    bits,
    caches,
    consumer,
    fake_client,
    producer,
    transfer,
)
from support.kvstore import deliver

from connector.integrity import (
    DIGEST_KEY,
    HEAD_DIGESTS_KEY,
    faults,
    flip_bit,
    shifted_slots,
)
from connector.kvstore import KVBuffer
from connector.logs import short_id
from connector.vllm_connector import producer as producer_mod
from connector.vllm_connector.config import ConnectorConfig
from connector.vllm_connector.metadata import LoadSpec, SaveSpec

SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS = [5, 1, 3], [0, 4, 2], 10
TRANSFER_ID = "t1-0123456789"


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings():
    handler = _Warnings()
    logger = logging.getLogger("vllm.tritonkv.connector")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


@pytest.fixture
def unhashed(monkeypatch):
    """Producers whose pack computes no NH (no native copy, or rows of partial 32-byte groups):
    their entries carry the whole entry's digest, which the consumer's unpack checks. (An entry
    hashed as it was packed carries none: its NH checks it, tests/vllm_connector/
    test_entry_tags.py.)"""
    monkeypatch.setattr(producer_mod, "nh_in_copy", lambda device, row_bytes: False)


def _flip_in_transit(get):
    """A fake client whose replies have one bit flipped after the producer's digest was taken."""

    def flipped(key, **kw):
        tensors, meta = get(key, **kw)
        kv = tensors["kv"].clone()
        kv.view(torch.uint8).view(-1)[kv.numel()] ^= 0x08  # one bit, mid-tensor
        return {**tensors, "kv": kv}, meta

    return fake_client(flipped)


def _load(prod, dst_tensors, cfg, *, tp_size=1, tp_rank=0, total_kv_heads=None, fault=None):
    """Save the prompt on ``prod`` and load it on a consumer of ``cfg``; ``fault(client_get)``
    makes the consumer's client. Returns ``(consumer, load-error blocks)``."""
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    prod.wait_for_save([SaveSpec("p", TRANSFER_ID, SRC_BLOCKS, NUM_TOKENS, prompt_digest=DIGEST)])
    get = partial(deliver, buffer)
    dst = consumer(
        dst_tensors,
        4,
        cfg=cfg,
        tp_size=tp_size,
        tp_rank=tp_rank,
        total_kv_heads=total_kv_heads,
        connect=lambda host, port: (fault or fake_client)(get),
    )
    spec = LoadSpec(
        "c", TRANSFER_ID, "h", 1, DST_BLOCKS, 0, NUM_TOKENS - 1, NUM_TOKENS, prompt_digest=DIGEST
    )
    dst.start_load_kv([spec])
    buffer.close()
    errors = dst.get_block_ids_with_load_errors()
    dst.shutdown()
    return dst, errors


def test_clean_transfer_carries_its_digest_and_loads(unhashed):
    src, dst = caches(VLLM_CPU), caches(VLLM_CPU, seed=None)
    prod = producer(src, 4)
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    prod.wait_for_save([SaveSpec("p", "t1", SRC_BLOCKS, NUM_TOKENS, prompt_digest=DIGEST)])
    _, meta = deliver(buffer, "t1", digest=DIGEST)
    assert len(meta[DIGEST_KEY]) == 16
    buffer.close()
    cons, errors = transfer(producer(src, 4), dst, 4, SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS, start=0)
    assert errors == set()
    assert cons.stats.peek()["loads"] == 1 and cons.stats.peek()["digest_failures"] == 0


def test_a_bit_flipped_in_transit_fails_the_load_and_is_warned_and_counted(warnings, unhashed):
    src, dst = caches(VLLM_CPU), caches(VLLM_CPU, seed=None)
    cons, errors = _load(producer(src, 4), dst, ConnectorConfig(), fault=_flip_in_transit)
    assert errors == set(DST_BLOCKS)  # recomputed by vLLM
    stats = cons.stats.peek()
    assert (stats["loads"], stats["load_failures"], stats["digest_failures"]) == (0, 1, 1)
    [line] = [w for w in warnings if "digest" in w]
    assert short_id(TRANSFER_ID) in line and "from h:1" in line and "'read'" in line
    assert TRANSFER_ID not in line


def test_without_the_digest_the_flipped_bit_lands(warnings, unhashed):
    """The negative control: digest off on both sides, the same fault loads wrong KV."""
    src, dst = caches(VLLM_CPU), caches(VLLM_CPU, seed=None)
    off = ConnectorConfig(digest=False)
    prod = producer(src, 4, cfg=off)
    cons, errors = _load(prod, dst, off, fault=_flip_in_transit)
    assert errors == set() and cons.stats.peek()["digest_failures"] == 0
    clean = caches(VLLM_CPU, seed=None)
    _load(producer(src, 4, cfg=off), clean, off)
    assert not torch.equal(bits(dst), bits(clean))  # the flipped bit is in the cache


def _wrong_slot(cons_caches):
    """Make ``caches.slots`` send position 5 to block 3 (not in the consumer's table)."""
    right = cons_caches.slots

    def slots(block_ids, start, stop, rows, offset=0):
        out = right(block_ids, start, stop, rows, offset).clone()
        out[5] = 3 * cons_caches.block_size
        return out

    cons_caches.slots = slots


@pytest.mark.parametrize("write_back", [True, False], ids=["write_back", "read_only"])
def test_a_wrong_destination_slot_is_caught_by_the_write_back_check(monkeypatch, write_back):
    """With ``digest_write_back`` the load fails; with the read check alone the bytes arrived
    intact, so the wrong slot goes unseen (the write-back check's reason to exist)."""
    src, dst = caches(VLLM_CPU), caches(VLLM_CPU, seed=None)
    cfg = ConnectorConfig(digest_write_back=write_back)
    from connector.vllm_connector import consumer as consumer_mod

    made = consumer_mod.Consumer.__init__

    def init(self, *args, **kw):
        made(self, *args, **kw)
        _wrong_slot(self.caches)

    monkeypatch.setattr(consumer_mod.Consumer, "__init__", init)
    cons, errors = _load(producer(src, 4, kv_format="tokens"), dst, cfg)
    stats = cons.stats.peek()
    if write_back:
        assert errors == set(DST_BLOCKS) and stats["digest_failures"] == 1
    else:
        assert errors == set() and stats["digest_failures"] == 0
        assert (bits(dst)[:, 3] != SENTINEL).any()  # the stray write landed in block 3


def test_unequal_tp_parts_carry_their_own_digests(warnings):
    """A TP-1 producer of 2 heads (token rows), TP-2 consumers loading one head each: each load
    is checked against its head's digest; a flipped bit in one rank's part fails that rank only."""
    src = caches(VLLM_CPU)
    prod = producer(src, 4, kv_format="tokens")
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    prod.wait_for_save([SaveSpec("p", "t9", SRC_BLOCKS, NUM_TOKENS, prompt_digest=DIGEST)])
    meta = buffer.checkout("t9", part=None, digest=DIGEST).meta
    assert len(meta[HEAD_DIGESTS_KEY]) == 2 * 16
    buffer.close()
    half = (VLLM_CPU[0], 1, *VLLM_CPU[2:])  # one head per consumer rank
    for rank, fault, want_errors in ((0, None, set()), (1, _flip_in_transit, set(DST_BLOCKS))):
        cons, errors = _load(
            producer(src, 4, kv_format="tokens"),
            caches(half, seed=None),
            ConnectorConfig(),
            tp_size=2,
            tp_rank=rank,
            total_kv_heads=2,
            fault=fault,
        )
        assert errors == want_errors
        assert cons.stats.peek()["digest_failures"] == (1 if fault else 0)


# ------------------------------------------------------------- the e2e test's fault hooks


def test_fault_hooks_are_parsed_only_when_allowed():
    params = {"tritonkv_debug_fault": "flip_bit,bogus,no_digest"}
    assert faults(params, allowed=True) == "flip_bit,no_digest"
    assert faults(params, allowed=False) == ""
    assert faults({"tritonkv_debug_fault": 1}, allowed=True) == ""
    assert faults(None, allowed=True) == ""


def test_flip_bit_and_shifted_slots_hooks():
    packed = torch.full((2, 2, 3, 1, 4), 0.5)
    packed[0, 0, 0, 0, 2] = -1.5  # the one in [1, 2): its exponent becomes all ones (NaN)
    flip_bit(packed)
    changed = (packed != 0.5) & (packed != -1.5)
    assert changed.sum() == 1 and torch.isnan(packed[0, 0, 0, 0, 2])
    slots = torch.tensor([-1, 10, 11, 12, 13])
    assert shifted_slots(slots, 1, 5).tolist() == [-1, 11, 12, 13, -1]


@pytest.mark.parametrize(
    "save_fault,load_fault,cfg,counter",
    [
        ("flip_bit", "", ConnectorConfig(), "load_failed:protocol"),
        ("flip_bit", "no_digest", ConnectorConfig(), None),
        ("", "wrong_slot", ConnectorConfig(digest_write_back=True), "digest_failures"),
        ("", "wrong_slot,no_digest", ConnectorConfig(digest_write_back=True), None),
    ],
    ids=["flip", "flip-unchecked", "wrong_slot", "wrong_slot-unchecked"],
)
def test_hooked_faults_are_caught_unless_unchecked(save_fault, load_fault, cfg, counter):
    """The hooks the e2e test uses, in-process: each fault fails the load, counted in
    ``counter`` (a bit flipped after the pack: the entry's tag, the twins' native copy having
    hashed the entry as it packed it; a wrong slot: the write-back digest); with this load
    unchecked (``no_digest``) the faulty KV lands, unlike a clean load's."""
    fails = counter is not None
    src, dst = caches(VLLM_CPU), caches(VLLM_CPU, seed=None)
    buffer = KVBuffer(1 << 24)
    prod = producer(src, 4)
    prod.attach_buffer(buffer)
    save = SaveSpec("p", "t1", SRC_BLOCKS, NUM_TOKENS, prompt_digest=DIGEST, debug_fault=save_fault)
    prod.wait_for_save([save])
    cons = consumer(dst, 4, cfg=cfg, connect=lambda h, p: fake_client(partial(deliver, buffer)))
    load = LoadSpec(
        "c",
        "t1",
        "h",
        1,
        DST_BLOCKS,
        0,
        NUM_TOKENS - 1,
        NUM_TOKENS,
        prompt_digest=DIGEST,
        debug_fault=load_fault,
    )
    cons.start_load_kv([load])
    errors = cons.get_block_ids_with_load_errors()
    cons.shutdown()
    buffer.close()
    assert (errors == set(DST_BLOCKS)) == fails
    stats = cons.stats.peek()
    assert stats["load_failures"] == int(fails) and (not fails or stats[counter] == 1)
    if not fails:
        clean = caches(VLLM_CPU, seed=None)
        transfer(producer(src, 4), clean, 4, SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS, start=0)
        assert not torch.equal(bits(dst), bits(clean))
