"""A producer rank's KV server: where it serves, to whom, and its buffer watcher (no vLLM)."""

from __future__ import annotations

import logging
import socket

import pytest
from support.connector_sides import NHD, caches, producer

from connector.serve.launch import free_port_run
from connector.vllm_connector.config import ConnectorConfig

SECRET = b"unit-test-shared-secret-01234567"


def test_a_taken_port_fails_the_start_naming_the_address_and_the_config_key():
    base = free_port_run(2)
    prod = producer(caches(NHD), 4, cfg=ConnectorConfig(port=base - 4), tp_rank=1, engine_port=base)
    taken = f"rank 1 cannot serve KV on 127.0.0.1:{base + 1} "
    with socket.create_server(("127.0.0.1", base + 1)), pytest.raises(OSError, match=taken):
        prod.serve()
    prod.serve()  # free again: serves on base + 1
    try:
        assert prod.server.address == ("127.0.0.1", base + 1)
    finally:
        prod.shutdown()


def test_shutdown_ends_the_buffer_watcher_before_it_returns():
    """A watcher left asleep woke after the interpreter began to exit, dropped the last reference
    to its worker and freed its caches there: the process aborted ("terminate called without an
    active exception"), pytest's exit code with it."""
    base = free_port_run(1)
    prod = producer(caches(NHD), 4, cfg=ConnectorConfig(port=base), engine_port=base)
    prod.serve()
    watcher = prod.watcher
    assert watcher.is_alive()
    prod.shutdown()
    assert not watcher.is_alive()


def test_a_producer_off_loopback_needs_a_secret_or_insecure(caplog):
    """Serving KV on a non-loopback address without a secret is refused at start, saying how to
    set one; with a secret it serves (and the secret is never logged); "insecure" accepts it."""
    cfg = ConnectorConfig(host="0.0.0.0")
    prod = producer(caches(NHD), 4, cfg=cfg, engine_port=free_port_run(1))
    with pytest.raises(ValueError, match=r"TRITONKV_SECRET.*secret_file.*insecure"):
        prod.serve()
    for secret, insecure in ((SECRET, False), (None, True)):
        cfg = ConnectorConfig(host="0.0.0.0", insecure=insecure)
        prod = producer(caches(NHD), 4, cfg=cfg, engine_port=free_port_run(1), secret=secret)
        with caplog.at_level(logging.DEBUG):
            prod.serve()
        # consumers load and discard, nothing else
        assert prod.server.requests == {"GET", "DISCARD"}
        prod.shutdown()
    assert SECRET.decode() not in caplog.text
    assert "without a shared secret (insecure)" in caplog.text


@pytest.mark.parametrize("configured,served", [(5.0, 10.0), (25.0, 25.0)])
def test_the_kv_servers_handshake_deadline_follows_a_longer_connect_timeout(configured, served):
    """A consumer given more than the server's 10 s to connect (a slow host) is not cut off by
    the producer's own deadline when both read one config; a shorter one keeps the 10 s."""
    base = free_port_run(1)
    cfg = ConnectorConfig(port=base, connect_timeout_s=configured)
    prod = producer(caches(NHD), 4, cfg=cfg, engine_port=base)
    prod.serve()
    try:
        assert prod.server._listener.connect_timeout_s == served
    finally:
        prod.shutdown()
