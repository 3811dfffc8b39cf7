"""``GpuckptConnector``: vLLM's KV connector API (v1) used to checkpoint and restore a worker.

Loaded by vLLM in two processes (``kv_connector_module_path =
"agent.engines.vllm.connector"``): the *scheduler half* in the EngineCore
process and the *worker half* in each worker. The only channels between them
are vLLM's: :class:`GpuckptMeta` (scheduler → worker, once per step) and
:class:`GpuckptWorkerMeta` (worker → scheduler, once per step). Bytes travel
through page files in host staging (:mod:`agent.engines.staging`).

Capture (one consistent point, then a stream; the bookkeeping is
:mod:`agent.engines.vllm.capture`):

1. The agent sends ``{"cmd": "capture"}`` on the control socket
   (``kv_connector_extra_config["control_socket"]``), served by a thread of
   the scheduler half. The call waits for the next step boundary.
2. ``build_connector_meta`` of that step (scheduler thread, after the step is
   scheduled, before its counters advance) writes the ledger and lists the
   pages: every block in the prefix cache, keyed by vLLM's block hash, every
   live request's full blocks, its partial tail (keyed by :func:`tail_key`)
   and the finished requests' stored tails. A request's KV at the end of the
   step covers ``num_computed_tokens + num_scheduled_tokens``. What may
   change after this step — live requests' partial tails and full blocks the
   cache map does not hold — goes into chunk 0 (a :class:`.CopyJob` in this
   step's :class:`GpuckptMeta`), topped up with cached blocks; the other
   cached blocks and stored tails stay pending.
3. The worker half copies a job's pages in ``wait_for_save`` of its step:
   after the step's forward (so blocks the step completes are whole) and
   before the next step can reuse any block. A thread writes them into a
   page file per rank and chunk; the report comes back in a later step's
   :class:`GpuckptWorkerMeta` and, once every rank's is in, chunk 0 answers
   the control call with the ledger.
4. Each later step issues the next chunk of pending blocks — at most
   ``copy_bytes_per_step`` bytes, and only while fewer than two chunks are
   unacknowledged (the staging bound ``max_staging_bytes``: backpressure),
   each block checked to be still mapped to its hash (then its content is the
   one the key names; an evicted one is *lost*, left out). The agent reads a
   chunk, deletes it and sends ``{"cmd": "next", "ack": k}`` for the next,
   until ``done``; ``{"cmd": "cancel"}`` abandons a stream.

Restore: the agent writes page files of verified blocks and sends
``{"cmd": "offer", "index": path}`` (a streaming restore: the in-flight
requests' pages first — ``{"cmd": "keys"}`` names them, hashed by this
engine — then the rest, each later part under the first offer's
``generation``, refused once that offer ended). From then on,
``get_num_new_matched_tokens`` reports the longest run of offered blocks
after the local prefix hit as an external hit (leaving at least one token to
compute), and the worker half loads those pages synchronously in
``start_load_kv``, before the forward. Behind the in-flight pages the agent
names what the rest brings (``coming``): a request whose next pages are
coming waits for them (briefly: ``want_s``) and asks for them — the next
part's reply lists them ``wanted``, and the agent brings them in the part
after, ahead of the rest.

Incremental capture: the scheduler half keeps the keys the repository
holds (``{"cmd": "durable", "add": [...]}`` from the agent after each
commit, plus the keys a restore offered), pruned to what is still cached.
A capture copies only the other pages and lists the durable ones under
``skipped``; the agent references them without their bytes
(:class:`ckpt.Existing`). If the repository no longer holds one (gc, another
repository) the save says so, the agent sends ``"remove"`` and captures
again: no checkpoint names a page that is not stored. ``{"full": true}``
copies everything; ``{"prefix_only": true}`` (a pre-copy between
checkpoints) copies only the cached full blocks not durable, records no
ledger and gives way to any real capture.

Staging lifetime: an offered page file belongs to the connector. It is
deleted when the offer ends — ``{"cmd": "withdraw"}``, or the offer's
``ttl`` — at the next step boundary (the workers close their mappings from
that step's metadata, ``close_files``). ``{"cmd": "sweep"}`` ends a capture
stream nobody reads and deletes capture page files no stream owns (a killed
agent's): the agent asks at start. A stream with no word from the agent for
5 minutes is abandoned and its chunks deleted.

Idle engine: a capture request wakes EngineCore's busy loop (a ``WAKEUP``
on its input queue) and ``has_pending_push_work`` keeps it stepping until the
capture is planned, so a capture works with no request running.

Finished requests: ``request_finished`` delays the free of a request whose
KV ends inside a block; the next step's metadata asks the worker to copy that
partial tail into a bounded in-memory store (keyed by :func:`tail_key`), the
worker reports the request in ``finished_sending`` and vLLM frees the blocks.
Every capture includes the stored tails, so a conversation's next turn after
a restore is served from the restored cache up to its last token.

Seeded sampling: the worker half finds the model runner from
``register_kv_caches``' calling frames; a capture reads each seeded request's
``torch.Generator`` state (before the step's sample, matching the ledger's
outputs) and the scheduler half writes it, base64, into the ledger entry. On
restore the offer carries the states by client request id; the first
schedule of that request sends it to the worker, which ``set_state``s it in
``start_load_kv`` (after the runner seeded the new generator, before the
first sample).

Tensor parallelism: each rank's worker half holds its shard of the KV heads
(rank ``r`` of ``tp`` holds heads ``[r·H//tp, r·H//tp + max(1, H//tp))`` of
the model's ``H``; MLA's single latent head is replicated). At a capture every
rank copies its own shard into its own page file (``<name>-r<rank>``); the
worker metadata of the ranks is merged (:meth:`GpuckptWorkerMeta.aggregate`)
and the control call is answered only when every rank has reported, with one
shard per rank. The agent joins the shards into TP-independent pages (all
``H`` heads, see :mod:`agent.engines.shards`); on restore every rank
loads its own heads out of those pages, whatever TP size wrote them.

Never harm the worker: every hook runs under :func:`_hook`, which turns any
exception into a log line and the hook's safe answer (no external hit, no
delayed free, loads reported as load errors so those blocks recompute, a
capture answered with the error). ``kv_connector_extra_config["inject_faults"]``
names hooks to fail on purpose (the fault-injection tests).

Request state on restore: the offer carries, per client request id, what a
resubmitted request needs beyond its tokens (see :mod:`.ledger`): the seeded
generator state, the earlier outputs for penalties and bad words (the worker
puts them in front of the request's outputs in the sampler's view), and for
structured outputs the earlier outputs to advance the new grammar by.

Limits: one KV cache group, PP = 1 (a PP > 1 worker answers every capture
with an error).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
import os
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from agent import fs
from agent.engines import control, staging
from agent.engines.base import token_digest
from agent.engines.offers import AWAIT_S, WANT_S, OfferBook
from agent.engines.shards import Heads, full_shape, local_heads
from agent.engines.vllm.capture import (
    DEFAULT_COPY_PER_STEP,
    DEFAULT_MAX_STAGING,
    CopyJob,
    Pending,
    Stream,
    chunk_pages,
    parse_job,
)
from agent.engines.vllm.copier import Gathered, PageCopier
from agent.engines.vllm.ledger import RunnerFacts, client_id, make_ledger, request_entry
from agent.fs import Trust
from ckpt.errors import GpuckptError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("gpuckpt.vllm")


def tail_key(parent: bytes, tokens: list[int] | tuple[int, ...], cache_salt: str | None, lora: str | None) -> bytes:
    """Content key of a partial block: its parent's block hash (``b""`` for the
    first block) and the tokens whose KV it holds. Salt and LoRA are included
    because vLLM puts them in the first block's hash only."""
    h = hashlib.sha256(b"gpuckpt-vllm-tail\x00")
    h.update(parent)
    h.update(b"\x00" + (cache_salt or "").encode() + b"\x00" + (lora or "").encode() + b"\x00")
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens))
    return h.digest()


@dataclass
class GpuckptMeta(KVConnectorMetadata):
    """Scheduler → worker, one per step.

    ``loads``: ``(block id, page file index path, key hex)`` to copy into the
    KV cache before this step's forward. ``capture``: a chunk of a capture to
    copy out after the forward (:class:`.CopyJob`).
    ``tails``: ``(key hex, block id, request id)`` partial tails of finished
    requests to copy into the worker's tail store (then report the request
    finished sending); ``tail_drop``: keys (hex) to drop from it. ``generators``: ``(request id, base64 state)`` to set
    before the request's first sample.
    """

    loads: list[tuple[int, str, str]] = field(default_factory=list)
    capture: CopyJob | None = None
    tails: list[tuple[str, int, str]] = field(default_factory=list)
    tail_drop: list[str] = field(default_factory=list)
    generators: list[tuple[str, str]] = field(default_factory=list)
    priors: list[tuple[str, list[int]]] = field(default_factory=list)
    fail_loads: list[int] = field(default_factory=list)
    # page files of an ended offer (withdrawn, expired): close their mappings (the scheduler deleted them)
    close_files: list[str] = field(default_factory=list)


