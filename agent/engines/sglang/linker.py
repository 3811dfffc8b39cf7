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

Capture (``capture``, a stream; its bookkeeping is :mod:`.stream`, the tree
walk :mod:`.tree`): at the first boundary where ``when`` holds — the
consistent point — the linker writes the ledger (:mod:`.ledger`: running
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
  (:class:`.tree.TreeIndex`).

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

Limits: MHA KV pools (``MHATokenToKVPool``: ``k_buffer``/``v_buffer``), TP =
PP = 1, no overlap scheduling (CPU turns it off; on a GPU run with
``--disable-overlap-schedule``), no HiCache (SGLang does not combine it with
a linker).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from array import array
from collections import deque
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)
from sglang.srt.mem_cache.utils import get_storage_hash_str, storage_namespace_seed

from agent.engines import staging
from agent.engines.protocol import Keys, Next
from agent.engines.service import Reply, Waiter, WorkerService, guard
from agent.engines.sglang import ledger as ledger_mod
from agent.engines.sglang.describe import describe
from agent.engines.sglang.stream import (
    DEFAULT_COPY_PER_STEP,
    DEFAULT_MAX_STAGING,
    Pending,
    Pin,
    Stream,
    chunk_pages,
)
from agent.engines.sglang.tree import TreeIndex, Walk
from agent.fs import Trust

log = logging.getLogger("gpuckpt.sglang")

#: A stream with no word from the agent for this long is abandoned (its page files deleted).
STREAM_IDLE_S = 300.0


def tail_key(parent: str | None, tokens: list[int], extra_key: str | None, cache_salt: str | None) -> bytes:
    """Content key of a partial last page: sha256 of a tag, the previous full page's storage hash
    (hex; ``None`` for a first page, which takes the request's namespace seed instead) and the
    tail's token ids (int64, little-endian)."""
    h = hashlib.sha256(b"gpuckpt-sglang-tail\x00")
    prior = parent if parent is not None else storage_namespace_seed(extra_key, cache_salt)
    h.update((prior or "").encode() + b"\x00")
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


def page_keys(tokens: list[int], n: int, page_size: int, extra_key: str | None, cache_salt: str | None) -> list[str]:
    """The storage hashes (hex) of the full pages of ``tokens[:n]``, as SGLang's radix cache keys them."""
    full = min(n, len(tokens)) // page_size * page_size
    if full <= 0:
        return []
    key = RadixKey(array("q", tokens[:full]), extra_key=extra_key, cache_salt=cache_salt)
    out = get_storage_hash_str(key, None, page_size=page_size)
    return [out] if isinstance(out, str) else list(out)


def _plain(v: Any) -> Any:
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


def _sampling(sp: Any) -> dict[str, Any]:
    """A request's ``SamplingParams`` as the ledger's JSON (stop strings from their normalized fields)."""
    out: dict[str, Any] = {}
    for name in ledger_mod.SAMPLING_FIELDS:
        v = getattr(sp, name, None)
        if name == "stop":
            v = v or getattr(sp, "stop_strs", None)
        elif name == "stop_regex":
            v = v or getattr(sp, "stop_regex_strs", None)
        if v is not None and v != [] and v != "":
            out[name] = _plain(v)
    return out


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


