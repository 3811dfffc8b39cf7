"""``GpuckptLinker``: gpuckpt's worker side inside an SGLang server, loaded without patching SGLang.

SGLang (0.5.23) loads it as an external cache linker of its unified radix
cache, in the scheduler process (the one that owns the KV pools)::

    --enable-unified-cache-external-linker
    --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "GpuckptLinker",
        "linker_module_path": "agent.engines.sglang.linker",
        "linker_extra_config": {"control_socket": PATH,
                                "staging_dir": PATH | null,
                                "shared_group": NAME | null}}'

(:func:`agent.engines.sglang.serve.serve_command` builds these.) It is a
:class:`agent.engines.service.WorkerService`: it serves the control protocol
(:mod:`agent.engines.protocol`) from a thread with the vLLM adapter's reply
shapes, so the agent's session code checkpoints and restores it unchanged;
this module holds only what is SGLang's.

Step boundary: the scheduler asks the linker ``num_completed_offloads()``
once per loop iteration (``check_hicache_events``, at the start of
``get_next_batch_to_run``: the previous batch's results are processed, the
next batch is not chosen yet). Every command that needs engine state is
queued by the control thread and run there, on the scheduler thread. An idle
scheduler loops without sleeping (``--sleep-on-idle`` off, the default; with
it on, it wakes at least once a second), so an idle server answers too; a
paused one (``/pause_generation``) answers once it continues.

Capture (``capture``, a stream; driven by :mod:`.capture`, its bookkeeping
is :mod:`.stream`, the tree walk :mod:`.tree`, the requests' keys and
ledger entries :mod:`.state`): at the first boundary where ``when`` holds —
the consistent point — the linker writes the ledger (:mod:`.ledger`: running
batch, the last prefill batch, the chunked request and the waiting queue)
and plans the pages:

- every in-flight request's pages, read through
  ``req_to_token_pool.req_to_token[req_pool_idx, :kv_tokens]`` (a running
  request's decode KV is not in the radix tree until it finishes): full
  pages keyed by SGLang's own chained page hash
  (``get_storage_hash_str``, seeded by ``extra_key`` / ``cache_salt`` as the
  radix cache seeds it), the partial last page by :func:`tail_key` (slots
  past the tail zeroed);
- every full page of the radix tree, however old: the tree core's own walk
  from each root, each page named by the key the tree gave it
  (:class:`.tree.TreeIndex`) — planned as page numbers and pinning nodes
  only, each key looked up as its page is taken for a chunk, so the
  consistent point's planning grows with the tree's nodes, not its pages.

The tree's pages are pinned — a lock reference (``inc_lock_ref``) on the
nodes that hold them — and copied over the next steps, at most
``copy_per_step`` bytes a step (``copy_bytes_per_step`` in the linker's
extra config, default 16 MiB) and at most ``max_staging`` bytes staged; a
node's lock is released as soon as its last page is copied, and every lock
when the stream ends for any reason (done, cancelled, timed out, abandoned,
failed, the cache flushed). What may change after the consistent point (the
live requests' pages outside the tree, tree pages no lock holds) is copied
at it, in chunk 0. So the scheduler's pause at the consistent point grows
with the live requests, not with the cache, and each later step pauses for
one bounded chunk. Chunk files are written by a thread, off the scheduler's
step. A page is ``[layers, 2 (K, V), page_size, kv_heads, head_dim]``
(heads on axis 2 of a layer's page). ``durable`` keys are listed under
``skipped`` and not copied. The reply is chunk 0 with the ledger; ``next``
acknowledges chunks and answers the ones written since, then ``done``.

Idle cost: while no capture or wait is pending, the step boundary counts the
step and reads two lists (no walk, no request list); what the linker does
per insert is record the keys of the pages the tree offers it.

Restore: ``offer`` registers a page file's keys (generation and TTL as in
the vLLM connector; an offered file belongs to the linker and is deleted
when the offer ends; a later part of an ended generation is refused and its
file deleted). ``lookup`` answers the prefix lengths (in pages) whose every
page key is offered; ``load`` queues the pages for the request's slots and
``start_layer_wise_loading`` copies them from the page file into every
layer's K and V (``.to(device)`` of a host tensor: CPU or CUDA alike), then
completes every layer of the load counter. Only verified pages are offered
(the agent verifies them), so a load fails only if its file cannot be read;
SGLang then aborts those requests. The linker loads whole pages only: a
captured tail page is stored, but a restored request recomputes its tail.

Never harm the server: every linker method and command runs under
:func:`agent.engines.service.guard`; an exception is logged and answered safely (no hit, no load,
an error reply). ``offload`` returns False: nothing is written through.

Tensor parallelism: every rank's scheduler has a linker; rank 0's serves
the control socket, and every rank copies (and loads) its own KV heads of
the same pages at the same step, kept in step by rank 0's notes on SGLang's
own request broadcast (:mod:`.ranks`).

Limits: MHA KV pools (``MHATokenToKVPool``: ``k_buffer``/``v_buffer``), PP =
1 and no data parallelism (refused by name), no overlap scheduling (CPU
turns it off; on a GPU run with ``--disable-overlap-schedule``), no HiCache
(SGLang does not combine it with a linker).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)

from agent.engines import staging, versions
from agent.engines.protocol import Keys
from agent.engines.service import Reply, Waiter, WorkerService, guard
from agent.engines.sglang import state
from agent.engines.sglang.capture import HEAD_AXIS, STREAM_IDLE_S
from agent.engines.sglang.describe import describe
from agent.engines.sglang.ranks import TensorParallel
from agent.engines.sglang.state import page_keys, tail_key
from agent.engines.sglang.stream import Pin, Stream
from agent.engines.sglang.tree import TreeIndex
from agent.engines.shards import Heads, ShardError, local_heads
from agent.engines.streams import DEFAULT_COPY_PER_STEP, DEFAULT_MAX_STAGING
from agent.fs import Trust

__all__ = ["STREAM_IDLE_S", "GpuckptLinker", "page_keys", "tail_key"]

log = logging.getLogger("gpuckpt.sglang")


def _find_scheduler() -> Any:
    """The ``Scheduler`` building this linker (its tree cache), from the calling frames."""
    f: Any = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if obj is not None and any(c.__name__ == "Scheduler" for c in type(obj).__mro__):
            return obj
        f = f.f_back
    return None


def _offered_node() -> int | None:
    """The tree node an ``offload`` call offers: SGLang's linker wrapper (``_offload_node``) calls
    us with its node's transfers, not its id, so the id is read from that caller's frame."""
    f: Any = sys._getframe(2)
    for _ in range(4):
        if f is None:
            return None
        if f.f_code.co_name == "_offload_node":
            node = f.f_locals.get("node_id")
            return node if isinstance(node, int) else None
        f = f.f_back
    return None


def _ranks() -> tuple[int, int]:
    """This scheduler's tensor-parallel rank and the rank of its pipeline stage or data-parallel
    replica (0 for both in the one scheduler that serves the control socket), from SGLang's
    parallel context (set before the cache is built); ``(0, 0)`` without one (a linker hosted on
    bare pools)."""
    try:  # probed: an SGLang without a parallel context (a linker on bare pools) answers (0, 0)
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        tp_rank = int(p.tp_rank)
    except Exception:
        return 0, 0
    other = 0
    for name in ("pp_rank", "dp_rank"):
        with contextlib.suppress(Exception):  # not published in this process: one stage, one replica
            other = max(other, int(getattr(p, name) or 0))
    return tp_rank, other


class GpuckptLinker(UnifiedCacheLinker, TensorParallel):  # type: ignore[misc]
    """See the module docstring. Constructed by SGLang's linker factory (``backend=dynamic``)."""

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: Any = None,
        extra_config: dict[str, Any] | None = None,
        forward_stream: Any = None,
    ) -> None:
        extra = dict(extra_config or {})
        tag = hashlib.sha256(str(extra.get("control_socket", "")).encode()).hexdigest()[:12]
        WorkerService.__init__(
            self,
            staging_dir=str(extra.get("staging_dir") or staging.default_dir(f"sglang-{tag}")),
            trust=Trust.of(extra.get("shared_group") or None),
            faults=set(extra.get("inject_faults") or ()),
        )
        self.forward_stream = forward_stream
        self._server_args = server_args
        self.page_size = int(params.page_size)
        self._kvpool = params.token_to_kv_pool_allocator.get_kvcache()
        self._req_to_token = params.req_to_token_pool
        self.pools = {PoolName.KV: self._kvpool}
        self._disabled: str | None = None
        k = getattr(self._kvpool, "k_buffer", None)
        v = getattr(self._kvpool, "v_buffer", None)
        if not isinstance(k, list) or not isinstance(v, list) or not k or len(k) != len(v):
            self._disabled = f"KV pool {type(self._kvpool).__name__} has no per-layer k_buffer/v_buffer"
            self._k: list[torch.Tensor] = []
            self._v: list[torch.Tensor] = []
        else:
            self._k, self._v = list(k), list(v)
        self._scheduler = _find_scheduler()
        self._tp = int(getattr(server_args, "tp_size", 1) or 1)
        self._pp = int(getattr(server_args, "pp_size", 1) or 1)
        self._rank, elsewhere = _ranks()
        count = int(self._k[0].shape[1]) if self._k else 1
        self._heads = Heads(0, count, count)
        if self._disabled is None:
            # an SGLang outside the supported range: nothing captured or restored, said by name
            # (agent.engines.versions; the operator may opt in)
            self._disabled = versions.refusal("sglang", allowed=versions.allowed_by(extra))
        if self._disabled is None:
            self._disabled = self._refusal(server_args, count)
        if self._disabled is not None:
            log.warning("gpuckpt: %s; captures will be refused and restores replayed cold", self._disabled)
        self.layer_done_counter = LayerWiseLoadCounter(max(1, len(self._k)))
        self.max_staging = int(extra.get("max_staging_bytes") or DEFAULT_MAX_STAGING)
        self.copy_per_step = int(extra.get("copy_bytes_per_step") or DEFAULT_COPY_PER_STEP)
        self._tree = TreeIndex(self.page_size)
        self._step = 0
        self._seq = 0
        self.stream: Stream | None = None  # the capture in flight (one at a time)
        self._unpin: list[Pin] = []  # locks of ended streams, released at the next boundary
        self._last_plan: dict[str, Any] = {}
        self._files: dict[str, staging.PageFile] = {}  # open mappings of offered files
        self._pending: dict[str, tuple[torch.Tensor, list[tuple[str, bytes]]]] = {}
        self._restored: dict[str, int] = {}  # rid → tokens loaded from offered pages
        self._lookups = 0
        # the linker's own time on the scheduler thread in its per-step and per-insert hooks (the
        # idle cost, read by bench/sglang_capture_pause.py)
        self._hook_s = 0.0
        self._offers = 0
        sock = extra.get("control_socket")
        self._init_ranks(str(sock) if sock else None)
        if sock and self._rank == 0 and not elsewhere:  # the other ranks are reached through rank 0
            self.serve(str(sock))
            self._serve_ranks()
        log.info(
            "gpuckpt: linker loaded (page size %d, rank %d of %d, KV heads %s, control socket %s)",
            self.page_size,
            self._rank,
            self._tp,
            self._heads.as_tuple(),
            sock if self._rank == 0 else f"{sock} (through rank 0)",
        )

    def _refusal(self, server_args: Any, count: int) -> str | None:
        """Why this server's KV cannot be captured or restored (named), or None; sets the heads."""
        if self._pp > 1:
            return (
                f"gpuckpt's SGLang linker does not carry pipeline-parallel servers (this one runs "
                f"pp_size={self._pp}: each stage holds other layers); run SGLang with --pp-size 1"
            )
        dp = int(getattr(server_args, "dp_size", 1) or 1)
        if dp > 1 or getattr(server_args, "enable_dp_attention", False):
            return (
                f"gpuckpt's SGLang linker does not carry data-parallel servers (dp_size={dp}, "
                f"dp attention {bool(getattr(server_args, 'enable_dp_attention', False))}): their "
                "schedulers are not one group in step; run one server per replica"
            )
        total = count
        if self._tp > 1:
            mc = getattr(self._scheduler, "model_config", None)
            if mc is None or not hasattr(mc, "get_total_num_kv_heads"):
                return "tensor parallel: the scheduler's model config (its total KV heads) is out of reach"
            total = int(mc.get_total_num_kv_heads())
        try:
            self._heads = local_heads(self._rank, self._tp, total, count)
        except ShardError as exc:
            return f"tensor parallel: the KV heads cannot be split as gpuckpt splits them: {exc}"
        return None

    # ------------------------------------------------------------------ engine state

    def _progress(self, live: list[Any]) -> dict[str, Any]:
        """A ``wait``'s answer: the step, the live requests' outputs, and the tokens of the radix tree
        that lock references hold (the live requests' and a capture's pins; read here, on the
        scheduler thread, as the tree is not thread-safe)."""
        cache = self._cache()
        protected = int(cache.protected_size()) if cache is not None else None
        return {
            "step": self._step,
            "live": len(live),
            "outputs": {r.rid: len(r.output_ids) for r in live},
            "tree_protected_tokens": protected,
        }

    # ------------------------------------------------------------------ the step boundary

    def _boundary(self) -> None:
        """Once per scheduler loop iteration, on the scheduler thread. Idle (no capture, wait,
        stream or file to delete), it reads a few fields and returns. A tensor-parallel server's
        ranks act on rank 0's step notes instead (:mod:`.ranks`)."""
        self._step += 1
        if self.retired:
            with self.lock:
                self._retire()
        if self._ranked:
            self._ranked_boundary()
            return
        if self._unpin:
            self._release_pins()
        st = self.stream
        if st is not None:
            self._pump(st)
        if not (self.capture_calls or self.wait_calls):  # read without the lock on every loop
            return
        live = state.live_requests(self._scheduler)
        with self.lock:
            due = [w for w in self.wait_calls + self.capture_calls if state.met(w.when, live)]
            self.wait_calls = [w for w in self.wait_calls if w not in due]
            self.capture_calls = [w for w in self.capture_calls if w not in due]
        for w in due:
            if w.kind == "wait":
                w.reply = {"ok": True, **self._progress(live)}
                w.event.set()
        captures = [w for w in due if w.kind == "capture"]
        if captures:
            try:
                self._capture(captures, live)
            except Exception as exc:
                log.exception("gpuckpt: capture failed")
                self.failures["capture"] = self.failures.get("capture", 0) + 1
                self.answer(captures, {"ok": False, "error": f"capture failed: {type(exc).__name__}: {exc}"})

    def _retire(self) -> None:
        """Delete and close the page files of ended offers (lock held, scheduler thread: no load runs)."""
        for path in self.retire_files():
            pf = self._files.pop(path, None)
            if pf is not None:
                pf.close()

    # ------------------------------------------------------------------ UnifiedCacheLinker

    def _no_hit(self, *args: Any, **kwargs: Any) -> list[int]:
        return []

    @guard(_no_hit)
    def lookup(self, rid: str, transfers: list[Any]) -> list[int]:
        """The prefix lengths (pages) whose every page key is offered: ``[1, …, n]``."""
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is None or not kv.keys or not self.offers.keys or self._disabled:
            return []
        self._lookups += 1
        offer = self.offers.keys  # replaced, never mutated: a consistent snapshot
        n = 0
        for kh in kv.keys:
            if bytes.fromhex(kh) not in offer:
                break
            n += 1
        if self._tp > 1 and n:
            self._remember_hit(rid, list(kv.keys[:n]), offer)
        return list(range(1, n + 1))

    def _refuse(self, *args: Any, **kwargs: Any) -> bool:
        return False

    @guard(_refuse)
    def load(self, rid: str, transfers: list[Any]) -> bool:
        """Queue the offered pages of ``transfers``' keys for the request's device slots."""
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is None or kv.device_indices is None or not kv.keys:
            return False
        # what this request's lookup saw (every rank answers as its lookup did), else the offer now
        seen = self._hits.pop(rid, None) if self._tp > 1 else None
        offer = seen if seen is not None else self.offers.keys
        plan: list[tuple[str, bytes]] = []
        for kh in kv.keys:
            kb = bytes.fromhex(kh)
            path = offer.get(kb)
            if path is None:  # withdrawn since the lookup
                return False
            plan.append((path, kb))
        if int(kv.device_indices.numel()) != len(plan) * self.page_size:
            return False
        self._pending[rid] = (kv.device_indices, plan)
        return True

    def _failed_start(self, *args: Any, **kwargs: Any) -> int:
        self._pending.clear()
        return -1

    @guard(_failed_start)
    def start_layer_wise_loading(self) -> int:
        """Copy every queued load into the pools now (before the forward); the counter index."""
        if not self._pending:
            return -1
        pending, self._pending = self._pending, {}
        index = int(self.layer_done_counter.update_producer())
        try:
            self._load(pending)
        except Exception as exc:
            log.exception("gpuckpt: loading offered pages failed; those requests are aborted")
            self.layer_done_counter.fail(index, exc)
            return index
        for layer in range(self.layer_done_counter.num_layers):
            self.layer_done_counter.complete(index, layer)
        return index

    def _load(self, pending: dict[str, tuple[torch.Tensor, list[tuple[str, bytes]]]]) -> None:
        """Copy each request's offered pages into its slots: this rank's heads of each stored page
        (which holds every head, whatever TP size wrote it)."""
        shape = self._page_shape()
        stored = self._stored_shape()
        heads = self._heads
        dtype = self._k[0].dtype
        device = self._k[0].device
        for rid, (slots, plan) in pending.items():
            with self.lock:
                files = []
                for path, _ in plan:
                    pf = self._files.get(path)
                    if pf is None:
                        raise staging.PageFileError(f"page file {path} is no longer offered")
                    files.append(pf)
                raw = [bytes(pf.page(kb)) for pf, (_, kb) in zip(files, plan, strict=True)]
            host = torch.frombuffer(bytearray(b"".join(raw)), dtype=torch.uint8).view(dtype)
            pages = host.view(len(plan), *stored)
            if heads.count != heads.total:  # [pages, layers, 2, page, heads, head_dim]
                pages = pages.narrow(1 + 1 + HEAD_AXIS, heads.start, heads.count)
            pages = pages.to(device)
            idx = slots.to(device=device, dtype=torch.int64)
            for layer, (k, v) in enumerate(zip(self._k, self._v, strict=True)):
                k[idx] = pages[:, layer, 0].reshape(-1, *shape[3:])
                v[idx] = pages[:, layer, 1].reshape(-1, *shape[3:])
            # the request inserts these pages into the tree as its own, which the tree may not
            # offer again (restored from the store): named here
            self._tree.learn([kb.hex() for _, kb in plan], slots, None)
            self._restored[rid] = self._restored.get(rid, 0) + len(plan) * self.page_size

    def _landed_false(self, *args: Any, **kwargs: Any) -> bool:
        return False

    @guard(_landed_false)
    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return bool(self.layer_done_counter.finish(counter_index))

    @guard(_refuse)
    def cancel_queued_load(self, rid: str) -> bool:
        return self._pending.pop(rid, None) is not None

    @guard(_refuse)
    def offload(self, transfers: list[Any], session_id: str | None = None) -> bool:
        """A node the tree inserted (or met again on an insert), offered for the store: its pages'
        keys are recorded for the tree walk (:mod:`.tree`), nothing is taken — a capture reads
        the pools — so the tree offers it again with every insert beneath it."""
        t0 = time.perf_counter()
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is not None and kv.keys and kv.device_indices is not None:
            self._tree.learn(list(kv.keys), kv.device_indices, _offered_node())
        self._offers += 1
        self._hook_s += time.perf_counter() - t0
        return False

    def _zero(self, *args: Any, **kwargs: Any) -> int:
        return 0

    @guard(_zero)
    def num_completed_offloads(self) -> int:
        """Never any (see :meth:`offload`); called once per scheduler loop: the step boundary."""
        t0 = time.perf_counter()
        self._boundary()
        self._hook_s += time.perf_counter() - t0
        return 0

    def pop_completed_offload(self) -> bool:
        return False

    @guard(lambda self: None)
    def reset(self) -> None:
        """SGLang flushes its cache (the tree is reset right after): queued loads go, a capture in
        flight ends and its locks are released first; the tree's page names go (the offer stays)."""
        self._pending.clear()
        self.layer_done_counter.reset()
        with self.lock:
            if self.stream is not None:
                self.end_stream(self.stream, "the server flushed its cache")
        self._release_all_pins()  # every rank flushes at this step: every rank releases now
        self._tree.clear()

    @guard(lambda self: None)
    def close(self) -> None:
        self.close_server()
        self._close_ranks()
        with self.lock:
            if self.stream is not None:
                self.end_stream(self.stream, "the server is shutting down")
            self.end_offer()
            self._retire()
        self._release_all_pins()

    # ------------------------------------------------------------------ the control protocol (control threads)

    def describe_worker(self) -> dict[str, Any]:
        return describe(self._server_args, self._k, self.page_size, self._tp, self._pp, self._heads, self._disabled)

    def waiting_for(self, w: Waiter) -> str:
        return f"waiting for {w.when}" if w.when else "is the scheduler paused?"

    def check_page_file(self, pf: staging.PageFile) -> None:
        want = (self._dtype(), self._stored_shape()) if self._k else None
        got = (pf.index.dtype, tuple(pf.index.page_shape))
        if got != want:
            raise staging.PageFileError(f"offered pages are {got}, this server's are {want}")

    def keep_page_file(self, path: str, pf: staging.PageFile) -> bool:
        """Offered files stay mapped for the loads (lock held); one offered again replaces its mapping."""
        old = self._files.pop(path, None)
        if old is not None:
            old.close()
        self._files[path] = pf
        return True

    def on_keys(self, msg: Keys) -> Reply:
        """Each request's page keys (hex) in order: full pages, then the tail key of a partial last page."""
        out = []
        p = self.page_size
        for r in msg.requests:
            ids = list(r.token_ids)
            n = r.kv_tokens
            keys = state.page_keys(ids, n, p, r.extra_key, r.cache_salt)
            if n > len(keys) * p:
                keys.append(
                    state.tail_key(keys[-1] if keys else None, ids[len(keys) * p : n], r.extra_key, r.cache_salt).hex()
                )
            out.append(keys)
        return {"ok": True, "keys": out}

    def engine_stats(self) -> dict[str, Any]:
        st = self.stream
        return {
            "restored_tokens": dict(self._restored),
            "step": self._step,
            "lookups": self._lookups,
            "tree_pages_named": len(self._tree),
            "hook_s": self._hook_s,
            "offers": self._offers,
            "stream": None if st is None else {"seq": st.seq, "pins": len(st.pins), **st.summary()},
            "pins_to_release": len(self._unpin),
            "last_plan": dict(self._last_plan),
            "disabled": self._disabled,
            "tensor_parallel_size": self._tp,
            "kv_heads": list(self._heads.as_tuple()),
        }
