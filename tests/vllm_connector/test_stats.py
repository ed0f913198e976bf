"""The worker's transfer figures (:mod:`connector.vllm_connector.stats`) and vLLM's view of them
(the facade's ``TritonKVStats``)."""

from __future__ import annotations

from support.vllm_fixtures import requires_vllm

from connector.vllm_connector import stats


def test_recorded_figures_are_taken_once_and_start_anew():
    figures = stats.TransferStats()
    figures.record_save(nbytes=10, num_tokens=2, pack_ms=1.5)
    figures.record_load(nbytes=20, num_tokens=3, fetch_ms=2.0, unpack_ms=0.5)
    figures.record_load_failure()
    figures.record_auth_failures(2)
    assert figures.peek()["loads"] == 1  # peeking takes nothing
    data = figures.take()
    assert (data["saves"], data["bytes_saved"], data["tokens_saved"]) == (1, 10, 2)
    assert (data["loads"], data["bytes_loaded"], data["tokens_loaded"]) == (1, 20, 3)
    assert (data["load_failures"], data["auth_failures"]) == (1, 2)
    assert (data["pack_ms"], data["fetch_ms"], data["unpack_ms"]) == ([1.5], [2.0], [0.5])
    assert figures.take() == stats.empty_stats() and stats.is_empty(stats.empty_stats())


@requires_vllm
def test_stats_aggregate_and_reduce():
    from connector.vllm_connector.connector import TritonKVConnector, TritonKVStats

    a, b = TritonKVStats(), TritonKVStats()
    assert a.is_empty()
    a.data["loads"] += 1
    a.data["fetch_ms"].append(2.0)
    b.data["loads"] += 2
    b.data["fetch_ms"].append(4.0)
    merged = a.aggregate(b).reduce()
    assert merged["loads"] == 3 and merged["avg_fetch_ms"] == 3.0
    rebuilt = TritonKVConnector.build_kv_connector_stats(data=a.data)
    assert not rebuilt.is_empty()


@requires_vllm
def test_digest_failures_reach_vllms_prometheus_counters():
    """vLLM's own Prometheus wiring (KVConnectorProm: the factory finds the connector class, its
    build_prom_metrics registers the counters, the stats logger's observe feeds them) turns an
    interval's digest failures into ``vllm:tritonkv_digest_failures_total`` of that engine."""
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
    figures = stats.TransferStats()
    figures.record_digest_failure()
    figures.record_load_failure()
    prom.observe(figures.take(), engine_idx=1)
    prom.observe(stats.empty_stats(), engine_idx=1)  # a quiet interval adds nothing

    def value(name, engine):
        labels = {"model_name": "tiny", "engine": engine}
        return registry.get_sample_value(f"vllm:tritonkv_{name}_total", labels)

    assert value("digest_failures", "1") == 1.0 and value("load_failures", "1") == 1.0
    assert value("digest_failures", "0") == 0.0 and value("auth_failures", "1") == 0.0