class GpuckptLinker(UnifiedCacheLinker, WorkerService):  # type: ignore[misc]
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
        self._tp = int(getattr(server_args, "tp_size", 1) or 1)
        self._pp = int(getattr(server_args, "pp_size", 1) or 1)
        if self._disabled is None and (self._tp > 1 or self._pp > 1):
            self._disabled = (
                f"gpuckpt's SGLang linker captures and restores single-GPU servers only "
                f"(this one runs tp_size={self._tp}, pp_size={self._pp}); checkpoint it with vLLM, "
                "or run SGLang with --tp-size 1 --pp-size 1"
            )
            log.warning("gpuckpt: %s; captures will be refused", self._disabled)
        self.layer_done_counter = LayerWiseLoadCounter(max(1, len(self._k)))
        self._scheduler = _find_scheduler()
        self.max_staging = int(extra.get("max_staging_bytes") or DEFAULT_MAX_STAGING)
        self.copy_per_step = int(extra.get("copy_bytes_per_step") or DEFAULT_COPY_PER_STEP)
        self._tree = TreeIndex(self.page_size)
        self._step = 0
        self._seq = 0
        self._stream: Stream | None = None  # the capture in flight (one at a time)
        self._unpin: list[Pin] = []  # locks of ended streams, released at the next boundary
        self._files: dict[str, staging.PageFile] = {}  # open mappings of offered files
        self._pending: dict[str, tuple[torch.Tensor, list[tuple[str, bytes]]]] = {}
        self._restored: dict[str, int] = {}  # rid → tokens loaded from offered pages
        self._lookups = 0
        # the linker's own time on the scheduler thread in its per-step and per-insert hooks (the
        # idle cost, read by bench/sglang_capture_pause.py)
        self._hook_s = 0.0
        self._offers = 0
        sock = extra.get("control_socket")
        if sock:
            self.serve(str(sock))
        log.info("gpuckpt: linker loaded (page size %d, control socket %s)", self.page_size, sock)

    # ------------------------------------------------------------------ engine state

    def _live(self) -> list[Any]:
        """The requests the scheduler holds now, unfinished, once each (scheduler thread)."""
        s = self._scheduler
        if s is None:
            return []
        groups: list[Any] = []
        for name in ("running_batch", "last_batch"):
            b = getattr(s, name, None)
            if b is not None:
                groups.append(getattr(b, "reqs", None) or [])
        chunked = getattr(s, "chunked_req", None)
        if chunked is not None:
            groups.append([chunked])
        groups.append(list(getattr(s, "waiting_queue", None) or []))
        out: dict[int, Any] = {}
        for g in groups:
            for r in g:
                if not r.finished() and id(r) not in out:
                    out[id(r)] = r
        return list(out.values())

    @staticmethod
    def _tokens(req: Any) -> list[int]:
        return [int(t) for t in req.origin_input_ids] + [int(t) for t in req.output_ids]

    def _kv_tokens(self, req: Any) -> int:
        """Tokens of prompt + outputs whose KV the request's slots hold (the last sampled token's is
        computed by the next step)."""
        kv = getattr(req, "kv", None)
        if kv is None or getattr(kv, "req_pool_idx", None) is None:
            return 0
        return max(0, min(int(kv.kv_committed_len), len(req.origin_input_ids) + len(req.output_ids) - 1))

    def _met(self, when: dict[str, int] | None, live: list[Any]) -> bool:
        if not when:
            return True
        k = when.get("min_outputs", 0)
        return sum(1 for r in live if len(r.output_ids) >= k) >= when.get("live", 0)

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

    def _cache(self) -> Any:
        return getattr(self._scheduler, "tree_cache", None)

    def _walk(self) -> Walk:
        """The radix tree's full pages now (none without a tree: a linker hosted on bare pools)."""
        core = getattr(self._cache(), "tree_core", None)
        if core is None or not hasattr(core, "walk_for_kv_canary"):
            return Walk([], 0)
        return self._tree.walk(core)

    # ------------------------------------------------------------------ the step boundary

    def _boundary(self) -> None:
        """Once per scheduler loop iteration, on the scheduler thread. Idle (no capture, wait,
        stream or file to delete), it reads a few fields and returns."""
        self._step += 1
        if self.retired:
            with self.lock:
                self._retire()
        if self._unpin:
            self._release_pins()
        st = self._stream
        if st is not None:
            self._pump(st)
        if not (self.capture_calls or self.wait_calls):  # read without the lock on every loop
            return
        live = self._live()
        with self.lock:
            due = [w for w in self.wait_calls + self.capture_calls if self._met(w.when, live)]
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

    def _release_pins(self) -> None:
        """Release the tree locks of ended streams (scheduler thread: the tree is not thread-safe)."""
        with self.lock:
            pins, self._unpin = self._unpin, []
        self._unlock(pins)

    def _unlock(self, pins: list[Pin]) -> None:
        cache = self._cache()
        for pin in pins:
            try:
                cache.unlock(pin.lock)
            except Exception:  # the node went with a flushed tree: nothing is held any more
                log.warning("gpuckpt: releasing a capture's lock on the radix tree failed", exc_info=True)

    def _page_shape(self) -> tuple[int, ...]:
        k = self._k[0]
        return (len(self._k), 2, self.page_size, int(k.shape[1]), int(k.shape[2]))

    def _page_bytes(self) -> int:
        n = 1
        for d in self._page_shape():
            n *= d
        return n * self._k[0].element_size()

    def _dtype(self) -> str:
        return str(self._k[0].dtype).removeprefix("torch.")

    def _live_pages(self, live: list[Any], entries: list[dict[str, Any]]) -> dict[bytes, Pending]:
        """The ledger's entries of ``live`` (appended to ``entries``) and their pages by key."""
        p = self.page_size
        pages: dict[bytes, Pending] = {}
        row = self._req_to_token.req_to_token
        for r in live:
            toks = self._tokens(r)
            n = self._kv_tokens(r)
            extra_key, salt = getattr(r, "extra_key", None), getattr(r, "cache_salt", None)
            sampling = _sampling(r.sampling_params)
            entries.append(
                {
                    "rid": str(r.rid),
                    "prompt_token_ids": [int(t) for t in r.origin_input_ids],
                    "output_token_ids": [int(t) for t in r.output_ids],
                    "kv_tokens": n,
                    "sampling": sampling,
                    "priority": getattr(r, "priority", None),
                    "extra_key": extra_key,
                    "cache_salt": salt,
                    "return_logprob": bool(getattr(r, "return_logprob", False)),
                    "inexact_reasons": ledger_mod.inexact_reasons(
                        sampling,
                        outputs=len(r.output_ids),
                        return_logprob=bool(getattr(r, "return_logprob", False)),
                    ),
                }
            )
            if n <= 0:
                continue
            firsts = row[r.kv.req_pool_idx, :n:p].tolist()  # each page's first slot
            keys = page_keys(toks, n, p, extra_key, salt)
            for kh, first in zip(keys, firsts, strict=False):
                pages.setdefault(bytes.fromhex(kh), Pending(bytes.fromhex(kh), self._page_of(first)))
            rest = n - len(keys) * p
            if rest:
                tk = tail_key(keys[-1] if keys else None, toks[len(keys) * p : n], extra_key, salt)
                pages.setdefault(tk, Pending(tk, self._page_of(firsts[len(keys)]), valid=rest))
        return pages

    def _page_of(self, first_slot: int) -> int:
        if first_slot % self.page_size:
            raise ValueError(
                f"slot {first_slot} does not start a page of {self.page_size}: a KV pool gpuckpt cannot read"
            )
        return int(first_slot) // self.page_size

    def _capture(self, waiters: list[Waiter], live: list[Any]) -> None:
        """The consistent point: the ledger, the pages planned, the tree's pages pinned and chunk 0
        copied; its page file is written by a thread, whose completion answers ``waiters``."""
        if self._disabled:
            self.answer(waiters, {"ok": False, "error": f"gpuckpt cannot capture this server: {self._disabled}"})
            return
        t0 = time.monotonic()
        prefix_only = all(w.prefix_only for w in waiters)
        full = any(w.full for w in waiters)
        entries: list[dict[str, Any]] = []
        live_pages = {} if prefix_only else self._live_pages(live, entries)
        walk = self._walk()
        tree: dict[bytes, Any] = {}
        for tp in walk.pages:
            tree.setdefault(tp.key, tp)
        # A live request's page the tree holds (its prompt, matched or inserted) is the tree's, and
        # streams; the others (decode KV, the tail, a prompt not inserted yet) may change or be freed
        # once the request moves on: copied at the consistent point.
        mutable: dict[bytes, Pending] = {}
        for key, pg in live_pages.items():
            t = tree.get(key)
            if t is None or t.page != pg.page or t.pin is None:
                mutable[key] = pg
        skip = set() if full else self.offers.durable
        skipped = [k for k in (*mutable, *(k for k in tree if k not in mutable)) if k in skip]
        mutable = {k: v for k, v in mutable.items() if k not in skip}
        streamed = [Pending(t.key, t.page, t.pin) for k, t in tree.items() if k not in mutable and k not in skip]
        cache = self._cache()
        pins: dict[int, Pin] = {}
        failed: set[int] = set()
        try:
            for node in {pg.pin for pg in streamed if pg.pin is not None}:
                try:
                    pins[node] = Pin(cache.lock(node))
                except Exception:  # gone since it was offered: its pages are copied now
                    log.debug("gpuckpt: no lock on tree node %s", node, exc_info=True)
                    failed.add(node)
            pending: deque[Pending] = deque()
            for pg in streamed:
                if pg.pin is None or pg.pin in failed:
                    mutable[pg.key] = Pending(pg.key, pg.page)
                else:
                    pins[pg.pin].left += 1
                    pending.append(pg)
            self._open_stream(waiters, entries, walk, tree, mutable, pending, pins, skipped, t0)
        except BaseException:
            with self.lock:
                owned = self._stream is not None and self._stream.pins is pins
            if not owned:  # an open stream releases its own locks as it ends
                self._unlock(list(pins.values()))
            raise

    def _open_stream(
        self,
        waiters: list[Waiter],
        entries: list[dict[str, Any]],
        walk: Walk,
        tree: dict[bytes, Any],
        mutable: dict[bytes, Pending],
        pending: deque[Pending],
        pins: dict[int, Pin],
        skipped: list[bytes],
        t0: float,
    ) -> None:
        """The capture's stream, with chunk 0 copied (``pins`` are the stream's once it is open)."""
        prefix_only = all(w.prefix_only for w in waiters)
        with self.lock:
            if self._stream is not None:
                self._end_stream(self._stream, "superseded by a new capture")
            self._seq += 1
            seq = self._seq
        w0 = waiters[0]
        bound = w0.max_staging or self.max_staging
        per_chunk, ring = chunk_pages(
            self._page_bytes(), max_staging=bound, copy_per_step=w0.copy_per_step or self.copy_per_step
        )
        info: dict[str, Any] = {
            "seq": seq,
            "step": self._step,
            "pages": len(mutable) + len(pending),
            "prefix_pages": len(tree),
            "unnamed_pages": walk.unnamed,
            "pinned_nodes": len(pins),
            "tail_pages": sum(1 for pg in mutable.values() if pg.valid is not None),
            "requests": len(entries),
            "inexact_requests": sum(1 for e in entries if e["inexact_reasons"]),
            "skipped": [k.hex() for k in skipped],
            "prefix_only": prefix_only,
            "plan_s": time.monotonic() - t0,
            "wait_s": t0 - min(w.requested for w in waiters),
        }
        if not prefix_only:
            info["ledger"] = ledger_mod.make_ledger(entries, page_size=self.page_size).model_dump(by_alias=True)
        st = Stream(
            seq=seq,
            name=f"capture-{os.getpid()}-{seq}",
            directory=self.staging_dir,
            info=info,
            pending=pending,
            chunk_pages=per_chunk,
            page_bytes=self._page_bytes(),
            max_staging=bound,
            ring=ring,
            prefix_only=prefix_only,
            idle_timeout=STREAM_IDLE_S,
            waiters=list(waiters),
            pins=pins,
        )
        if len(mutable) > per_chunk:
            log.warning(
                "gpuckpt: capture %d: %d pages may change after the consistent point and are copied at it, "
                "more than a chunk within the staging bound of %d bytes",
                seq,
                len(mutable),
                bound,
            )
        with self.lock:
            self._stream = st
            first = list(mutable.values()) + st.take(max(0, per_chunk - len(mutable)))
        self._copy_chunk(st, first)

    def _pump(self, st: Stream) -> None:
        """A stream's share of this step: the next chunk, if the staging bound has room."""
        with self.lock:
            if self._stream is not st:
                return
            if st.idle(time.monotonic()):
                self._end_stream(st, "no word from the agent")
                return
            if not st.can_issue():
                return
            pages = st.take()
        self._copy_chunk(st, pages)

    def _copy_chunk(self, st: Stream, pages: list[Pending]) -> None:
        """Copy ``pages`` off the pools (the scheduler's pause), release the locks that held only
        them, and hand the page file's writing to a thread."""
        t0 = time.monotonic()
        try:
            host = self._gather(pages)
        except BaseException as exc:
            with self.lock:
                self._end_stream(st, f"copying pages failed: {type(exc).__name__}: {exc}")
            raise
        copy_s = time.monotonic() - t0
        with self.lock:
            k = st.issue(len(pages), copy_s)
            done = st.copied(pages)
        self._unlock(done)
        threading.Thread(
            target=self._write_chunk,
            args=(st, k, pages, host, copy_s),
            name=f"gpuckpt-capture-{st.seq}.{k}",
            daemon=True,
        ).start()

    def _gather(self, pages: list[Pending]) -> torch.Tensor:
        """``pages`` copied off the pools into host memory: ``[n, *page shape]``, tails zeroed."""
        shape = self._page_shape()
        n = len(pages)
        out = torch.empty((n, *shape), dtype=self._k[0].dtype)
        if not n:
            return out
        p = self.page_size
        device = self._k[0].device
        first = torch.tensor([pg.page * p for pg in pages], dtype=torch.int64)
        slots = (first[:, None] + torch.arange(p, dtype=torch.int64)).reshape(-1).to(device)
        for layer, (k, v) in enumerate(zip(self._k, self._v, strict=True)):
            out[:, layer, 0] = k.index_select(0, slots).reshape(n, *shape[2:]).cpu()
            out[:, layer, 1] = v.index_select(0, slots).reshape(n, *shape[2:]).cpu()
        for i, pg in enumerate(pages):
            if pg.valid is not None:  # a tail: slots past it hold whatever was there before
                out[i, :, :, pg.valid :] = 0
        return out

    def _write_chunk(self, st: Stream, k: int, pages: list[Pending], host: torch.Tensor, copy_s: float) -> None:
        """Write chunk ``k``'s page file (a thread) and report it: chunk 0 answers the capture call."""
        t0 = time.monotonic()
        w = staging.PageWriter(
            self.staging_dir,
            f"{st.name}-c{k}",
            dtype=self._dtype(),
            page_shape=self._page_shape(),
            layers=[f"layer.{i}" for i in range(len(self._k))],
            trust=self.trust,
        )
        rec: dict[str, Any]
        try:
            if pages:
                raw = host.view(len(pages), -1).view(torch.uint8)
                for i, pg in enumerate(pages):
                    w.write(pg.key, raw[i].numpy().data)
            idx = w.commit()
            heads = int(self._k[0].shape[1])
            rec = {
                "rank": 0,
                "index": str(w.index_path),
                "head_axis": 2,
                "total_kv_heads": heads,
                "kv_heads": [0, heads],
                "device": str(self._k[0].device),
                "pages_written": len(idx.keys),
                "bytes": idx.page_bytes * len(idx.keys),
                "copy_s": copy_s,
                "write_s": time.monotonic() - t0,
            }
        except Exception as exc:
            w.abort()
            log.exception("gpuckpt: writing capture %d chunk %d failed", st.seq, k)
            rec = {"error": f"{type(exc).__name__}: {exc}"}
        with self.lock:
            if self._stream is not st or st.error is not None:  # ended meanwhile: nobody reads it
                if rec.get("index"):
                    staging.unlink_pair(rec["index"])
                return
            if rec.get("error"):
                self._end_stream(st, f"chunk {k}: {rec['error']}")
                return
            st.report(k, rec)
            if k == 0:
                self.answer(st.waiters, self._first_reply(st, rec))
                st.waiters = []
            self.cond.notify_all()

    def _first_reply(self, st: Stream, rec: dict[str, Any]) -> dict[str, Any]:
        """The capture call's answer: the consistent point's facts and chunk 0."""
        return {
            "ok": True,
            **st.info,
            **st.part(0),
            "index": rec["index"],
            "tensor_parallel_size": 1,
            "copy_s": rec["copy_s"],
            "write_s": rec["write_s"],
            "bytes": rec["bytes"],
            "pages_written": rec["pages_written"],
            "chunk_pages": st.chunk_pages,
            "max_staging_bytes": st.max_staging,
        }

    # ------------------------------------------------------------------ UnifiedCacheLinker

    def _no_hit(self, *args: Any, **kwargs: Any) -> list[int]:
        return []

    @guard(_no_hit)
    def lookup(self, rid: str, transfers: list[Any]) -> list[int]:
        """The prefix lengths (pages) whose every page key is offered: ``[1, …, n]``."""
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is None or not kv.keys or not self.offers.keys:
            return []
        self._lookups += 1
        offer = self.offers.keys  # replaced, never mutated: a consistent snapshot
        n = 0
        for kh in kv.keys:
            if bytes.fromhex(kh) not in offer:
                break
            n += 1
        return list(range(1, n + 1))

    def _refuse(self, *args: Any, **kwargs: Any) -> bool:
        return False

    @guard(_refuse)
    def load(self, rid: str, transfers: list[Any]) -> bool:
        """Queue the offered pages of ``transfers``' keys for the request's device slots."""
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is None or kv.device_indices is None or not kv.keys:
            return False
        offer = self.offers.keys
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
        shape = self._page_shape()
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
            pages = host.view(len(plan), *shape).to(device)
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
            if self._stream is not None:
                self._end_stream(self._stream, "the server flushed its cache")
        self._release_pins()
        self._tree.clear()

    @guard(lambda self: None)
    def close(self) -> None:
        self.close_server()
        with self.lock:
            if self._stream is not None:
                self._end_stream(self._stream, "the server is shutting down")
            self.end_offer()
            self._retire()
        self._release_pins()

    # ------------------------------------------------------------------ the control protocol (control threads)

    def describe_worker(self) -> dict[str, Any]:
        return describe(self._server_args, self._k, self.page_size, self._tp, self._pp)

    def waiting_for(self, w: Waiter) -> str:
        return f"waiting for {w.when}" if w.when else "is the scheduler paused?"

    def forget_waiter(self, w: Waiter) -> None:
        """A capture call gave up (lock held): a stream whose chunk 0 nobody awaits any more ends."""
        st = self._stream
        if st is not None and w in st.waiters:
            st.waiters.remove(w)
            if not st.waiters:
                self._end_stream(st, "the capture call timed out")

    def end_stream_of(self, w: Waiter, seq: int, why: str) -> None:
        self.stream_cancel(seq, why)

    def stream_cancel(self, seq: int, why: str) -> bool:
        st = self._stream
        if st is not None and (seq < 0 or st.seq == seq):
            self._end_stream(st, why)
            return True
        return False

    def stream_names(self) -> set[str]:
        return {self._stream.name} if self._stream is not None else set()

    def _end_stream(self, st: Stream, error: str | None) -> None:
        """Close a capture stream (lock held): its locks go to the next boundary's release; with
        ``error``, delete what it staged and tell whoever waits for it."""
        if error is not None:
            st.error = st.error or error
            for path in st.files():
                staging.unlink_pair(path)
            self.answer(st.waiters, {"ok": False, "error": f"capture {st.seq} failed: {st.error}"})
            log.warning("gpuckpt: capture %d ended: %s", st.seq, st.error)
        st.waiters = []
        self._unpin.extend(st.take_pins())
        self.last_stream = {"seq": st.seq, "error": st.error, **st.summary()}
        if self._stream is st:
            self._stream = None
        self.cond.notify_all()

    def on_next(self, msg: Next) -> Reply:
        """The agent consumed the chunks ``ack`` names (their files are gone): answer with every
        chunk written by then (``parts``, at least one), or ``done`` after the last one."""
        seq = msg.seq
        deadline = time.monotonic() + msg.timeout
        with self.lock:
            st = self._stream
            if st is None or st.seq != seq:
                last = self.last_stream
                if last.get("seq") == seq and last.get("error") is None:
                    return {"ok": True, "done": True, **last}
                why = last.get("error") if last.get("seq") == seq else "no such capture in flight"
                return {"ok": False, "error": f"capture {seq}: {why}"}
            for k in msg.ack:
                st.ack(k)
            if st.done:
                self._end_stream(st, None)
                return {"ok": True, "done": True, **self.last_stream}
            st.touched = time.monotonic()
        with self.cond:
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
                    return {
                        "ok": False,
                        "error": f"capture {seq}: no chunk within the timeout (is the scheduler paused?)",
                    }
                self.cond.wait(min(left, 1.0))

    def check_page_file(self, pf: staging.PageFile) -> None:
        want = (self._dtype(), self._page_shape()) if self._k else None
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
            keys = page_keys(ids, n, p, r.extra_key, r.cache_salt)
            if n > len(keys) * p:
                keys.append(
                    tail_key(keys[-1] if keys else None, ids[len(keys) * p : n], r.extra_key, r.cache_salt).hex()
                )
            out.append(keys)
        return {"ok": True, "keys": out}

    def engine_stats(self) -> dict[str, Any]:
        st = self._stream
        return {
            "restored_tokens": dict(self._restored),
            "step": self._step,
            "lookups": self._lookups,
            "tree_pages_named": len(self._tree.pages),
            "hook_s": self._hook_s,
            "offers": self._offers,
            "stream": None if st is None else {"seq": st.seq, "pins": len(st.pins), **st.summary()},
            "pins_to_release": len(self._unpin),
            "disabled": self._disabled,
        }
