"""vLLM plugin entry point: registers ``GpuckptConnector`` by name.

Declared in pyproject.toml under ``[project.entry-points."vllm.general_plugins"]``,
so once gpuckpt is installed users can write
``--kv-transfer-config '{"kv_connector": "GpuckptConnector", "kv_role": "kv_both", ...}'``
without ``kv_connector_module_path``. vLLM loads general plugins in every one
of its processes (front end, EngineCore, workers): ``register`` must be cheap,
idempotent, and import nothing heavy. If ``VLLM_PLUGINS`` is set, it must list
``gpuckpt``.

It also keeps two of vLLM's configuration rules for KV connectors from changing a worker that
loads gpuckpt's, each for a configuration whose connector is gpuckpt's alone (any other, a
``MultiConnector`` too, gets vLLM's rule as before):

- **Expandable segments** (:func:`_keep_expandable_segments`): vLLM refuses every KV connector
  beside ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; loading gpuckpt stopped a worker
  that a fleet runs so from starting at all.
- **Client-supplied multimodal embeddings** (:func:`_keep_mm_embedding_inputs`): vLLM takes
  every ``kv_both`` connector for a disaggregated consumer and turns on ``enable_mm_embeds``, so
  loading gpuckpt opened a multimodal worker's API to pre-computed embeddings from any client,
  which vLLM documents as able to crash the engine ("only enable this flag for trusted users").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.engines.vllm.internals import connector_registered

NAME = "GpuckptConnector"


def register() -> None:
    # late: vLLM calls register() while it loads its plugins, before its connector factory is wanted
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # register_connector raises on a second registration of the same name.
    if not connector_registered(NAME):
        KVConnectorFactory.register_connector(NAME, "agent.engines.vllm.connector", NAME)
    _keep_expandable_segments()
    _keep_mm_embedding_inputs()


def _ours_alone(config: Any) -> bool:
    """Whether a ``VllmConfig``'s KV connector is gpuckpt's, and no other."""
    ktc = getattr(config, "kv_transfer_config", None)
    return ktc is not None and getattr(ktc, "kv_connector", None) == NAME


def _wrap(method: str, ours: Callable[[Any, Callable[[Any], None]], None]) -> None:
    """Put ``ours(config, vllm_rule)`` in place of ``VllmConfig.<method>`` for a configuration whose
    connector is gpuckpt's alone; every other keeps vLLM's rule. Once per process (vLLM loads
    plugins more than once in some); nothing where vLLM has no such method."""
    try:  # late, like register's: vLLM is loading its plugins when this runs
        from vllm.config import VllmConfig
    except ImportError:  # pragma: no cover - vLLM is what loads this plugin
        return
    rule = getattr(VllmConfig, method, None)
    if rule is None or getattr(rule, "_gpuckpt", False):
        return

    def wrapped(self: Any) -> None:
        if _ours_alone(self):
            ours(self, rule)
        else:
            rule(self)

    wrapped._gpuckpt = True  # type: ignore[attr-defined]
    setattr(VllmConfig, method, wrapped)


def _keep_expandable_segments() -> None:
    """vLLM refuses every KV connector beside PyTorch's expandable segments (vLLM 0.32–0.33:
    ``VllmConfig._verify_kv_transfer_compat``), because a connector that registers the KV cache's
    memory with a NIC (NIXL, Mooncake: ``ibv_reg_mr``) keeps physical pages that the CUDA VMM
    allocator may remap. gpuckpt registers nothing: every copy, each step, goes through the KV
    cache's tensors by their virtual addresses, so a remap under them changes nothing it reads
    or writes."""
    _wrap("_verify_kv_transfer_compat", lambda config, rule: None)


def _keep_mm_embedding_inputs() -> None:
    """vLLM (``VllmConfig._resolve_mm_embedding_inputs``) lets a KV consumer — any ``kv_both``
    connector — take multimodal requests without their embedding tensors and turns
    ``enable_mm_embeds`` on, since a disaggregated decode worker receives the prompt's KV made
    from embeddings it never sees. gpuckpt is no such consumer: a request it restores pages for
    brings its own images (one whose input the ledger cannot carry is left to its client), so
    the worker keeps the user's ``enable_mm_embeds`` and rejects a missing tensor, as without
    gpuckpt. An embeddings-cache (EC) consumer configured beside it keeps vLLM's rule."""

    def ours(config: Any, rule: Callable[[Any], None]) -> None:
        ec = getattr(config, "ec_transfer_config", None)
        if ec is not None and getattr(ec, "is_ec_consumer", False):
            rule(config)
            return
        mc = getattr(config, "model_config", None)
        mm = getattr(mc, "multimodal_config", None) if mc is not None else None
        if mm is not None and hasattr(mm, "allow_missing_mm_embeddings"):
            mm.allow_missing_mm_embeddings = False

    _wrap("_resolve_mm_embedding_inputs", ours)
