"""Entries hashed as they are packed and checked as they are unpacked, in the worker sides in
process (no sockets, no vLLM): a producer whose pack runs in Triton (the GPU's path, here under
the interpreter) or in the CPU twins' native copy stores each KV entry with the NH outputs its pack computed under the entry's key
(tritonkv.umac.entry_keys of the shared secret and the entry's key); a consumer that gets such an
entry with its tag left to it (``KVClient.get(defer_entry_check=True)``) has its unpack compute
the NH of what it read, and checks the tag with it before the load counts. A changed bit of the
entry fails the load (recomputed, a ``protocol`` failure) even with the digest off; the control:
without the tag the same bit lands. (Over a real connection the tag is the umac one: its tests
are tests/transport/test_entry_nh.py and tests/kvstore/test_tampered_entry.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.connector_sides import (
    DIGEST,
    HEAD_SIZE,
    VLLM_CPU,
    bits,
    caches,
    consumer,
    fake_client,
    producer,
)
from support.kvstore import deliver

from connector.integrity import DIGEST_KEY, HEAD_DIGESTS_KEY
from connector.kvstore import KVBuffer
from connector.vllm_connector import consumer as consumer_mod
from connector.vllm_connector import producer as producer_mod
from connector.vllm_connector.config import ConnectorConfig
from connector.vllm_connector.metadata import LoadSpec, SaveSpec
from connector.vllm_connector.producer import entry_key
from tritonkv import _cpu_digest, umac

SECRET = b"entry-tags-secret-0123456789abcdef"
SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS = [5, 1, 3], [0, 4, 2], 10
SAVE = SaveSpec("p", "t1", SRC_BLOCKS, NUM_TOKENS, prompt_digest=DIGEST)
# a consumer rank of TP 2, which takes one of the producer's two heads, and its caches' shape
TP2, ONE_HEAD = {"tp_size": 2, "total_kv_heads": 2}, (6, 1, 4, 2 * HEAD_SIZE)


def _saved(monkeypatch, cfg: ConnectorConfig, hashed: bool = True, fault: str = "") -> KVBuffer:
    """A buffer holding the prompt saved by a producer whose pack runs in Triton (``hashed``
    False: one whose pack computes no NH, and stores the whole entry's digest; ``fault``: the
    save's debug fault)."""
    monkeypatch.setenv("TRITONKV_KERNELS", "triton")
    monkeypatch.setattr(producer_mod, "nh_in_copy", lambda device, row_bytes: hashed)
    prod = producer(caches(VLLM_CPU, seed=3), 4, cfg=cfg, secret=SECRET)
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    prod.wait_for_save([dataclasses.replace(SAVE, debug_fault=fault)])
    return buffer


def _load(buffer, cfg, kernels: str, monkeypatch, *, flip=False, tags=True, fault="", rank=None):
    """Load the saved prompt on a fresh consumer (its unpack in ``kernels``); ``flip``: one
    bit of the entry changed after the producer hashed it; ``tags``: the client leaves the tag
    to the consumer; ``fault``: the load's debug fault; ``rank``: the consumer is that rank of
    TP 2, which takes one of the producer's two heads. Returns ``(consumer, load-error blocks,
    the tags given, its caches)``."""
    monkeypatch.setenv("TRITONKV_KERNELS", kernels)
    given = []

    def get(key, defer_entry_check=False, **kw):
        tensors, meta, tag = deliver(buffer, key, defer_entry_check=True, secret=SECRET, **kw)
        if flip:
            kv = tensors["kv"].clone()
            kv.view(torch.uint8).view(-1)[kv.numel() // 3] ^= 0x04
            tensors = {**tensors, "kv": kv}
        given.append(tag if tags else None)
        return (tensors, meta, given[-1]) if defer_entry_check else (tensors, meta)

    tp = {} if rank is None else {"tp_rank": rank, **TP2}
    dst = caches(VLLM_CPU if rank is None else ONE_HEAD, seed=None)
    cons = consumer(dst, 4, cfg=cfg, secret=SECRET, connect=lambda h, p: fake_client(get), **tp)
    spec = LoadSpec(
        "c", "t1", "h", 1, DST_BLOCKS, 0, NUM_TOKENS - 1, NUM_TOKENS, prompt_digest=DIGEST,
        debug_fault=fault,
    )  # fmt: skip
    cons.start_load_kv([spec])
    errors = cons.get_block_ids_with_load_errors()
    cons.shutdown()
    return cons, errors, given, dst


def test_the_triton_pack_stores_the_nh_of_the_entry_under_its_key(monkeypatch):
    buffer = _saved(monkeypatch, ConnectorConfig())
    key = entry_key(SAVE)
    lease = buffer.checkout(key, digest=DIGEST)
    try:
        packed, nh = lease.tensors["kv"], lease.entry_nh["kv"]
        assert torch.equal(nh, umac.nh_hash(packed, umac.entry_keys(SECRET, key)))
        assert not torch.equal(nh, umac.nh_hash(packed, umac.entry_keys(SECRET, key + "x")))
        assert not torch.equal(nh, umac.nh_hash(packed, umac.entry_keys(None, key)))
    finally:
        buffer.checkin(lease, delivered=False)


@pytest.mark.parametrize("library", ["native", "none"])
def test_the_cpu_pack_stores_the_nh_its_copy_computes(monkeypatch, library):
    """On the CPU the twins' native copy hashes the entry as it packs it (a token row of these
    caches is one 32-byte group), and the entry is stored with its NH; without the library the
    pack computes none (NH would be a pass of its own) and the sender hashes the entry under the
    frame's key."""
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    if library == "none":
        monkeypatch.setattr(_cpu_digest, "native", lambda: None)
    calls = []
    real = umac.nh_hash
    monkeypatch.setattr(umac, "nh_hash", lambda data, key: calls.append(1) or real(data, key))
    prod = producer(caches(VLLM_CPU, seed=3), 4, secret=SECRET)
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    prod.wait_for_save([SAVE])
    assert calls == []  # no pass of its own
    key = entry_key(SAVE)
    with buffer.checkout(key, digest=DIGEST) as lease:
        if library == "none":
            assert lease.entry_nh is None
        else:
            packed, nh = lease.tensors["kv"], lease.entry_nh["kv"]
            assert torch.equal(nh, real(packed, umac.entry_keys(SECRET, key)))


@pytest.mark.parametrize("kv_format", ["pages", "tokens"])
@pytest.mark.parametrize("library", ["native", "none"])
def test_an_entry_hashed_as_it_is_packed_carries_no_whole_entry_digest(
    monkeypatch, kv_format, library
):
    """Its NH checks every whole delivery of it (the payload's tag, or the KV server's check
    before an inline send), so the pack computes no digest of the whole entry beside it; the
    per-head digests of token rows stay (a consumer of another TP size loads a slice of the
    heads, which the entry's NH does not cover). Without NH in the copy the whole entry's digest
    is computed and stored as before."""
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")
    if library == "none":
        monkeypatch.setattr(_cpu_digest, "native", lambda: None)
    asked = []
    real = producer_mod.pack_kv
    monkeypatch.setattr(
        producer_mod, "pack_kv", lambda *a, **kw: asked.append(kw["digest"]) or real(*a, **kw)
    )
    prod = producer(caches(VLLM_CPU, seed=3), 4, kv_format=kv_format, secret=SECRET)
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    prod.wait_for_save([SAVE])
    with buffer.checkout(entry_key(SAVE), digest=DIGEST) as lease:
        hashed = lease.entry_nh is not None
        meta = lease.meta
    assert hashed == (library == "native")
    assert asked == [not hashed]
    assert (DIGEST_KEY in meta) == (not hashed)
    assert (HEAD_DIGESTS_KEY in meta) == (kv_format == "tokens")  # (2 heads)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_unpack_computes_the_nh_the_tag_is_checked_with(monkeypatch, kernels):
    cfg = ConnectorConfig()
    cons, errors, given, dst = _load(_saved(monkeypatch, cfg), cfg, kernels, monkeypatch)
    assert errors == set()
    [tag] = given
    assert tag.checked == ["kv"]  # checked once, with the unpack's NH
    assert cons.stats.peek()["loads"] == 1
    _, _, _, plain = _load(_saved(monkeypatch, cfg), cfg, kernels, monkeypatch, tags=False)
    assert torch.equal(bits(dst), bits(plain))  # the same KV landed


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("digest", [True, False], ids=["digest", "no-digest"])
def test_a_changed_bit_fails_the_load_as_an_authentication_failure(monkeypatch, kernels, digest):
    cfg = ConnectorConfig(digest=digest)
    cons, errors, given, _ = _load(_saved(monkeypatch, cfg), cfg, kernels, monkeypatch, flip=True)
    assert errors == set(DST_BLOCKS)  # recomputed by vLLM
    stats = cons.stats.peek()
    assert (stats["loads"], stats["load_failures"], stats["digest_failures"]) == (0, 1, 0)
    assert stats["load_failed:protocol"] == 1  # the tag's refusal, before the digest's check
    assert given[0].checked == ["kv"]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_tagged_unpack_computes_no_read_digest_and_the_write_back_still_runs(
    monkeypatch, kernels
):
    """The tag checks the bytes the read digest would (what the producer's pack wrote), so the
    unpack of a tagged entry computes no digest (an untagged one with a digest does); the
    write-back check, which reads the cache again and needs no digest of the producer's, still
    runs: a wrong destination slot fails the load."""
    cfg = ConnectorConfig(digest_write_back=True)
    asked = []
    real = consumer_mod.unpack_kv
    monkeypatch.setattr(
        consumer_mod, "unpack_kv", lambda *a, **kw: asked.append(kw["digest"]) or real(*a, **kw)
    )
    cons, errors, given, _ = _load(_saved(monkeypatch, cfg), cfg, kernels, monkeypatch)
    assert errors == set() and given[0].checked == ["kv"] and asked == [False]
    _load(_saved(monkeypatch, cfg, hashed=False), cfg, kernels, monkeypatch, tags=False)
    assert asked == [False, True]
    saved = _saved(monkeypatch, cfg)
    cons, errors, _, _ = _load(saved, cfg, kernels, monkeypatch, fault="wrong_slot")
    stats = cons.stats.peek()
    assert errors == set(DST_BLOCKS) and stats["digest_failures"] == 1


def test_without_the_tag_the_changed_bit_lands(monkeypatch):
    """The control: digest off and no tag to check, the same bit loads wrong KV."""
    cfg = ConnectorConfig(digest=False)
    cons, errors, _, flipped = _load(
        _saved(monkeypatch, cfg), cfg, "torch", monkeypatch, flip=True, tags=False
    )
    assert errors == set() and cons.stats.peek()["loads"] == 1
    _, _, _, clean = _load(_saved(monkeypatch, cfg), cfg, "torch", monkeypatch, tags=False)
    assert not torch.equal(bits(flipped), bits(clean))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("consumer_tp", [1, 2], ids=["whole", "slice-of-heads"])
def test_over_a_connection_the_entry_is_checked_by_the_unpack_and_a_change_is_refused(
    monkeypatch, consumer_tp
):
    """A served producer (Triton pack, a secret) and a consumer with real clients over gloo:
    the entry (or, for a consumer rank of TP 2, the slice of one of its two heads) travels
    marked as hashed under its key, the consumer's pipe does not hash it, the unpack's NH
    passes the tag; a bit changed on the wire fails that load (recomputed, the pipe broken),
    and the next load reconnects and lands."""
    from connector.kvstore import KVServer
    from connector.transport import PipeOptions, receiving
    from connector.transport import sending as sending_mod

    monkeypatch.setenv("TRITONKV_KERNELS", "triton")
    cfg = ConnectorConfig(kv_format="tokens") if consumer_tp == 2 else None
    prod = producer(caches(VLLM_CPU, seed=3), 4, cfg=cfg, secret=SECRET)
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    saves = [SaveSpec("p", tid, SRC_BLOCKS, NUM_TOKENS, prompt_digest=DIGEST) for tid in "abc"]
    prod.wait_for_save(saves)
    # (entries of 1.5 KiB: sent on the process group, not inline, as larger ones are)
    options = PipeOptions(inline_max_bytes=1)
    server = KVServer(buffer, "127.0.0.1", 0, transport="gloo", secret=SECRET, options=options)
    sent, hashed_on_arrival = [], []
    original_pieces = sending_mod._Sender._pieces
    original_hash = receiving._PayloadReceiver._hash_piece

    def pieces(self, item, src, copies, deadline, what):
        sent.append((item.key, [s.entry_nh for s in item.specs]))
        for piece in original_pieces(self, item, src, copies, deadline, what):
            if item.key == "b" and not item.inline:
                piece = piece.clone()
                piece[100] ^= 0x01
            yield piece

    def hash_piece(self, name, piece, keys):
        hashed_on_arrival.append(name)
        return original_hash(self, name, piece, keys)

    monkeypatch.setattr(sending_mod._Sender, "_pieces", pieces)
    monkeypatch.setattr(receiving._PayloadReceiver, "_hash_piece", hash_piece)
    monkeypatch.setenv("TRITONKV_KERNELS", "torch")  # the consumer's unpack: the CPU twin
    tp = {"tp_rank": 1, **TP2} if consumer_tp == 2 else {}
    dst = caches(VLLM_CPU if consumer_tp == 1 else ONE_HEAD, seed=None)
    cons = consumer(dst, 4, cfg=ConnectorConfig(transport="gloo"), secret=SECRET, **tp)
    outcomes = []
    try:
        for tid in "abc":
            spec = LoadSpec(
                "c" + tid,
                tid,
                "127.0.0.1",
                server.port,
                DST_BLOCKS,
                0,
                NUM_TOKENS - 1,
                NUM_TOKENS,
                prompt_digest=DIGEST,
            )
            cons.start_load_kv([spec])
            outcomes.append(cons.get_block_ids_with_load_errors())
        connects = sum(c.stats()["connects"] for c in cons.clients._clients.values())
    finally:
        cons.shutdown()
        server.close()
        buffer.close()
    assert outcomes == [set(), set(DST_BLOCKS), set()]
    assert [k for k, flags in sent] == ["a", "b", "c"] and all(f == [True] for _, f in sent)
    assert hashed_on_arrival == []  # left to the unpack
    assert cons.stats.peek()["load_failed:protocol"] == 1
    assert connects == 2  # the refused pipe was broken: the next load reconnected


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_slice_of_heads_is_checked_by_its_tag_and_by_its_head_digests(monkeypatch, kernels):
    """A consumer of TP 2 takes one of the producer's two heads: its server hashes the slice
    under the entry's key as it sends it (``delivery_nh``), and the consumer's unpack computes
    the NH its tag is checked with, as for a whole entry. Those outputs are of the bytes as
    stored, not as packed, so the slice's head digests are checked too: a bit flipped in the
    store after the pack fails one rank's load as a digest failure (the other rank's head
    loads), which the digest off lets land; a bit changed on the way fails as ``protocol``."""
    cfg = ConnectorConfig(kv_format="tokens")
    both = []
    for rank in (0, 1):
        cons, errors, given, dst = _load(
            _saved(monkeypatch, cfg), cfg, kernels, monkeypatch, rank=rank
        )
        assert errors == set() and given[0].checked == ["kv"], rank
        both.append(bits(dst))
    _, _, _, whole = _load(_saved(monkeypatch, cfg), cfg, kernels, monkeypatch)
    assert torch.equal(torch.cat(both, dim=2), bits(whole))  # each rank its head, bit-exact

    failed = {}
    for rank in (0, 1):
        stored = _saved(monkeypatch, cfg, fault="flip_bit")
        cons, errors, given, _ = _load(stored, cfg, kernels, monkeypatch, rank=rank)
        assert given[0].checked == ["kv"]  # the tag passed: the server hashed what it held
        failed[rank] = (errors, cons.stats.peek()["digest_failures"])
    assert sorted(failed.values(), key=lambda o: o[1]) == [(set(), 0), (set(DST_BLOCKS), 1)]
    bad = next(r for r, (errors, _) in failed.items() if errors)
    off = ConnectorConfig(kv_format="tokens", digest=False)
    stored = _saved(monkeypatch, off, fault="flip_bit")
    assert _load(stored, off, kernels, monkeypatch, rank=bad)[1] == set()  # the control

    cons, errors, _, _ = _load(
        _saved(monkeypatch, cfg), cfg, kernels, monkeypatch, flip=True, rank=bad
    )
    assert errors == set(DST_BLOCKS) and cons.stats.peek()["load_failed:protocol"] == 1
