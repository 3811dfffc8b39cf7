"""``GpuckptConnector``: vLLM's KV connector API (v1), used to checkpoint and restore a worker.

Loaded by vLLM in two kinds of process (``kv_connector_module_path =
"agent.engines.vllm.connector"``, or by name through :mod:`.plugin`). This
class is only a facade: it builds the half its role needs and forwards each
hook to it under :func:`agent.engines.service.guard`, which turns anything a
hook raises into a log line, a count (``stats``' ``hook_failures``) and the
hook's safe answer — the engine never sees gpuckpt fail.
``kv_connector_extra_config["inject_faults"]`` names hooks to fail on
purpose (the guards' tests).

Scheduler side (EngineCore process; :class:`.scheduler.SchedulerHalf`, which
also serves the control socket, :mod:`.commands`):

=============================  ==============================================  =====================
hook                           when vLLM calls it                              safe answer
=============================  ==============================================  =====================
``bind_gpu_block_pool``        once, building the scheduler                    —
``bind_kv_cache_manager``      once, building the scheduler                    —
``on_new_request``             a request arrives                               nothing
``get_num_new_matched_tokens`` scheduling a waiting request (asynchronous      no external hit
                               with several KV cache groups: see .scheduler)
``update_state_after_alloc``   after its blocks are allocated                  its loads fail
``build_connector_meta``       after each step is scheduled                    loads fail, no copy
``update_connector_output``    each step's worker output (all ranks folded)    nothing
``request_finished_all_groups`` a request finishes (every KV cache group's       free at once
                               blocks; ``request_finished`` with one group)
``has_pending_push_work``      each busy-loop turn: keep an idle engine        False
                               stepping?
``shutdown``                   engine shutdown                                 —
=============================  ==============================================  =====================

Worker side (one per rank; :class:`.worker.WorkerHalf`), each step with that
step's :class:`.meta.GpuckptMeta`:

=================================  ==========================================  =====================
hook                               when                                        safe answer
=================================  ==========================================  =====================
``register_kv_caches``             once, after the caches are allocated        rank disabled
``handle_preemptions``             before the step's preprocessing: a capture's chunk failed
                                   pages its forward changes (state blocks)
``bind_connector_metadata``        before the forward (an idle step's is not   —
                                   bound: the per-layer hooks are skipped)
``start_load_kv``                  before the forward (loads by request: after loads are errors,
                                   it, for requests outside the batch)         requests failed
``wait_for_layer_load``            per layer (nothing: loads are synchronous)  —
``save_kv_layer``                  per layer (nothing: copies wait for save)   —
``wait_for_save``                  after the forward                           chunk failed
``get_finished``                   after the step (``get_transfer_results``:   tails sent, requests
                                   and the failed receives)                    received
``get_block_ids_with_load_errors`` after the step                              —
``build_connector_worker_meta``    after the step                              nothing
=================================  ==========================================  =====================

The halves talk only through the per-step metadata (:mod:`.meta`), one
object per direction per step.

``SupportsHMA``: vLLM keeps its hybrid KV cache manager on with gpuckpt loaded
(sliding-window and hybrid models keep their memory savings; hybrid SSM
models start). Each page is one KV cache group's block (:mod:`.groups`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from agent.engines import versions
from agent.engines.service import Reply, WorkerService, guard
from agent.engines.vllm import internals
from agent.engines.vllm.commands import staging_of
from agent.engines.vllm.meta import IDLE, GpuckptMeta, GpuckptWorkerMeta
from agent.engines.vllm.scheduler import SchedulerHalf
from agent.engines.vllm.worker import WorkerHalf

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["GpuckptConnector", "GpuckptMeta", "GpuckptWorkerMeta"]

log = logging.getLogger("gpuckpt.vllm")

_DISABLED = "register_kv_caches failed (see the worker's log)"


class GpuckptConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring: the hook map by side."""

    def __new__(cls, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> Any:
        # vLLM outside the supported range: the inert connector instead (its __init__ runs here;
        # Python skips ours for an object of another class)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        allowed = versions.allowed_by(extra)
        why = versions.refusal("vllm", vllm.__version__, allowed=allowed)
        if why is not None:
            return DisabledConnector(vllm_config, role, kv_cache_config, why)
        if allowed and not versions.support("vllm", vllm.__version__).ok:
            log.warning("gpuckpt: vllm %s is not a version this gpuckpt was tested on; run as asked", vllm.__version__)
        return super().__new__(cls)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.scheduler: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning(
                    "gpuckpt: kv_load_failure_policy=%r: a block that fails to load fails its request; "
                    "set it to 'recompute' (gpuckpt's serve_command does) so such blocks are recomputed",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
            self.scheduler = SchedulerHalf(vllm_config, kv_cache_config, extra)
            if extra.get("control_socket"):
                self.scheduler.serve(extra["control_socket"])
                self.scheduler.warm_description()
            half: SchedulerHalf | WorkerHalf = self.scheduler
        else:
            half = self.worker = WorkerHalf(vllm_config, kv_cache_config, extra)
        # the guard's fault list and failure counts are the half's (its stats report them)
        self.faults, self.failures = half.faults, half.failures

    @property
    def _s(self) -> SchedulerHalf:
        assert self.scheduler is not None, "a scheduler-side hook called in a worker"
        return self.scheduler

    @property
    def _w(self) -> WorkerHalf:
        assert self.worker is not None, "a worker-side hook called in the scheduler"
        return self.worker

    # ------------------------------------------------------------------ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._s.bind_gpu_block_pool(gpu_block_pool)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._s.bind_kv_cache_manager(kv_cache_manager)

    @guard(lambda self: False)
    def has_pending_push_work(self) -> bool:
        return self._s.has_pending_push_work()

    @guard(lambda self, request: None)
    def on_new_request(self, request: Request) -> None:
        self._s.on_new_request(request)

    @guard(lambda self, request, block_ids: (False, None))
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._s.request_finished(request, block_ids)

    @guard(lambda self, request, block_ids: (False, None))
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s.request_finished_all_groups(request, block_ids)

    @guard(lambda self, request, num_computed_tokens: self._s.no_match(request))
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s.get_num_new_matched_tokens(request, num_computed_tokens)

    @guard(lambda self, request, blocks, num_external_tokens: self._s.fail_alloc(request, blocks, num_external_tokens))
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._s.update_state_after_alloc(request, blocks, num_external_tokens)

    @guard(lambda self, scheduler_output: self._s.empty_meta())
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s.build_connector_meta(scheduler_output)

    @guard(lambda self, connector_output: None)
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._s.update_connector_output(connector_output)

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()

    # ------------------------------------------------------------------ worker side

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # An idle step is left unbound: vLLM's per-layer wrapper then skips both per-layer hooks
        # (it calls them only with metadata bound), and the other worker hooks return at once —
        # what a worker pays for gpuckpt while nothing is checkpointed or restored.
        w = self.worker
        # (an exact type test: isinstance against vLLM's ABC takes the slow path for a non-match)
        if w is not None and type(connector_metadata) is GpuckptMeta and connector_metadata.idle:
            try:
                if w.idle_step():
                    return
            except Exception:  # never the engine's problem: bind it, the hooks' guards take over
                log.exception("gpuckpt: an idle step's bookkeeping failed")
        super().bind_connector_metadata(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # called every step: an idle step (the one shared IDLE object) has nothing to copy, and
        # returns before the guard's bookkeeping
        if kv_connector_metadata is not IDLE:
            self._copy_before(kv_connector_metadata)

    @guard(lambda self, kv_connector_metadata: None)  # wait_for_save then fails the chunk
    def _copy_before(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._w.copy_before(kv_connector_metadata)

    @guard(lambda self, kv_caches: self._w.disable(_DISABLED))
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w.register_kv_caches(kv_caches)

    # vLLM 0.33+ sleep mode: carried — nothing is copied or loaded while the KV cache's memory is
    # released (vLLM resets the prefix cache before a sleep; the tensors come back at the same
    # addresses, empty). supports_sleep_mode keeps vLLM's True. 0.32 calls neither hook.

    def unregister_kv_caches(self) -> None:
        self._w.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self._w.restore_kv_caches()

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.34: False — the block hashes stay the ones without lookahead tokens, the keys a
        checkpoint's pages are stored under on every supported version (EAGLE's block drop then
        drops the trailing block instead)."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34: ``IN_PROCESS`` — gpuckpt reads and writes the registered tensors with torch
        ops in the worker's own process; it registers no memory with a NIC and exports no handle,
        so the extensible KV cache stays on (docs/design/vllm-versions.md)."""
        try:
            return internals.in_process_access()
        except Exception:  # a vLLM that moved the flag: its own default (IN_PROCESS in 0.34), never a failed start
            return super().kv_cache_access(kv_transfer_config)

    @guard(lambda self, forward_context, **kwargs: self._w.fail_loads(self._connector_metadata))
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._w.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return

    @guard(lambda self: self._w.fail_capture(self._connector_metadata))
    def wait_for_save(self) -> None:
        self._w.wait_for_save(self._connector_metadata)

    @guard(lambda self, finished_req_ids: self._w.get_finished())
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._w.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # get_finished, with the requests loaded by request whose load failed (vLLM releases and
        # recomputes them: the only load failure it takes from a worker with several KV groups)
        sending, receiving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(receiving or ()),
            failed_recving=self._w.take_receive_failures(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w.get_block_ids_with_load_errors()

    @guard(lambda self: None)
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._w.build_connector_worker_meta()


class DisabledService(WorkerService):
    """The control socket of a worker whose gpuckpt is disabled: it answers ``ping`` (the worker is
    up) and refuses every other call naming why, so the agent's describe, checkpoint and restore
    each say it."""

    def __init__(self, why: str, extra: dict[str, Any]) -> None:
        staging_dir, trust = staging_of(extra)
        super().__init__(staging_dir=staging_dir, trust=trust)
        self.why = why

    def handle(self, raw: dict[str, Any]) -> Reply:
        if raw.get("cmd") == "ping":
            return super().handle(raw)
        return {"ok": False, "error": self.why, "refused": versions.REFUSED}


class DisabledConnector(KVConnectorBase_V1, SupportsHMA):
    """What a worker of a vLLM outside :data:`agent.engines.versions.SUPPORTED` loads in place of
    :class:`GpuckptConnector`: every hook is vLLM's "no connector" answer (no external hit, nothing
    to load, save or free late), nothing of vLLM's internals is read, and the scheduler side's
    control socket refuses every call but ``ping`` naming the version and the range. The worker
    serves as if gpuckpt were not configured; its log says why once per process."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig, why: str
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.why = why
        self.service: DisabledService | None = None
        log.error("gpuckpt: %s", why)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        if role == KVConnectorRole.SCHEDULER and extra.get("control_socket"):
            self.service = DisabledService(why, extra)
            self.service.serve(extra["control_socket"])

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def shutdown(self) -> None:
        if self.service is not None:
            self.service.close_server()
