"""The worker's transfer figures (:mod:`connector.vllm_connector.stats`) and vLLM's view of them
(the facade's ``TritonKVStats``)."""

from __future__ import annotations

import pytest
from support.vllm_fixtures import requires_vllm

from connector.integrity import DigestMismatch
from connector.kvstore import KeyMissError
from connector.transport import AuthError, PeerDeadError, ProtocolError, TransferTimeout
from connector.vllm_connector import stats


def test_recorded_figures_are_taken_once_and_start_anew():
    figures = stats.TransferStats()
    figures.record_save(nbytes=10, num_tokens=2, pack_ms=1.5)
    figures.record_load(nbytes=20, num_tokens=3, network_ms=2.0, unpack_ms=0.5)
    figures.record_load_failure("timeout")
    figures.record_load_failure("digest")
    figures.record_load_refusal("producer")
    figures.record_save_failure("buffer_full")
    figures.record_auth_failures(2)
    figures.record_expired(3)
    assert figures.peek()["loads"] == 1  # peeking takes nothing
    data = figures.take()
    assert (data["saves"], data["bytes_saved"], data["tokens_saved"]) == (1, 10, 2)
    assert (data["loads"], data["bytes_loaded"], data["tokens_loaded"]) == (1, 20, 3)
    assert (data["load_failures"], data["digest_failures"], data["save_failures"]) == (2, 1, 1)
    assert (data["load_failed:timeout"], data["load_failed:digest"]) == (1, 1)
    assert (data["load_refused:producer"], data["save_failed:buffer_full"]) == (1, 1)
    assert (data["auth_failures"], data["entries_expired"]) == (2, 3)
    assert (data["pack_ms"], data["network_ms"], data["unpack_ms"]) == ([1.5], [2.0], [0.5])
    assert figures.take() == stats.empty_stats() and stats.is_empty(stats.empty_stats())


def test_reasons_are_bounded():
    figures = stats.TransferStats()
    for record, reason in [
        (figures.record_load_failure, "eof"),
        (figures.record_load_refusal, "timeout"),
        (figures.record_save_failure, "digest"),
    ]:
        with pytest.raises(ValueError, match=f"expected one of .*got '{reason}'"):
            record(reason)
    with pytest.raises(ValueError, match="gauge: expected one of"):
        figures.set_gauge("loads", 1)
    assert stats.is_empty(figures.take())