@dataclass
class GpuckptWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler: each rank's capture chunks finished this step,
    ``"<seq>.<chunk>" → {rank → {"index", "error", "copy_s", "bytes", …}}``."""

    done: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge another rank's reports (vLLM folds the ranks in rank order); no rank's report is dropped."""
        if not isinstance(other, GpuckptWorkerMeta):
            return self
        merged = {seq: dict(parts) for seq, parts in self.done.items()}
        for seq, parts in other.done.items():
            merged.setdefault(seq, {}).update(parts)
        return GpuckptWorkerMeta(merged)


class InjectedFault(GpuckptError):
    """Raised inside a hook named in ``inject_faults`` (tests of the hooks' guards)."""


_F = TypeVar("_F", bound=Callable[..., Any])


def _hook(recover: Callable[..., Any]) -> Callable[[_F], _F]:
    """Run a connector hook so that nothing it raises reaches vLLM.

    On an exception (or an injected fault) the failure is logged and
    ``recover(self, *args, **kwargs)`` gives the hook's safe answer.
    ``recover`` itself must not raise; if it does, ``None`` is returned.
    """

    def deco(fn: _F) -> _F:
        name = fn.__name__

        @functools.wraps(fn)
        def wrapper(self: GpuckptConnector, *args: Any, **kwargs: Any) -> Any:
            try:
                if name in self._faults:
                    raise InjectedFault(f"injected fault in {name}")
                return fn(self, *args, **kwargs)
            except Exception:
                log.exception("gpuckpt: %s failed; the engine goes on without it", name)
                self._hook_failures[name] = self._hook_failures.get(name, 0) + 1
                try:
                    return recover(self, *args, **kwargs)
                except Exception:
                    log.exception("gpuckpt: recovering from a failed %s failed", name)
                    return None

        return wrapper  # type: ignore[return-value]

    return deco


def _nothing(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


@dataclass
class _Waiter:
    event: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] | None = None
    requested: float = field(default_factory=time.monotonic)
    # {"live": n, "min_outputs": k}: wait for a step boundary where at least n
    # unfinished requests have k outputs each (judged on the scheduler thread)
    when: dict[str, int] | None = None
    full: bool = False  # copy every page, durable or not
    prefix_only: bool = False  # a pre-copy: non-durable full blocks only, no ledger
    max_staging: int | None = None  # this capture's staging bound (bytes), else the connector's
    copy_per_step: int | None = None  # bytes of full blocks copied per step after the consistent point


def _condition(raw: Any) -> dict[str, int] | None:
    if not raw:
        return None
    if not isinstance(raw, dict) or not set(raw) <= {"live", "min_outputs"}:
        raise ValueError(f"a condition is {{'live': n, 'min_outputs': k}}, not {raw!r}")
    return {k: int(v) for k, v in raw.items()}


