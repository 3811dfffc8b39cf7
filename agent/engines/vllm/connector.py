"""``GpuckptConnector``: vLLM's KV connector API (v1) used to checkpoint and restore a worker.

Loaded by vLLM in two processes (``kv_connector_module_path =
"agent.engines.vllm.connector"``): the *scheduler half* in the EngineCore
process and the *worker half* in each worker. The only channels between them
are vLLM's: :class:`GpuckptMeta` (scheduler → worker, once per step) and
:class:`GpuckptWorkerMeta` (worker → scheduler, once per step). Bytes travel
through page files in host staging (:mod:`agent.engines.vllm.staging`).

Capture (one consistent snapshot):

1. The agent sends ``{"cmd": "capture"}`` on the control socket
   (``kv_connector_extra_config["control_socket"]``), served by a thread of
   the scheduler half. The call waits for the next step boundary.
2. ``build_connector_meta`` of that step (scheduler thread, after the step is
   scheduled, before its counters advance) lists the pages to copy — every
   block in the prefix cache, keyed by vLLM's block hash, and every live
   request's full blocks plus its partial tail (keyed by :func:`tail_key`) —
   and writes the ledger. A request's KV at the end of the step covers
   ``num_computed_tokens + num_scheduled_tokens``.
3. The worker half copies those pages in ``wait_for_save`` of the same step:
   after the step's forward (so blocks the step completes are whole) and
   before the next step can reuse any block. Nothing this step writes lands
   in a block that was cached before it, and blocks the step allocated were
   evicted from the cache map before step 2 listed it.
4. The worker reports the page file through the worker metadata; the
   scheduler half answers the control call with the ledger and the page file.

Restore: the agent writes a page file of verified blocks and sends
``{"cmd": "offer", "index": path}``. From then on, ``get_num_new_matched_tokens``
reports the longest run of offered blocks after the local prefix hit as an
external hit (leaving at least one token to compute), and the worker half
loads those pages synchronously in ``start_load_kv``, before the forward.

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

Limits of this slice: one KV cache group, a layer tensor whose first
dimension is the block id (vLLM's CPU layout), a single worker (TP = PP = 1),
copies are synchronous.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from agent.engines.vllm import control, staging
from agent.engines.vllm.copier import Gathered, PageCopier
from agent.engines.vllm.ledger import client_id, make_ledger, request_entry

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
    KV cache before this step's forward. ``capture``: when set, copy these
    pages out after the forward: ``{"seq", "dir", "name", "pages": [[key hex, block id], …],
    "tails": [key hex, …]}`` (``tails``: stored tails of finished requests to include).
    ``tails``: ``(key hex, block id, request id)`` partial tails of finished
    requests to copy into the worker's tail store (then report the request
    finished sending); ``tail_drop``: keys (hex) to drop from it. ``generators``: ``(request id, base64 state)`` to set
    before the request's first sample.
    """

    loads: list[tuple[int, str, str]] = field(default_factory=list)
    capture: dict[str, Any] | None = None
    tails: list[tuple[str, int, str]] = field(default_factory=list)
    tail_drop: list[str] = field(default_factory=list)
    generators: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class GpuckptWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler: captures finished this step, ``seq → {"index", "error", "copy_s", "bytes"}``."""

    done: dict[int, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, GpuckptWorkerMeta)
        merged = dict(self.done)
        for seq, d in other.done.items():
            if seq in merged and d.get("error"):
                merged[seq] = {**merged[seq], "error": d["error"]}
            else:
                merged.setdefault(seq, d)
        return GpuckptWorkerMeta(merged)


@dataclass
class _Waiter:
    event: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] | None = None
    requested: float = field(default_factory=time.monotonic)


class GpuckptConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._staging_dir = str(extra.get("staging_dir") or staging.default_dir(f"vllm-{os.getpid()}"))
        # Finished requests' partial tails kept in worker memory for the next
        # capture: a FIFO bounded in bytes, decided by the scheduler half, which
        # tells the worker what to drop (GpuckptMeta.tail_drop).
        group = kv_cache_config.kv_cache_groups[0] if kv_cache_config.kv_cache_groups else None
        page_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names) if group else 1
        self._tail_cap = int(extra.get("tail_bytes", 256 << 20)) // max(1, page_bytes)
        # scheduler half
        self._lock = threading.Lock()
        self._pool: BlockPool | None = None
        self._live: dict[str, Request] = {}
        self._step = 0
        self._capture_seq = 0
        self._capture_requests: list[_Waiter] = []
        self._captures: dict[int, tuple[list[_Waiter], dict[str, Any]]] = {}
        self._offer: dict[bytes, str] = {}  # key → page file index path
        self._plans: dict[str, tuple[int, list[bytes]]] = {}
        self._loads: list[tuple[int, str, str]] = []
        self._restored: dict[str, int] = {}  # client request id → tokens loaded
        self._server: control.ControlServer | None = None
        self._facts_cache: dict[str, Any] | None = None
        self._engine: Any = None  # EngineCoreProc, to wake its busy loop
        self._tail_keys: OrderedDict[bytes, None] = OrderedDict()
        self._tail_copies: list[tuple[str, int, str]] = []
        self._tails_inflight: set[str] = set()
        self._gen_offer: dict[str, str] = {}  # client request id → base64 generator state
        self._gen_loads: list[tuple[str, str]] = []
        # worker half
        self._runner: Any = None
        self._tail_pages: OrderedDict[bytes, bytes] = OrderedDict()
        self._sent: set[str] = set()
        self._kv: list[tuple[str, torch.Tensor]] = []
        self._done: dict[int, dict[str, Any]] = {}
        self._done_lock = threading.Lock()
        self._copier: PageCopier | None = None
        self._files: dict[str, staging.PageFile] = {}
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER and extra.get("control_socket"):
            self._server = control.ControlServer(extra["control_socket"], self._handle)

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

    def has_pending_push_work(self) -> bool:
        # A capture in flight keeps an idle engine stepping until the worker
        # half reports its page file (written off the step, one or more steps later).
        return bool(self._capture_requests or self._captures or self._tail_copies or self._tails_inflight)

    def on_new_request(self, request: Request) -> None:
        with self._lock:
            self._live[request.request_id] = request

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

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The offered blocks that extend the local hit, as tokens; side-effect free
        apart from remembering the plan for ``update_state_after_alloc``."""
        with self._lock:
            offer = self._offer
            if not offer:
                return 0, False
            bs = self._block_size
            n = request.num_tokens
            hashes = request.block_hashes
            start = num_computed_tokens
            i = start // bs
            keys: list[bytes] = []
            end = start
            while i < len(hashes) and (i + 1) * bs <= n and bytes(hashes[i]) in offer:
                keys.append(bytes(hashes[i]))
                i += 1
                end = i * bs
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

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        with self._lock:
            if self._gen_offer and not request.num_output_tokens:
                g = self._gen_offer.pop(client_id(request.request_id), None)
                if g is not None:
                    self._gen_loads.append((request.request_id, g))
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
                self._loads.append((ids[b], self._offer[key], key.hex()))
            rid = client_id(request.request_id)
            self._restored[rid] = self._restored.get(rid, 0) + num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        with self._lock:
            self._step += 1
            meta = GpuckptMeta(loads=self._loads, tails=self._tail_copies, generators=self._gen_loads)
            self._loads, self._tail_copies, self._gen_loads = [], [], []
            for key_hex, _, rid in meta.tails:
                self._tails_inflight.add(rid)
                self._tail_keys[bytes.fromhex(key_hex)] = None
                while len(self._tail_keys) > self._tail_cap:
                    meta.tail_drop.append(self._tail_keys.popitem(last=False)[0].hex())
            if self._capture_requests:
                meta.capture = self._plan_capture(scheduler_output)
        return meta

    def _plan_capture(self, so: SchedulerOutput) -> dict[str, Any]:
        from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_block_hash

        t0 = time.monotonic()
        bs = self._block_size
        pages: dict[bytes, int] = {}
        assert self._pool is not None
        assert self._kv_cache_manager is not None
        # Every cached full block (in use or free-but-cached). Blocks this step
        # evicted for reuse are already gone from the map.
        for k, v in list(self._pool.cached_block_hash_to_block._cache.items()):
            blk = v if isinstance(v, KVCacheBlock) else next(iter(v.values()))
            # block_hash_num_tokens is the prefix length the hash covers; an
            # entry ending inside a block is a partial entry, not a full block.
            n = blk.block_hash_num_tokens
            if blk.is_null or (n is not None and n % bs):
                continue
            pages.setdefault(bytes(get_block_hash(k)), blk.block_id)
        entries = []
        n_prefix = len(pages)
        for rid, req in self._live.items():
            if req.is_finished():
                continue
            kv_tokens = req.num_computed_tokens + so.num_scheduled_tokens.get(rid, 0)
            try:
                ids = self._kv_cache_manager.get_block_ids(rid)[0]
            except (KeyError, IndexError):
                ids = []
            n_full = min(kv_tokens // bs, len(ids), len(req.block_hashes))
            for i in range(n_full):
                pages.setdefault(bytes(req.block_hashes[i]), ids[i])
            kv_held = n_full * bs
            tail = kv_tokens - kv_held
            if tail > 0 and n_full < len(ids) and n_full == kv_tokens // bs:
                parent = bytes(req.block_hashes[n_full - 1]) if n_full else b""
                lora = getattr(req.lora_request, "lora_name", None)
                toks = req.all_token_ids[kv_held:kv_tokens]
                pages[tail_key(parent, toks, req.cache_salt, lora)] = ids[n_full]
                kv_held = kv_tokens
            entries.append(request_entry(req, kv_held))
        tails = [k.hex() for k in self._tail_keys if k not in pages]
        self._capture_seq += 1
        seq = self._capture_seq
        ledger = make_ledger(entries, step=self._step, block_size=bs)
        waiters = self._capture_requests
        self._capture_requests = []
        name = f"capture-{os.getpid()}-{seq}"
        info = {
            "seq": seq,
            "ledger": ledger.model_dump(mode="json", by_alias=True),
            "step": self._step,
            "pages": len(pages) + len(tails),
            "prefix_pages": n_prefix,
            "tail_pages": len(tails),
            "requests": len(entries),
            "plan_s": time.monotonic() - t0,
            "wait_s": time.monotonic() - min(w.requested for w in waiters),
        }
        self._captures[seq] = (waiters, info)  # several callers may share one capture
        return {
            "seq": seq,
            "dir": self._staging_dir,
            "name": name,
            "pages": [[k.hex(), b] for k, b in pages.items()],
            "tails": tails,
        }

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        sent = connector_output.finished_sending
        if sent and self._tails_inflight:
            with self._lock:
                self._tails_inflight.difference_update(sent)
        wm = connector_output.kv_connector_worker_meta
        if not isinstance(wm, GpuckptWorkerMeta) or not wm.done:
            return
        with self._lock:
            for seq, d in wm.done.items():
                item = self._captures.pop(seq, None)
                if item is None:
                    continue
                waiters, info = item
                d = dict(d)
                gens = d.pop("generators", None) or {}
                for e in info["ledger"]["data"]["requests"]:
                    g = gens.get(e["request_id"])
                    if g is not None:
                        e["generator_state"] = g
                reply = {"ok": False, "error": d["error"]} if d.get("error") else {"ok": True, **info, **d}
                for w in waiters:
                    w.reply = reply
                    w.event.set()

    # -- control channel (runs on the control thread) --

    def _handle(self, req: dict[str, Any]) -> dict[str, Any]:
        cmd = req.get("cmd")
        if cmd == "ping":
            return {"ok": True, "pid": os.getpid()}
        if cmd == "describe":
            return {"ok": True, **self._describe()}
        if cmd == "capture":
            w = _Waiter()
            with self._lock:
                self._capture_requests.append(w)
            self._wake()
            if not w.event.wait(float(req.get("timeout", 60))):
                with self._lock:
                    if w in self._capture_requests:
                        self._capture_requests.remove(w)
                return {"ok": False, "error": "no step boundary within the timeout (is the engine idle?)"}
            assert w.reply is not None
            return w.reply
        if cmd == "offer":
            pf = staging.PageFile(req["index"])
            try:
                keys = list(pf.index.keys)
            finally:
                pf.close()
            with self._lock:
                offer = dict(self._offer)
                for k in keys:
                    offer[k] = str(req["index"])
                self._offer = offer
                self._gen_offer.update({str(k): str(v) for k, v in (req.get("generators") or {}).items()})
            return {"ok": True, "offered": len(keys)}
        if cmd == "withdraw":
            with self._lock:
                self._offer = {}
                self._gen_offer = {}
            return {"ok": True}
        if cmd == "stats":
            with self._lock:
                return {
                    "ok": True,
                    "restored_tokens": dict(self._restored),
                    "step": self._step,
                    "live": len(self._live),
                    "offered": len(self._offer),
                    "tail_pages": len(self._tail_keys),
                    "generators_pending": len(self._gen_offer),
                }
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    def _describe(self) -> dict[str, Any]:
        if self._facts_cache is None:
            self._facts_cache = describe(self._vllm_config, self._kv_cache_config)
        return self._facts_cache

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for pf in self._files.values():
            pf.close()
        self._files.clear()

    # ------------------------------------------------------------------ worker half

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        # Block-first views of every layer: the CPU backend (and FlashInfer-
        # style layouts) put the block id first; FlashAttention-style layouts
        # put K/V first ([2, num_blocks, ...]), which is two block-first views.
        self._kv = []
        for name, t in sorted(kv_caches.items()):
            if t.shape[0] == num_blocks:
                self._kv.append((name, t))
            elif t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
                self._kv += [(f"{name}#k", t[0]), (f"{name}#v", t[1])]
            else:
                raise NotImplementedError(
                    f"gpuckpt: layer {name} KV tensor has shape {tuple(t.shape)}; "
                    f"expected the block id ({num_blocks} blocks) first, or K/V first and then the block id"
                )
        self._copier = PageCopier([t for _, t in self._kv])
        # The model runner (for seeded requests' generators) called us from
        # initialize_kv_cache; under MRV2 it is a few frames further up.
        f = sys._getframe(1)
        while f is not None and self._runner is None:
            obj = f.f_locals.get("self")
            if obj is not None and isinstance(getattr(obj, "requests", None), dict) and hasattr(obj, "input_batch"):
                self._runner = obj
            f = f.f_back  # type: ignore[assignment]
        log.info(
            "gpuckpt: %d layers, page shape %s %s; runner %s",
            len(self._kv),
            tuple(self._kv[0][1].shape[1:]),
            self._kv[0][1].dtype,
            type(self._runner).__name__,
        )

    def _generator(self, rid: str) -> torch.Generator | None:
        st = self._runner.requests.get(rid) if self._runner is not None else None
        return getattr(st, "generator", None)

    def _page_shape(self) -> tuple[int, ...]:
        return (len(self._kv), *self._kv[0][1].shape[1:])

    def _dtype(self) -> str:
        return str(self._kv[0][1].dtype).removeprefix("torch.")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, GpuckptMeta):
            return
        for rid, state in meta.generators:
            g = self._generator(rid)
            if g is None:
                log.warning("gpuckpt: no sampler generator for %s; its seeded state is not restored", rid)
                continue
            g.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))
        if not meta.loads:
            return
        shape = self._page_shape()
        ids: list[int] = []
        pages: list[memoryview] = []
        for block_id, index_path, key_hex in meta.loads:
            try:
                pf = self._files.get(index_path)
                if pf is None:
                    pf = self._files[index_path] = staging.PageFile(index_path)
                if tuple(pf.index.page_shape) != shape or pf.index.dtype != self._dtype():
                    raise ValueError(f"page {pf.index.page_shape} {pf.index.dtype} != {shape} {self._dtype()}")
                pages.append(pf.page(bytes.fromhex(key_hex)))
                ids.append(block_id)
            except Exception:
                log.exception("gpuckpt: loading block %d failed", block_id)
                self._load_errors.add(block_id)
        try:
            assert self._copier is not None
            self._copier.scatter(ids, pages)  # queued before this step's forward (same stream on CUDA)
        except Exception:
            log.exception("gpuckpt: loading %d blocks failed", len(ids))
            self._load_errors.update(ids)

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
        t0 = time.monotonic()
        try:
            assert self._copier is not None
            # Only the copy holds up the engine (on CUDA, only its GPU stream);
            # the page file is written by a thread, reported a step or more later.
            gathered = self._copier.gather([b for _, b in cap["pages"]])
            tails = [
                (k, self._tail_pages[bytes.fromhex(k)])
                for k in cap.get("tails", ())
                if bytes.fromhex(k) in self._tail_pages
            ]
            # Seeded requests' sampler state, before this step's sample (matches the ledger's outputs).
            gens = {}
            if self._runner is not None:
                for rid, st in list(self._runner.requests.items()):
                    g = getattr(st, "generator", None)
                    if g is not None:
                        gens[rid] = base64.b64encode(g.get_state().numpy().tobytes()).decode()
        except Exception as exc:
            log.exception("gpuckpt: capture %s failed", cap["seq"])
            self._finish_capture(cap["seq"], {"error": f"{type(exc).__name__}: {exc}"})
            return
        pause = time.monotonic() - t0
        threading.Thread(
            target=self._write_capture,
            args=(cap, gathered, tails, gens, pause),
            name=f"gpuckpt-capture-{cap['seq']}",
            daemon=True,
        ).start()

    def _write_capture(
        self,
        cap: dict[str, Any],
        gathered: Gathered,
        tails: list[tuple[str, bytes]],
        gens: dict[str, str],
        pause: float,
    ) -> None:
        t0 = time.monotonic()
        w = staging.PageWriter(
            cap["dir"], cap["name"], dtype=self._dtype(), page_shape=self._page_shape(), layers=[n for n, _ in self._kv]
        )
        try:
            for (key_hex, _), page in zip(cap["pages"], gathered.pages(), strict=True):
                w.write(bytes.fromhex(key_hex), page)
            for key_hex, tail in tails:
                w.write(bytes.fromhex(key_hex), tail)
            idx = w.commit()
            res: dict[str, Any] = {
                "index": str(w.index_path),
                "copy_s": pause,
                "write_s": time.monotonic() - t0,
                "bytes": idx.page_bytes * len(idx.keys),
                "pages": len(idx.keys),
                "generators": gens,
            }
        except Exception as exc:
            w.abort()
            log.exception("gpuckpt: writing capture %s failed", cap["seq"])
            res = {"error": f"{type(exc).__name__}: {exc}"}
        self._finish_capture(cap["seq"], res)

    def _finish_capture(self, seq: int, result: dict[str, Any]) -> None:
        with self._done_lock:
            self._done[seq] = result

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, self._sent = self._sent, set()
        return (sent or None), None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        with self._done_lock:
            if not self._done:
                return None
            done, self._done = self._done, {}
        return GpuckptWorkerMeta(done)


