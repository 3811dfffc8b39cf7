"""vLLM plugin entry point: registers ``GpuckptConnector`` by name.

Declared in pyproject.toml under ``[project.entry-points."vllm.general_plugins"]``,
so once gpuckpt is installed users can write
``--kv-transfer-config '{"kv_connector": "GpuckptConnector", "kv_role": "kv_both", ...}'``
without ``kv_connector_module_path``. vLLM loads general plugins in every one
of its processes (front end, EngineCore, workers): ``register`` must be cheap,
idempotent, and import nothing heavy. If ``VLLM_PLUGINS`` is set, it must list
``gpuckpt``.
"""

from __future__ import annotations

NAME = "GpuckptConnector"


def register() -> None:
    # late: vLLM calls register() while it loads its plugins, before its connector factory is wanted
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # register_connector raises on a second registration of the same name.
    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "agent.engines.vllm.connector", NAME)
