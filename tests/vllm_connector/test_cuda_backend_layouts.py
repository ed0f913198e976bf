"""The caches of every vLLM 0.32 CUDA attention backend, in every layout vLLM may give them, built
on the CPU exactly as the GPU model runner allocates them (:mod:`support.vllm_layouts`), are
accepted by the connector and move bit for bit between two ranks.

What is checked is always vLLM's own view of the bytes (its logical ``[kernel blocks, H, N, C]``
cells) and the whole backing allocation: sentinels everywhere but the transferred cells show that
nothing else (another layer, another block, padding) was written.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.connector_sides import DIGEST, fake_client
from support.kvstore import deliver
from support.vllm_layouts import CASES, Allocation, Case, copy_cells, layer_spec, vllm_caches
from vllm.v1.kv_cache_layout import KVCacheLayout

from connector.kvstore import KVBuffer
from connector.vllm_connector.cache_views import PAGES_ONLY, RankCaches
from connector.vllm_connector.config import ConnectorConfig
from connector.vllm_connector.consumer import Consumer
from connector.vllm_connector.metadata import LoadSpec, SaveSpec
from connector.vllm_connector.producer import Producer
from connector.vllm_connector.stats import TransferStats
from tritonkv import _kv_triton, pack_kv, unpack_kv

SENTINEL = 0xA5  # every byte of a destination allocation before a load


def _allocates(case: Case, layout: KVCacheLayout) -> bool:
    """Whether vLLM allocates ``case`` in ``layout`` at all: it refuses to split blocks into
    kernel blocks where a block's page is not dense (heads outside blocks, LHBNC / BHLNC)."""
    try:
        vllm_caches(case, layout, fill=0)
    except ValueError as exc:
        assert "cannot be split" in str(exc)
        return False
    return True


_ALL = [(c, lay) for c in CASES for lay in c.layouts]
PAIRS = [pytest.param(c, lay, id=f"{c.name}-{lay.name}") for c, lay in _ALL if _allocates(c, lay)]
VLLM_REFUSES = [f"{c.name}-{lay.name}" for c, lay in _ALL if not _allocates(c, lay)]
DEFAULT = [pytest.param(c, id=c.name) for c in CASES]  # vLLM's default layout, LBNHC


def expected_layout(case: Case) -> str:
    """MLA: one latent row per token; K and V of ``head_size`` each: token rows of K and V;
    anything else (scales inline, nvfp4, K and V of unequal sizes): whole pages."""
    spec = layer_spec(case)
    if case.mla:
        return "mla"
    if spec.state_content_size_bytes == 2 * case.head_size * spec.dtype.itemsize:
        return "vllm_pages"
    return "vllm_packed"


def rank(alloc: Allocation, case: Case) -> RankCaches:
    return RankCaches(
        alloc.caches, case.head_size, case.block_size, use_mla=case.mla, on_cpu=False, isa=None
    )


