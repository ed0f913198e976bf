"""tritonkv's vLLM V1 KV connector, as a package.

``"kv_connector_module_path": "connector.vllm_connector"`` (``tritonkv_connector.vllm_connector``
when installed) names this package; vLLM then reads :class:`TritonKVConnector` from it. Only
:mod:`.connector` imports vLLM, and only when that attribute is first read: the sides, the plugin
and the tests import their modules here without vLLM.
"""

from __future__ import annotations

__all__ = ["TritonKVConnector"]


def __getattr__(name: str):
    if name == "TritonKVConnector":
        from .connector import TritonKVConnector

        return TritonKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
