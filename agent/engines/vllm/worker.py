"""The connector's worker half (one per rank): register the caches, load pages, copy captures.

Built by :class:`.connector.GpuckptConnector` for the worker role; every hook
is called under the facade's guard with this step's :class:`.GpuckptMeta`.
It reports back only through :class:`.GpuckptWorkerMeta` (capture chunks
done, and its own self-description until the scheduler half has every
rank's).

Loads: ``start_load_kv`` copies the step's planned loads out of the offered
page files into the KV cache, before the forward (queued on the same stream
on CUDA); a page that cannot be read is a load error, and vLLM recomputes
that block — with several KV cache groups, loads come by request
(``request_loads``), each request reported received (``get_finished``) or,
if a page failed, failed (``failed_recving``), and vLLM recomputes the
request. Captures: ``wait_for_save`` copies a chunk's pages after the
forward (so blocks the step completes are whole) and before the next step
can reuse any block; a thread writes them into a page file per rank and
chunk, reported a step or more later.

Seeded sampling: the model runner is found from ``register_kv_caches``'
calling frames; a capture reads each seeded request's ``torch.Generator``
state (before the step's sample, matching the ledger's outputs); on restore
the state is ``set_state``'d in ``start_load_kv`` (after the runner seeded the
new generator, before the first sample). Penalties: restored requests'
earlier outputs are put in front of their outputs in the sampler's view.

Tensor parallelism: rank ``r`` of ``tp`` holds heads
``[r·H//tp, r·H//tp + max(1, H//tp))`` of the model's ``H`` (MLA's single
latent head is replicated); it copies its own shard into its own page file
(``<name>-r<rank>``) and loads its own heads out of TP-independent pages
(:mod:`agent.engines.shards`), whatever TP size wrote them — except where a
state group runs at TP above the model's KV heads: there a stored page has
one slot per rank (:func:`.groups.page_heads`), for the same TP size only.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed import get_tensor_model_parallel_rank

from agent.engines import staging
from agent.engines.service import InjectedFault
from agent.engines.shards import Heads, full_shape, local_heads, rank_slot
from agent.engines.vllm import internals
from agent.engines.vllm.capture import CopyJob
from agent.engines.vllm.commands import staging_of
from agent.engines.vllm.copier import Gathered, PageCopier
from agent.engines.vllm.describe import attention_backend_name, kv_scales
from agent.engines.vllm.groups import page_heads
from agent.engines.vllm.meta import GpuckptMeta, GpuckptWorkerMeta
from ckpt.errors import EngineError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("gpuckpt.vllm")


#: the one layer name of a worker with no KV layer this connector pages (see register_kv_caches)
PAGELESS = "gpuckpt:no-pageable-layer"


class WorkerHalf:
    """See the module docstring. Hooks run on the worker's thread; a capture's page file is
    written by a thread of its own, whose result is kept under ``_done_lock``."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, extra: dict[str, Any]) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.staging_dir, self.trust = staging_of(extra)
        self.faults: set[str] = set(extra.get("inject_faults") or ())
        self.failures: dict[str, int] = {}
        self.tp = int(vllm_config.parallel_config.tensor_parallel_size)
        self.runner: Any = None
        self.rank = 0
        self.heads: Heads | None = None
        self.head_axis = 0
        self.disabled: str | None = None
        self.asleep = False  # vLLM's sleep mode released the KV cache's memory (see unregister_kv_caches)
        self.priors: dict[str, list[int]] = {}
        self.tail_pages: OrderedDict[bytes, bytes] = OrderedDict()
        self.sent: set[str] = set()
        self.kv: list[tuple[str, torch.Tensor]] = []
        self.copier: PageCopier | None = None
        self.files: dict[str, staging.PageFile] = {}
        self.load_errors: set[int] = set()
        self.before: dict[str, bytes] = {}  # a capture's pages copied before the forward (key hex)
        self.received: set[str] = set()  # loaded by request (several KV cache groups): get_finished
        self.receive_failed: set[str] = set()  # of those, failed
        self.report: dict[str, Any] | None = None  # sent until the scheduler half has every rank's
        self._done: dict[str, dict[int, dict[str, Any]]] = {}
        self._done_lock = threading.Lock()

    # ------------------------------------------------------------------ registration

    def disable(self, why: str) -> None:
        """The safe answer of a failed ``register_kv_caches``: this rank copies nothing, says so."""
        self.disabled = why
        with contextlib.suppress(Exception):  # no distributed state: a single in-process worker
            self.rank = int(get_tensor_model_parallel_rank())
        self.report = {"rank": self.rank, "disabled": why}

    def unusable(self) -> str | None:
        """Why this rank can copy no page now (``None``: it can)."""
        if self.disabled:
            return self.disabled
        if self.asleep:
            return "the worker is asleep (vLLM's sleep mode released its KV cache)"
        return None

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33+: sleep mode (or a discard) is about to release the KV cache's memory. Nothing
        is copied or loaded from now on — a capture asked for meanwhile fails naming the sleep —
        until :meth:`restore_kv_caches`; the tensors stay registered (vLLM maps fresh memory at
        the same addresses on wake, and passes none anew)."""
        self.asleep = True
        log.info("gpuckpt: rank %d: the KV cache is released (sleep mode); nothing is copied until it wakes", self.rank)

    def restore_kv_caches(self) -> None:
        """vLLM 0.33+: the KV cache's memory is back (empty: the prefix cache was reset before the
        sleep, so no page kept from before names it)."""
        self.asleep = False
        log.info("gpuckpt: rank %d: the KV cache is back", self.rank)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self.kv_cache_config.num_blocks
        # Block-first views of every layer: the CPU backend and vLLM 0.33's
        # logical [blocks, head slots, tokens, content] views put the block id
        # first; older FlashAttention-style tensors put K/V first
        # ([2, num_blocks, tokens, heads, head_size]), which is two block-first views.
        self.kv = []
        kv_first = False
        seen: set[int] = set()
        # pages are read through attention layers' views: a state-space layer shares its physical
        # slot with one (vLLM pads both pages to one size), so its state block is in the same
        # bytes (see .groups, which refuses a state group with a slot no attention layer is in)
        # (not a host-resident group's layers, nor a replica vLLM keeps out of transfer: their
        # block ids are not the scheduler's pool's, and .groups names them not carried)
        transferable = internals.transfer_groups(self.kv_cache_config)
        attention = {
            name
            for i, g in enumerate(self.kv_cache_config.kv_cache_groups)
            if hasattr(g.kv_cache_spec, "head_size")
            and not internals.host_resident(g)
            and (transferable is None or i in transferable)
            for name in g.layer_names
        }
        for name, t in sorted(kv_caches.items()):
            if name not in attention or not isinstance(t, torch.Tensor):
                continue
            if t.data_ptr() in seen:  # KV-sharing layers alias their target's tensor
                continue
            seen.add(t.data_ptr())
            if t.shape[0] == num_blocks:
                self.kv.append((name, t))
            elif t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
                self.kv += [(f"{name}#k", t[0]), (f"{name}#v", t[1])]
                kv_first = True
            else:
                raise NotImplementedError(
                    f"gpuckpt: layer {name} KV tensor has shape {tuple(t.shape)}; "
                    f"expected the block id ({num_blocks} blocks) first, or K/V first and then the block id"
                )
        self.head_axis = 1 if kv_first else 0
        try:
            self.rank = int(get_tensor_model_parallel_rank())
        except Exception:  # no distributed state: a single in-process worker
            self.rank = 0
        mc = self.vllm_config.model_config
        # an attention-free model (pure Mamba) reports 0 KV heads: its pages hold none (pageless)
        total = 1 if getattr(mc, "use_mla", False) else max(1, int(mc.get_total_num_kv_heads()))
        if not self.kv:
            # No group this connector pages (DeepSeek V3.2's latent + indexer in one group of two
            # page sizes, an SSM-only model): the scheduler half plans no page (see .groups), and
            # a capture carries the ledger alone (a cold replay). One empty placeholder slot keeps
            # the page file format — a capture's file of this rank then holds no page.
            log.warning("gpuckpt: no KV layer this connector can page; checkpoints carry the ledger only")
            self.kv = [(PAGELESS, torch.zeros((1, max(1, total // self.tp), 1, 1), dtype=torch.uint8))]
        self.copier = PageCopier([t for _, t in self.kv])
        held = int(self.kv[0][1].shape[1 + self.head_axis])
        if page_heads(self.kv_cache_config, self.tp, total) != total:
            # state at TP above the model's KV heads: one slot per rank (see .groups.page_heads)
            self.heads = rank_slot(self.rank, self.tp, held)
        else:
            self.heads = local_heads(self.rank, self.tp, total, held)
        # The model runner (for seeded requests' generators and the sampler's
        # view of outputs) called us from initialize_kv_cache.
        self.runner = self.runner or internals.runner_of_caller()
        self.report = self._describe_rank()
        # the staging directory exists (private, or the shared group's) from the start, not from the
        # first capture: an agent of another account checks it before it trusts a page file there
        staging.ensure_dir(self.staging_dir, self.trust)
        log.info(
            "gpuckpt: rank %d/%d, %d layers, page shape %s %s, heads %s; runner %s",
            self.rank,
            self.tp,
            len(self.kv),
            tuple(self.kv[0][1].shape[1:]),
            self.kv[0][1].dtype,
            self.heads,
            type(self.runner).__name__,
        )

    def _describe_rank(self) -> dict[str, Any]:
        """This rank's self-description for the scheduler half's ``describe``."""
        assert self.heads is not None
        t = self.kv[0][1]
        # a quantized KV cache's scales live outside its pages (describe folds every rank's into
        # the namespace); absent when nothing is quantized, so such a report is what it always was
        scales = kv_scales(self.vllm_config)
        report = {
            "rank": self.rank,
            "device": str(t.device),
            "backend": attention_backend_name(self.vllm_config),
            # the tokens axis of a layer's page: the kernel's block
            "kernel_block_size": int(t.shape[1 + (1 - self.head_axis)]) if t.dim() >= 3 else None,
            "kv_heads": [self.heads.start, self.heads.count],
            "page_shape": list(self.page_shape()),
            "dtype": self.dtype(),
            "runner": type(self.runner).__name__,
        }
        if scales is not None:
            report["kv_scales"] = scales
        return report

    def generator(self, rid: str) -> torch.Generator | None:
        st = self.runner.requests.get(rid) if self.runner is not None else None
        return getattr(st, "generator", None)

    def page_shape(self) -> tuple[int, ...]:
        """This rank's page: ``[layers, *layer page]`` with its own heads."""
        return (len(self.kv), *self.kv[0][1].shape[1:])

    def stored_shape(self) -> tuple[int, ...]:
        """A stored page: every KV head of the model (see :mod:`.shards`), or one slot per rank
        (:func:`.groups.page_heads`)."""
        assert self.heads is not None
        return full_shape(self.page_shape(), self.head_axis, self.heads.total)

    def dtype(self) -> str:
        return str(self.kv[0][1].dtype).removeprefix("torch.")

    # ------------------------------------------------------------------ before the forward

    def copy_before(self, meta: Any) -> None:
        """Before the step's forward (``handle_preemptions``): the capture's pages the forward
        would change — a state group's running states (see :class:`.CopyJob`)."""
        if type(meta) is not GpuckptMeta or meta.capture is None or not meta.capture.before:
            return
        if self.unusable():
            return  # wait_for_save reports the chunk failed
        assert self.copier is not None
        self.before = {key_hex: self.copier.page(block_id) for key_hex, block_id in meta.capture.before}

    def fail_loads(self, meta: Any) -> None:
        """The safe answer of a failed ``start_load_kv``: every planned load is a load error, every
        request loading by request a failed receive."""
        if isinstance(meta, GpuckptMeta):
            self.load_errors.update(b for b, _, _ in meta.loads)
            self.load_errors.update(meta.fail_loads)
            self.fail_requests([rid for rid, _ in meta.request_loads] + meta.failed_requests)

    def fail_requests(self, rids: list[str]) -> None:
        """Report ``rids`` received and failed (vLLM releases them and recomputes them)."""
        self.received.update(rids)
        self.receive_failed.update(rids)

    def idle_step(self) -> bool:
        """An idle step's metadata arrived (nothing of gpuckpt's this step): whether the step may
        run with no metadata bound at all — vLLM then skips the two per-layer hooks, and each
        worker hook finds nothing to do. Not while restored requests' earlier outputs are to be put
        in front of the sampler's view (:meth:`refresh_priors`, in ``start_load_kv``)."""
        self.report = None  # an idle step's metadata means every rank's report is in
        return not self.priors

    def start_load_kv(self, meta: Any) -> None:
        if meta is None or not isinstance(meta, GpuckptMeta):  # None first: no ABC instance check
            return
        if meta.idle:  # bound only for the priors (see idle_step)
            if not self.idle_step():
                self.refresh_priors()
            return
        if meta.ranks_known:
            self.report = None
        self.load_errors.update(meta.fail_loads)
        for rid, state in meta.generators:
            try:
                g = self.generator(rid)
                if g is None:
                    raise LookupError("no sampler generator (not the V1 model runner?)")
                g.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))
            except Exception as exc:
                log.error("gpuckpt: the seeded state of %s is not restored: %s", rid, exc)
        for path in meta.close_files:
            pf = self.files.pop(path, None)
            if pf is not None:
                pf.close()  # its pages (users' KV) leave host memory with the last mapping
        for rid, prior in meta.priors:
            self.priors[rid] = prior
        if self.priors:
            self.refresh_priors()
        if (why := self.unusable()) and (meta.loads or meta.request_loads):
            raise EngineError(why)  # the guard fails them all (fail_loads)
        if meta.loads:
            self.load_errors.update(self.load(meta.loads))
        self.fail_requests(meta.failed_requests)
        for rid, loads in meta.request_loads:
            if self.load(loads):
                self.fail_requests([rid])
            self.received.add(rid)

    def load(self, loads: list[tuple[int, str, str]]) -> set[int]:
        """Copy ``loads`` (block id, page file, key) into the KV cache; the block ids that failed."""
        failed: set[int] = set()
        shape = self.stored_shape()
        ids: list[int] = []
        pages: list[memoryview] = []
        for block_id, index_path, key_hex in loads:
            try:
                pf = self.files.get(index_path)
                if pf is None:
                    pf = self.files[index_path] = staging.PageFile(index_path, trust=self.trust)
                if tuple(pf.index.page_shape) != shape or pf.index.dtype != self.dtype():
                    raise ValueError(f"page {pf.index.page_shape} {pf.index.dtype} != {shape} {self.dtype()}")
                pages.append(pf.page(bytes.fromhex(key_hex)))
                ids.append(block_id)
            except Exception:
                log.exception("gpuckpt: loading block %d failed", block_id)
                failed.add(block_id)
        try:
            assert self.copier is not None
            assert self.heads is not None
            # queued before this step's forward (same stream on CUDA); each rank takes its heads
            self.copier.scatter(ids, pages, self.heads.as_tuple(), self.head_axis)
        except Exception:
            log.exception("gpuckpt: loading %d blocks failed", len(ids))
            failed.update(ids)
        return failed

    def refresh_priors(self) -> None:
        """Put restored requests' earlier outputs in front of their outputs, in the sampler's view.

        Frequency / presence penalties and bad words read
        ``input_batch.req_output_token_ids`` (the list vLLM hands the sampler);
        a resubmitted request has its earlier outputs in its prompt instead.
        The entry is replaced by ``prior + outputs`` each step (after the
        runner updated the batch, before it samples); the request's own list,
        which the runner appends to and the min-tokens processor counts, is
        left alone. V1 model runner only (the ledger marks other runners'
        penalised requests inexact).
        """
        runner = self.runner
        batch = getattr(runner, "input_batch", None)
        if batch is None:
            self.priors.clear()
            return
        for rid, prior in list(self.priors.items()):
            st = runner.requests.get(rid)
            if st is None:
                del self.priors[rid]  # finished or aborted
                continue
            idx = batch.req_id_to_index.get(rid)
            if idx is not None:
                batch.req_output_token_ids[idx] = prior + list(st.output_token_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self.load_errors = self.load_errors, set()
        return errs

    # ------------------------------------------------------------------ after the forward

    def fail_capture(self, meta: Any) -> None:
        """The safe answer of a failed ``wait_for_save``: tails count as sent (their blocks must be
        freed all the same) and the chunk is reported failed."""
        if isinstance(meta, GpuckptMeta):
            self.sent.update(rid for _, _, rid in meta.tails)
            if meta.capture is not None:
                self.finish_capture(meta.capture, {"error": "the worker's copy failed (see its log)"})

    def wait_for_save(self, meta: Any) -> None:
        if meta is None or not isinstance(meta, GpuckptMeta) or meta.idle:
            return
        for key_hex, block_id, rid in meta.tails:  # before the capture, which includes them
            if self.asleep:  # no memory under the block: the tail is not kept
                self.sent.add(rid)
                continue
            try:
                assert self.copier is not None
                self.tail_pages[bytes.fromhex(key_hex)] = self.copier.page(block_id)
            except Exception:
                log.exception("gpuckpt: copying the tail of %s failed", rid)
            self.sent.add(rid)
        for key_hex in meta.tail_drop:
            self.tail_pages.pop(bytes.fromhex(key_hex), None)
        if meta.capture is None:
            return
        cap = meta.capture
        if self.disabled:
            why = f"the connector is disabled on rank {self.rank}: {self.disabled}"
            self.finish_capture(cap, {"error": why})
            return
        if self.asleep:
            self.finish_capture(cap, {"error": f"rank {self.rank}: {self.unusable()}"})
            return
        t0 = time.monotonic()
        try:
            if "gather" in self.faults:
                raise InjectedFault("injected fault in gather")
            assert self.copier is not None
            # Only the copy holds up the engine (on CUDA, only its GPU stream);
            # the page file is written by a thread, reported a step or more later.
            before, self.before = self.before, {}
            if len(before) != len(cap.before):
                raise RuntimeError(f"{len(cap.before) - len(before)} of the pages to copy before the forward were not")
            gathered = self.copier.gather([b for _, b in cap.pages])
            tails = [(k, self.tail_pages[bytes.fromhex(k)]) for k in cap.tails if bytes.fromhex(k) in self.tail_pages]
            tails += list(before.items())
            # Seeded requests' sampler state, before this step's sample (matches the ledger's outputs).
            gens = {}
            if self.runner is not None and cap.generators:
                for rid, st in list(self.runner.requests.items()):
                    g = getattr(st, "generator", None)
                    if g is not None:
                        gens[rid] = base64.b64encode(g.get_state().numpy().tobytes()).decode()
        except Exception as exc:
            log.exception("gpuckpt: capture %s failed", cap.job)
            self.finish_capture(cap, {"error": f"{type(exc).__name__}: {exc}"})
            return
        pause = time.monotonic() - t0
        threading.Thread(
            target=self._write_capture,
            args=(cap, gathered, tails, gens, pause),
            name=f"gpuckpt-capture-{cap.job}",
            daemon=True,
        ).start()

    def _write_capture(
        self,
        cap: CopyJob,
        gathered: Gathered,
        tails: list[tuple[str, bytes]],
        gens: dict[str, str],
        pause: float,
    ) -> None:
        t0 = time.monotonic()
        w: staging.PageWriter | None = None
        try:
            if "write_capture" in self.faults:
                raise InjectedFault("injected fault in write_capture")
            assert self.heads is not None
            w = staging.PageWriter(
                cap.directory,
                cap.file(self.rank),
                dtype=self.dtype(),
                page_shape=self.page_shape(),
                layers=[n for n, _ in self.kv],
                trust=self.trust,
            )
            for (key_hex, _), page in zip(cap.pages, gathered.pages(), strict=True):
                w.write(bytes.fromhex(key_hex), page)
            for key_hex, tail in tails:
                w.write(bytes.fromhex(key_hex), tail)
            idx = w.commit()
            gathered.release()
            res: dict[str, Any] = {
                "rank": self.rank,
                "device": str(self.kv[0][1].device),
                "kv_heads": [self.heads.start, self.heads.count],
                "total_kv_heads": self.heads.total,
                "head_axis": self.head_axis,
                "index": str(w.index_path),
                "copy_s": pause,
                "write_s": time.monotonic() - t0,
                "bytes": idx.page_bytes * len(idx.keys),
                "pages_written": len(idx.keys),
                "generators": gens,
            }
        except Exception as exc:
            gathered.release()
            if w is not None:
                w.abort()
            log.exception("gpuckpt: writing capture %s failed", cap.job)
            res = {"error": f"{type(exc).__name__}: {exc}"}
        self.finish_capture(cap, res)

    def finish_capture(self, cap: CopyJob, result: dict[str, Any]) -> None:
        with self._done_lock:
            self._done.setdefault(cap.job, {})[self.rank] = result

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """The finished requests whose tails were copied (their blocks may be freed now), and the
        requests whose pages were loaded by request (those that failed among them)."""
        sent, self.sent = self.sent, set()
        received, self.received = self.received, set()
        return (sent or None), (received or None)

    def take_receive_failures(self) -> set[str]:
        """The requests reported received this step whose load failed (``failed_recving``)."""
        failed, self.receive_failed = self.receive_failed, set()
        return failed

    def build_connector_worker_meta(self) -> GpuckptWorkerMeta | None:
        if not self._done and self.report is None:
            # the usual step: no lock taken (a page file a writer thread finishes meanwhile is in
            # the next step's metadata)
            return None
        with self._done_lock:
            done, self._done = self._done, {}
        reports = {self.rank: self.report} if self.report is not None else {}
        if not done and not reports:
            return None
        return GpuckptWorkerMeta(done, reports)

    def shutdown(self) -> None:
        for pf in self.files.values():
            pf.close()
        self.files.clear()
