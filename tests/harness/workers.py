"""Worker sides without an engine process, for the worker conformance suite and unit tests.

- :class:`VllmHalves`: vLLM's real ``Scheduler`` (CPU, a small config of the
  tiny Llama) with gpuckpt's connector, and the connector's worker half
  registered on CPU tensors; a thread steps them (``schedule`` → the worker
  half's hooks → ``update_from_output``), with a toy model runner that
  samples token 7 for every scheduled request. What runs is vLLM's own
  scheduling and block pool; only the forward is missing.
- :class:`SglangLinkerHost`: the SGLang linker in a process of SGLang's
  interpreter (``scripts/sglang_linker_host.py``), on CPU KV pools, its step
  boundary driven in a loop.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from agent.engines.channel import WorkerChannel
from tests.harness.paths import ROOT
from tests.harness.sglang import STANDIN

BLOCK = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS, HEAD_SIZE = 2, 64
NUM_BLOCKS = 64
#: one engine step every so often: a live request of the toy runner decodes ~100 tokens a second
STEP_S = 0.01


def vllm_scheduler(model: Path, sock: Path, stage: Path) -> tuple[Any, Any, Any]:
    """vLLM's own ``Scheduler`` over a small config (``NUM_BLOCKS`` blocks of ``BLOCK`` tokens, one
    full-attention group of ``LAYERS``), built as the engine builds it, with gpuckpt's connector
    configured on ``sock``: ``(VllmConfig, KVCacheConfig, Scheduler)``."""
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    mc = ModelConfig(
        model=str(model), tokenizer=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=512
    )
    kv = KVTransferConfig(
        kv_connector="GpuckptConnector",
        kv_role="kv_both",
        kv_connector_module_path="agent.engines.vllm.connector",
        kv_connector_extra_config={"control_socket": str(sock), "staging_dir": str(stage)},
        kv_load_failure_policy="recompute",
    )
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512, is_encoder_decoder=False)
    config = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=kv,
        scheduler_config=sc,
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    kvc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kvc,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=False,
    )
    return config, kvc, scheduler


class VllmHalves:
    """The vLLM connector's two halves in this process, stepped by a thread (see the module doc)."""

    def __init__(self, model: Path, sock: Path, stage: Path) -> None:
        import torch
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        from agent.engines.vllm.worker import WorkerHalf

        self.config, self.kv_cache_config, self.scheduler = vllm_scheduler(model, sock, stage)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        connector = self.scheduler.connector
        assert connector is not None
        self.half = connector.scheduler  # type: ignore[attr-defined]
        # what EngineCoreProc would be: the block hasher ``keys`` uses (no input queue: nothing to wake)
        self.half.engine = SimpleNamespace(request_block_hasher=self.hasher, input_queue=None)
        extra = dict(self.config.kv_transfer_config.kv_connector_extra_config or {})
        self.worker = WorkerHalf(self.config, self.kv_cache_config, extra)
        self.caches = {name: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, HEAD_SIZE) for name in LAYERS}
        self.worker.register_kv_caches(self.caches)
        self.channel = WorkerChannel(sock)
        self.page_shape = self.worker.stored_shape()
        self.dtype = self.worker.dtype()
        self.layers = [n for n, _ in self.worker.kv]
        self.lock = threading.Lock()
        self.failed: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-halves", daemon=True)
        self._thread.start()

    def add_request(self, request_id: str, prompt: list[int] | None, max_tokens: int = 1000, **kw: Any) -> Any:
        """A request as the engine would add it (hashed with the engine's block hasher); ``kw``:
        more of ``Request``'s arguments (``prompt_embeds``, say)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        r = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), None, block_hasher=self.hasher, **kw)
        with self.lock:
            self.scheduler.add_request(r)
        return r

    def step(self) -> None:
        """One engine step: schedule, the worker half's hooks around a missing forward, the output."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        with self.lock:
            so = self.scheduler.schedule()
            meta = so.kv_connector_metadata
            self.worker.start_load_kv(meta)
            self.worker.wait_for_save(meta)
            sent, _ = self.worker.get_finished()
            ids = [r for r, n in so.num_scheduled_tokens.items() if n]
            # vLLM 0.34 dropped ``req_id_to_index`` (the order of ``req_ids`` is the index)
            has_index = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
            index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if has_index else {}
            out = ModelRunnerOutput(
                req_ids=ids,
                **index,
                sampled_token_ids=[[7] for _ in ids],
                kv_connector_output=KVConnectorOutput(
                    finished_sending=sent,
                    kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
                    invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
                ),
            )
            self.scheduler.update_from_output(so, out)

    def block_ids(self, request_id: str) -> list[int]:
        """The blocks vLLM allocated to a request, in order."""
        with self.lock:
            return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def _run(self) -> None:
        try:
            while not self._stop.wait(STEP_S):
                self.step()
        except BaseException as exc:  # a test waiting on steps fails on this, not on its timeout
            self.failed = exc
            raise

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.scheduler.shutdown()
        self.worker.shutdown()


class SglangLinkerHost:
    """The SGLang linker in a process of SGLang's interpreter (see the module doc)."""

    PAGE_SIZE = 16
    PAGE_SHAPE = (2, 2, 16, 2, 64)  # layers, K/V, page size, heads, head dim

    def __init__(self, python: str, sock: Path, stage: Path, log: Path, env: dict[str, str] | None = None) -> None:
        """``env``: more of the host's environment (``GPUCKPT_TEST_SGLANG_VERSION``: the SGLang
        version the linker is told it runs in)."""
        script = ROOT / "tests" / "harness" / "scripts" / "sglang_linker_host.py"
        env = {
            **os.environ,
            "SGLANG_USE_CPU_ENGINE": "1",
            "PYTHONPATH": os.pathsep.join([str(STANDIN), str(ROOT)]),
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            [python, str(script), str(sock), str(stage)],
            env=env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        self.channel = WorkerChannel(sock)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the SGLang linker host exited ({self.proc.returncode}): {log.read_text()[-3000:]}")
            if sock.exists():
                try:
                    self.channel.ping()
                    break
                except Exception:  # noqa: S110  (not answering yet)
                    pass
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the SGLang linker host did not answer in 120 s: {log.read_text()[-3000:]}")
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
