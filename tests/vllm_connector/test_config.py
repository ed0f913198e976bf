"""``kv_connector_extra_config`` parsing (:mod:`connector.vllm_connector.config`), without vLLM."""

from __future__ import annotations

import dataclasses

import pytest

from connector.vllm_connector.config import RENAMED_KEYS, ConnectorConfig, describe_keys


def test_config_defaults_and_overrides():
    cfg = ConnectorConfig.from_extra({"port": 15000, "load_timeout_s": 3, "kernels": "torch"})
    assert (cfg.port, cfg.load_timeout_s, cfg.kernels) == (15000, 3.0, "torch")
    assert ConnectorConfig.from_extra(None) == ConnectorConfig()
    assert ConnectorConfig().async_load is False


@pytest.mark.parametrize(
    "extra,error,match",
    [
        ({"prot": 1}, ValueError, "unknown keys \\['prot'\\]"),
        ({"port": "14600"}, TypeError, "expected int, got str"),
        ({"port": True}, TypeError, "expected int, got bool"),
        ({"async_load": 1}, TypeError, "expected bool"),
        ({"full_policy": "drop"}, ValueError, "evict\\|wait\\|error"),
        ({"transport": "tcp"}, ValueError, "auto\\|gloo\\|nccl\\|socket"),
        ({"kernels": "cuda"}, ValueError, "kernels: expected auto\\|torch\\|triton"),
        ({"kv_format": "blocks"}, ValueError, "kv_format: expected auto\\|tokens\\|pages"),
        ({"backend": "torch"}, ValueError, "unknown keys \\['backend'\\]"),  # now "kernels"
        ({"wire": "tokens"}, ValueError, "unknown keys \\['wire'\\]"),  # now "kv_format"
        ({"load_timeout_s": 0}, ValueError, "load_timeout_s: expected > 0"),
        ({"port": 70000}, ValueError, "out of range"),
        ({"transfer_cpus": "3-1"}, ValueError, "expected ids and ranges"),
        ({"transfer_cpus": 3}, TypeError, "expected str, got int"),
    ],
)
def test_config_rejects_bad_values(extra, error, match):
    with pytest.raises(error, match=match):
        ConnectorConfig.from_extra(extra)


def test_a_renamed_key_still_works_under_its_old_name_with_a_warning(caplog):
    """``fetch_timeout_s`` is read as ``load_timeout_s``: a logged warning and a
    DeprecationWarning name the new key; both names at once are refused."""
    deprecated = pytest.warns(DeprecationWarning, match="'fetch_timeout_s' is deprecated: use ")
    with caplog.at_level("WARNING", logger="vllm.tritonkv"), deprecated:
        cfg = ConnectorConfig.from_extra({"fetch_timeout_s": 7})
    assert cfg.load_timeout_s == 7.0
    assert "use 'load_timeout_s'" in caplog.text
    assert RENAMED_KEYS == {"fetch_timeout_s": "load_timeout_s"}
    with pytest.raises(ValueError, match="expected 'load_timeout_s' only, got both"):
        ConnectorConfig.from_extra({"fetch_timeout_s": 7, "load_timeout_s": 8})
    with pytest.raises(ValueError, match="load_timeout_s: expected > 0"):
        ConnectorConfig.from_extra({"fetch_timeout_s": 0})


def test_every_key_is_documented_once_beside_its_field():
    """The defaults and meanings live in the dataclass only; the table is generated from it."""
    keys = describe_keys()
    assert [k for k, _, _ in keys] == [f.name for f in dataclasses.fields(ConnectorConfig)]
    undocumented = [k for k, _, meaning in keys if not meaning]
    assert undocumented == []
    assert dict((k, d) for k, d, _ in keys)["port"] == "14600"


def test_producers_are_addresses_networks_or_host_names():
    cfg = ConnectorConfig.from_extra({"producers": ["10.0.0.0/8", "fd00::/8", "192.0.2.7", "P-0."]})
    assert cfg.producers == ("10.0.0.0/8", "fd00::/8", "192.0.2.7", "P-0.")
    for host in ("10.1.2.3", "::ffff:10.1.2.3", "fd00::1", "192.0.2.7", "p-0", "P-0."):
        assert cfg.allows_producer(host), host
    for host in ("11.0.0.1", "192.0.2.8", "fe80::1", "p-1", "10.0.0.1.example"):
        assert not cfg.allows_producer(host), host
    assert ConnectorConfig().allows_producer("anything.example")  # empty: any producer
    with pytest.raises(TypeError, match="expected a list of strings"):
        ConnectorConfig.from_extra({"producers": "10.0.0.0/8"})
    with pytest.raises(ValueError, match="producers: expected IP addresses, networks"):
        ConnectorConfig.from_extra({"producers": ["10.0.0.0/33"]})


def test_producers_may_name_ports_that_must_hold_every_tp_port():
    cfg = ConnectorConfig.from_extra(
        {"producers": ["10.0.0.0/8:14600-14603", "prefill-0:15000", "[fd00::/8]:16000-16001"]}
    )
    allowed = [("10.1.2.3", 14600, 4), ("10.1.2.3", 14602, 2), ("prefill-0", 15000, 1),
               ("fd00::1", 16000, 2), ("10.1.2.3", None, 1)]  # fmt: skip
    for host, port, tp in allowed:
        assert cfg.allows_producer(host, port, tp), (host, port, tp)
    refused = [("10.1.2.3", 14599, 1), ("10.1.2.3", 14602, 4), ("10.1.2.3", 22, 1),
               ("prefill-0", 15001, 1), ("prefill-1", 15000, 1), ("fd00::1", 16001, 2),
               ("11.0.0.1", 14600, 1)]  # fmt: skip
    for host, port, tp in refused:
        assert not cfg.allows_producer(host, port, tp), (host, port, tp)
    for bad in ("10.0.0.0/8:0", "10.0.0.0/8:14700-14600", "host:70000", "[fd00::/8]:x"):
        with pytest.raises(ValueError, match="optionally with :port or :first-last"):
            ConnectorConfig.from_extra({"producers": [bad]})
