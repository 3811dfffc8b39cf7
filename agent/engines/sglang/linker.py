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

Capture (``capture``, one chunk): at the first boundary where ``when``
holds, the linker writes the ledger (:mod:`.ledger`: running batch, the last
prefill batch, the chunked request and the waiting queue) and copies, into
one page file of the staging directory:

- every in-flight request's pages, read through
  ``req_to_token_pool.req_to_token[req_pool_idx, :kv_tokens]`` (a running
  request's decode KV is not in the radix tree until it finishes): full
  pages keyed by SGLang's own chained page hash
  (``get_storage_hash_str``, seeded by ``extra_key`` / ``cache_salt`` as the
  radix cache seeds it), the partial last page by :func:`tail_key` (slots
  past the tail zeroed);
- every full page of the prefix cache reachable from the token sequences of
  the requests this linker has seen (live, and the last ``track_requests``
  finished ones): ``match_full_device_prefix`` and ``path_device_indices``
  name the slots the tree holds for them now. Pages the tree took from
  elsewhere (none: every insert comes from a request) are not enumerated —
  SGLang's Rust tree core offers no walk with token ids.

A page is ``[layers, 2 (K, V), page_size, kv_heads, head_dim]`` (heads on
axis 2 of a layer's page). ``durable`` keys are listed under ``skipped`` and
not copied. The reply is chunk 0 with the ledger; the next ``next`` answers
``done``. The copy runs on the scheduler thread at the boundary (the engine
waits for it).

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
import sys
import time
from array import array
from collections import OrderedDict
from pathlib import Path
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
from agent.fs import Trust

log = logging.getLogger("gpuckpt.sglang")

#: Finished requests whose token sequences a capture looks up in the prefix cache.
DEFAULT_TRACK = 4096
#: A stream with no word from the agent for this long is abandoned (its page file deleted).
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
            self._disabled = f"tensor/pipeline parallel (tp={self._tp}, pp={self._pp}) is not supported"
        self.layer_done_counter = LayerWiseLoadCounter(max(1, len(self._k)))
        self._scheduler = _find_scheduler()
        self._track = int(extra.get("track_requests") or DEFAULT_TRACK)
        self._step = 0
        self._seq = 0
        self._stream: dict[str, Any] | None = None  # the capture not yet acknowledged: seq, index, touched
        self._files: dict[str, staging.PageFile] = {}  # open mappings of offered files
        self._pending: dict[str, tuple[torch.Tensor, list[tuple[str, bytes]]]] = {}
        self._restored: dict[str, int] = {}  # rid → tokens loaded from offered pages
        self._lookups = 0
        self._seen: OrderedDict[str, Any] = OrderedDict()  # rid → Req, most recent last
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

    def _remember(self, reqs: list[Any]) -> None:
        for r in reqs:
            self._seen[r.rid] = r
            self._seen.move_to_end(r.rid)
        while len(self._seen) > self._track:
            self._seen.popitem(last=False)

    def _met(self, when: dict[str, int] | None, live: list[Any]) -> bool:
        if not when:
            return True
        k = when.get("min_outputs", 0)
        return sum(1 for r in live if len(r.output_ids) >= k) >= when.get("live", 0)

    def _progress(self, live: list[Any]) -> dict[str, Any]:
        return {"step": self._step, "live": len(live), "outputs": {r.rid: len(r.output_ids) for r in live}}

    # ------------------------------------------------------------------ the step boundary

    def _boundary(self) -> None:
        """Once per scheduler loop iteration, on the scheduler thread."""
        self._step += 1
        live = self._live()
        if live:
            self._remember(live)
        if self.retired:
            with self.lock:
                self._retire()
        if not (self.capture_calls or self.wait_calls):  # read without the lock on every loop
            return
        with self.lock:
            due = [w for w in self.wait_calls + self.capture_calls if self._met(w.when, live)]
            self.wait_calls = [w for w in self.wait_calls if w not in due]
            self.capture_calls = [w for w in self.capture_calls if w not in due]
        for w in due:
            if w.kind == "wait":
                w.reply = {"ok": True, **self._progress(live)}
            else:
                try:
                    w.reply = self._capture(w, live)
                except Exception as exc:
                    log.exception("gpuckpt: capture failed")
                    self.failures["capture"] = self.failures.get("capture", 0) + 1
                    w.reply = {"ok": False, "error": f"capture failed: {type(exc).__name__}: {exc}"}
            w.event.set()
        with self.lock:
            st = self._stream
            if st is not None and time.monotonic() - st["touched"] > STREAM_IDLE_S:
                self._end_stream("no word from the agent")

    def _retire(self) -> None:
        """Delete and close the page files of ended offers (lock held, scheduler thread: no load runs)."""
        for path in self.retire_files():
            pf = self._files.pop(path, None)
            if pf is not None:
                pf.close()

    def _page_shape(self) -> tuple[int, ...]:
        k = self._k[0]
        return (len(self._k), 2, self.page_size, int(k.shape[1]), int(k.shape[2]))

    def _dtype(self) -> str:
        return str(self._k[0].dtype).removeprefix("torch.")

    def _capture(self, w: Waiter, live: list[Any]) -> dict[str, Any]:
        """Plan and copy a capture at this boundary; the reply to the capture call (chunk 0, done)."""
        if self._disabled:
            return {"ok": False, "error": f"gpuckpt cannot capture this server: {self._disabled}"}
        t0 = time.monotonic()
        wait_s = t0 - w.requested
        p = self.page_size
        pages: dict[bytes, tuple[torch.Tensor, int | None]] = {}  # key → (slots, valid slots or None)
        entries: list[dict[str, Any]] = []
        row = self._req_to_token.req_to_token
        tails = 0
        if not w.prefix_only:
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
                slots = row[r.kv.req_pool_idx, :n].to(torch.int64)
                keys = page_keys(toks, n, p, extra_key, salt)
                for i, kh in enumerate(keys):
                    pages.setdefault(bytes.fromhex(kh), (slots[i * p : (i + 1) * p], None))
                rest = n - len(keys) * p
                if rest:
                    tk = tail_key(keys[-1] if keys else None, toks[len(keys) * p : n], extra_key, salt)
                    first = int(slots[len(keys) * p])
                    page = torch.arange(first, first + p, dtype=torch.int64, device=slots.device)
                    pages.setdefault(tk, (page, rest))
                    tails += 1
        prefix = self._prefix_pages(pages)
        skipped = [] if w.full else [k for k in pages if k in self.offers.durable]
        copy = [(k, v) for k, v in pages.items() if w.full or k not in self.offers.durable]
        plan_s = time.monotonic() - t0
        with self.lock:
            if self._stream is not None:
                self._end_stream("superseded by a new capture")
            self._seq += 1
            seq = self._seq
        t1 = time.monotonic()
        written, nbytes, index = self._write(f"capture-{seq}", copy)
        copy_s = time.monotonic() - t1
        ledger = None if w.prefix_only else ledger_mod.make_ledger(entries, page_size=p)
        dev = str(self._k[0].device)
        heads = int(self._k[0].shape[1])
        with self.lock:
            self._stream = {"seq": seq, "index": str(index), "touched": time.monotonic()}
        stats = {
            "step": self._step,
            "pages": written,
            "prefix_pages": prefix,
            "tail_pages": tails,
            "requests": len(entries),
            "plan_s": plan_s,
            "wait_s": wait_s,
            "copy_s": copy_s,
            "write_s": 0.0,
            "bytes": nbytes,
            "inexact_requests": sum(1 for e in entries if e["inexact_reasons"]),
        }
        return {
            "ok": True,
            "seq": seq,
            "chunk": 0,
            "index": str(index),
            "shards": [
                {
                    "rank": 0,
                    "index": str(index),
                    "head_axis": 2,
                    "total_kv_heads": heads,
                    "kv_heads": [0, heads],
                    "device": dev,
                    "pages_written": written,
                    "bytes": nbytes,
                    "copy_s": copy_s,
                }
            ],
            "tensor_parallel_size": 1,
            "ledger": None if ledger is None else ledger.model_dump(by_alias=True),
            "skipped": [k.hex() for k in skipped],
            "lost": [],
            "chunk_pages": written,
            "max_staging_bytes": None,
            **stats,
        }

    def _prefix_pages(self, pages: dict[bytes, tuple[torch.Tensor, int | None]]) -> int:
        """Add the prefix cache's full pages for every token sequence seen; returns how many were added."""
        s = self._scheduler
        cache = getattr(s, "tree_cache", None)
        core = getattr(cache, "tree_core", None)
        if cache is None or core is None:
            return 0
        p = self.page_size
        added = 0
        for r in list(self._seen.values()):
            toks = self._tokens(r)
            extra_key, salt = getattr(r, "extra_key", None), getattr(r, "cache_salt", None)
            matched, node, _ = core.match_full_device_prefix(
                RadixKey(array("q", toks), extra_key=extra_key, cache_salt=salt)
            )
            full = int(matched) // p * p
            if full <= 0:
                continue
            keys = page_keys(toks, full, p, extra_key, salt)
            if all(bytes.fromhex(k) in pages for k in keys):
                continue
            slots = cache.path_device_indices(node).to(torch.int64)
            full = min(full, int(slots.numel()) // p * p)
            for i, kh in enumerate(keys[: full // p]):
                kb = bytes.fromhex(kh)
                if kb not in pages:
                    pages[kb] = (slots[i * p : (i + 1) * p], None)
                    added += 1
        return added

    def _write(self, name: str, copy: list[tuple[bytes, tuple[torch.Tensor, int | None]]]) -> tuple[int, int, Path]:
        """Copy pages out of the pools into page file ``name``: (pages, bytes, index path)."""
        w = staging.PageWriter(
            self.staging_dir,
            name,
            dtype=self._dtype(),
            page_shape=self._page_shape(),
            layers=[f"layer.{i}" for i in range(len(self._k))],
            trust=self.trust,
        )
        nbytes = 0
        try:
            if copy:
                slots = torch.cat([s for _, (s, _) in copy]).to(self._k[0].device)
                n = len(copy)
                shape = self._page_shape()
                out = torch.empty((n, *shape), dtype=self._k[0].dtype)
                for layer, (k, v) in enumerate(zip(self._k, self._v, strict=True)):
                    out[:, layer, 0] = k[slots].reshape(n, *shape[2:]).cpu()
                    out[:, layer, 1] = v[slots].reshape(n, *shape[2:]).cpu()
                for i, (_, (_, valid)) in enumerate(copy):
                    if valid is not None:  # a tail: slots past it hold whatever was there before
                        out[i, :, :, valid:] = 0
                raw = out.view(n, -1).view(torch.uint8)
                for i, (key, _) in enumerate(copy):
                    w.write(key, raw[i].numpy().data)
                nbytes = int(raw.numel())
            idx = w.commit()
        except BaseException:
            w.abort()
            raise
        return len(idx.keys), nbytes, w.index_path

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
            self._restored[rid] = self._restored.get(rid, 0) + len(plan) * self.page_size

    def _landed_false(self, *args: Any, **kwargs: Any) -> bool:
        return False

    @guard(_landed_false)
    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return bool(self.layer_done_counter.finish(counter_index))

    @guard(_refuse)
    def cancel_queued_load(self, rid: str) -> bool:
        return self._pending.pop(rid, None) is not None

    def offload(self, transfers: list[Any], session_id: str | None = None) -> bool:
        """Nothing is written through: a capture reads the pools directly."""
        return False

    def _zero(self, *args: Any, **kwargs: Any) -> int:
        return 0

    @guard(_zero)
    def num_completed_offloads(self) -> int:
        """Never any (see :meth:`offload`); called once per scheduler loop: the step boundary."""
        self._boundary()
        return 0

    def pop_completed_offload(self) -> bool:
        return False

    @guard(lambda self: None)
    def reset(self) -> None:
        """SGLang flushed its cache: queued loads go (the offer stays)."""
        self._pending.clear()
        self.layer_done_counter.reset()

    @guard(lambda self: None)
    def close(self) -> None:
        self.close_server()
        with self.lock:
            self.end_offer()
            self._retire()

    # ------------------------------------------------------------------ the control protocol (control threads)

    def describe_worker(self) -> dict[str, Any]:
        return describe(self._server_args, self._k, self.page_size, self._tp, self._pp)

    def waiting_for(self, w: Waiter) -> str:
        return f"waiting for {w.when}" if w.when else "is the scheduler paused?"

    def end_stream_of(self, w: Waiter, seq: int, why: str) -> None:
        self._end_stream(why)

    def stream_cancel(self, seq: int, why: str) -> bool:
        st = self._stream
        if st is not None and (seq < 0 or st["seq"] == seq):
            self._end_stream(why)
            return True
        return False

    def _end_stream(self, error: str | None) -> None:
        """Close the capture stream (lock held); with ``error``, delete what it staged."""
        st = self._stream
        if st is None:
            return
        if error is not None:
            staging.unlink_pair(st["index"])
        self.last_stream = {"seq": st["seq"], "error": error, "chunks": 1, "lost_pages": 0}
        self._stream = None

    def on_next(self, msg: Next) -> Reply:
        """A capture is one chunk, so the next call after it is ``done``."""
        seq = msg.seq
        with self.lock:
            st = self._stream
            if st is not None and st["seq"] == seq:
                self._end_stream(None)
            last = self.last_stream
            if last.get("seq") == seq and last.get("error") is None:
                return {"ok": True, "done": True, **last}
            why = last.get("error") if last.get("seq") == seq else "no such capture in flight"
        return {"ok": False, "error": f"capture {seq}: {why}"}

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
        return {
            "restored_tokens": dict(self._restored),
            "step": self._step,
            "lookups": self._lookups,
            "tracked_requests": len(self._seen),
            "stream": None if self._stream is None else {"seq": self._stream["seq"]},
            "disabled": self._disabled,
        }
