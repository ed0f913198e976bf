"""Unit tests of the vLLM connector's pieces that need no running engine: config, layouts, stats."""

from __future__ import annotations

import pytest
import torch
from _vllm_fixtures import requires_vllm

pytestmark = requires_vllm


@pytest.fixture(scope="module")
def vc():
    from connector import vllm_connector

    return vllm_connector


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
        ({"fetch_timeout_s": 0}, ValueError, "fetch_timeout_s: expected > 0"),
        ({"port": 70000}, ValueError, "out of range"),
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
    (k, v), name = vc.layer_views(cache, head_size, 16, use_mla=use_mla)
    assert name == expected
    assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    assert (v is None) == (expected in ("mla", "opaque_pages"))


def test_layer_views_refuses_what_it_cannot_copy(vc):
    cache = torch.zeros(16, 6, 5).transpose(0, 1)  # pages not contiguous, unknown layout
    with pytest.raises(ValueError, match="unsupported KV cache layout"):
        vc.layer_views(cache, 8, 16, use_mla=False)


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


def test_async_load_fetches_on_a_thread_and_unpacks_on_the_worker_thread(vc, monkeypatch):
    """The load thread only fetches; the unpack (torch copies: on CPU an OpenMP team on another
    thread slows every team in the process) runs in get_finished, on the worker's thread. A failed
    fetch still reports its request, with its blocks in the same step's load errors."""
    import threading
    import time
    from types import SimpleNamespace

    from tritonkv import layouts, pack_kv

    block_size, num_blocks = 4, 6
    src = torch.randint(-(2**15), 2**15, (2, num_blocks, block_size, 2, 8), dtype=torch.int16)
    dst = torch.full_like(src, 12345)  # sentinel: rows outside the load must keep it
    src_layers, dst_layers = [layouts.flash_attn(src)], [layouts.flash_attn(dst)]
    prompt_slots = torch.tensor([8, 9, 10, 11, 20, 21])  # blocks 2 and 5 of a 6-token prompt
    packed, _ = pack_kv(src_layers, prompt_slots)

    threads = {"fetch": set(), "unpack": set()}

    class FakeClient:
        def get(self, transfer_id):
            threads["fetch"].add(threading.current_thread())
            if transfer_id == "gone":
                raise ValueError("unknown transfer id")
            return {"kv": packed}, {}

    real_unpack = vc.unpack_kv

    def unpack(*args, **kwargs):
        threads["unpack"].add(threading.current_thread())
        return real_unpack(*args, **kwargs)

    monkeypatch.setattr(vc, "unpack_kv", unpack)
    conn = object.__new__(vc.TritonKVConnector)  # a worker, without an engine around it
    vars(conn).update(
        cfg=vc.ConnectorConfig(async_load=True),
        block_size=block_size,
        _tp_rank=0,
        _layers=dst_layers,
        _device=torch.device("cpu"),
        _lock=threading.Lock(),
        _loading={},
        _pool=None,
        _load_errors=set(),
        _stats=vc.TritonKVStats(),
        _client=lambda host, port: FakeClient(),
    )
    spec = dict(host="h", port=1, block_ids=[2, 5], start=0, count=5, num_tokens=6)
    conn._connector_metadata = vc.TritonKVMetadata(
        loads=[
            vc.LoadSpec("ok", "t1", **spec),
            vc.LoadSpec("bad", "gone", **{**spec, "block_ids": [3, 4]}),
        ]
    )
    conn.start_load_kv(SimpleNamespace())
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
    by_slot_src, by_slot_dst = src.view(2, -1, 2, 8), dst.view(2, -1, 2, 8)  # [K/V, slot, H, D]
    want = torch.full_like(by_slot_dst, 12345)
    want[:, prompt_slots[:5]] = by_slot_src[:, prompt_slots[:5]]
    assert torch.equal(by_slot_dst, want), "loaded rows (and only those) must match the source"
