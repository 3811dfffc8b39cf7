"""A KV connector that does nothing: what loading *any* KV connector costs a vLLM worker.

vLLM runs extra work every step once a connector is configured, whatever the connector does: the
per-layer KV transfer hooks, the connector metadata in every scheduler output, the connector
output the workers send back and the scheduler's bookkeeping of it. ``bench/vllm_step_overhead.py``
runs this connector beside gpuckpt's so that gpuckpt's own share (gpuckpt ÷ this) is told apart
from vLLM's (this ÷ no connector). It declares ``SupportsHMA`` as gpuckpt's does, so vLLM's hybrid
KV cache manager stays on in both. Nothing here is loaded outside the benchmark.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA


class NoopMeta(KVConnectorMetadata):
    """The one (empty) metadata object every step carries."""


_META = NoopMeta()


class NoopConnector(KVConnectorBase_V1, SupportsHMA):
    """Every hook returns at once; no KV is ever matched, loaded or saved."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _META

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return False, None
