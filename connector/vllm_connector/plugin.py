"""vLLM general plugin: makes ``"kv_connector": "TritonKVConnector"`` work without a module path.

An installed tritonkv declares :func:`register` under vLLM's ``vllm.general_plugins`` entry-point
group (``pyproject.toml``). vLLM calls every such function once in each of its processes (API
server, engine core, workers) before it builds a connector, so::

    --kv-transfer-config '{"kv_connector": "TritonKVConnector", "kv_role": "kv_producer", ...}'

finds the connector from any working directory. ``kv_connector_module_path`` still takes
precedence when given (vLLM's rule), which is how a checkout without an install names it.

Loading this module imports nothing but :mod:`logging` (vLLM loads every installed plugin in every
process, whether or not it uses it); :func:`register` imports vLLM's connector factory, which vLLM
imports itself, and never the connector module: the factory imports that lazily, only where a
config names the connector.
"""

from __future__ import annotations

from ..logs import get_logger

#: The name to put in ``--kv-transfer-config``'s ``kv_connector``.
CONNECTOR_NAME = "TritonKVConnector"
#: The connector's module, under the name this package is imported as (``tritonkv_connector``
#: when installed, ``connector`` from a checkout).
CONNECTOR_MODULE = __package__

# Under vLLM's logger tree, so lines carry vLLM's format and obey VLLM_LOGGING_LEVEL.
log = get_logger("plugin")

_registered = False  # this module registered the name in this process


def register() -> None:
    """Register :data:`CONNECTOR_NAME` with vLLM's ``KVConnectorFactory`` (once per process).

    Safe to call any number of times: later calls do nothing. If the name is already registered
    by something else (a vLLM release that ships a connector of that name, another package), that
    registration is kept and a warning says how to pick this one (``kv_connector_module_path``).
    Never raises: vLLM does not catch exceptions from general plugins, so one would stop every
    vLLM process of this environment from starting, tritonkv user or not; a failure is logged.
    """
    global _registered
    if _registered:
        return
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        try:
            KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
        except ValueError as exc:  # vLLM 0.32: "Connector '...' is already registered."
            log.warning(
                "tritonkv: %s is already registered with vLLM by something else (%s); keeping "
                'that one. To use tritonkv\'s, add "kv_connector_module_path": "%s"',
                CONNECTOR_NAME,
                exc,
                CONNECTOR_MODULE,
            )
        else:
            log.debug("tritonkv: registered %s -> %s", CONNECTOR_NAME, CONNECTOR_MODULE)
        _registered = True
    except Exception:
        log.exception(
            'tritonkv: could not register %s with vLLM; name it with "kv_connector_module_path": '
            '"%s" instead',
            CONNECTOR_NAME,
            CONNECTOR_MODULE,
        )
