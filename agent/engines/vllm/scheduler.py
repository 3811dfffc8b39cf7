"""The connector's scheduler half (EngineCore process): matching, holds, request states, tails.

Built by :class:`.connector.GpuckptConnector` for the scheduler role; every
hook is called under the facade's guard. The control side (capture planning
and streaming, page keys, the offer) is :class:`.commands.VllmService`, which
this class extends: one lock, one set of state.

Restore: the agent writes page files of verified blocks and sends ``offer``
(a streaming restore: the in-flight requests' pages first — ``keys`` names
them, hashed by this engine — then the rest, each later part under the first
offer's ``generation``, refused once that offer ended). From then on,
:meth:`SchedulerHalf.get_num_new_matched_tokens` reports the longest run of
offered blocks after the local prefix hit as an external hit (leaving at
least one token to compute), and the worker half loads those pages
synchronously in ``start_load_kv``, before the forward — or, in a worker with
several KV cache groups (``load_async``), by request, while the request waits
outside the batch, so that a failed load is that request's failed receive
(vLLM raises on failed block ids there) and a state group's hit is in place
before the model runner's pre-copy reads it. Behind the in-flight
pages the agent names what the rest brings (``coming``): a request whose next
pages are coming waits for them (briefly: ``want_s``) and asks for them —
the next part's reply lists them ``wanted``, and the agent brings them in the
part after, ahead of the rest.

Staging lifetime: an offered page file belongs to the connector. It is
deleted when the offer ends — ``withdraw``, or the offer's ``ttl`` — at the
next step boundary (the workers close their mappings from that step's
metadata, ``close_files``). ``sweep`` ends a capture stream nobody reads and
deletes capture page files no stream owns (a killed agent's).

Finished requests: :meth:`SchedulerHalf.request_finished` delays the free of a
request whose KV ends inside a block; the next step's metadata asks the worker
to copy that partial tail into a bounded in-memory store (keyed by
:func:`.meta.tail_key`), the worker reports the request in
``finished_sending`` and vLLM frees the blocks. Every capture includes the
stored tails, so a conversation's next turn after a restore is served from
the restored cache up to its last token.

Request state on restore: the offer carries, per client request id, what a
resubmitted request needs beyond its tokens (see :mod:`.ledger`): the seeded
generator state, the earlier outputs for penalties and bad words, and for
structured outputs the earlier outputs to advance the new grammar by. It is
handed over at the request's first schedule, and only to the request that
continues the ledger entry (:meth:`SchedulerHalf.apply_request_state`).

KV cache groups (the hybrid allocator, ``SupportsHMA``): each page is one
group's block (:mod:`.groups`); a request's external hit must cover every
block vLLM allocates for it in every group — a windowed group only those
inside its window at the hit's end (:func:`.groups.plan_hit`). A worker with
a group gpuckpt cannot carry matches nothing (its ledger replays cold).

Limits: PP = 1.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from agent.engines import staging
from agent.engines.types import token_digest
from agent.engines.vllm import internals
from agent.engines.vllm.capture import parse_job
from agent.engines.vllm.commands import VllmService
from agent.engines.vllm.groups import STATE, GroupRule, group_key, plan_hit
from agent.engines.vllm.ledger import VOID_PARAM, client_id
from agent.engines.vllm.meta import IDLE, GpuckptMeta, GpuckptWorkerMeta, tail_identified, tail_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("gpuckpt.vllm")


class SchedulerHalf(VllmService):
    """See the module docstring. Thread-safe: hooks run on the scheduler thread, control calls on
    the control server's; ``lock`` guards both."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, extra: dict[str, Any]) -> None:
        super().__init__(vllm_config, kv_cache_config, extra)
        # Tests and benchmarks: slow every step by this much (pacing an engine that would otherwise
        # finish the traffic before the moment a test observes); 0 in production.
        self.step_delay = float(extra.get("step_delay_s") or 0.0)
        self.plans: dict[str, tuple[int, list[bytes]]] = {}
        self.loads: list[tuple[int, str, str]] = []
        # With more than one KV cache group, loads are asynchronous and by request: vLLM can map a
        # failed block back to its request only when block ids are unique (one group), so a
        # hybrid worker reports a failed load per request (``failed_recving``), which vLLM then
        # recomputes from scratch. A hit's request waits for its pages outside the batch
        # (WAITING_FOR_REMOTE_KVS), so they are in before its first step — before the model
        # runner's pre-copy moves a state group's hit into the request's running block.
        self.load_async = len(kv_cache_config.kv_cache_groups) > 1
        self.request_loads: list[tuple[str, list[tuple[int, str, str]]]] = []
        self.failed_requests: list[str] = []
        # a request loading by request reaches the model runner only once its pages are in: its
        # sampler state and earlier outputs wait for its first scheduled step
        self.deferred: dict[str, tuple[str | None, list[int] | None]] = {}
        # requests whose load failed: recomputed from scratch, never offered a hit again (a page
        # that failed once would fail again, and the request would never run)
        self.cold: set[str] = set()
        self.fail_loads: list[int] = []
        self.tail_copies: list[tuple[str, int, str]] = []
        self.tails_inflight: set[str] = set()
        self.gen_loads: list[tuple[str, str]] = []
        self.prior_loads: list[tuple[str, list[int]]] = []

    # ------------------------------------------------------------------ binding

    def bind_gpu_block_pool(self, pool: BlockPool) -> None:
        self.pool = pool

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        """Called from ``Scheduler.__init__`` inside ``EngineCoreProc.__init__``; the engine's input
        queue may not exist yet, so keep the engine object (found in the calling frames)."""
        self.kv_manager = manager
        self.engine = internals.engine_of_caller() or self.engine

    # ------------------------------------------------------------------ hooks

    def has_pending_push_work(self) -> bool:
        """A capture in flight keeps an idle engine stepping until the worker half reports its page
        file (written off the step, one or more steps later); so do tail copies, files to delete and
        the ranks' reports not yet in. (Conditional waiters wait for requests, which keep the engine
        stepping themselves.)"""
        unconditional = bool(self.capture_calls) and any(not w.when for w in self.capture_calls)
        streaming = self.stream is not None and self.stream.needs_steps()
        return (
            bool(unconditional or streaming or self.tail_copies or self.tails_inflight or self.retired)
            or self.wants_reports()
        )

    def on_new_request(self, request: Request) -> None:
        with self.lock:
            self.live[request.request_id] = request

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """One group (the hybrid allocator off): see :meth:`request_finished_all_groups`."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Delay the free of a finished request whose KV ends inside a block, so the next step can
        copy that partial tail — every group's (see :class:`.GpuckptMeta`); a voided continuation
        (:meth:`void`) finishes with ``{VOID_PARAM: why}`` as its ``kv_transfer_params``."""
        with self.lock:
            void = self.voiding.pop(request.request_id, None)
            delay = self.finished_locked(request, block_ids)
            return delay, ({VOID_PARAM: void} if void is not None else None)

    def finished_locked(self, request: Request, block_ids: tuple[list[int], ...]) -> bool:
        """Forget a finished request; whether its partial tail is to be copied first (lock held)."""
        self.live.pop(request.request_id, None)
        self.plans.pop(request.request_id, None)
        self.deferred.pop(request.request_id, None)
        self.cold.discard(request.request_id)
        if self.tail_cap <= 0 or not self.carried:
            return False
        bs = self.block_size
        n = int(request.num_computed_tokens)  # block_ids cover these tokens
        n_full = n // bs
        hashes = self.block_hashes(request.block_hashes)
        if n % bs == 0 or n_full > len(hashes) or not tail_identified(request, n_full * bs, n):
            return False
        if any(n_full >= len(block_ids[g.index]) for g in self.carried):
            return False
        parent = bytes(hashes[n_full - 1]) if n_full else b""
        lora = getattr(request.lora_request, "lora_name", None)
        key = tail_key(parent, request.all_token_ids[n_full * bs : n], request.cache_salt, lora)
        if key in self.tail_keys:
            return False
        for g in self.carried:
            gk = group_key(key, g.index)
            self.tail_copies.append((gk.hex(), block_ids[g.index][n_full], request.request_id))
        return True

    def no_match(self, request: Request) -> tuple[int, bool]:
        """The safe answer of a failed match: no external hit, nothing planned."""
        with self.lock:
            self.plans.pop(request.request_id, None)
        return 0, False

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The offered blocks that extend the local hit, as tokens; side-effect free apart from
        remembering the plan for ``update_state_after_alloc``.

        A streaming restore's request whose pages are still being fetched (the offer's
        ``awaiting``, until a later part names it ``ready``) waits the same way, so it resumes from
        its restored pages as soon as they are in, not from a recompute, while requests whose pages
        arrived already run. So does any request whose next pages the rest of the restore has yet
        to bring (the offer's ``coming``: a returning conversation whose history is still
        streaming), for at most the offer's ``want_s``: it asks for them (the next part's reply
        names them ``wanted``, and the agent brings them next) and goes on with what is there once
        they are in or its wait ran out.

        While a hold is set (``hold``) new requests wait (``None``: the scheduler skips them this
        step) until ``n`` have arrived, then start together: resubmitted requests batch as they did
        before the checkpoint, and a test's requests are all in flight at once however their
        client threads are scheduled.
        """
        with self.lock:
            if self.hold_count:
                self.held.add(request.request_id)
                if len(self.held) < self.hold_count and time.monotonic() < self.hold_until:
                    return None, False
                self.hold_count, self.held = 0, set()
            if self.offers.awaiting and self.offers.holds(self.ledger_id(request.request_id)):
                return None, False
            offer = self.offers.keys
            if not offer or not self.carried or request.request_id in self.cold:
                return 0, False
            bs = self.block_size
            n = request.num_tokens
            hashes = self.block_hashes(request.block_hashes)
            start = num_computed_tokens
            coming = self.offers.coming
            if coming:
                # its next pages are in the checkpoint but not here yet (the rest still streams):
                # ask for them and wait, briefly, rather than recompute them
                # from the end of the run of offered blocks (every group that keeps all blocks has
                # them; windowed groups need only their window and are asked for along the way)
                keep_all = [g.index for g in self.carried if g.keeps_every_block] or [g.index for g in self.carried]
                i, last = start // bs, min(n // bs, len(hashes))
                while i < last and all(group_key(bytes(hashes[i]), g) in offer for g in keep_all):
                    i += 1
                want = self.coming_run(hashes, i, last)
                if want and self.offers.want(request.request_id, want):
                    return None, False
            tokens = request.all_token_ids
            lora = getattr(request.lora_request, "lora_name", None)

            def tail(i: int, length: int) -> bytes | None:
                if i > len(hashes) or not tail_identified(request, i * bs, i * bs + length):
                    return None
                parent = bytes(hashes[i - 1]) if i else b""
                return tail_key(parent, tokens[i * bs : i * bs + length], request.cache_salt, lora)

            end, keys = plan_hit(
                n=n, start=start, bs=bs, hashes=hashes, rules=self.group_rules(), have=offer.__contains__, tail=tail
            )
            ext = end - start
            if ext <= 0:
                self.plans.pop(request.request_id, None)
                return 0, False
            self.plans[request.request_id] = (start, keys)
            return ext, self.load_async

    def coming_run(self, hashes: Any, first: int, last: int) -> list[bytes]:
        """The keys of the blocks from ``first`` on whose pages the rest of the restore brings next
        (``coming``), while every group keeping them has them coming (lock held)."""
        coming = self.offers.coming
        out: list[bytes] = []
        for h in hashes[first:last]:
            ks = [group_key(bytes(h), g.index) for g in self.carried]
            if not any(k in coming for k in ks):
                break
            out += [k for k in ks if k in coming]
        return out

    def group_rules(self) -> list[GroupRule]:
        """How each carried group matches: the windowed ones by their manager's own skip rule."""
        if self.rules is None:
            managers = getattr(getattr(self.kv_manager, "coordinator", None), "single_type_managers", None)
            rules = []
            for g in self.carried:
                skip = None
                if not g.keeps_every_block:
                    if managers is None:
                        raise LookupError(f"no KV cache manager bound for the {g.label()} group")
                    skip = managers[g.index].get_num_skipped_tokens
                rules.append(GroupRule(g.index, skip, state=g.kind == STATE))
            self.rules = rules
        return self.rules

    def fail_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """The safe answer of a failed ``update_state_after_alloc``: the scheduler was promised
        ``num_external_tokens`` of loaded KV, so the load fails and vLLM recomputes instead of
        reading unloaded blocks (kv_load_failure_policy=recompute): every block of the request is
        reported a load error (one group), or the request a failed receive (``load_async``)."""
        with self.lock:
            self.plans.pop(request.request_id, None)
            self.fail_alloc_locked(request, blocks, num_external_tokens)

    def fail_alloc_locked(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        if self.load_async:
            self.failed_requests.append(request.request_id)  # the worker reports it failed
            self.cold.add(request.request_id)
            return
        null = self.null_block_id()
        self.fail_loads.extend(int(b) for ids in blocks.get_block_ids() for b in ids if b != null)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Turn the request's plan into this step's loads: block by block (one group), or the
        request's whole set, reported back by request (several groups: ``load_async``). A page
        the plan names but the offer no longer has fails the load — recomputed, never read."""
        with self.lock:
            plan = self.plans.pop(request.request_id, None)
            if self.state_offer and not request.num_output_tokens:
                self.apply_request_state(request, defer=self.load_async and num_external_tokens > 0)
            if num_external_tokens <= 0:
                return
            rid = request.request_id
            if plan is None:  # promised tokens with no plan: fail them rather than leave them unloaded
                log.error("gpuckpt: %d external tokens of %s have no load plan", num_external_tokens, rid)
                self.fail_alloc_locked(request, blocks, num_external_tokens)
                return
            start, keys = plan
            bs = self.block_size
            per_group = blocks.get_block_ids()
            null = self.null_block_id()
            first = start // bs
            last = (start + num_external_tokens - 1) // bs
            planned: list[tuple[int, str, str]] = []
            missing: list[int] = []
            for g in self.carried:
                ids = per_group[g.index]
                for b in range(first, min(last + 1, len(ids))):
                    if ids[b] == null:  # outside the group's window: vLLM keeps no block there
                        continue
                    key = group_key(keys[b - first], g.index)
                    path = self.offers.keys.get(key)
                    if path is None:  # never planned so (see plan_hit): recompute it, never read garbage
                        log.error("gpuckpt: no offered page for group %d block %d of %s", g.index, b, rid)
                        missing.append(int(ids[b]))
                        continue
                    planned.append((ids[b], path, key.hex()))
            if self.load_async:
                if missing:
                    self.failed_requests.append(rid)
                    self.cold.add(rid)
                    return
                self.request_loads.append((rid, planned))
            else:
                self.fail_loads += missing
                self.loads += planned
            lid = self.ledger_id(rid)
            self.restored[lid] = self.restored.get(lid, 0) + num_external_tokens

    def null_block_id(self) -> int:
        """The id of vLLM's null block (a windowed group's skipped positions)."""
        null = getattr(self.pool, "null_block", None)
        return int(null.block_id) if null is not None else 0

    def ledger_id(self, request_id: str) -> str:
        """The ledger's client id of an engine request (through the offered states' aliases)."""
        cid = client_id(request_id)
        return self.state_alias.get(cid, cid)

    def apply_request_state(self, request: Request, *, defer: bool = False) -> None:
        """A restored request's first schedule: hand over what it needs beyond its tokens (lock held).

        The state goes to the request that continues the ledger entry: its id
        (or the resubmission's alias) *and* its prompt, which must be the
        entry's prompt + outputs (``match``). Another request under the same
        id — a client's retry, someone reusing the id — gets nothing, and the
        state stays for the resubmission. Each part fails alone (logged, in
        ``stats``): a state that cannot be applied leaves that request as a
        plain resubmission, which the restore reports as a cold replay. ``defer``: the request
        waits for its pages first; its sampler state and earlier outputs go to the worker with
        its first scheduled step (:meth:`release_deferred`).
        """
        cid = self.ledger_id(request.request_id)
        st = self.state_offer.get(cid)
        if not st:
            return
        want = st.get("match")
        if want is not None and token_digest(list(request.prompt_token_ids or ())) != want:
            self.states_refused[cid] = f"{request.request_id}: its tokens are not the checkpointed request's"
            log.warning("gpuckpt: request %s has the id of a restored request but not its tokens", request.request_id)
            return
        del self.state_offer[cid]
        applied = self.states_applied.setdefault(cid, [])
        g = st.get("generator_state")
        prior = st.get("prior_outputs")
        g, prior = (str(g) if g else None), ([int(t) for t in prior] if prior else None)
        if defer and (g or prior):
            self.deferred[request.request_id] = (g, prior)
        else:
            self.send_state(request.request_id, g, prior)
        applied += ["generator_state"] * bool(g) + ["prior_outputs"] * bool(prior)
        grammar_outputs = st.get("grammar_outputs")
        if grammar_outputs:
            so = getattr(request, "structured_output_request", None)
            grammar = getattr(so, "grammar", None)
            toks = [int(t) for t in grammar_outputs]
            try:
                if grammar is None or isinstance(grammar, Exception):
                    raise ValueError("the request has no compiled grammar")
                if len(grammar.validate_tokens(toks)) != len(toks):
                    raise ValueError("the grammar rejects the earlier outputs")
                if not grammar.accept_tokens(request.request_id, toks):
                    raise ValueError("the grammar did not accept the earlier outputs")
                applied.append("grammar")
            except Exception as exc:
                log.error("gpuckpt: grammar of %s not advanced: %s", cid, exc)
                applied.append(f"grammar failed: {exc}")
                self.void(request, cid, f"its grammar could not be applied to the earlier outputs ({exc})")

    def void(self, request: Request, cid: str, why: str) -> None:
        """A carried state the continuation needs could not be applied (lock held): the
        continuation would ignore it (a grammar that does not constrain it, say), so it must never
        reach a client. The engine request stops after its first token (``max_tokens`` is what
        vLLM's stop check reads) and finishes with ``{VOID_PARAM: why}`` in its
        ``kv_transfer_params`` (:meth:`request_finished_all_groups`), which the API server's
        middleware reads: the continuation is dropped, an attached retry's stream is cut, and
        later retries are served anew. The agent reads ``states_voided`` and reports the request
        left to its client."""
        request.max_tokens = min(int(request.max_tokens), int(request.num_output_tokens) + 1)
        self.states_voided[cid] = why
        self.voiding[request.request_id] = why

    def send_state(self, rid: str, generator: str | None, prior: list[int] | None) -> None:
        if generator:
            self.gen_loads.append((rid, generator))
        if prior:
            self.prior_loads.append((rid, prior))

    def release_deferred(self, so: SchedulerOutput) -> None:
        """The deferred states of the requests this step schedules for the first time (lock held)."""
        for nr in so.scheduled_new_reqs:
            st = self.deferred.pop(nr.req_id, None)
            if st is not None:
                self.send_state(nr.req_id, *st)

    def empty_meta(self) -> GpuckptMeta:
        """The safe answer of a failed ``build_connector_meta``: planned loads become load errors
        (requests loading by request: failed receives)."""
        with self.lock:
            failed = [b for b, _, _ in self.loads] + self.fail_loads
            failed_requests = [rid for rid, _ in self.request_loads] + self.failed_requests
            self.loads, self.fail_loads, self.request_loads, self.failed_requests = [], [], [], []
            return GpuckptMeta(
                fail_loads=failed, failed_requests=failed_requests, ranks_known=len(self.reports) >= self.tp
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> GpuckptMeta:
        if self.step_delay and scheduler_output.total_num_scheduled_tokens:
            time.sleep(self.step_delay)
        with self.lock:
            self.step += 1
            if self.deferred:
                self.release_deferred(scheduler_output)
            if self.idle_now():
                # nothing planned, nothing waiting: the same empty metadata every step (the worker
                # only reads it), no per-step allocation or scan — the idle worker's whole cost
                return IDLE
            meta = GpuckptMeta(
                loads=self.loads,
                request_loads=self.request_loads,
                failed_requests=self.failed_requests,
                tails=self.tail_copies,
                generators=self.gen_loads,
                priors=self.prior_loads,
                fail_loads=self.fail_loads,
                close_files=self.retire_files(),
                ranks_known=len(self.reports) >= self.tp,
            )
            self.loads, self.request_loads, self.failed_requests, self.tail_copies = [], [], [], []
            self.gen_loads, self.prior_loads, self.fail_loads = [], [], []
            for key_hex, _, rid in meta.tails:
                self.tails_inflight.add(rid)
                self.tail_keys[bytes.fromhex(key_hex)] = None
                while len(self.tail_keys) > self.tail_cap:
                    meta.tail_drop.append(self.tail_keys.popitem(last=False)[0].hex())
            if self.wait_calls:
                met = [w for w in self.wait_calls if self.met(w.when)]
                if met:
                    self.wait_calls = [w for w in self.wait_calls if w not in met]
                    self.answer(met, {"ok": True, **self.progress()})
            idle = not scheduler_output.total_num_scheduled_tokens
            st = self.stream
            if st is not None and st.prefix_only and any(not w.prefix_only for w in self.capture_calls):
                self.end_stream(st, "superseded by a checkpoint's capture")  # a pre-copy makes way
                st = None
            if st is not None and st.idle(time.monotonic()):
                self.end_stream(st, f"abandoned: no word from the agent for {st.idle_timeout:.0f} s")
                st = None
            if st is not None:
                if st.can_issue() and st.issued:
                    meta.capture = self.next_chunk(st)
                elif idle:
                    time.sleep(0.002)  # an idle engine stepping only to collect chunk reports: do not spin
            else:
                ready = [w for w in self.capture_calls if self.met(w.when)]
                if ready:
                    self.capture_calls = [w for w in self.capture_calls if w not in ready]
                    try:
                        meta.capture = self.plan_capture(scheduler_output, ready)
                    except Exception as exc:  # the capture fails; the step goes on
                        log.exception("gpuckpt: planning a capture failed")
                        self.answer(ready, {"ok": False, "error": f"planning the capture failed: {exc}"})
                elif idle and self.wants_reports():
                    time.sleep(0.002)  # stepping only for the ranks' reports: do not spin
            idle_awaiting = bool(self.offers.awaiting or self.offers.wanted) and idle
            if idle_awaiting:
                self.offered_event.clear()
        if idle_awaiting:
            # only requests that wait for their pages: sleep until the next part, not spin a core
            # the restore's fetch needs
            self.offered_event.wait(0.005)
        return meta

    def idle_now(self) -> bool:
        """Whether this step has nothing of gpuckpt's to do (lock held): no load, tail copy, request
        state, file to retire, waiter, capture, stream, awaited page or missing rank report."""
        return not (
            self.loads
            or self.request_loads
            or self.failed_requests
            or self.tail_copies
            or self.gen_loads
            or self.prior_loads
            or self.fail_loads
            or self.retired
            or self.wait_calls
            or self.capture_calls
            or self.stream is not None
            or self.offers.awaiting
            or self.offers.wanted
            or len(self.reports) < self.tp
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        failed = connector_output.failed_recving
        if failed:
            log.warning("gpuckpt: loading the pages of %d requests failed; they are recomputed", len(failed))
            with self.lock:
                self.cold |= failed
                self.load_failed.update(self.ledger_id(rid) for rid in failed)
        sent = connector_output.finished_sending
        if sent and self.tails_inflight:
            with self.lock:
                self.tails_inflight.difference_update(sent)
        wm = connector_output.kv_connector_worker_meta
        if wm is None or not isinstance(wm, GpuckptWorkerMeta):  # None first: no ABC instance check
            return
        if wm.reports and len(self.reports) < self.tp:
            with self.lock:
                self.reports.update({int(r): rep for r, rep in wm.reports.items()})
                self.cond.notify_all()
        if not wm.done:
            return
        with self.lock:
            for job, parts in wm.done.items():
                seq, chunk = parse_job(job)
                st = self.stream
                if st is None or st.seq != seq:
                    # an ended stream's late chunk (cancelled, failed, abandoned): nobody will read it
                    for d in parts.values():
                        if d.get("index"):
                            staging.unlink_pair(d["index"])
                    continue
                for rank, rec in parts.items():
                    if not st.report(chunk, int(rank), rec, self.tp):
                        continue
                    if st.error is not None:
                        self.end_stream(st, st.error)
                        break
                    if chunk == 0:
                        part = st.hand_out(0)
                        assert part is not None
                        if not st.waiters:  # every caller gave up waiting: nobody reads the stream
                            self.end_stream(st, "the capture call timed out before its consistent point")
                            break
                        self.answer(st.waiters, self.first_reply(st, part))
                        st.waiters = []
                    self.cond.notify_all()

    def shutdown(self) -> None:
        self.close_server()
