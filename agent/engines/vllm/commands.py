"""vLLM's side of the control protocol: the capture at the step boundary and its stream.

:class:`VllmService` is the engine-specific part of the scheduler half
(:class:`.scheduler.SchedulerHalf` builds on it; the engine-neutral part is
:class:`agent.engines.service.WorkerService`).

Capture (one consistent point, then a stream; the bookkeeping is
:mod:`agent.engines.vllm.capture`):

1. The agent sends ``capture``; the call waits for the next step boundary.
2. ``build_connector_meta`` of that step (scheduler thread, after the step is
   scheduled, before its counters advance) calls :meth:`VllmService.plan_capture`,
   which writes the ledger and lists the pages: every block in the prefix
   cache, keyed by vLLM's block hash, every live request's full blocks, its
   partial tail (keyed by :func:`.meta.tail_key`) and the finished requests'
   stored tails. A request's KV at the end of the step covers
   ``num_computed_tokens + num_scheduled_tokens``. What may change after this
   step — live requests' partial tails and full blocks the cache map does not
   hold — goes into chunk 0 (a :class:`.CopyJob` in this step's
   :class:`.GpuckptMeta`), topped up with cached blocks; the other cached
   blocks and stored tails stay pending.
3. The worker half copies a job's pages in ``wait_for_save`` of its step
   (:mod:`.worker`). The report comes back in a later step's
   :class:`.GpuckptWorkerMeta` and, once every rank's is in, chunk 0 answers
   the control call with the ledger.
4. Each later step issues the next chunk of pending blocks — at most
   ``copy_bytes_per_step`` bytes, and only while fewer than two chunks are
   unacknowledged (the staging bound ``max_staging_bytes``: backpressure),
   each block checked to be still mapped to its hash (then its content is the
   one the key names; an evicted one is *lost*, left out). The agent reads a
   chunk, deletes it and sends ``next`` with ``ack``, until ``done``;
   ``cancel`` abandons a stream. A stream with no word from the agent for
   5 minutes is abandoned and its chunks deleted.

Incremental capture: the durable keys (``durable`` after each commit, plus
the keys a restore offered) are pruned to what is still cached at each
capture; a capture copies only the other pages and lists the durable ones
under ``skipped``. ``full`` copies everything; ``prefix_only`` (a pre-copy
between checkpoints) copies only the cached full blocks not durable, records
no ledger and gives way to any real capture.

Idle engine: a control call wakes EngineCore's busy loop (a ``WAKEUP`` on its
input queue) and ``has_pending_push_work`` keeps it stepping until the
capture is planned, so a capture works with no request running.

Limits: PP = 1 (a PP > 1 worker answers every capture with an error).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

from vllm import SamplingParams
from vllm.v1.core.kv_cache_utils import BlockHashListWithBlockSize, get_block_hash, get_group_id
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.request import Request

from agent.engines import staging
from agent.engines.protocol import Hold, KeyRequest, Keys
from agent.engines.service import InjectedFault, Reply, Waiter, WorkerService
from agent.engines.streams import DEFAULT_COPY_PER_STEP, DEFAULT_MAX_STAGING, chunk_pages
from agent.engines.vllm import internals
from agent.engines.vllm.capture import CopyJob, Pending, Stream
from agent.engines.vllm.describe import describe
from agent.engines.vllm.groups import STATE, GroupRule, carried, group_key, not_carried, worker_groups
from agent.engines.vllm.ledger import (
    LEFT,
    RunnerFacts,
    client_id,
    grammar_settings,
    make_ledger,
    request_entry,
    speculative_method,
)
from agent.engines.vllm.meta import tail_identified, tail_key
from agent.fs import Trust

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("gpuckpt.vllm")

#: how long ``describe`` waits for every rank's report (sent in the ranks' per-step metadata)
REPORT_WAIT_S = 30.0


def check_states(raw: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Offered request states that can be applied, and why the others cannot (by client id).

    A state is dropped whole when any part is malformed: that request then
    replays as a plain resubmission, and nothing else is affected.
    """
    ok: dict[str, dict[str, Any]] = {}
    rejected: dict[str, str] = {}
    for cid, st in raw.items():
        try:
            if not isinstance(st, dict):
                raise ValueError("not an object")
            g = st.get("generator_state")
            if g is not None and not base64.b64decode(str(g), validate=True):
                raise ValueError("empty generator state")
            for k in ("prior_outputs", "grammar_outputs"):
                v = st.get(k)
                if v is not None and not (isinstance(v, list) and all(isinstance(t, int) for t in v)):
                    raise ValueError(f"{k} is not a list of token ids")
            ids, match = st.get("ids"), st.get("match")
            if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
                raise ValueError("ids is not a list of request ids")
            if match is not None and not (isinstance(match, str) and len(match) == 64):
                raise ValueError("match is not a token digest")
            ok[str(cid)] = st
        except Exception as exc:
            rejected[str(cid)] = f"{type(exc).__name__}: {exc}"
    return ok, rejected