@pytest.mark.parametrize(
    "exc,reason",
    [
        (DigestMismatch("read", "a", "b"), "digest"),
        (AuthError("x"), "auth"),
        (TransferTimeout("x"), "timeout"),
        (PeerDeadError("x"), "peer_dead"),
        (ConnectionRefusedError(), "peer_dead"),
        (KeyMissError("x"), "missing"),
        (ProtocolError("x"), "protocol"),
        (RuntimeError("x"), "other"),
    ],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_a_failed_load_has_one_bounded_reason(exc, reason):
    assert stats.load_failure(exc) == reason


def test_gauges_are_each_ranks_last_value_and_reported_when_they_change():
    rank0, rank1 = stats.TransferStats(rank=0), stats.TransferStats(rank=1)
    rank0.set_gauge("buffer_bytes", 100)
    rank1.set_gauge("buffer_bytes", 50)
    step1 = stats.merge(rank0.take(), rank1.take())
    assert stats.gauges(step1) == {"buffer_bytes": {"0": 100, "1": 50}}
    assert not stats.is_empty(step1) and stats.reduce(step1)["buffer_bytes"] == 150
    rank0.set_gauge("buffer_bytes", 100)  # unchanged: nothing to report
    assert stats.is_empty(rank0.take())
    rank0.set_gauge("buffer_bytes", 0)
    later = stats.merge(step1, rank0.take())  # a later step of the same interval: replaced
    assert stats.gauges(later) == {"buffer_bytes": {"0": 0, "1": 50}}


@requires_vllm
def test_stats_aggregate_and_reduce():
    from connector.vllm_connector.connector import TritonKVConnector, TritonKVStats

    a, b = TritonKVStats(), TritonKVStats()
    assert a.is_empty()
    a.data["loads"] += 1
    a.data["network_ms"].append(2.0)
    b.data["loads"] += 2
    b.data["network_ms"].append(4.0)
    merged = a.aggregate(b).reduce()
    assert merged["loads"] == 3 and merged["avg_network_ms"] == 3.0
    rebuilt = TritonKVConnector.build_kv_connector_stats(data=a.data)
    assert not rebuilt.is_empty()


@requires_vllm
def test_the_figures_reach_vllms_prometheus_endpoint():
    """vLLM's own Prometheus wiring (KVConnectorProm: the factory finds the connector class, its
    build_prom_metrics registers the metrics, the stats logger's observe feeds them) turns
    intervals' figures into the engine's counters, outcome counters, histograms and gauges."""
    from functools import partial
    from types import SimpleNamespace

    import prometheus_client
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    registry = prometheus_client.CollectorRegistry()  # not the process-wide one

    class Prom(KVConnectorProm):
        _gauge_cls = partial(prometheus_client.Gauge, registry=registry)
        _counter_cls = partial(prometheus_client.Counter, registry=registry)
        _histogram_cls = partial(prometheus_client.Histogram, registry=registry)

    transfer = KVTransferConfig(
        kv_connector="TritonKVConnector",
        kv_connector_module_path="connector.vllm_connector.connector",
        kv_role="kv_both",
    )
    labels = {0: ["tiny", "0"], 1: ["tiny", "1"]}
    prom = Prom(SimpleNamespace(kv_transfer_config=transfer), ["model_name", "engine"], labels)
    rank0, rank1 = stats.TransferStats(rank=0), stats.TransferStats(rank=1)
    rank0.record_load(nbytes=1000, num_tokens=10, network_ms=3.0, unpack_ms=0.2)
    rank1.record_load(nbytes=1000, num_tokens=10, network_ms=30.0, unpack_ms=0.2)
    rank0.record_load_failure("digest")
    rank0.record_save(nbytes=500, num_tokens=5, pack_ms=1.0)
    rank0.record_save_failure("too_large")
    rank0.set_gauge("buffer_bytes", 500)
    rank1.set_gauge("buffer_bytes", 700)
    refusals = stats.TransferStats()
    refusals.record_load_refusal("engine")
    prom.observe(stats.merge(stats.merge(rank0.take(), rank1.take()), refusals.take()), 1)
    rank1.set_gauge("buffer_bytes", 0)  # a later interval: rank 0 unchanged
    prom.observe(rank1.take(), engine_idx=1)
    prom.observe(stats.empty_stats(), engine_idx=1)  # a quiet interval adds nothing

    def value(name, engine="1", **extra):
        labels = {"model_name": "tiny", "engine": engine, **extra}
        return registry.get_sample_value(f"vllm:tritonkv_{name}", labels)

    assert value("bytes_loaded_total") == 2000.0 and value("tokens_loaded_total") == 20.0
    assert value("bytes_saved_total") == 500.0 and value("bytes_loaded_total", "0") == 0.0
    assert value("loads_total", outcome="ok", reason="none") == 2.0
    assert value("loads_total", outcome="failed", reason="digest") == 1.0
    assert value("loads_total", outcome="refused", reason="engine") == 1.0
    assert value("saves_total", outcome="ok", reason="none") == 1.0
    assert value("saves_total", outcome="failed", reason="too_large") == 1.0
    assert value("digest_failures_total") == 1.0 and value("load_failures_total") == 1.0
    assert value("load_network_seconds_count") == 2.0
    assert value("load_network_seconds_sum") == pytest.approx(0.033)
    assert value("load_network_seconds_bucket", le="0.005") == 1.0  # 3 ms in, 30 ms out
    assert value("save_pack_seconds_count") == 1.0
    assert value("buffer_bytes") == 500.0  # rank 0's 500 + rank 1's latest 0
