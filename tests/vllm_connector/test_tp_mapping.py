"""Heterogeneous tensor parallelism: which producer ranks and heads each consumer rank loads, and
a bit-exact round trip through pack/unpack for every pairing, with sentinel-filled destinations."""

from __future__ import annotations

import itertools

import pytest
import torch

from connector.vllm_connector.tp_mapping import HeadSource, plan_heads, rank_heads
from tritonkv import layouts, pack_kv, unpack_kv

SIZES = (1, 2, 4, 8)
HEADS = (1, 2, 8)
CASES = [
    (p, d, h)
    for p, d, h in itertools.product(SIZES, SIZES, HEADS)
    if (p % d == 0 or d % p == 0) and (h % p == 0 or p % h == 0) and (h % d == 0 or d % h == 0)
]
NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEAD_SIZE, SENTINEL = 2, 5, 4, 3, -7777


def test_the_docstring_examples():
    assert plan_heads(8, 2, 4, 3) == (HeadSource(1, (2, 4), (0, 2)),)
    assert plan_heads(8, 2, 1, 0) == (HeadSource(0, (0, 4), (0, 4)), HeadSource(1, (0, 4), (4, 8)))
    assert rank_heads(2, 8, 5) == range(1, 2)  # replicated: ranks 4..7 hold head 1


@pytest.mark.parametrize("p,d,h", CASES, ids=lambda v: str(v))
def test_every_needed_head_comes_once_from_a_rank_that_holds_it(p, d, h):
    for r in range(d):
        sources = plan_heads(h, p, d, r)
        got = []
        for s in sources:
            held = list(rank_heads(h, p, s.rank))
            assert 0 <= s.src[0] < s.src[1] <= len(held)
            assert s.dst[1] - s.dst[0] == s.num_heads
            got += held[s.src[0] : s.src[1]]
        assert got == list(rank_heads(h, d, r)), (p, d, h, r, sources)
        dst = [i for s in sources for i in range(*s.dst)]
        assert dst == list(range(len(rank_heads(h, d, r))))  # each local head written once
        if d >= p or h >= p:  # one source per consumer rank unless it gathers
            assert len({s.rank for s in sources}) == max(1, min(p // d, h // d if h >= d else 1))


def test_replicas_spread_consumer_ranks_and_mla_takes_one_rank():
    # 2 heads, producer TP 8 (each head on 4 ranks), consumer TP 2: both pick distinct replicas
    assert [plan_heads(2, 8, 2, r)[0].rank for r in range(2)] == [0, 5]
    assert [plan_heads(1, 4, 8, r, mla=True)[0].rank for r in range(8)] == [0, 1, 2, 3] * 2


@pytest.mark.parametrize(
    "args,match",
    [
        ((8, 3, 2, 0), "producer TP 3 and consumer TP 2: expected one to divide the other"),
        ((6, 4, 2, 0), "producer TP 4 with 6 KV heads"),
        ((8, 2, 4, 4), "consumer_rank: expected 0 <= rank < 4"),
        ((8, 0, 4, 0), "producer_tp: expected a positive int"),
    ],
)
def test_pairings_vllm_cannot_give_are_refused_naming_why(args, match):
    with pytest.raises(ValueError, match=match):
        plan_heads(*args)


def _rank_cache(global_kv: torch.Tensor, heads: range) -> torch.Tensor:
    """A rank's FlashAttention-style cache [2, B, N, heads, D] (int16) of the given heads."""
    return global_kv[:, :, :, heads.start : heads.stop].clone()


@pytest.mark.parametrize("p,d,h", CASES, ids=lambda v: str(v))
def test_round_trip_moves_exactly_each_consumer_ranks_heads(p, d, h):
    """Producer ranks pack their caches (all their heads) for a 7-token prompt; each consumer rank
    loads only the head slices its plan names (what the server sends), unpacks each into its own
    head range, and ends with exactly its heads; nothing else in its cache is written."""
    gen = torch.Generator().manual_seed(p * 100 + d * 10 + h)
    shape = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, h, HEAD_SIZE)
    global_kv = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16)
    src_slots = torch.tensor([9, 10, 11, 4, 5, 6, 7])
    dst_slots = torch.tensor([0, 1, 2, 3, 16, 17, 18])
    packed = {}
    for rank in range(p):
        heads = rank_heads(h, p, rank)
        layers = [layouts.flash_attn(_rank_cache(global_kv[i], heads)) for i in range(NUM_LAYERS)]
        packed[rank], _ = pack_kv(layers, src_slots)
    for r in range(d):
        heads = rank_heads(h, d, r)
        caches = [
            torch.full_like(_rank_cache(global_kv[i], heads), SENTINEL) for i in range(NUM_LAYERS)
        ]
        moved = 0
        for s in plan_heads(h, p, d, r):
            part = packed[s.rank][:, :, :, s.src[0] : s.src[1]].contiguous()  # the load
            moved += part.nbytes
            views = [
                tuple(t[:, s.dst[0] : s.dst[1]] for t in layouts.flash_attn(c)) for c in caches
            ]
            unpack_kv(part, views, dst_slots)
        assert moved == NUM_LAYERS * 2 * len(src_slots) * len(heads) * HEAD_SIZE * 2  # its share
        for i, cache in enumerate(caches):
            want = torch.full_like(cache, SENTINEL)
            flat_want = want.view(2, NUM_BLOCKS * BLOCK_SIZE, len(heads), HEAD_SIZE)
            flat_src = _rank_cache(global_kv[i], heads).view(2, -1, len(heads), HEAD_SIZE)
            flat_want[:, dst_slots] = flat_src[:, src_slots]
            assert torch.equal(cache, want), (p, d, h, r, i)


def test_mla_round_trip_from_any_producer_rank():
    latent = torch.randint(-(2**15), 2**15, (NUM_BLOCKS, BLOCK_SIZE, 12), dtype=torch.int16)
    slots = torch.arange(6)
    packed = {rank: pack_kv([layouts.mla(latent.clone())], slots)[0] for rank in range(2)}
    for r in range(4):
        (s,) = plan_heads(1, 2, 4, r, mla=True)
        dst = torch.full_like(latent, SENTINEL)
        unpack_kv(packed[s.rank], [layouts.mla(dst)], slots)
        assert torch.equal(dst.view(-1, 12)[:6], latent.view(-1, 12)[:6])
        assert (dst.view(-1, 12)[6:] == SENTINEL).all()