def describe(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """The worker's pins, layout and namespace fields, as JSON (see :class:`agent.engines.base.WorkerDescription`)."""
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
    backend: str | None = None
    isa: str | None = None
    if device == "cpu":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        backend = "CPU_ATTN"
        isa = _get_attn_isa(mc.dtype, cc.block_size, spec.head_size, cc.cache_dtype)
        layout = f"cpu:{isa}:[num_blocks,kv_heads,block_size,hk+hv]"
    else:
        layout = None  # the slice only knows the CPU layout; unknown → strict policy refuses
    model_digest = tokenizer_digest = None
    if os.path.isdir(mc.model):
        model_digest = fingerprint.model_digest(mc.model)
        tok = mc.tokenizer if mc.tokenizer and os.path.isdir(mc.tokenizer) else mc.model
        tokenizer_digest = fingerprint.tokenizer_digest(tok)
    facts = {
        "engine": "vllm",
        "engine_version": vllm.__version__,
        "attention_backend": backend,
        "kv_layout": layout,
        "block_size": cc.block_size,
        "kv_dtype": kv_dtype,
        "tensor_parallel_size": pc.tensor_parallel_size,
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
        "block_size": cc.block_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "dtype": kv_dtype,
        "layers": sorted(group.layer_names),
        "page": "one block id across all layers, layer-major, each layer's page whole",
    }
    ns = {
        "engine": "vllm",
        "model": model_digest or f"path:{mc.model}",
        "layout": layout or "unknown",
        "kv": f"{kv_dtype}/bs{cc.block_size}/h{spec.num_kv_heads}x{spec.head_size}/l{len(group.layer_names)}",
        "hash": f"{facts['prefix_hash_algo']}/{facts['prefix_hash_seed']}",
    }
    return {"facts": facts, "layout": layout_doc, "namespace": ns}