def moves(src_blocks, dst_blocks, block_size, first, stop) -> list[tuple[int, int]]:
    """``(src_slot, dst_slot)`` of each position in ``[first, stop)``."""
    return [
        (src_blocks[p // block_size] * block_size + p % block_size,
         dst_blocks[p // block_size] * block_size + p % block_size)
        for p in range(first, stop)
    ]  # fmt: skip


def blocks(case: Case) -> tuple[list[int], list[int]]:
    """Three source and three destination blocks of ``case``'s caches, out of order."""
    nb = case.num_blocks
    return [nb - 2, 1, nb - 1], [nb - 1, 0, 2]


def move(src: RankCaches, dst: RankCaches, src_blocks, dst_blocks, first, stop, *, pages):
    """One save on ``src`` and one load into ``dst`` of positions ``[first, stop)`` (the real
    pack/unpack path: the torch twin on CPU tensors)."""
    rows = max(len(src_blocks), len(dst_blocks)) * src.block_size
    views = (src.pages, dst.pages) if pages else (src.layers, dst.layers)
    packed, _ = pack_kv(views[0], src.slots(src_blocks, first, stop, rows))
    unpack_kv(packed, views[1], dst.slots(dst_blocks, first, stop, rows))


def check_moved(case, layout, src, dst, pairs):
    want = vllm_caches(case, layout, fill=SENTINEL)
    copy_cells(want, src, pairs)
    got, expected = dst.raw, want.raw
    bad = (got != expected).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} bytes differ, first at {bad[:8].tolist()}"


def test_only_what_vllm_refuses_to_allocate_is_left_out():
    """The pairs not tested are exactly those vLLM itself refuses at start: 128-token blocks
    split into FlashInfer's 64-token kernel blocks where heads lie outside blocks (LHBNC: a
    block's page is not dense; MLA's single head slot keeps FlashMLA's dense)."""
    assert VLLM_REFUSES == ["flashinfer-nvfp4-LHBNC"]


@pytest.mark.parametrize("case,layout", PAIRS)
def test_the_harness_allocates_what_the_backend_declares(case, layout):
    """The caches are vLLM's: ``[kernel blocks, head slots, kernel block size, C]`` with C the
    spec's cell bytes, in the layout's physical order, all layers in one allocation."""
    alloc = vllm_caches(case, layout)
    spec, cache = alloc.spec, alloc.caches[0]
    want_shape = (case.num_blocks * alloc.ratio, spec.num_heads, alloc.kernel_block_size)
    assert tuple(cache.shape[:3]) == want_shape
    assert cache.shape[3] * cache.element_size() == spec.state_content_size_bytes
    order = sorted(range(4), key=lambda d: -cache.stride(d))
    assert tuple(order) == layout.layer_view_order or 1 in (cache.shape[1], cache.shape[2])
    assert all(c.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
               for c in alloc.caches)  # fmt: skip


@pytest.mark.parametrize("case,layout", PAIRS)
def test_every_backend_cache_is_accepted(case, layout):
    """Each cache gets a layout and a format that can move it: token rows where the cells are
    K and V of ``head_size`` each (or an MLA latent), whole pages otherwise; pages exist in every
    layout (a block's page is its cells, however they are spread)."""
    caches = rank(vllm_caches(case, layout), case)
    assert caches.layout == expected_layout(case)
    assert caches.kv_format("auto") == ("pages" if caches.layout in PAGES_ONLY else "tokens")
    assert caches.pages is not None and caches.page_kind.startswith(caches.layout)
    assert caches.num_slots == case.num_blocks * case.block_size


@pytest.mark.parametrize("case,layout", PAIRS)
def test_whole_pages_move_bit_exact(case, layout):
    """A 3-block prompt's pages, from source blocks out of order into other destination blocks:
    every cell of those pages, in every layer; no other byte of the allocation changes."""
    src, dst = vllm_caches(case, layout), vllm_caches(case, layout, fill=SENTINEL)
    bs = case.block_size
    src_blocks, dst_blocks = blocks(case)
    stop = len(src_blocks) * bs
    move(rank(src, case), rank(dst, case), src_blocks, dst_blocks, 0, stop, pages=True)
    check_moved(case, layout, src, dst, moves(src_blocks, dst_blocks, bs, 0, stop))


@pytest.mark.parametrize(
    "case,layout", [p for p in PAIRS if expected_layout(p.values[0]) != "vllm_packed"]
)
def test_token_rows_move_bit_exact(case, layout):
    """Token rows of positions [bs + 3, 2 bs + 5) (past a local hit, into a block's middle) write
    exactly those tokens' cells, in kernel blocks too."""
    src, dst = vllm_caches(case, layout), vllm_caches(case, layout, fill=SENTINEL)
    bs = case.block_size
    first, stop = bs + 3, 2 * bs + 5
    src_blocks, dst_blocks = blocks(case)
    move(rank(src, case), rank(dst, case), src_blocks, dst_blocks, first, stop, pages=False)
    check_moved(case, layout, src, dst, moves(src_blocks, dst_blocks, bs, first, stop))


def _producer(caches: RankCaches, kv_format: str = "auto") -> Producer:
    return Producer(
        ConnectorConfig(kv_format=kv_format),
        caches,
        tp_rank=0,
        engine_port=14600,
        fingerprint="fp",
        secret=None,
        stats=TransferStats(),
    )


def transfer(prod: Producer, dst: RankCaches, src_blocks, dst_blocks, num_tokens, start):
    """Save a ``num_tokens`` prompt on ``prod``, load it into ``dst`` past a local hit of
    ``start`` positions, in process; returns ``(consumer, its load-error blocks)``."""
    buffer = KVBuffer(1 << 24)
    prod.attach_buffer(buffer)
    prod.wait_for_save([SaveSpec("p", "t1", src_blocks, num_tokens, prompt_digest=DIGEST)])
    cons = Consumer(
        ConnectorConfig(),
        dst,
        tp_rank=0,
        tp_size=1,
        total_kv_heads=dst.num_heads,
        use_mla=dst.layout == "mla",
        secret=None,
        stats=TransferStats(),
        connect=lambda host, port: fake_client(partial(deliver, buffer)),
    )
    count = num_tokens - 1 - start
    spec = LoadSpec("c", "t1", "h", 1, dst_blocks, start, count, num_tokens, prompt_digest=DIGEST)
    cons.start_load_kv([spec])
    buffer.close()
    errors = cons.get_block_ids_with_load_errors()
    cons.shutdown()
    return cons, errors


@pytest.mark.parametrize("case", DEFAULT)
def test_the_connector_sides_move_each_backend_in_the_default_layout(case):
    """Producer and consumer, as the worker builds them, under vLLM's default layout (LBNHC:
    the token dim outside the heads, so a block's cells are not in token-row order): a prompt of
    2 blocks and 5 tokens past a one-block local hit lands where ``kv_format`` "auto" puts it:
    token rows for its positions but the last, or whole pages of its blocks after the hit."""
    layout = KVCacheLayout.LBNHC
    src, dst = vllm_caches(case, layout), vllm_caches(case, layout, fill=SENTINEL)
    bs, num_tokens = case.block_size, 2 * case.block_size + 5
    src_blocks, dst_blocks = blocks(case)
    prod = _producer(rank(src, case))
    cons, errors = transfer(prod, rank(dst, case), src_blocks, dst_blocks, num_tokens, start=bs)
    assert errors == set()
    assert cons.stats.peek()["loads"] == 1
    stop = 3 * bs if prod.kv_format == "pages" else num_tokens - 1
    check_moved(case, layout, src, dst, moves(src_blocks, dst_blocks, bs, bs, stop))


PACKED = [c for c in CASES if expected_layout(c) == "vllm_packed"]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in PACKED])
def test_token_rows_of_packed_caches_are_refused_at_start_and_on_load(case):
    """A packed cell's token axis need not index tokens (FlashInfer's nvfp4 pages in NHD order
    keep all of K before V), so "tokens" is refused at start, naming the content; a consumer
    handed token rows from a K/V cache fails the load (recompute) and writes nothing."""
    alloc = vllm_caches(case, KVCacheLayout.LBNHC)
    with pytest.raises(ValueError, match=r'"tokens" cannot address this cache: vLLM packs each'):
        _producer(rank(alloc, case), "tokens")
    kv_case = CASES[0]
    prod = _producer(rank(vllm_caches(kv_case, KVCacheLayout.LBNHC), kv_case), "tokens")
    dst = vllm_caches(case, KVCacheLayout.LBNHC, fill=SENTINEL)
    cons, errors = transfer(prod, rank(dst, case), [1, 2], [0, 3], 40, start=0)
    assert errors == {[0, 3][p // case.block_size] for p in range(39)}
    assert cons.stats.peek()["load_failures"] == 1
    assert torch.equal(dst.raw, torch.full_like(dst.raw, SENTINEL))


@pytest.mark.parametrize(
    "src_layout,dst_case",
    [
        (KVCacheLayout.LBHNC, "triton_attn-int8_per_token_head"),  # same cells, other order
        (KVCacheLayout.LBNHC, "triton_attn-fp8_per_token_head"),  # same shape, other dtype
    ],
)
def test_pages_into_an_unlike_packed_cache_are_refused_and_recomputed(src_layout, dst_case):
    """Pages of one packed cache are never written into a cache whose pages differ in order or
    dtype (the page kinds differ): the load fails and the destination keeps its sentinels."""
    case = next(c for c in CASES if c.name == "triton_attn-int8_per_token_head")
    other = next(c for c in CASES if c.name == dst_case)
    prod = _producer(rank(vllm_caches(case, src_layout), case))
    dst = vllm_caches(other, KVCacheLayout.LBNHC, fill=SENTINEL)
    cons, errors = transfer(prod, rank(dst, other), [1, 2], [0, 3], 40, start=0)
    assert errors == {0, 3} and cons.stats.peek()["load_failures"] == 1
    assert torch.equal(dst.raw, torch.full_like(dst.raw, SENTINEL))


PERMUTED = [  # pages not in token-row order (LBNHC, BLNHC) or not dense (LHBNC)
    p
    for p in PAIRS
    if p.values[0].name in ("triton_attn-int8_per_token_head", "flashinfer-nvfp4", "flash_attn")
    and p.values[1] in (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC, KVCacheLayout.LHBNC)
]


@pytest.mark.parametrize("case,layout", PERMUTED)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_batches_of_prompts_move_whole_pages_of_permuted_caches(case, layout, data):
    """Several prompts (any lengths, any distinct destination blocks, local hits of whole
    blocks) loaded one after another into one cache: each lands in its own blocks' pages from
    its first missing block on, and nothing else is written."""
    bs, nb = case.block_size, case.num_blocks
    src, dst = vllm_caches(case, layout), vllm_caches(case, layout, fill=SENTINEL)
    src_rank, dst_rank = rank(src, case), rank(dst, case)
    free = data.draw(st.permutations(range(nb)), label="destination block order")
    expected = []
    for _ in range(data.draw(st.integers(1, 3), label="prompts")):
        if not free:
            break
        num_tokens = data.draw(st.integers(1, len(free) * bs), label="num_tokens")
        need = -(-num_tokens // bs)
        dst_blocks, free = list(free[:need]), free[need:]
        src_blocks = data.draw(
            st.lists(st.integers(0, nb - 1), min_size=need, max_size=need, unique=True)
        )
        first = data.draw(st.integers(0, need - 1), label="local-hit blocks") * bs
        move(src_rank, dst_rank, src_blocks, dst_blocks, first, need * bs, pages=True)
        expected += moves(src_blocks, dst_blocks, bs, first, need * bs)
    check_moved(case, layout, src, dst, expected)


def test_unknown_caches_with_permuted_dense_pages_are_copied_whole():
    """A layout no view knows, whose pages are dense but permuted (``cache[0]`` not contiguous,
    which was refused before): whole pages of blocks [4, 1] land in blocks [0, 3], bit for bit,
    and every other element keeps its sentinel."""
    gen = torch.Generator().manual_seed(7)
    raw = [torch.randint(-(2**15), 2**15, (6, 16, 3, 5), generator=gen, dtype=torch.int16)
           for _ in range(2)]  # fmt: skip
    src = [r.permute(0, 2, 1, 3) for r in raw]  # [6, 3, 16, 5], memory [6, 16, 3, 5]
    dst = [torch.full_like(r, -7).permute(0, 2, 1, 3) for r in raw]
    src_rank, dst_rank = (RankCaches(c, 8, 16, use_mla=False, on_cpu=True, isa="vec")
                          for c in (src, dst))  # fmt: skip
    assert (src_rank.layout, src_rank.kv_format("auto")) == ("opaque_pages", "pages")
    move(src_rank, dst_rank, [4, 1], [0, 3], 0, 32, pages=True)
    for s, d in zip(src, dst, strict=True):
        want = torch.full_like(d, -7)
        want[[0, 3]] = s[[4, 1]]
        assert torch.equal(d, want)


def test_slots_are_checked_on_the_host_whatever_the_device():
    """Slots are made and range-checked on the host before they go to the caches' device
    (here ``meta``, which holds no data: a device-side check could not run there), so a block id
    past the cache is a ValueError, never a copy out of bounds."""
    case = CASES[0]
    spec = layer_spec(case)
    shape = (case.num_blocks, spec.num_heads, case.block_size, 2 * case.head_size)
    cache = torch.empty(shape, dtype=spec.dtype, device="meta")
    caches = RankCaches([cache], case.head_size, case.block_size, use_mla=False, on_cpu=False,
                        isa=None)  # fmt: skip
    slots = caches.slots([3, case.num_blocks - 1], 0, 40, 2 * case.block_size)
    assert slots.device.type == "meta" and slots.shape == (2 * case.block_size,)
    with pytest.raises(ValueError, match=r"outside this cache's \[0, 224\)"):
        caches.slots([3, case.num_blocks], 0, 40, 2 * case.block_size)
    with pytest.raises(ValueError, match="need 2 blocks of 32, got 1"):
        caches.slots([3], 0, 40, 2 * case.block_size)


@pytest.mark.parametrize(
    "case,layout,pages",
    [
        pytest.param(CASES[8], KVCacheLayout.LBNHC, True, id="int8_per_token_head-LBNHC-pages"),
        pytest.param(CASES[8], KVCacheLayout.LHBNC, True, id="int8_per_token_head-LHBNC-pages"),
        pytest.param(CASES[0], KVCacheLayout.LBNHC, False, id="flash_attn-LBNHC-tokens"),
    ],
)
def test_the_triton_kernels_address_permuted_caches_alike(monkeypatch, case, layout, pages):
    """The Triton kernels (the GPU path, here under Triton's CPU interpreter) read the same
    strides as the torch twin: permuted and spread-out pages, and token rows of LBNHC, land
    bit for bit in the same cells."""
    assert case.name in ("triton_attn-int8_per_token_head", "flash_attn")
    monkeypatch.setenv("TRITONKV_KERNELS", "triton")
    launches = []
    copy_kv = _kv_triton.copy_kv
    monkeypatch.setattr(_kv_triton, "copy_kv", lambda *a, **kw: launches.append(copy_kv(*a, **kw)))
    src, dst = vllm_caches(case, layout), vllm_caches(case, layout, fill=SENTINEL)
    bs = case.block_size
    src_blocks, dst_blocks = blocks(case)
    first, stop = (0, 3 * bs) if pages else (bs + 3, 2 * bs + 5)
    move(rank(src, case), rank(dst, case), src_blocks, dst_blocks, first, stop, pages=pages)
    assert len(launches) == 2  # the pack and the unpack ran the Triton kernels
    check_moved(case, layout, src, dst, moves(src_blocks, dst_blocks, bs, first, stop))