def _check_states(raw: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
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


class GpuckptConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._faults: set[str] = set(extra.get("inject_faults") or ())
        # Tests and benchmarks: slow every step by this much (pacing an engine that would otherwise
        # finish the traffic before the moment a test observes); 0 in production.
        self._step_delay = float(extra.get("step_delay_s") or 0.0)
        self._hook_failures: dict[str, int] = {}
        # Both halves (EngineCore and every rank's worker) must agree on the
        # staging directory without talking: derive it from the control socket.
        tag = hashlib.sha256(str(extra.get("control_socket", "")).encode()).hexdigest()[:12]
        self._staging_dir = str(extra.get("staging_dir") or staging.default_dir(f"vllm-{tag}"))
        # Who may own the staging directory and the page files offered to us: this account and
        # root, plus the shared group's members where worker and agent are two accounts.
        self._trust = Trust.of(extra.get("shared_group") or None)
        pc = vllm_config.parallel_config
        self._tp = int(pc.tensor_parallel_size)
        self._pp = int(pc.pipeline_parallel_size)
        self._runner_facts = RunnerFacts(
            model_runner="v2" if getattr(vllm_config, "use_v2_model_runner", False) else "v1",
            async_scheduling=bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)),
        )
        if self._kv_transfer_config.kv_load_failure_policy != "recompute" and role == KVConnectorRole.SCHEDULER:
            log.warning(
                "gpuckpt: kv_load_failure_policy=%r: a block that fails to load fails its request; "
                "set it to 'recompute' (gpuckpt's serve_command does) so such blocks are recomputed",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        # Finished requests' partial tails kept in worker memory for the next
        # capture: a FIFO bounded in bytes, decided by the scheduler half, which
        # tells the worker what to drop (GpuckptMeta.tail_drop).
        group = kv_cache_config.kv_cache_groups[0] if kv_cache_config.kv_cache_groups else None
        page_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names) if group else 1
        self._tail_cap = int(extra.get("tail_bytes", 256 << 20)) // max(1, page_bytes)
        # A capture's host staging: every rank's shard of a page together (see .capture).
        self._host_page_bytes = page_bytes * self._tp
        self._max_staging = int(extra.get("max_staging_bytes") or DEFAULT_MAX_STAGING)
        self._copy_per_step = int(extra.get("copy_bytes_per_step") or DEFAULT_COPY_PER_STEP)
        # scheduler half
        self._lock = threading.Lock()
        self._pool: BlockPool | None = None
        self._live: dict[str, Request] = {}
        self._step = 0
        self._capture_seq = 0
        self._capture_requests: list[_Waiter] = []
        self._step_waiters: list[_Waiter] = []
        self._hold = 0  # hold new requests until this many have arrived (see get_num_new_matched_tokens)
        self._hold_until = 0.0
        self._held: set[str] = set()
        # A streaming restore's requests whose pages are still on their way (self._offers.awaiting)
        # wait — None from get_num_new_matched_tokens — until the agent says they are ready, the
        # offer ends, or no part has come for the offer's await_s (see OfferBook.holds).
        self._offered = threading.Event()  # set by each offer: an engine idle on awaited requests wakes
        # The capture in flight (one at a time): its consistent point is taken, its full blocks
        # follow chunk by chunk (see .capture). Control calls wait on _cond for its chunks.
        self._stream: Stream | None = None
        self._cond = threading.Condition(self._lock)
        self._last_stream: dict[str, Any] = {}
        # The restore offer (key → page file; an offered file is the connector's, deleted when the
        # offer ends, once the workers closed their mappings of it) and the durable keys, which an
        # incremental capture does not copy (pruned to the keys still cached at each capture).
        self._offers = OfferBook(self._expire_offer)
        self._retired: list[str] = []  # ended offers' files: deleted at the next step boundary
        self._plans: dict[str, tuple[int, list[bytes]]] = {}
        self._loads: list[tuple[int, str, str]] = []
        self._fail_loads: list[int] = []
        self._restored: dict[str, int] = {}  # client request id → tokens loaded
        self._server: control.ControlServer | None = None
        self._facts_cache: dict[str, Any] | None = None
        self._engine: Any = None  # EngineCoreProc, to wake its busy loop
        self._tail_keys: OrderedDict[bytes, None] = OrderedDict()
        self._tail_copies: list[tuple[str, int, str]] = []
        self._tails_inflight: set[str] = set()
        # client request id → {"generator_state", "prior_outputs", "grammar_outputs"} (see the offer)
        self._state_offer: dict[str, dict[str, Any]] = {}
        # another client id a state's request may run under (the API server's id for the agent's
        # resubmission) → the ledger's client id: holds, counts and states all use the latter
        self._state_alias: dict[str, str] = {}
        self._states_refused: dict[str, str] = {}  # ledger client id → why a claimant was refused
        self._gen_loads: list[tuple[str, str]] = []
        self._prior_loads: list[tuple[str, list[int]]] = []
        self._states_applied: dict[str, list[str]] = {}  # client id → what was applied
        # worker half
        self._runner: Any = None
        self._rank = 0
        self._heads: Heads | None = None
        self._head_axis = 0
        self._disabled: str | None = None
        self._priors: dict[str, list[int]] = {}
        self._tail_pages: OrderedDict[bytes, bytes] = OrderedDict()
        self._sent: set[str] = set()
        self._kv: list[tuple[str, torch.Tensor]] = []
        self._done: dict[str, dict[int, dict[str, Any]]] = {}
        self._done_lock = threading.Lock()
        self._copier: PageCopier | None = None
        self._files: dict[str, staging.PageFile] = {}
        self._load_errors: set[int] = set()
        self._facts_lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER and extra.get("control_socket"):
            sock = Path(extra["control_socket"])
            # never in a directory another account made or can write to (it could answer for us)
            fs.ensure_socket_dir(sock.parent, self._trust)
            self._server = control.ControlServer(sock, self._handle)
            if self._trust.gid is not None:  # two accounts: the agent's reaches it through the group
                os.chown(sock, -1, self._trust.gid)
                os.chmod(sock, 0o660)
            # The description (model digests, the ranks' reports) is worked out now, beside the
            # engine's start, not on the first ``describe``: a restore at start asks for it
            # first, and every second of it would come before the first resumed token.
            threading.Thread(target=self._warm_describe, name="gpuckpt-describe", daemon=True).start()

    # ------------------------------------------------------------------ scheduler half

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._pool = gpu_block_pool

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        # Called from Scheduler.__init__ inside EngineCoreProc.__init__; the
        # engine's input queue may not exist yet, so keep the engine object.
        f = sys._getframe(1)
        while f is not None:
            obj = f.f_locals.get("self")
            if obj is not None and hasattr(type(obj), "_handle_client_request"):
                self._engine = obj
                break
            f = f.f_back  # type: ignore[assignment]

    def _wake(self) -> None:
        """Make an idle EngineCore step (no-op when it runs in-process: the next
        client ``step()`` then plans the capture)."""
        q = getattr(self._engine, "input_queue", None)
        if q is None:
            return
        from vllm.v1.engine import EngineCoreRequestType

        q.put_nowait((EngineCoreRequestType.WAKEUP, None))

    @_hook(lambda self: False)
    def has_pending_push_work(self) -> bool:
        # A capture in flight keeps an idle engine stepping until the worker
        # half reports its page file (written off the step, one or more steps later).
        # (Conditional waiters wait for requests, which keep the engine stepping themselves.)
        unconditional = any(not w.when for w in self._capture_requests)
        streaming = self._stream is not None and self._stream.needs_steps()
        return bool(unconditional or streaming or self._tail_copies or self._tails_inflight or self._retired)

    @_hook(_nothing)
    def on_new_request(self, request: Request) -> None:
        with self._lock:
            self._live[request.request_id] = request

    @_hook(lambda self, request, block_ids: (False, None))
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delay the free of a finished request whose KV ends inside a block, so
        the next step can copy that partial tail (see :class:`GpuckptMeta`)."""
        with self._lock:
            self._live.pop(request.request_id, None)
            self._plans.pop(request.request_id, None)
            if self._tail_cap <= 0:
                return False, None
            bs = self._block_size
            n = int(request.num_computed_tokens)  # block_ids cover these tokens
            n_full = n // bs
            if n % bs == 0 or n_full >= len(block_ids) or n_full > len(request.block_hashes):
                return False, None
            parent = bytes(request.block_hashes[n_full - 1]) if n_full else b""
            lora = getattr(request.lora_request, "lora_name", None)
            key = tail_key(parent, request.all_token_ids[n_full * bs : n], request.cache_salt, lora)
            if key in self._tail_keys:
                return False, None
            self._tail_copies.append((key.hex(), block_ids[n_full], request.request_id))
            return True, None

    def _no_match(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        with self._lock:
            self._plans.pop(request.request_id, None)
        return 0, False

    @_hook(_no_match)
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The offered blocks that extend the local hit, as tokens; side-effect free
        apart from remembering the plan for ``update_state_after_alloc``.

        A streaming restore's request whose pages are still being fetched (the
        offer's ``awaiting``, until a later part names it ``ready``) waits the
        same way, so it resumes from its restored pages as soon as they are in,
        not from a recompute, while requests whose pages arrived already run.
        So does any request whose next pages the rest of the restore has yet to
        bring (the offer's ``coming``: a returning conversation whose history
        is still streaming), for at most the offer's ``want_s``: it asks for
        them (the next part's reply names them ``wanted``, and the agent brings
        them next) and goes on with what is there once they are in or its wait
        ran out.

        While a hold is set (``{"cmd": "hold", "requests": n}``) new requests
        wait (``None``: the scheduler skips them this step) until ``n`` have
        arrived, then start together: resubmitted requests batch as they did
        before the checkpoint, and a test's requests are all in flight at once
        however their client threads are scheduled.
        """
        with self._lock:
            if self._hold:
                self._held.add(request.request_id)
                if len(self._held) < self._hold and time.monotonic() < self._hold_until:
                    return None, False
                self._hold, self._held = 0, set()
            if self._offers.awaiting and self._offers.holds(self._ledger_id(request.request_id)):
                return None, False
            offer = self._offers.keys
            if not offer:
                return 0, False
            bs = self._block_size
            n = request.num_tokens
            hashes = request.block_hashes
            start = num_computed_tokens

            def run(first: int, have: Container[bytes]) -> list[bytes]:
                """The keys of the full blocks from ``first`` on, while each is in ``have``."""
                out = []
                for h in hashes[first : n // bs]:
                    if bytes(h) not in have:
                        break
                    out.append(bytes(h))
                return out

            keys = run(start // bs, offer)
            i = start // bs + len(keys)
            end = i * bs if keys else start
            coming = self._offers.coming
            if coming:
                # its next pages are in the checkpoint but not here yet (the rest still streams):
                # ask for them and wait, briefly, rather than recompute them
                want = run(i, coming)
                if want and self._offers.want(request.request_id, want):
                    return None, False
            if end < n and i == end // bs and i <= len(hashes):
                tokens = request.all_token_ids
                parent = bytes(hashes[i - 1]) if i else b""
                lora = getattr(request.lora_request, "lora_name", None)
                for length in range(min(bs - 1, n - end), 0, -1):
                    k = tail_key(parent, tokens[end : end + length], request.cache_salt, lora)
                    if k in offer:
                        keys.append(k)
                        end += length
                        break
            end = min(end, n - 1)  # a synchronous hit must leave a token to compute
            ext = end - start
            if ext <= 0:
                self._plans.pop(request.request_id, None)
                return 0, False
            self._plans[request.request_id] = (start, keys)
            return ext, False

    def _fail_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        # The scheduler was promised num_external_tokens of loaded KV: report
        # every block of the request as a load error, so vLLM recomputes them
        # (kv_load_failure_policy=recompute) instead of reading unloaded blocks.
        with self._lock:
            self._plans.pop(request.request_id, None)
            if num_external_tokens > 0:
                self._fail_loads.extend(int(b) for b in blocks.get_block_ids()[0])

    @_hook(_fail_alloc)
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        with self._lock:
            if self._state_offer and not request.num_output_tokens:
                self._apply_request_state(request)
            plan = self._plans.pop(request.request_id, None)
            if num_external_tokens <= 0 or plan is None:
                return
            start, keys = plan
            bs = self._block_size
            ids = blocks.get_block_ids()[0]
            first = start // bs
            last = (start + num_external_tokens - 1) // bs
            for b in range(first, last + 1):
                key = keys[b - first]
                self._loads.append((ids[b], self._offers.keys[key], key.hex()))
            rid = self._ledger_id(request.request_id)
            self._restored[rid] = self._restored.get(rid, 0) + num_external_tokens

    def _ledger_id(self, request_id: str) -> str:
        """The ledger's client id of an engine request (through the offered states' aliases)."""
        cid = client_id(request_id)
        return self._state_alias.get(cid, cid)

    def _apply_request_state(self, request: Request) -> None:
        """A restored request's first schedule: hand over what it needs beyond its tokens (lock held).

        The state goes to the request that continues the ledger entry: its id
        (or the resubmission's alias) *and* its prompt, which must be the
        entry's prompt + outputs (``match``). Another request under the same
        id — a client's retry, someone reusing the id — gets nothing, and the
        state stays for the resubmission. Each part fails alone (logged, in
        ``stats``): a state that cannot be applied leaves that request as a
        plain resubmission, which the restore reports as a cold replay.
        """
        cid = self._ledger_id(request.request_id)
        st = self._state_offer.get(cid)
        if not st:
            return
        want = st.get("match")
        if want is not None and token_digest(list(request.prompt_token_ids or ())) != want:
            self._states_refused[cid] = f"{request.request_id}: its tokens are not the checkpointed request's"
            log.warning("gpuckpt: request %s has the id of a restored request but not its tokens", request.request_id)
            return
        del self._state_offer[cid]
        applied = self._states_applied.setdefault(cid, [])
        g = st.get("generator_state")
        if g:
            self._gen_loads.append((request.request_id, str(g)))
            applied.append("generator_state")
        prior = st.get("prior_outputs")
        if prior:
            self._prior_loads.append((request.request_id, [int(t) for t in prior]))
            applied.append("prior_outputs")
        grammar_outputs = st.get("grammar_outputs")
        if grammar_outputs:
            so = getattr(request, "structured_output_request", None)
            grammar = getattr(so, "grammar", None)
            toks = [int(t) for t in grammar_outputs]
            try:
                if grammar is None or isinstance(grammar, Exception):
                    raise RuntimeError("the request has no compiled grammar")
                if len(grammar.validate_tokens(toks)) != len(toks):
                    raise RuntimeError("the grammar rejects the earlier outputs")
                if not grammar.accept_tokens(request.request_id, toks):
                    raise RuntimeError("the grammar did not accept the earlier outputs")
                applied.append("grammar")
            except Exception as exc:
                log.error("gpuckpt: grammar of %s not advanced: %s", cid, exc)
                applied.append(f"grammar failed: {exc}")

    def _empty_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        with self._lock:
            failed = [b for b, _, _ in self._loads] + self._fail_loads
            self._loads, self._fail_loads = [], []
            return GpuckptMeta(fail_loads=failed)

    @_hook(_empty_meta)
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._step_delay and scheduler_output.total_num_scheduled_tokens:
            time.sleep(self._step_delay)
        with self._lock:
            self._step += 1
            meta = GpuckptMeta(
                loads=self._loads,
                tails=self._tail_copies,
                generators=self._gen_loads,
                priors=self._prior_loads,
                fail_loads=self._fail_loads,
                close_files=self._retire_files(),
            )
            self._loads, self._tail_copies, self._gen_loads, self._prior_loads, self._fail_loads = [], [], [], [], []
            for key_hex, _, rid in meta.tails:
                self._tails_inflight.add(rid)
                self._tail_keys[bytes.fromhex(key_hex)] = None
                while len(self._tail_keys) > self._tail_cap:
                    meta.tail_drop.append(self._tail_keys.popitem(last=False)[0].hex())
            if self._step_waiters:
                met = [w for w in self._step_waiters if self._met(w.when)]
                if met:
                    self._step_waiters = [w for w in self._step_waiters if w not in met]
                    self._answer(met, {"ok": True, **self._progress()})
            st = self._stream
            if st is not None and st.prefix_only and any(not w.prefix_only for w in self._capture_requests):
                self._end_stream(st, "superseded by a checkpoint's capture")  # a pre-copy makes way
                st = None
            if st is not None and st.idle(time.monotonic()):
                self._end_stream(st, f"abandoned: no word from the agent for {st.idle_timeout:.0f} s")
                st = None
            if st is not None:
                if st.can_issue() and st.issued:
                    meta.capture = self._next_chunk(st)
                elif not scheduler_output.total_num_scheduled_tokens:
                    time.sleep(0.002)  # an idle engine stepping only to collect chunk reports: do not spin
            else:
                ready = [w for w in self._capture_requests if self._met(w.when)]
                if ready:
                    self._capture_requests = [w for w in self._capture_requests if w not in ready]
                    try:
                        meta.capture = self._plan_capture(scheduler_output, ready)
                    except Exception as exc:  # the capture fails; the step goes on
                        log.exception("gpuckpt: planning a capture failed")
                        self._answer(ready, {"ok": False, "error": f"planning the capture failed: {exc}"})
            idle_awaiting = (
                bool(self._offers.awaiting or self._offers.wanted) and not scheduler_output.total_num_scheduled_tokens
            )
            if idle_awaiting:
                self._offered.clear()
        if idle_awaiting:
            # only requests that wait for their pages: sleep until the next part, not spin a core
            # the restore's fetch needs
            self._offered.wait(0.005)
        return meta

    def _still_cached(self, p: Pending) -> bool:
        """Whether the block pool's map still names block ``p.block_id`` for ``p``'s hash (lock held):
        then its content is the one the key names (see .capture)."""
        if p.lookup is None:  # a finished request's stored tail (worker memory): still kept?
            return p.key in self._tail_keys
        assert self._pool is not None
        v = self._pool.cached_block_hash_to_block._cache.get(p.lookup)
        if v is None:
            return False
        if isinstance(v, dict):
            return p.block_id in v
        return int(v.block_id) == p.block_id

    def _next_chunk(self, st: Stream) -> CopyJob:
        """The step's share of a stream's full blocks, for the workers to copy after the forward."""
        pages = st.take(self._still_cached)
        k = st.issue(len(pages))
        return CopyJob(
            seq=st.seq,
            chunk=k,
            directory=st.directory,
            name=st.name,
            pages=[(p.key.hex(), p.block_id) for p in pages if p.lookup is not None],
            tails=[p.key.hex() for p in pages if p.lookup is None],
        )

    def _end_stream(self, st: Stream, error: str | None) -> None:
        """Close a stream (lock held): with ``error``, abandon it and delete what it staged."""
        if error is not None:
            st.error = st.error or error
            for path in st.files():
                staging.unlink_pair(path)
            self._answer(st.waiters, {"ok": False, "error": f"capture {st.seq} failed: {st.error}"})
            log.warning("gpuckpt: capture %d ended: %s", st.seq, st.error)
        st.waiters = []
        self._last_stream = {"seq": st.seq, "error": st.error, **st.summary()}
        if self._stream is st:
            self._stream = None
        self._cond.notify_all()

    def _retire_files(self) -> list[str]:
        """Delete the page files of ended offers (lock held; at a step boundary, so that no load
        planned from now on names them); returns them for the workers to close. A load planned
        before the offer ended and run after finds its file gone: a load error, recomputed."""
        out, self._retired = self._retired, []
        for path in out:
            try:
                staging.unlink_pair(path)
            except OSError as exc:
                log.warning("gpuckpt: could not delete the page file %s: %s", path, exc)
        return out

    def _sweep(self) -> list[str]:
        """Delete capture page files in the staging directory that no capture in flight owns: left
        by a killed agent (mid-save) or a killed worker. The agent asks at its start."""
        with self._lock:
            live = {self._stream.name} if self._stream is not None else set()
        removed: list[str] = []
        d = Path(self._staging_dir)
        if not d.is_dir():
            return removed

        def owned(stem: str) -> bool:  # "<capture name>" or "<capture name>-r<rank>"
            return any(stem == n or stem.startswith(n + "-") for n in live)

        for p in sorted(d.glob("capture-*.json")):
            if not owned(p.stem):
                staging.unlink_pair(p)
                removed.append(p.name)
        for p in sorted(d.glob("capture-*.bin")):  # data whose index was never written (killed mid-write)
            if not owned(p.stem) and not p.with_suffix(".json").exists():
                p.unlink(missing_ok=True)
                removed.append(p.name)
        return removed

    def _request_keys(self, r: dict[str, Any]) -> list[str]:
        """The keys of the pages holding the first ``kv_tokens`` tokens of ``token_ids``: the engine's
        own block hashes, then the tail key of a partial last page (hex)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        hasher = getattr(self._engine, "request_block_hasher", None)
        ids = [int(t) for t in r.get("token_ids") or []]
        n = min(int(r.get("kv_tokens", len(ids))), len(ids))
        if hasher is None or n <= 0:
            return []
        salt = r.get("cache_salt")
        rq = Request("gpuckpt-keys", ids[:n], SamplingParams(max_tokens=1), None, cache_salt=salt, block_hasher=hasher)
        bs = self._block_size
        full = [bytes(h) for h in rq.block_hashes][: n // bs]
        keys = [k.hex() for k in full]
        if n % bs and len(full) == n // bs:
            keys.append(tail_key(full[-1] if full else b"", ids[len(full) * bs : n], salt, None).hex())
        return keys

    def _end_offer(self) -> None:
        """Withdraw every offered block and state (lock held); their page files go at the next step."""
        self._state_offer, self._state_alias = {}, {}
        self._retired.extend(self._offers.end())

    def _expire_offer(self) -> None:
        with self._lock:
            n = len(self._offers.keys)
            files = self._offers.expired()
            if files is not None:
                log.info("gpuckpt: the restore offer expired (%d blocks)", n)
                self._state_offer, self._state_alias = {}, {}
                self._retired.extend(files)
        self._wake()  # an idle engine must step for the files to go

    def _met(self, when: dict[str, int] | None) -> bool:
        """Whether this step boundary satisfies a waiter's condition (lock held)."""
        if not when:
            return True
        k = when.get("min_outputs", 0)
        n = sum(1 for r in self._live.values() if not r.is_finished() and r.num_output_tokens >= k)
        return n >= when.get("live", 0)

    def _progress(self) -> dict[str, Any]:
        return {
            "step": self._step,
            "live": len(self._live),
            "outputs": {client_id(rid): int(r.num_output_tokens) for rid, r in self._live.items()},
        }

    @staticmethod
    def _answer(waiters: list[_Waiter], reply: dict[str, Any]) -> None:
        for w in waiters:
            w.reply = reply
            w.event.set()

    def _plan_capture(self, so: SchedulerOutput, waiters: list[_Waiter]) -> CopyJob:
        """The consistent point: write the ledger, open the stream and return chunk 0 for the workers.

        Chunk 0 holds what may change after this step (live requests' partial tails, their full
        blocks the map does not name, finished requests' stored tails) and the first share of the
        cached full blocks; the rest follow over the next steps (see :mod:`.capture`). Pages the
        repository holds (durable) are listed as ``skipped`` and not copied.
        """
        from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_block_hash

        if self._pp != 1:
            raise NotImplementedError(f"pipeline_parallel_size={self._pp}: only PP = 1 workers can be captured")
        if "plan_capture" in self._faults:
            raise InjectedFault("injected fault in plan_capture")
        t0 = time.monotonic()
        bs = self._block_size
        prefix_only = all(w.prefix_only for w in waiters)
        assert self._pool is not None
        assert self._kv_cache_manager is not None
        # Every cached full block (in use or free-but-cached); blocks this step evicted for reuse
        # are already gone from the map. Free ones first: they are the ones at risk of eviction.
        cached: dict[bytes, Pending] = {}
        at_risk: list[Pending] = []
        in_use: list[Pending] = []
        for k, v in list(self._pool.cached_block_hash_to_block._cache.items()):
            blk = v if isinstance(v, KVCacheBlock) else next(iter(v.values()))
            # block_hash_num_tokens is the prefix length the hash covers; an
            # entry ending inside a block is a partial entry, not a full block.
            n = blk.block_hash_num_tokens
            if blk.is_null or (n is not None and n % bs):
                continue
            key = bytes(get_block_hash(k))
            if key in cached:
                continue
            p = cached[key] = Pending(key, int(blk.block_id), k)
            (in_use if blk.ref_cnt > 0 else at_risk).append(p)
        mutable: dict[bytes, int] = {}  # copied at this step: may change or go after it
        entries = []
        for rid, req in [] if prefix_only else list(self._live.items()):
            if req.is_finished():
                continue
            # With async scheduling the step being planned may hold KV of a
            # token whose id is not back yet: claim only the tokens we know.
            kv_tokens = min(req.num_computed_tokens + so.num_scheduled_tokens.get(rid, 0), req.num_tokens)
            try:
                ids = self._kv_cache_manager.get_block_ids(rid)[0]
            except (KeyError, IndexError):
                ids = []
            n_full = min(kv_tokens // bs, len(ids), len(req.block_hashes))
            for i in range(n_full):
                key = bytes(req.block_hashes[i])
                if key not in cached:
                    mutable.setdefault(key, ids[i])
            kv_held = n_full * bs
            tail = kv_tokens - kv_held
            if tail > 0 and n_full < len(ids) and n_full == kv_tokens // bs:
                parent = bytes(req.block_hashes[n_full - 1]) if n_full else b""
                lora = getattr(req.lora_request, "lora_name", None)
                toks = req.all_token_ids[kv_held:kv_tokens]
                mutable[tail_key(parent, toks, req.cache_salt, lora)] = ids[n_full]
                kv_held = kv_tokens
            entries.append(request_entry(req, kv_held, self._runner_facts))
        # finished requests' stored tails do not change either: they stream like the cached blocks
        tails = [] if prefix_only else [k for k in self._tail_keys if k not in cached and k not in mutable]
        # Incremental: what the repository holds is referenced by the save, not copied.
        self._offers.durable &= set(cached) | set(mutable) | set(self._tail_keys)
        skip = set() if any(w.full for w in waiters) else self._offers.durable
        skipped = [] if prefix_only else [k.hex() for k in (*cached, *mutable) if k in skip]
        skipped += [t.hex() for t in tails if t in skip]
        mutable = {k: b for k, b in mutable.items() if k not in skip}
        stored = [Pending(t, -1, None) for t in tails if t not in skip]
        pending = deque(p for p in (*at_risk, *stored, *in_use) if p.key not in skip)
        self._capture_seq += 1
        seq = self._capture_seq
        w0 = waiters[0]
        bound = w0.max_staging or self._max_staging
        per_step = w0.copy_per_step or self._copy_per_step
        info: dict[str, Any] = {
            "seq": seq,
            "step": self._step,
            "pages": len(mutable) + len(pending),
            "skipped": skipped,  # durable: referenced, not copied
            "prefix_pages": len(cached),
            "tail_pages": len(stored),
            "requests": len(entries),
            "inexact_requests": sum(not e["exact"] for e in entries),
            "tensor_parallel_size": self._tp,
            "prefix_only": prefix_only,
            "plan_s": time.monotonic() - t0,
            "wait_s": time.monotonic() - min(w.requested for w in waiters),
        }
        if not prefix_only:
            info["ledger"] = make_ledger(entries, step=self._step, block_size=bs).model_dump(mode="json", by_alias=True)
        pages_per_chunk, ring = chunk_pages(self._host_page_bytes, max_staging=bound, copy_per_step=per_step)
        st = Stream(
            seq=seq,
            name=f"capture-{os.getpid()}-{seq}",
            directory=self._staging_dir,
            info=info,
            pending=pending,
            chunk_pages=pages_per_chunk,
            ring=ring,
            page_bytes=self._host_page_bytes,
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
        self._stream = st
        # chunk 0: what may change, topped up to a chunk with blocks that do not
        room, st.chunk_pages = st.chunk_pages, max(0, st.chunk_pages - len(mutable))
        first = st.take(self._still_cached)
        st.chunk_pages = room
        k = st.issue(len(mutable) + len(first))
        return CopyJob(
            seq=seq,
            chunk=k,
            directory=self._staging_dir,
            name=st.name,
            pages=[(key.hex(), b) for key, b in mutable.items()]
            + [(p.key.hex(), p.block_id) for p in first if p.lookup is not None],
            tails=[p.key.hex() for p in first if p.lookup is None],
            generators=not prefix_only,
        )

    @_hook(_nothing)
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        sent = connector_output.finished_sending
        if sent and self._tails_inflight:
            with self._lock:
                self._tails_inflight.difference_update(sent)
        wm = connector_output.kv_connector_worker_meta
        if not isinstance(wm, GpuckptWorkerMeta) or not wm.done:
            return
        with self._lock:
            for job, parts in wm.done.items():
                seq, chunk = parse_job(job)
                st = self._stream
                if st is None or st.seq != seq:
                    # an ended stream's late chunk (cancelled, failed, abandoned): nobody will read it
                    for d in parts.values():
                        if d.get("index"):
                            staging.unlink_pair(d["index"])
                    continue
                for rank, rec in parts.items():
                    if not st.report(chunk, int(rank), rec, self._tp):
                        continue
                    if st.error is not None:
                        self._end_stream(st, st.error)
                        break
                    if chunk == 0:
                        part = st.hand_out(0)
                        assert part is not None
                        if not st.waiters:  # every caller gave up waiting: nobody reads the stream
                            self._end_stream(st, "the capture call timed out before its consistent point")
                            break
                        self._answer(st.waiters, self._first_reply(st, part))
                        st.waiters = []
                    self._cond.notify_all()

    def _first_reply(self, st: Stream, part: dict[str, Any]) -> dict[str, Any]:
        """The capture call's answer: the consistent point's facts and chunk 0 (lock held)."""
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

    def _next_reply(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{"cmd": "next", "seq", "ack": [chunk, …], "timeout"}``: the agent consumed the chunks
        ``ack`` names (their files are gone); answer with every chunk complete by then (``parts``,
        at least one: one round trip per batch, not per chunk — under load a round trip costs the
        agent tens of milliseconds), or ``done`` after the last one."""
        seq = int(req.get("seq", -1))
        ack = req.get("ack")
        acks = [ack] if isinstance(ack, int) else list(ack or [])
        deadline = time.monotonic() + float(req.get("timeout", 60))
        with self._lock:
            st = self._stream
            if st is None or st.seq != seq:
                last = self._last_stream
                if last.get("seq") == seq and last.get("error") is None:
                    return {"ok": True, "done": True, **last}
                why = last.get("error") if last.get("seq") == seq else "no such capture in flight"
                return {"ok": False, "error": f"capture {seq}: {why}"}
            for k in acks:
                st.ack(int(k))
            if st.done:
                self._end_stream(st, None)
                return {"ok": True, "done": True, **self._last_stream}
            st.touched = time.monotonic()
        self._wake()  # a chunk may be issued now: an idle engine must step
        with self._cond:
            while True:
                if self._stream is not st or st.error is not None:
                    return {"ok": False, "error": f"capture {seq} failed: {st.error}"}
                parts = []
                while (part := st.hand_out()) is not None:
                    parts.append(part)
                if parts:
                    return {"ok": True, "seq": seq, "done": False, "parts": parts}
                left = deadline - time.monotonic()
                if left <= 0:
                    why = "no chunk within the timeout (is the engine stepping?)"
                    return {"ok": False, "error": f"capture {seq}: {why}"}
                self._cond.wait(min(left, 1.0))

    # -- control channel (runs on the control thread) --

    def _handle(self, req: dict[str, Any]) -> dict[str, Any]:
        """One control request (a JSON object with ``cmd``) → its JSON reply (``ok`` and the rest)."""
        commands: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "ping": self._cmd_ping,
            "describe": self._cmd_describe,
            "capture": self._cmd_capture,
            "wait": self._cmd_capture,
            "offer": self._cmd_offer,
            "keys": self._cmd_keys,
            "hold": self._cmd_hold,
            "withdraw": self._cmd_withdraw,
            "durable": self._cmd_durable,
            "next": self._cmd_next,
            "cancel": self._cmd_cancel,
            "sweep": self._cmd_sweep,
            "stats": self._cmd_stats,
        }
        cmd = req.get("cmd")
        handler = commands.get(cmd) if isinstance(cmd, str) else None
        if handler is None:
            return {"ok": False, "error": f"unknown command {cmd!r}"}
        return handler(req)

    def _cmd_ping(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{}`` → ``{"pid"}``: the connector is loaded and answering."""
        return {"ok": True, "pid": os.getpid()}

    def _cmd_describe(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{}`` → the worker's pins, layout and namespace fields."""
        return {"ok": True, **self._describe()}

    def _cmd_capture(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{"when", "full", "prefix_only", "max_staging", "copy_per_step", "timeout"}`` → chunk 0 of a capture, with
        its ledger; ``wait`` (``{"when", "timeout"}``) → the step boundary where ``when`` held."""
        cmd = req.get("cmd")
        w = _Waiter(
            when=_condition(req.get("when")),
            full=bool(req.get("full", False)),
            prefix_only=bool(req.get("prefix_only", False)),
            max_staging=int(req["max_staging"]) if req.get("max_staging") else None,
            copy_per_step=int(req["copy_per_step"]) if req.get("copy_per_step") else None,
        )
        with self._lock:
            (self._capture_requests if cmd == "capture" else self._step_waiters).append(w)
        self._wake()
        if not w.event.wait(float(req.get("timeout", 60))):
            with self._lock:
                for q in (self._capture_requests, self._step_waiters):
                    if w in q:
                        q.remove(w)
                if self._stream is not None and w in self._stream.waiters:
                    self._stream.waiters.remove(w)
            if cmd == "wait":
                return {"ok": False, "error": f"the engine did not reach {w.when} in time: {self._progress()}"}
            failing = ", ".join(f"{k} ({n}×)" for k, n in sorted(self._hook_failures.items()))
            why = f"; failing connector hooks: {failing}" if failing else " (is the engine idle?)"
            if w.when:
                with self._lock:
                    why += f"; waiting for {w.when}, at the last step: {self._progress()}"
            return {"ok": False, "error": f"no step boundary planned the capture within the timeout{why}"}
        assert w.reply is not None
        return w.reply

    def _cmd_offer(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{"index", "requests", "ttl", "generation", "awaiting", "ready", "await_s", "coming",
        "want_s", "done"}``: offer a page file's blocks and request states. ``awaiting`` (client
        ids) are requests whose pages later parts bring: they wait until a part names them
        ``ready``, or ``await_s`` pass without a part. The reply's ``awaits`` says this worker
        holds them (a worker without it needs every in-flight page offered before the requests
        are resubmitted). ``coming`` (hex keys) are the pages the rest of the restore
        brings: a request that needs them waits up to ``want_s`` for them, and each
        reply's ``wanted`` names those asked for since the last part; ``done`` (a last part):
        nothing more comes."""
        # {"index": page file or null, "requests": {client id: state}}; a
        # null index offers request state alone (a cold replay).
        keys: list[bytes] = []
        if req.get("index"):
            pf = staging.PageFile(req["index"], trust=self._trust)
            try:
                keys = list(pf.index.keys)
            finally:
                pf.close()
        states, rejected = _check_states(req.get("requests") or {})
        ttl = req.get("ttl")
        with self._lock:
            gen = req.get("generation")
            if not self._offers.admit(gen):
                # a streaming restore's later part, after its offer ended (withdrawn, expired)
                if req.get("index"):
                    staging.unlink_pair(req["index"])
                return {"ok": False, "error": f"the offer of generation {gen} has ended", "ended": True}
            if req.get("index"):
                self._offers.add(str(req["index"]), keys)
            self._state_offer.update(states)
            for cid, st in states.items():
                for alt in st.get("ids") or ():
                    if alt != cid:
                        self._state_alias[str(alt)] = cid
            self._offers.expect(req.get("awaiting") or (), req.get("ready") or (), req.get("await_s", AWAIT_S))
            if req.get("coming") is not None:
                self._offers.expect_keys(req["coming"], req.get("want_s", WANT_S))
            if req.get("done"):
                self._offers.no_more()
            wanted = [k.hex() for k in self._offers.take_wanted()]
            if ttl is not None:
                self._offers.expire_after(float(ttl))
            generation = self._offers.generation
        self._offered.set()
        return {
            "ok": True,
            "offered": len(keys),
            "requests": len(states),
            "rejected": rejected,
            "generation": generation,
            "awaits": True,
            "wanted": wanted,
        }

    def _cmd_keys(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{"requests": [{"token_ids", "kv_tokens", "cache_salt"}]}`` → each request's page keys, in order."""
        # {"requests": [{"token_ids", "kv_tokens", "cache_salt"}]}: the page keys of each, in order
        # (a streaming restore fetches the in-flight requests' pages first)
        return {"ok": True, "keys": [self._request_keys(r) for r in req.get("requests") or []]}

    def _cmd_hold(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{"requests": n, "timeout"}``: hold new requests until n have arrived."""
        with self._lock:
            self._hold = int(req.get("requests", 0))
            self._hold_until = time.monotonic() + float(req.get("timeout", 60))  # never held forever
            self._held = set()
        return {"ok": True}

    def _cmd_withdraw(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{}``: end the restore offer (its files go at the next step boundary)."""
        with self._lock:
            files = len(self._offers.files)
            self._end_offer()
        self._wake()
        return {"ok": True, "files": files}

    def _cmd_durable(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{"add", "remove"}``: keys the repository holds (incremental capture)."""
        with self._lock:
            return self._offers.mark(req)

    def _cmd_next(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{"seq", "ack", "timeout"}`` → the next chunk of a capture, or ``done``."""
        return self._next_reply(req)

    def _cmd_cancel(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{"seq"}``: abandon a capture stream."""
        # {"seq"}: the agent gives up on a capture (its save failed): stop copying, delete its chunks
        with self._lock:
            st = self._stream
            if st is not None and st.seq == int(req.get("seq", -1)):
                self._end_stream(st, "cancelled by the agent")
                return {"ok": True, "cancelled": True}
        return {"ok": True, "cancelled": False}

    def _cmd_sweep(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{}``: a (re)started agent: end any capture stream and delete unowned capture files."""
        # the agent (re)starts: a capture stream of its predecessor has no reader
        with self._lock:
            if self._stream is not None:
                self._end_stream(self._stream, "the agent restarted (sweep)")
        return {"ok": True, "removed": self._sweep()}

    def _cmd_stats(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{}`` → counters."""
        with self._lock:
            return {
                "ok": True,
                "restored_tokens": dict(self._restored),
                "step": self._step,
                "live": len(self._live),
                "offered": len(self._offers.keys),
                "awaiting": len(self._offers.awaiting),
                "asked": self._offers.asked(),
                "coming": len(self._offers.coming),
                "tail_pages": len(self._tail_keys),
                "generators_pending": sum(1 for v in self._state_offer.values() if v.get("generator_state")),
                "states_pending": len(self._state_offer),
                "states_waiting": sorted(self._state_offer),
                "states_applied": {k: list(v) for k, v in self._states_applied.items()},
                "states_refused": dict(self._states_refused),
                "hook_failures": dict(self._hook_failures),
                "captures_pending": len(self._capture_requests),
                "stream": None if self._stream is None else {"seq": self._stream.seq, **self._stream.summary()},
                "last_stream": dict(self._last_stream),
                "offer_files": sorted(self._offers.files),
                "files_to_delete": len(self._retired),
                "durable": len(self._offers.durable),
                "waits_pending": len(self._step_waiters),
            }

    def _describe(self) -> dict[str, Any]:
        with self._facts_lock:  # one computation, whoever asks first (the warm-up or a command)
            if self._facts_cache is None:
                self._facts_cache = describe(self._vllm_config, self._kv_cache_config, self._staging_dir)
            return self._facts_cache

    def _warm_describe(self) -> None:
        try:
            self._describe()
        except Exception:  # the ``describe`` command computes it again and reports the error
            log.debug("gpuckpt: describing the worker ahead of time failed", exc_info=True)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for pf in self._files.values():
            pf.close()
        self._files.clear()

    # ------------------------------------------------------------------ worker half

    def _disable(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._disabled = "register_kv_caches failed (see the worker's log)"

    @_hook(_disable)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        # Block-first views of every layer: the CPU backend and vLLM 0.33's
        # logical [blocks, head slots, tokens, content] views put the block id
        # first; older FlashAttention-style tensors put K/V first
        # ([2, num_blocks, tokens, heads, head_size]), which is two block-first views.
        self._kv = []
        kv_first = False
        seen: set[int] = set()
        for name, t in sorted(kv_caches.items()):
            if t.data_ptr() in seen:  # KV-sharing layers alias their target's tensor
                continue
            seen.add(t.data_ptr())
            if t.shape[0] == num_blocks:
                self._kv.append((name, t))
            elif t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
                self._kv += [(f"{name}#k", t[0]), (f"{name}#v", t[1])]
                kv_first = True
            else:
                raise NotImplementedError(
                    f"gpuckpt: layer {name} KV tensor has shape {tuple(t.shape)}; "
                    f"expected the block id ({num_blocks} blocks) first, or K/V first and then the block id"
                )
        self._head_axis = 1 if kv_first else 0
        self._copier = PageCopier([t for _, t in self._kv])
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            self._rank = int(get_tensor_model_parallel_rank())
        except Exception:  # no distributed state: a single in-process worker
            self._rank = 0
        mc = self._vllm_config.model_config
        total = 1 if getattr(mc, "use_mla", False) else int(mc.get_total_num_kv_heads())
        self._heads = local_heads(self._rank, self._tp, total, int(self._kv[0][1].shape[1 + self._head_axis]))
        # The model runner (for seeded requests' generators and the sampler's
        # view of outputs) called us from initialize_kv_cache.
        f = sys._getframe(1)
        while f is not None and self._runner is None:
            obj = f.f_locals.get("self")
            if obj is not None and isinstance(getattr(obj, "requests", None), dict) and hasattr(obj, "input_batch"):
                self._runner = obj
            f = f.f_back  # type: ignore[assignment]
        self._write_report()
        log.info(
            "gpuckpt: rank %d/%d, %d layers, page shape %s %s, heads %s; runner %s",
            self._rank,
            self._tp,
            len(self._kv),
            tuple(self._kv[0][1].shape[1:]),
            self._kv[0][1].dtype,
            self._heads,
            type(self._runner).__name__,
        )

    def _write_report(self) -> None:
        """This rank's self-description for the scheduler half's ``describe`` (private staging dir)."""
        import json

        assert self._heads is not None
        t = self._kv[0][1]
        report = {
            "rank": self._rank,
            "device": str(t.device),
            "backend": attention_backend_name(self._vllm_config),
            # the tokens axis of a layer's page: the kernel's block
            "kernel_block_size": int(t.shape[1 + (1 - self._head_axis)]) if t.dim() >= 3 else None,
            "kv_heads": [self._heads.start, self._heads.count],
            "page_shape": list(self._page_shape()),
            "dtype": self._dtype(),
            "runner": type(self._runner).__name__,
        }
        d = staging.ensure_dir(self._staging_dir, self._trust)
        tmp = d / f".worker-r{self._rank}.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(report).encode())
        os.replace(tmp, d / f"worker-r{self._rank}.json")

    def _generator(self, rid: str) -> torch.Generator | None:
        st = self._runner.requests.get(rid) if self._runner is not None else None
        return getattr(st, "generator", None)

    def _page_shape(self) -> tuple[int, ...]:
        """This rank's page: ``[layers, *layer page]`` with its own heads."""
        return (len(self._kv), *self._kv[0][1].shape[1:])

    def _stored_shape(self) -> tuple[int, ...]:
        """A stored page: every KV head of the model (see :mod:`.shards`)."""
        assert self._heads is not None
        return full_shape(self._page_shape(), self._head_axis, self._heads.total)

    def _dtype(self) -> str:
        return str(self._kv[0][1].dtype).removeprefix("torch.")

    def _fail_meta_loads(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, GpuckptMeta):
            self._load_errors.update(b for b, _, _ in meta.loads)
            self._load_errors.update(meta.fail_loads)

    @_hook(_fail_meta_loads)
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, GpuckptMeta):
            return
        self._load_errors.update(meta.fail_loads)
        for rid, state in meta.generators:
            try:
                g = self._generator(rid)
                if g is None:
                    raise LookupError("no sampler generator (not the V1 model runner?)")
                g.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))
            except Exception as exc:
                log.error("gpuckpt: the seeded state of %s is not restored: %s", rid, exc)
        for path in meta.close_files:
            pf = self._files.pop(path, None)
            if pf is not None:
                pf.close()  # its pages (users' KV) leave host memory with the last mapping
        for rid, prior in meta.priors:
            self._priors[rid] = prior
        if self._priors:
            self._refresh_priors()
        if not meta.loads:
            return
        if self._disabled:
            raise RuntimeError(self._disabled)
        shape = self._stored_shape()
        ids: list[int] = []
        pages: list[memoryview] = []
        for block_id, index_path, key_hex in meta.loads:
            try:
                pf = self._files.get(index_path)
                if pf is None:
                    pf = self._files[index_path] = staging.PageFile(index_path, trust=self._trust)
                if tuple(pf.index.page_shape) != shape or pf.index.dtype != self._dtype():
                    raise ValueError(f"page {pf.index.page_shape} {pf.index.dtype} != {shape} {self._dtype()}")
                pages.append(pf.page(bytes.fromhex(key_hex)))
                ids.append(block_id)
            except Exception:
                log.exception("gpuckpt: loading block %d failed", block_id)
                self._load_errors.add(block_id)
        try:
            assert self._copier is not None
            assert self._heads is not None
            # queued before this step's forward (same stream on CUDA); each rank takes its heads
            self._copier.scatter(ids, pages, self._heads.as_tuple(), self._head_axis)
        except Exception:
            log.exception("gpuckpt: loading %d blocks failed", len(ids))
            self._load_errors.update(ids)

    def _refresh_priors(self) -> None:
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
        runner = self._runner
        batch = getattr(runner, "input_batch", None)
        if batch is None:
            self._priors.clear()
            return
        for rid, prior in list(self._priors.items()):
            st = runner.requests.get(rid)
            if st is None:
                del self._priors[rid]  # finished or aborted
                continue
            idx = batch.req_id_to_index.get(rid)
            if idx is not None:
                batch.req_output_token_ids[idx] = prior + list(st.output_token_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return

    def _page(self, block_id: int) -> bytes:
        assert self._copier is not None
        return self._copier.page(block_id)

    def _fail_capture(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, GpuckptMeta):
            self._sent.update(rid for _, _, rid in meta.tails)  # the blocks must be freed all the same
            if meta.capture is not None:
                self._finish_capture(meta.capture, {"error": "the worker's copy failed (see its log)"})

    @_hook(_fail_capture)
    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, GpuckptMeta):
            return
        for key_hex, block_id, rid in meta.tails:  # before the capture, which includes them
            try:
                self._tail_pages[bytes.fromhex(key_hex)] = self._page(block_id)
            except Exception:
                log.exception("gpuckpt: copying the tail of %s failed", rid)
            self._sent.add(rid)
        for key_hex in meta.tail_drop:
            self._tail_pages.pop(bytes.fromhex(key_hex), None)
        if meta.capture is None:
            return
        cap = meta.capture
        if self._disabled:
            why = f"the connector is disabled on rank {self._rank}: {self._disabled}"
            self._finish_capture(cap, {"error": why})
            return
        t0 = time.monotonic()
        try:
            if "gather" in self._faults:
                raise InjectedFault("injected fault in gather")
            assert self._copier is not None
            # Only the copy holds up the engine (on CUDA, only its GPU stream);
            # the page file is written by a thread, reported a step or more later.
            gathered = self._copier.gather([b for _, b in cap.pages])
            tails = [(k, self._tail_pages[bytes.fromhex(k)]) for k in cap.tails if bytes.fromhex(k) in self._tail_pages]
            # Seeded requests' sampler state, before this step's sample (matches the ledger's outputs).
            gens = {}
            if self._runner is not None and cap.generators:
                for rid, st in list(self._runner.requests.items()):
                    g = getattr(st, "generator", None)
                    if g is not None:
                        gens[rid] = base64.b64encode(g.get_state().numpy().tobytes()).decode()
        except Exception as exc:
            log.exception("gpuckpt: capture %s failed", cap.job)
            self._finish_capture(cap, {"error": f"{type(exc).__name__}: {exc}"})
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
            if "write_capture" in self._faults:
                raise InjectedFault("injected fault in write_capture")
            assert self._heads is not None
            w = staging.PageWriter(
                cap.directory,
                cap.file(self._rank),
                dtype=self._dtype(),
                page_shape=self._page_shape(),
                layers=[n for n, _ in self._kv],
                trust=self._trust,
            )
            for (key_hex, _), page in zip(cap.pages, gathered.pages(), strict=True):
                w.write(bytes.fromhex(key_hex), page)
            for key_hex, tail in tails:
                w.write(bytes.fromhex(key_hex), tail)
            idx = w.commit()
            gathered.release()
            res: dict[str, Any] = {
                "rank": self._rank,
                "device": str(self._kv[0][1].device),
                "kv_heads": [self._heads.start, self._heads.count],
                "total_kv_heads": self._heads.total,
                "head_axis": self._head_axis,
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
        self._finish_capture(cap, res)

    def _finish_capture(self, cap: CopyJob, result: dict[str, Any]) -> None:
        with self._done_lock:
            self._done.setdefault(cap.job, {})[self._rank] = result

    def _sent_anyway(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, self._sent = self._sent, set()
        return (sent or None), None

    @_hook(_sent_anyway)
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, self._sent = self._sent, set()
        return (sent or None), None

    @_hook(_nothing)
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        with self._done_lock:
            if not self._done:
                return None
            done, self._done = self._done, {}
        return GpuckptWorkerMeta(done)


def page_format(
    *,
    device: str,
    backend: str | None,
    kv_cache_layout: str | None,
    spec: Any,
    kernel_block_size: int | None,
    isa: str | None = None,
) -> str | None:
    """The byte format of one KV head's slice of a page, TP-independent; ``None`` when not known.

    What decides how a head's bytes are read (vLLM 0.33, ``../shared`` notes
    "KV cache layout on GPU"): device, attention backend, the global
    ``KVCacheLayout`` (LBHNC / LBNHC / …), the content of one token of one
    head slot (``head_size + head_size_v``, or MLA's latent), the head slots
    per KV head (NVFP4 doubles them), the kernel block size and the KV
    quantization mode, plus the CPU backend's instruction set (its in-page
    order of K depends on it). The number of heads is not part of it: a
    stored page holds all of them (:mod:`.shards`), and ``num_kv_heads`` is a
    pin of its own.
    """
    if backend is None or kv_cache_layout is None:
        return None
    hk = int(getattr(spec, "head_size", 0))
    hv = getattr(spec, "head_size_v", None)
    mla = type(spec).__name__.startswith("MLA") or "MLA" in backend
    content = f"latent{hk}" if mla else f"k{hk}+v{hv if hv is not None else hk}"
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    heads = int(getattr(spec, "num_kv_heads", 1) or 1)
    slots = getattr(spec, "num_head_slots", None)
    per_head = int(slots) // heads if slots else 1
    parts = [device, backend, kv_cache_layout, content, f"slots{per_head}", f"kb{kernel_block_size}", f"q{quant}"]
    if isa:
        parts.append(isa)
    return ":".join(parts)


def _worker_reports(staging_dir: str, tp: int, wait: float) -> list[dict[str, Any]]:
    """Every rank's self-description (written at ``register_kv_caches``), waiting up to ``wait`` s."""
    import json as _json

    deadline = time.monotonic() + wait
    while True:
        out = []
        for r in range(tp):
            p = os.path.join(staging_dir, f"worker-r{r}.json")
            try:
                with open(p, "rb") as f:
                    out.append(_json.loads(f.read()))
            except (OSError, ValueError):
                break
        if len(out) == tp or time.monotonic() > deadline:
            return out
        time.sleep(0.05)


def describe(vllm_config: Any, kv_cache_config: Any, staging_dir: str | None = None) -> dict[str, Any]:
    """The worker's pins, layout and namespace fields, as JSON (see :class:`agent.engines.base.WorkerDescription`).

    Facts that only the ranks know (the attention backend their layers run,
    the kernel block size, each rank's device and heads) come from the
    reports they write into the staging directory at start; without them
    the backend is unknown and the strict policy refuses a warm restore.
    """
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    from ckpt import ABSENT, fingerprint

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    model_dtype = str(mc.dtype).removeprefix("torch.")
    kv_dtype = model_dtype if cc.cache_dtype == "auto" else str(cc.cache_dtype)
    device = "cpu" if current_platform.is_cpu() else str(current_platform.device_type)
    tp = int(pc.tensor_parallel_size)
    reports = _worker_reports(staging_dir, tp, 30.0) if staging_dir else []
    backends = {r.get("backend") for r in reports}
    backend = backends.pop() if len(backends) == 1 and len(reports) == tp else None
    kernel_blocks = {r.get("kernel_block_size") for r in reports}
    kernel_block = kernel_blocks.pop() if len(kernel_blocks) == 1 else None
    isa: str | None = None
    if device == "cpu":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(mc.dtype, cc.block_size, spec.head_size, cc.cache_dtype)
        backend = backend or "CPU_ATTN"
    layout_name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(cc, "kv_cache_layout", None)
    layout = page_format(
        device=device,
        backend=backend,
        kv_cache_layout=str(layout_name) if layout_name else None,
        spec=spec,
        kernel_block_size=kernel_block or cc.block_size,
        isa=isa,
    )
    total_heads = 1 if getattr(mc, "use_mla", False) else int(mc.get_total_num_kv_heads())
    model_digest = tokenizer_digest = None
    if os.path.isdir(mc.model):
        model_digest = fingerprint.model_digest(mc.model)
        tok = mc.tokenizer if mc.tokenizer and os.path.isdir(mc.tokenizer) else mc.model
        tokenizer_digest = fingerprint.tokenizer_digest(tok)
    model_runner = "v2" if getattr(vllm_config, "use_v2_model_runner", False) else "v1"
    facts = {
        "engine": "vllm",
        "engine_version": vllm.__version__,
        "attention_backend": backend,
        "kv_layout": layout,
        "block_size": cc.block_size,
        "kv_dtype": kv_dtype,
        "num_kv_heads": total_heads,
        "head_size": int(spec.head_size),
        "model_runner": model_runner,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pc.pipeline_parallel_size,
        "rank": 0,
        "model": str(mc.model),
        # A local directory has no revision: its digest is its identity.
        "model_revision": mc.revision if mc.revision or not os.path.isdir(mc.model) else ABSENT,
        "model_digest": model_digest,
        "tokenizer_digest": tokenizer_digest,
        "prefix_hash_algo": str(cc.prefix_caching_hash_algo),
        "prefix_hash_seed": get_none_hash_seed(),
    }
    layout_doc = {
        "device": device,
        "isa": isa,
        "attention_backend": backend,
        "kv_cache_layout": str(layout_name) if layout_name else None,
        "block_size": cc.block_size,
        "kernel_block_size": kernel_block,
        "num_kv_heads": total_heads,
        "head_size": spec.head_size,
        "dtype": kv_dtype,
        "layers": sorted(group.layer_names),
        "tensor_parallel_size": tp,
        "model_runner": model_runner,
        "async_scheduling": bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)),
        "ranks": reports,
        "page": "one block id across all layers, layer-major, each layer's page whole with all KV heads",
    }
    ns = {
        "engine": "vllm",
        "model": model_digest or f"path:{mc.model}",
        "layout": layout or "unknown",
        "kv": f"{kv_dtype}/bs{cc.block_size}/h{total_heads}x{spec.head_size}/l{len(group.layer_names)}",
        "hash": f"{facts['prefix_hash_algo']}/{facts['prefix_hash_seed']}",
    }
    return {"facts": facts, "layout": layout_doc, "namespace": ns}


def attention_backend_name(vllm_config: Any) -> str | None:
    """The backend the worker's attention layers run (one name), from vLLM's forward context."""
    names = set()
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    for layer in ctx.values():
        b = getattr(layer, "attn_backend", None) or getattr(layer, "backend", None)
        if b is None:
            continue
        name = b.get_name() if hasattr(b, "get_name") else getattr(b, "name", None)
        if name:
            names.add(str(name))
    return names.pop() if len(names) == 1 else None