class VllmService(WorkerService):
    """The scheduler half's control side: capture planning and streaming, page keys by vLLM's
    hash, holds, request states kept for their requests, the ranks' reports, counters."""

    AWAITS = True

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, extra: dict[str, Any]) -> None:
        staging_dir, trust = staging_of(extra)
        super().__init__(staging_dir=staging_dir, trust=trust, faults=set(extra.get("inject_faults") or ()))
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = vllm_config.cache_config.block_size
        pc = vllm_config.parallel_config
        self.tp = int(pc.tensor_parallel_size)
        self.pp = int(pc.pipeline_parallel_size)
        self.runner_facts = RunnerFacts(
            model_runner=internals.model_runner(vllm_config),
            async_scheduling=bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)),
            speculative=speculative_method(vllm_config),
            grammar=grammar_settings(vllm_config),
        )
        # the KV cache groups (the hybrid allocator): each page is one group's block; none is
        # carried when one cannot be (see .groups)
        self.groups = worker_groups(vllm_config, kv_cache_config)
        self.carried = carried(self.groups)
        self.kv_not_carried = not_carried(self.groups)
        self.rules: list[GroupRule] | None = None  # built once the KV cache manager is bound
        if self.kv_not_carried:
            log.warning("gpuckpt: the KV cache is not carried (requests replay cold): %s", self.kv_not_carried)
        # a page: one block across the physical layer slots, as many as the largest group has layers
        page_bytes = max(
            (g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv_cache_config.kv_cache_groups), default=1
        )
        # Finished requests' partial tails kept in worker memory for the next capture: a FIFO
        # bounded in bytes, decided here, which tells the worker what to drop (GpuckptMeta.tail_drop).
        self.tail_cap = int(extra.get("tail_bytes", 256 << 20)) // max(1, page_bytes)
        # A capture's host staging: every rank's shard of a page together (see .capture).
        self.host_page_bytes = page_bytes * self.tp
        self.max_staging = int(extra.get("max_staging_bytes") or DEFAULT_MAX_STAGING)
        self.copy_per_step = int(extra.get("copy_bytes_per_step") or DEFAULT_COPY_PER_STEP)
        self.pool: BlockPool | None = None
        self.kv_manager: KVCacheManager | None = None
        self.engine: Any = None  # EngineCoreProc, to wake its busy loop
        self.live: dict[str, Request] = {}
        self.step = 0
        self.capture_seq = 0
        # The capture in flight (one at a time): its consistent point is taken, its full blocks
        # follow chunk by chunk (see .capture). Control calls wait on ``cond`` for its chunks.
        self.stream: Stream | None = None
        self.tail_keys: OrderedDict[bytes, None] = OrderedDict()
        self.hold_count = 0  # hold new requests until this many have arrived (see get_num_new_matched_tokens)
        self.hold_until = 0.0
        self.held: set[str] = set()
        # A streaming restore's requests whose pages are still on their way (offers.awaiting) wait
        # until the agent says they are ready, the offer ends, or no part comes for its await_s.
        self.offered_event = threading.Event()  # set by each offer: an engine idle on awaited requests wakes
        self.restored: dict[str, int] = {}  # client request id → tokens loaded
        self.load_failed: set[str] = set()  # client request ids whose load failed (by request)
        # client request id → {"generator_state", "prior_outputs", "grammar_outputs", "ids", "match"}
        self.state_offer: dict[str, dict[str, Any]] = {}
        # another client id a state's request may run under (the API server's id for the agent's
        # resubmission) → the ledger's client id: holds, counts and states all use the latter
        self.state_alias: dict[str, str] = {}
        self.states_refused: dict[str, str] = {}  # ledger client id → why a claimant was refused
        self.states_applied: dict[str, list[str]] = {}  # client id → what was applied
        # client id → why its carried state could not be applied: its continuation is void (the
        # engine request stops at once and the API server never serves it: SchedulerHalf.void)
        self.states_voided: dict[str, str] = {}
        self.voiding: dict[str, str] = {}  # engine request id → why, until it finishes
        # every rank's self-description (from GpuckptWorkerMeta.reports); describe waits for them
        self.reports: dict[int, dict[str, Any]] = {}
        self.reports_until = 0.0  # an idle engine steps for them until then (while describe waits)

    # ------------------------------------------------------------------ WorkerService hooks

    def describe_worker(self) -> dict[str, Any]:
        deadline = time.monotonic() + REPORT_WAIT_S
        with self.cond:
            while len(self.reports) < self.tp and time.monotonic() < deadline:
                self.reports_until = max(self.reports_until, deadline)
                self.wake()  # an idle engine steps, and the ranks' metadata brings their reports
                self.cond.wait(0.25)
            reports = [self.reports[r] for r in sorted(self.reports)]
        return describe(self.vllm_config, self.kv_cache_config, reports)

    def wants_reports(self) -> bool:
        """Whether an idle engine should step for the ranks' reports (lock held)."""
        return len(self.reports) < self.tp and time.monotonic() < self.reports_until

    def wake(self) -> None:
        """Make an idle EngineCore step (no-op when it runs in-process: the next client ``step()``
        then plans the capture)."""
        q = getattr(self.engine, "input_queue", None)
        if q is not None:
            q.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def forget_waiter(self, w: Waiter) -> None:
        if self.stream is not None and w in self.stream.waiters:
            self.stream.waiters.remove(w)

    def waiting_for(self, w: Waiter) -> str:
        failing = ", ".join(f"{k} ({n}×)" for k, n in sorted(self.failures.items()))
        why = f"failing connector hooks: {failing}" if failing else "is the engine idle?"
        if w.when:
            why += f"; waiting for {w.when}, at the last step: {self.progress()}"
        return why

    def check_states(self, raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        return check_states(raw)

    def take_states(self, states: dict[str, Any]) -> None:
        self.state_offer.update(states)
        for cid, st in states.items():
            for alt in st.get("ids") or ():
                if alt != cid:
                    self.state_alias[str(alt)] = cid

    def offer_ended(self) -> None:
        self.state_offer, self.state_alias = {}, {}

    def offered(self) -> None:
        self.offered_event.set()

    def engine_stats(self) -> dict[str, Any]:
        return {
            "restored_tokens": dict(self.restored),
            # requests whose pages failed to load (several KV cache groups: reported by request),
            # recomputed from scratch
            "load_failed_requests": sorted(self.load_failed),
            "step": self.step,
            "live": len(self.live),
            # the worker's sequence slots: a request beyond them queues (the agent's canary probe)
            "max_num_seqs": int(self.vllm_config.scheduler_config.max_num_seqs),
            "awaiting": len(self.offers.awaiting),
            "asked": self.offers.asked(),
            "coming": len(self.offers.coming),
            "tail_pages": len(self.tail_keys),
            "generators_pending": sum(1 for v in self.state_offer.values() if v.get("generator_state")),
            "states_pending": len(self.state_offer),
            "states_waiting": sorted(self.state_offer),
            "states_applied": {k: list(v) for k, v in self.states_applied.items()},
            "states_refused": dict(self.states_refused),
            "states_voided": dict(self.states_voided),
            "stream": None if self.stream is None else {"seq": self.stream.seq, **self.stream.summary()},
            "ranks_reported": len(self.reports),
        }

    # ------------------------------------------------------------------ vLLM's commands

    def block_hashes(self, hashes: Any) -> Any:
        """A request's block hashes, one per block of the worker's size. vLLM hashes at the pool's
        ``hash_block_size``, which is smaller when it raised the block size so that a state
        group's page fits (Qwen3-Next: blocks of 256, hashes of the configured 32); a block's
        hash is then the last one inside it, as vLLM's own view (``BlockHashListWithBlockSize``)
        and the prefix cache's map of full blocks name it."""
        hb = int(getattr(self.pool, "hash_block_size", 0) or self.block_size)
        if hb == self.block_size:
            return hashes
        return BlockHashListWithBlockSize(hashes, hb, self.block_size)

    def running_states(
        self,
        req: Request,
        hashes: Any,
        groups: list[tuple[int, list[int]]],
        states: set[int],
        before: dict[bytes, int],
        mutable: dict[bytes, int],
        cached: dict[bytes, Any],
        null: int,
    ) -> int:
        """A live request's pages in a worker with a state group (lock held); the tokens they carry.

        The state group's page is the request's running state *before* this step: the state after
        exactly the tokens computed so far, in the block vLLM keeps it in (``cdiv(computed, bs) -
        1``), which the step's forward advances in place — so it is copied before the forward
        (``before``). The restored request then hits up to those tokens, computes the rest, and
        continues from the exact next token; a state after the step's tokens would leave it
        nothing to compute. Its key is a block's at a boundary, else a tail's, and each attention
        group's page of that tail is taken too (full blocks are taken already). 0 when the state
        block is not there."""
        bs = self.block_size
        pre = int(req.num_computed_tokens)
        n_pre = pre // bs
        if pre <= 0 or n_pre > len(hashes):
            return 0
        idx = (pre - 1) // bs
        if any(idx >= len(ids) for _, ids in groups):
            return 0
        if pre % bs == 0:
            base = bytes(hashes[n_pre - 1])
        elif not tail_identified(req, n_pre * bs, pre):
            return 0
        else:
            parent = bytes(hashes[n_pre - 1]) if n_pre else b""
            lora = getattr(req.lora_request, "lora_name", None)
            base = tail_key(parent, req.all_token_ids[n_pre * bs : pre], req.cache_salt, lora)
        for g, ids in groups:
            key = group_key(base, g)
            if g in states:
                if ids[idx] == null:
                    return 0
                before[key] = ids[idx]
            elif pre % bs and key not in cached and ids[idx] != null:
                mutable.setdefault(key, ids[idx])
        return pre

    def on_keys(self, msg: Keys) -> Reply:
        """Each request's page keys, in order (a streaming restore fetches the in-flight requests'
        pages first)."""
        return {"ok": True, "keys": [self.request_keys(r) for r in msg.requests]}

    def request_keys(self, r: KeyRequest) -> list[str]:
        """The keys of the pages holding the first ``kv_tokens`` tokens of ``token_ids``: the engine's
        own block hashes, then the tail key of a partial last page (hex)."""
        hasher = getattr(self.engine, "request_block_hasher", None)
        ids = list(r.token_ids)
        n = r.kv_tokens
        if hasher is None or n <= 0 or not self.carried:
            return []
        salt = r.cache_salt
        rq = Request("gpuckpt-keys", ids[:n], SamplingParams(max_tokens=1), None, cache_salt=salt, block_hasher=hasher)
        bs = self.block_size
        full = [bytes(h) for h in self.block_hashes(rq.block_hashes)][: n // bs]
        if n % bs and len(full) == n // bs:
            full.append(tail_key(full[-1] if full else b"", ids[len(full) * bs : n], salt, None))
        # every group's page of each block (a windowed group's older ones are not in a checkpoint:
        # the agent keeps only the keys it holds)
        return [group_key(k, g.index).hex() for k in full for g in self.carried]

    def on_hold(self, msg: Hold) -> Reply:
        """Hold new requests until ``requests`` have arrived (see ``get_num_new_matched_tokens``)."""
        with self.lock:
            self.hold_count = msg.requests
            self.hold_until = time.monotonic() + msg.timeout  # never held forever
            self.held = set()
        return {"ok": True}

    # ------------------------------------------------------------------ at the step boundary (lock held)

    def met(self, when: dict[str, int] | None) -> bool:
        """Whether this step boundary satisfies a waiter's condition."""
        if not when:
            return True
        k = when.get("min_outputs", 0)
        n = sum(1 for r in self.live.values() if not r.is_finished() and r.num_output_tokens >= k)
        return n >= when.get("live", 0)

    def progress(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "live": len(self.live),
            "outputs": {client_id(rid): int(r.num_output_tokens) for rid, r in self.live.items()},
        }

    def still_cached(self, p: Pending) -> bool:
        """Whether the block pool's map still names block ``p.block_id`` for ``p``'s hash: then its
        content is the one the key names (see .capture)."""
        if p.lookup is None:  # a finished request's stored tail (worker memory): still kept?
            return p.key in self.tail_keys
        assert self.pool is not None
        return internals.still_cached(self.pool, p.lookup, p.block_id)

    def next_chunk(self, st: Stream) -> CopyJob:
        """The step's share of a stream's full blocks, for the workers to copy after the forward."""
        pages = st.take(self.still_cached)
        k = st.issue(len(pages))
        return CopyJob(
            seq=st.seq,
            chunk=k,
            directory=st.directory,
            name=st.name,
            pages=[(p.key.hex(), p.block_id) for p in pages if p.lookup is not None],
            tails=[p.key.hex() for p in pages if p.lookup is None],
        )

    def end_stream(self, st: Stream, error: str | None) -> None:
        """Close a stream: with ``error``, abandon it and delete what it staged."""
        if error is not None:
            st.error = st.error or error
            for path in st.files():
                staging.unlink_pair(path)
            self.answer(st.waiters, {"ok": False, "error": f"capture {st.seq} failed: {st.error}"})
            log.warning("gpuckpt: capture %d ended: %s", st.seq, st.error)
        st.waiters = []
        self.last_stream = {"seq": st.seq, "error": st.error, **st.summary()}
        if self.stream is st:
            self.stream = None
        self.cond.notify_all()

    def plan_capture(self, so: SchedulerOutput, waiters: list[Waiter]) -> CopyJob:
        """The consistent point: write the ledger, open the stream and return chunk 0 for the workers.

        Chunk 0 holds what may change after this step (live requests' partial tails, their full
        blocks the map does not name, finished requests' stored tails) and the first share of the
        cached full blocks; the rest follow over the next steps (see :mod:`.capture`). Pages the
        repository holds (durable) are listed as ``skipped`` and not copied.
        """
        if self.pp != 1:
            raise NotImplementedError(f"pipeline_parallel_size={self.pp}: only PP = 1 workers can be captured")
        if "plan_capture" in self.faults:
            raise InjectedFault("injected fault in plan_capture")
        t0 = time.monotonic()
        bs = self.block_size
        prefix_only = all(w.prefix_only for w in waiters)
        assert self.pool is not None
        assert self.kv_manager is not None
        # Every cached full block (in use or free-but-cached); blocks this step evicted for reuse
        # are already gone from the map. Free ones first: they are the ones at risk of eviction.
        cached: dict[bytes, Pending] = {}
        at_risk: list[Pending] = []
        in_use: list[Pending] = []
        carried_ids = {g.index for g in self.carried}
        for k, blk in internals.cached_blocks(self.pool) if carried_ids else ():
            # block_hash_num_tokens is the prefix length the hash covers; an
            # entry ending inside a block is a partial entry, not a full block.
            n = blk.block_hash_num_tokens
            if blk.is_null or (n is not None and n % bs):
                continue
            gid = get_group_id(k)
            if gid not in carried_ids:
                continue
            key = group_key(bytes(get_block_hash(k)), gid)
            if key in cached:
                continue
            p = cached[key] = Pending(key, int(blk.block_id), k)
            (in_use if blk.ref_cnt > 0 else at_risk).append(p)
        mutable: dict[bytes, int] = {}  # copied at this step: may change or go after it
        before: dict[bytes, int] = {}  # copied before this step's forward: a state group's running state
        null = int(self.pool.null_block.block_id)
        states = {g.index for g in self.carried if g.kind == STATE}
        entries = []
        for rid, req in [] if prefix_only else list(self.live.items()):
            if req.is_finished():
                continue
            # With async scheduling the step being planned may hold KV of a
            # token whose id is not back yet: claim only the tokens we know.
            kv_tokens = min(req.num_computed_tokens + so.num_scheduled_tokens.get(rid, 0), req.num_tokens)
            try:
                per_group = self.kv_manager.get_block_ids(rid) if self.carried else ()
            except (KeyError, IndexError):
                per_group = ()
            groups = [(g.index, per_group[g.index]) for g in self.carried] if per_group else []
            attention = [(g, ids) for g, ids in groups if g not in states]
            n_ids = min((len(ids) for _, ids in groups), default=0)
            hashes = self.block_hashes(req.block_hashes)
            n_full = min(kv_tokens // bs, n_ids, len(hashes))
            lora = getattr(req.lora_request, "lora_name", None)
            # A state group's blocks by position are not states at their boundaries (only those the
            # map names are); its one page of a live request is the running state, below.
            for i in range(n_full):
                for g, ids in attention:
                    key = group_key(bytes(hashes[i]), g)
                    if ids[i] != null and key not in cached:  # a windowed group keeps no block out of its window
                        mutable.setdefault(key, ids[i])
            kv_held = n_full * bs
            tail = kv_tokens - kv_held
            if tail > 0 and n_full < n_ids and n_full == kv_tokens // bs and tail_identified(req, kv_held, kv_tokens):
                parent = bytes(hashes[n_full - 1]) if n_full else b""
                toks = req.all_token_ids[kv_held:kv_tokens]
                tk = tail_key(parent, toks, req.cache_salt, lora)
                for g, ids in attention:
                    mutable[group_key(tk, g)] = ids[n_full]
                kv_held = kv_tokens
            if states and groups:
                held = self.running_states(req, hashes, groups, states, before, mutable, cached, null)
                kv_held = min(kv_held, held)
            entries.append(request_entry(req, kv_held, self.runner_facts))
        # finished requests' stored tails do not change either: they stream like the cached blocks
        tails = [] if prefix_only else [k for k in self.tail_keys if k not in cached and k not in mutable | before]
        # Incremental: what the repository holds is referenced by the save, not copied.
        self.offers.durable &= set(cached) | set(mutable) | set(before) | set(self.tail_keys)
        skip = set() if any(w.full for w in waiters) else self.offers.durable
        skipped = [] if prefix_only else [k.hex() for k in (*cached, *mutable, *before) if k in skip]
        skipped += [t.hex() for t in tails if t in skip]
        mutable = {k: b for k, b in mutable.items() if k not in skip}
        before = {k: b for k, b in before.items() if k not in skip}
        stored = [Pending(t, -1, None) for t in tails if t not in skip]
        pending = deque(p for p in (*at_risk, *stored, *in_use) if p.key not in skip)
        self.capture_seq += 1
        seq = self.capture_seq
        w0 = waiters[0]
        bound = w0.max_staging or self.max_staging
        per_step = w0.copy_per_step or self.copy_per_step
        info: dict[str, Any] = {
            "seq": seq,
            "step": self.step,
            "pages": len(mutable) + len(before) + len(pending),
            "skipped": skipped,  # durable: referenced, not copied
            "prefix_pages": len(cached),
            "tail_pages": len(stored),
            "requests": len(entries),
            "inexact_requests": sum(not e["exact"] for e in entries),
            "left_requests": sum(LEFT in e for e in entries),
            "tensor_parallel_size": self.tp,
            "kv_not_carried": self.kv_not_carried,
            "prefix_only": prefix_only,
            "plan_s": time.monotonic() - t0,
            "wait_s": time.monotonic() - min(w.requested for w in waiters),
        }
        if not prefix_only:
            info["ledger"] = make_ledger(entries, step=self.step, block_size=bs).model_dump(mode="json", by_alias=True)
        pages_per_chunk, ring = chunk_pages(self.host_page_bytes, max_staging=bound, copy_per_step=per_step)
        st = Stream(
            seq=seq,
            name=f"capture-{os.getpid()}-{seq}",
            directory=self.staging_dir,
            info=info,
            pending=pending,
            chunk_pages=pages_per_chunk,
            ring=ring,
            page_bytes=self.host_page_bytes,
            max_staging=bound,
            prefix_only=prefix_only,
            waiters=list(waiters),  # several callers may share one capture
        )
        if len(mutable) > st.chunk_pages:
            log.warning(
                "gpuckpt: capture %d: %d pages may change after the consistent point and are copied at it, "
                "more than a chunk within the staging bound of %d bytes",
                seq,
                len(mutable),
                bound,
            )
        self.stream = st
        # chunk 0: what may change, topped up to a chunk with blocks that do not
        room, st.chunk_pages = st.chunk_pages, max(0, st.chunk_pages - len(mutable) - len(before))
        first = st.take(self.still_cached)
        st.chunk_pages = room
        k = st.issue(len(mutable) + len(before) + len(first))
        return CopyJob(
            seq=seq,
            chunk=k,
            directory=self.staging_dir,
            name=st.name,
            pages=[(key.hex(), b) for key, b in mutable.items()]
            + [(p.key.hex(), p.block_id) for p in first if p.lookup is not None],
            tails=[p.key.hex() for p in first if p.lookup is None],
            generators=not prefix_only,
            before=[(key.hex(), b) for key, b in before.items()],
        )

    def first_reply(self, st: Stream, part: dict[str, Any]) -> dict[str, Any]:
        """The capture call's answer: the consistent point's facts and chunk 0."""
        ranks = part["shards"]
        gens = ranks[0].pop("generators", None) or {}  # every rank samples alike: rank 0's
        for d in ranks[1:]:
            d.pop("generators", None)
        info = dict(st.info)
        ledger = info.get("ledger")
        if ledger is not None:
            for e in ledger["data"]["requests"]:
                g = gens.get(e["request_id"])
                if g is not None:
                    e["generator_state"] = g
        return {
            "ok": True,
            **info,
            **part,
            # rank 0's figures at the top level (one-rank callers read these)
            **{k: ranks[0][k] for k in ("index", "write_s", "pages_written") if k in ranks[0]},
            "copy_s": max(d.get("copy_s", 0.0) for d in ranks),
            "bytes": sum(int(d.get("bytes", 0)) for d in ranks),
            "chunk_pages": st.chunk_pages,
            "max_staging_bytes": st.max_staging,
        }


def staging_of(extra: dict[str, Any]) -> tuple[str, Trust]:
    """The staging directory and the accounts trusted in it, from ``kv_connector_extra_config``.

    Both halves (EngineCore and every rank's worker) must agree on the
    directory without talking: it is derived from the control socket. Who may
    own it and the page files offered: this account and root, plus the shared
    group's members where worker and agent are two accounts.
    """
    tag = hashlib.sha256(str(extra.get("control_socket", "")).encode()).hexdigest()[:12]
    directory = str(extra.get("staging_dir") or staging.default_dir(f"vllm-{tag}"))
    return directory, Trust.of(extra.get("shared_group") or None)
