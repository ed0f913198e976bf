"""The kernel cases on CUDA (skipped without a GPU), plus CUDA-graph capture and launch counting."""

from __future__ import annotations

import pytest
import support.kv_cases as kv_cases
import torch
from support.kv_cases import (
    DTYPE_IDS,
    DTYPES,
    LAYOUT_IDS,
    assert_bits_equal,
    like_with_sentinel,
    loop_pack,
    loop_unpack,
    make_cache,
    random_bits_,
    storage_bits,
)

from tritonkv import pack_hidden, pack_kv, unpack_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
QSL = torch.tensor([0, 18, 19, 20], device="cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def on_cuda(monkeypatch):
    monkeypatch.setattr(kv_cases, "DEVICE", "cuda")
    monkeypatch.setenv("TRITONKV_KERNELS", "auto")


def _slots(n=20, num_slots=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:n]
    slots[3] = -1
    return slots.cuda()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_roundtrip_on_cuda(layout, dtype):
    raw, layers = make_cache(layout, dtype, num_layers=3, head_size=12)
    slots = _slots()
    packed, _ = pack_kv(layers, slots, QSL, [2, 0])
    expected = loop_pack(layers, slots.cpu(), QSL.cpu(), [2, 0])
    assert_bits_equal(packed.cpu(), expected, f"pack {layout}")
    dst_raw, dst_layers = like_with_sentinel(raw, layout)
    exp_raw, exp_layers = like_with_sentinel(raw, layout)
    unpack_kv(packed, dst_layers, slots, QSL, [2, 0])
    loop_unpack(packed, exp_layers, slots.cpu(), QSL.cpu(), [2, 0])
    for got, want in zip(storage_bits(dst_raw), storage_bits(exp_raw), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("seq_ids", [None, [2, 0]], ids=["all", "some"])
def test_non_contiguous_index_tensors_on_cuda(seq_ids):
    """Index tensors that are columns of bigger ones, already on the GPU (int64 offsets stay as
    they are there): the kernels read index tensors with stride 1, so they must get contiguous
    ones. The values between the columns are valid, so a stride-1 read gives wrong rows."""
    raw, layers = make_cache("flash_attn_nhd", torch.float16, num_layers=3, head_size=12)

    def every_other(t):
        return torch.stack([t, t.flip(0)], 1)[:, 0]

    slots, qsl = every_other(_slots()), every_other(QSL.long())
    assert not (slots.is_contiguous() or qsl.is_contiguous())
    ids = range(3) if seq_ids is None else seq_ids
    packed, _ = pack_kv(layers, slots, qsl, seq_ids)
    expected = loop_pack(layers, slots.cpu(), qsl.cpu(), ids)
    assert_bits_equal(packed.cpu(), expected, "pack")
    dst_raw, dst_layers = like_with_sentinel(raw, "flash_attn_nhd")
    exp_raw, exp_layers = like_with_sentinel(raw, "flash_attn_nhd")
    unpack_kv(packed, dst_layers, slots, qsl, seq_ids)
    loop_unpack(packed, exp_layers, slots.cpu(), qsl.cpu(), ids)
    for got, want in zip(storage_bits(dst_raw), storage_bits(exp_raw), strict=True):
        assert torch.equal(got.cpu(), want.cpu())


def test_large_batch_matches_torch_twin():
    """Thousands of tokens, 32 layers, bf16 HND: the kernel equals the twin bit for bit."""
    from tritonkv import pack_kv_torch

    raw, layers = make_cache(
        "flash_attn_hnd",
        torch.bfloat16,
        num_layers=32,
        num_blocks=512,
        block_size=16,
        num_kv_heads=8,
        head_size=128,
    )
    slots = torch.randperm(512 * 16, device="cuda")[:4000]
    qsl = torch.tensor([0, 1000, 1001, 3000, 4000], device="cuda")
    packed, _ = pack_kv(layers, slots, qsl, [3, 0, 2])
    twin, _ = pack_kv_torch(layers, slots, qsl, [3, 0, 2])
    assert_bits_equal(packed, twin, "large batch")


@pytest.mark.parametrize("prepared", [False, True], ids=["views", "prepared"])
def test_cuda_graph_capture_pack_and_unpack(prepared):
    """With out= and device-resident indices, pack_kv/unpack_kv capture and replay in a graph,
    given the views or a prepared KVCacheSet (whose direct launches run on the capturing
    stream)."""
    from tritonkv import prepare_kv

    raw, layers = make_cache("flash_attn_nhd", torch.float16, num_layers=4)
    dst_raw, dst_layers = like_with_sentinel(raw, "flash_attn_nhd")
    src, dst = (prepare_kv(layers), prepare_kv(dst_layers)) if prepared else (layers, dst_layers)
    slots, ids = _slots(), torch.tensor([0, 2], device="cuda")
    out = torch.empty(4, 2, 19, 2, 8, dtype=torch.float16, device="cuda")
    for _ in range(2):  # warm-up: autotune + address table; the second call already goes direct
        pack_kv(src, slots, QSL, ids, out=out)
        unpack_kv(out, dst, slots, QSL, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pack_kv(src, slots, QSL, ids, out=out)
        unpack_kv(out, dst, slots, QSL, ids)
    gen = torch.Generator().manual_seed(5)
    for r in raw:
        random_bits_(r, gen)  # new contents, same addresses
    graph.replay()
    torch.cuda.synchronize()
    expected = loop_pack(layers, slots.cpu(), QSL.cpu(), [0, 2])
    assert_bits_equal(out.cpu(), expected, "replayed pack")
    unpacked = loop_pack(dst_layers, slots.cpu(), QSL.cpu(), [0, 2])
    assert_bits_equal(unpacked, expected, "replayed unpack")


def test_one_launch_for_all_layers():
    """32 layers, K and V: the profiler sees exactly one copy kernel per pack_kv call."""
    raw, layers = make_cache(
        "flash_attn_nhd",
        torch.bfloat16,
        num_layers=32,
        num_blocks=64,
        block_size=16,
        num_kv_heads=8,
        head_size=128,
    )
    slots = torch.arange(512, device="cuda")
    qsl = torch.tensor([0, 256, 512], device="cuda")
    out = torch.empty(32, 2, 512, 8, 128, dtype=torch.bfloat16, device="cuda")
    pack_kv(layers, slots, qsl, out=out)  # autotune outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        pack_kv(layers, slots, qsl, out=out)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "_kv_copy_kernel" in e.name]
    assert len(names) == 1, names


def test_check_env_catches_bad_slots_on_gpu(monkeypatch):
    _, layers = make_cache("flash_attn_nhd", torch.float16)
    monkeypatch.setenv("TRITONKV_CHECK", "1")
    with pytest.raises(ValueError, match="slot_mapping"):
        pack_kv(layers, torch.full((20,), 10_000, device="cuda"), QSL)


def test_hidden_on_cuda():
    hidden = torch.randn(20, 4096, device="cuda", dtype=torch.bfloat16)
    packed, _ = pack_hidden(hidden, QSL, [2, 0], last_only=True)
    assert_bits_equal(packed.cpu(), hidden[[19, 17]].cpu(), "hidden")


@pytest.mark.parametrize("last_only", [False, True], ids=["all_rows", "last_only"])
@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_index_of_thousands_of_sequences_on_cuda(where, last_only):
    """The index for CUDA data: made on the host and copied (offsets on the host) or by the
    one-program kernel (offsets on the GPU, 1024 sequences a step); both equal the host index
    (``tritonkv._index``, called directly: the ops do not return the index's ``src_start``)."""
    from tritonkv._index import host_seq_index, seq_index

    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1 if last_only else 0, 6, (2500,), generator=gen)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    ids = torch.randperm(2500, generator=gen)[:2100]
    num_tokens = int(qsl[-1])
    got = seq_index(
        qsl.to(where), ids.to(where), num_tokens, torch.device("cuda"), last_only=last_only
    )
    want = host_seq_index(qsl, ids, num_tokens, last_only)
    assert got.cu_seqlens.is_cuda and got.src_start.is_cuda
    assert torch.equal(got.cu_seqlens.cpu(), want.cu_seqlens)
    assert torch.equal(got.src_start.cpu(), want.src_start)


@pytest.mark.parametrize(
    "layout,dtype,head_size",
    [
        ("flash_attn_nhd", torch.bfloat16, 128),  # 8-byte copies: the digest in the launch
        ("vllm_pages_lbhnc", torch.float32, 12),
        ("mla", torch.bfloat16, 576),
        ("flashinfer_hnd", torch.float8_e4m3fn, 5),  # 1-byte copies: the digest's own launch
    ],
    ids=["nhd-bf16", "pages-fp32", "mla-bf16", "hnd-fp8-odd"],
)
def test_digest_on_cuda_is_the_reference_and_sees_a_flip(layout, dtype, head_size):
    """pack, unpack and kv_digest on CUDA give the NumPy reference's digest of the packed bytes;
    one flipped bit changes what unpack reports."""
    from tritonkv import kv_digest
    from tritonkv.digest import digest_hex, packed_digest

    raw, layers = make_cache(layout, dtype, num_layers=3, head_size=head_size)
    slots = _slots()
    packed, _, sent = pack_kv(layers, slots, QSL, [2, 0], digest=True)
    want = digest_hex(packed_digest(packed.cpu()))
    dst_raw, dst_layers = like_with_sentinel(raw, layout)
    read = unpack_kv(packed, dst_layers, slots, QSL, [2, 0], digest=True)
    again = kv_digest(layers, slots, QSL, [2, 0])
    assert [digest_hex(d) for d in (sent, read, again)] == [want] * 3
    packed.view(torch.uint8).view(-1)[packed.numel() // 3] ^= 0x20
    assert digest_hex(unpack_kv(packed, dst_layers, slots, QSL, [2, 0], digest=True)) != want


def _prepared_case(layout="flash_attn_nhd", dtype=torch.bfloat16, num_layers=4):
    raw, layers = make_cache(layout, dtype, num_layers=num_layers, head_size=16)
    parts, heads = 1 + (layers[0][1] is not None), layers[0][0].shape[1]
    out = torch.empty(num_layers, parts, 19, heads, 16, dtype=dtype, device="cuda")
    return raw, layers, out


@pytest.mark.parametrize("layout", ["flash_attn_nhd", "flash_attn_hnd", "mla", "vllm_pages_lbnhc"])
def test_prepared_handle_on_cuda_is_the_plain_path(layout):
    """pack/unpack with a prepared handle, direct launches from the second call on: the plain
    path's bits, the loop oracle's, and sentinel caches written exactly as the plain path does."""
    from tritonkv import _launch, prepare_kv

    raw, layers, out = _prepared_case(layout)
    slots, ids = _slots(), torch.tensor([2, 0], device="cuda")
    handle = prepare_kv(layers)
    expected = loop_pack(layers, slots.cpu(), QSL.cpu(), [2, 0])
    for _ in range(3):
        out.fill_(0)
        pack_kv(handle, slots, QSL, ids, out=out)
        assert_bits_equal(out.cpu(), expected, f"prepared pack {layout}")
    assert_bits_equal(pack_kv(layers, slots, QSL, ids)[0].cpu(), expected, "plain pack")
    width = min(handle.layer_set.width, 8)  # the kernels move at most 8-byte integers
    groups = handle.layer_set.launches(width, handle.views)
    assert bool(groups[0].direct) == _launch.DIRECT  # the direct launches are the ones checked
    dst_raw, dst_layers = like_with_sentinel(raw, layout)
    plain_raw, plain_layers = like_with_sentinel(raw, layout)
    dst = prepare_kv(dst_layers)
    for _ in range(2):
        unpack_kv(out, dst, slots, QSL, ids)
    unpack_kv(out, plain_layers, slots, QSL, ids)
    for got, want in zip(storage_bits(dst_raw), storage_bits(plain_raw), strict=True):
        assert torch.equal(got, want)


def test_the_layer_table_is_kept_for_every_stream_that_launched_with_it():
    """The device table of layer addresses is allocated on the stream current when it is made;
    a launch on another stream records its use there, so that freeing it (the caller's views
    gone) cannot hand its memory out again before that stream's launches read it."""
    from tritonkv import prepare_kv

    _, layers, out = _prepared_case()
    slots, ids = _slots(), torch.tensor([2, 0], device="cuda")
    handle = prepare_kv(layers)
    side = torch.cuda.Stream()
    pack_kv(handle, slots, QSL, ids, out=out)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # the second one direct
            pack_kv(handle, slots, QSL, ids, out=out)
    torch.cuda.synchronize()
    [group] = handle.layer_set.launches(min(handle.layer_set.width, 8), handle.views)
    assert group.streams == {torch.cuda.current_stream().cuda_stream, side.cuda_stream}


def test_prepared_out_path_never_syncs():
    """With out= (pack) or packed (unpack) and index tensors on the GPU, a prepared call makes no
    host sync (torch's sync debug mode raises on one)."""
    from tritonkv import prepare_kv

    raw, layers, out = _prepared_case()
    _, dst_layers = like_with_sentinel(raw, "flash_attn_nhd")
    src, dst = prepare_kv(layers), prepare_kv(dst_layers)
    slots, ids = _slots(), torch.tensor([2, 0], device="cuda")
    pack_kv(src, slots, QSL, ids, out=out)  # warm-up: compiles, tunes, files the direct launch
    unpack_kv(out, dst, slots, QSL, ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            pack_kv(src, slots, QSL, ids, out=out)
            unpack_kv(out, dst, slots, QSL, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert_bits_equal(out.cpu(), loop_pack(layers, slots.cpu(), QSL.cpu(), [2, 0]), "pack")


def test_prepared_fused_digest_of_4_byte_words_on_cuda():
    """fp32 caches move 4-byte words (or 8): the fused digest of either width compiles and equals
    the reference digest (a 4-byte width failed to compile before tile_lanes lost its early
    return)."""
    from tritonkv import prepare_kv
    from tritonkv.digest import packed_digest

    _raw, layers = make_cache("flash_attn_nhd", torch.float32, num_layers=3, head_size=12)
    handle = prepare_kv(layers)
    slots = _slots()
    room = torch.empty(3 * 2 * 20 * 2 * 12 + 1, dtype=torch.float32, device="cuda")
    for shift in (0, 1):  # 16-byte aligned (8-byte words), then 4 bytes off (4-byte words)
        out = room[shift : shift + 3 * 2 * 20 * 2 * 12].view(3, 2, 20, 2, 12)
        for _ in range(2):
            _, _, digest = pack_kv(handle, slots, QSL, out=out, digest=True)
            assert torch.equal(digest.cpu(), packed_digest(out.cpu())), shift
