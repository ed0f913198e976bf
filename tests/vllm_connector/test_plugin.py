"""tritonkv's vLLM general plugin (``connector/vllm_connector/plugin.py``): what it registers, that it does so once,
never raises into vLLM's start, and imports nothing heavy when vLLM loads it.

The installed entry point (``vllm.general_plugins``) is tested on a built wheel in
``tests/e2e/test_packaging.py``; here the function is called directly, against vLLM's real factory
with its registry swapped for a copy, so nothing leaks into other tests.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from support.vllm_fixtures import REPO_ROOT, captured_log, requires_vllm

import connector.vllm_connector.plugin as plugin

pytestmark = pytest.mark.timeout(120)

HEAVY = ("torch", "numpy", "triton", "vllm", "tritonkv", "connector.vllm_connector.connector")


def test_loading_the_plugin_module_imports_nothing_heavy() -> None:
    """vLLM loads every installed plugin in every process: loading ours must cost nothing."""
    script = (
        "import json, sys; import connector.vllm_connector.plugin; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} "
        f"or m in {HEAVY!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout) == []
    assert plugin.CONNECTOR_MODULE == "connector.vllm_connector"  # this package's own name


@pytest.fixture
def factory(monkeypatch):
    """vLLM's ``KVConnectorFactory`` with a private copy of its registry, and the plugin's
    once-per-process flag reset; both restored afterwards."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = {k: v for k, v in KVConnectorFactory._registry.items() if k != "TritonKVConnector"}
    monkeypatch.setattr(KVConnectorFactory, "_registry", registry)
    monkeypatch.setattr(plugin, "_registered", False)
    return KVConnectorFactory


@pytest.fixture
def plugin_log():
    """The plugin's log records, from DEBUG up."""
    with captured_log("vllm.tritonkv.plugin", logging.DEBUG) as records:
        yield records


def _config(name: str = "TritonKVConnector"):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector=name, kv_role="kv_consumer")


@requires_vllm
def test_register_makes_the_bare_name_resolve_to_the_connector_once(factory, plugin_log) -> None:
    """Without the plugin vLLM does not know the name; after it, the name resolves to this
    package's connector class, and calling the plugin again (vLLM may) changes nothing."""
    with pytest.raises(ValueError, match="Unsupported connector type: TritonKVConnector"):
        factory.get_connector_class(_config())
    plugin.register()
    loader = factory._registry["TritonKVConnector"]
    plugin.register()
    plugin.register()
    assert factory._registry["TritonKVConnector"] is loader
    cls = factory.get_connector_class(_config())
    from connector.vllm_connector.connector import TritonKVConnector

    assert cls is TritonKVConnector
    assert [r.levelno for r in plugin_log] == [logging.DEBUG]


@requires_vllm
def test_a_name_registered_by_someone_else_is_kept_and_start_goes_on(factory, plugin_log) -> None:
    """vLLM's register_connector raises on a taken name; the plugin catches it, keeps the other
    registration and says how to pick tritonkv's (by module path)."""
    factory.register_connector(
        "TritonKVConnector",
        "vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
        "ExampleConnector",
    )
    theirs = factory._registry["TritonKVConnector"]
    plugin.register()  # must not raise
    assert factory._registry["TritonKVConnector"] is theirs
    [warning] = [r for r in plugin_log if r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert "already registered" in message
    assert '"kv_connector_module_path": "connector.vllm_connector"' in message


@requires_vllm
def test_a_failure_inside_register_is_logged_not_raised(factory, monkeypatch, plugin_log) -> None:
    """vLLM calls general plugins without a try: an exception would stop every vLLM start."""

    def broken(*args):
        raise RuntimeError("factory changed")

    monkeypatch.setattr(factory, "register_connector", broken)
    plugin.register()
    [error] = [r for r in plugin_log if r.levelno == logging.ERROR]
    assert "could not register TritonKVConnector" in error.getMessage()
    assert "factory changed" in str(error.exc_info[1])
    assert "TritonKVConnector" not in factory._registry
