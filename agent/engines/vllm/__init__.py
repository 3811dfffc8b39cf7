"""The vLLM adapter: a KV connector loaded inside vLLM, its request ledger and serving client, and its Engine.

Load the connector with (gpuckpt's ``vllm.general_plugins`` entry point
registers the name in every vLLM process; ``"kv_connector_module_path":
"agent.engines.vllm.connector"`` also works)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "GpuckptConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"control_socket": "/run/gpuckpt/w0.sock"}}'

This package imports nothing from vLLM at import time; ``connector`` does.
"""
