"""Switch one running vLLM engine between no connector, a no-op connector and gpuckpt's, between
batches: the benchmark's same-process comparison (``bench/vllm_step_overhead.py --paired``).

Fresh engine processes differ from one another by several per cent in step time whatever they
load (memory layout), far more than a connector's few microseconds a step, so comparing engines
needs dozens of them. One engine switched between batches compares like with like: the same
process, the same layout, the same warm caches, the batches alternated so that the host's drift
falls on every configuration.

What is switched is everything vLLM consults per step to decide whether a connector is there —
and nothing else, so "without" runs vLLM's no-connector path, call for call (the benchmark checks
the count against a fresh engine built without a connector):

- the scheduler's ``connector`` (every scheduler-side hook and branch: ``self.connector is not None``);
- the executor's ``kv_output_aggregator`` (the worker outputs folded across ranks);
- each worker's ``kv_transfer_state._KV_CONNECTOR_AGENT`` (``has_kv_transfer_group()``: the model
  runner's connector context and the attention layers' per-layer wrapper), by ``collective_rpc``.

The engine is built with gpuckpt's connector (so its KV caches are registered with it, as in a
real worker) and switched only while it has no request: a connector's per-request state never
straddles a switch. The no-op connector is built beside it from the same configuration. Nothing
here is loaded outside the benchmark.
"""

from __future__ import annotations

from typing import Any

#: per worker process: the connectors by configuration, built on the first switch
_WORKER: dict[str, Any] = {}


def _connectors(vllm_config: Any, role: Any, kv_cache_config: Any, gpuckpt: Any) -> dict[str, Any]:
    from noop_connector import NoopConnector

    return {
        "without": None,
        "noop": NoopConnector(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config),
        "with": gpuckpt,
    }


def switch_worker(worker: Any, config: str) -> str:
    """Run in each worker (``collective_rpc``): install ``config``'s connector as the worker's
    KV transfer agent; returns the class now installed (``None`` for none), for the caller's check."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    if not _WORKER:
        gpuckpt = kv_transfer_state._KV_CONNECTOR_AGENT
        assert gpuckpt is not None, "the engine was not built with a connector"
        kv_cache_config = getattr(gpuckpt, "_kv_cache_config", None)
        _WORKER.update(_connectors(worker.vllm_config, KVConnectorRole.WORKER, kv_cache_config, gpuckpt))
    kv_transfer_state._KV_CONNECTOR_AGENT = _WORKER[config]
    return type(_WORKER[config]).__name__


class EngineSwitch:
    """The scheduler and executor side of one in-process engine (``LLM`` built with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so its EngineCore runs in this process) and the
    ``collective_rpc`` to its workers."""

    def __init__(self, llm: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

        core = llm.llm_engine.engine_core.engine_core  # the in-process client's EngineCore
        self.llm = llm
        self.scheduler = core.scheduler
        self.executor = core.model_executor
        gpuckpt = self.scheduler.connector
        assert gpuckpt is not None, "the engine was not built with a connector"
        self.aggregator = self.executor.kv_output_aggregator
        self.connectors = _connectors(
            core.vllm_config, KVConnectorRole.SCHEDULER, self.scheduler.kv_cache_config, gpuckpt
        )
        self.connectors["noop"].bind_kv_cache_manager(self.scheduler.kv_cache_manager)

    def use(self, config: str) -> None:
        """Make the engine run ``config`` (``without``, ``noop`` or ``with``) from its next step on;
        call only while it has no request."""
        assert not self.scheduler.has_unfinished_requests(), "a connector is switched only between batches"
        connector = self.connectors[config]
        self.scheduler.connector = connector
        self.executor.kv_output_aggregator = None if connector is None else self.aggregator
        want = type(connector).__name__
        got = self.llm.collective_rpc(switch_worker, args=(config,))
        assert all(g == want for g in got), f"workers run {got}, not {want}"
