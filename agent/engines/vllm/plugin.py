"""vLLM plugin entry point: registers ``GpuckptConnector`` by name.

Declared in pyproject.toml under ``[project.entry-points."vllm.general_plugins"]``,
so once gpuckpt is installed users can write
``--kv-transfer-config '{"kv_connector": "GpuckptConnector", "kv_role": "kv_both", ...}'``
without ``kv_connector_module_path``. vLLM loads general plugins in every one
of its processes (front end, EngineCore, workers): ``register`` must be cheap,
idempotent, and import nothing heavy. If ``VLLM_PLUGINS`` is set, it must list
``gpuckpt``.

It also exempts a worker whose only connector is gpuckpt's from vLLM's refusal of
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` beside any KV connector
(:func:`_exempt_from_the_pinned_memory_check`): without it, loading gpuckpt stops a worker
that a fleet runs with expandable segments from starting at all.
"""

from __future__ import annotations

from typing import Any

NAME = "GpuckptConnector"


def register() -> None:
    # late: vLLM calls register() while it loads its plugins, before its connector factory is wanted
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # register_connector raises on a second registration of the same name.
    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "agent.engines.vllm.connector", NAME)
    _exempt_from_the_pinned_memory_check()


def _exempt_from_the_pinned_memory_check() -> None:
    """vLLM refuses every KV connector beside PyTorch's expandable segments (vLLM 0.32–0.33:
    ``VllmConfig._verify_kv_transfer_compat``), because a connector that registers the KV cache's
    memory with a NIC (NIXL, Mooncake: ``ibv_reg_mr``) keeps physical pages that the CUDA VMM
    allocator may remap. gpuckpt registers nothing: every copy, each step, goes through the KV
    cache's tensors by their virtual addresses, so a remap under them changes nothing it reads
    or writes. The exemption is for a configuration whose connector is gpuckpt's alone; any other
    (a ``MultiConnector`` too) is checked by vLLM as before. Where vLLM has no such check, this
    does nothing."""
    try:
        from vllm.config import VllmConfig
    except ImportError:  # pragma: no cover - vLLM is what loads this plugin
        return
    original = getattr(VllmConfig, "_verify_kv_transfer_compat", None)
    if original is None or getattr(original, "_gpuckpt", False):
        return

    def verify(self: Any) -> None:
        ktc = getattr(self, "kv_transfer_config", None)
        if ktc is not None and getattr(ktc, "kv_connector", None) == NAME:
            return
        original(self)

    verify._gpuckpt = True  # type: ignore[attr-defined]
    VllmConfig._verify_kv_transfer_compat = verify
