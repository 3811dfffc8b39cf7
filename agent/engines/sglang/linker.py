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

(:func:`agent.engines.sglang.serve.serve_command` builds these.) It serves
gpuckpt's control socket (:mod:`agent.engines.control`) from a thread, with
the commands and reply shapes of the vLLM connector
(:mod:`agent.engines.vllm.connector`), so :mod:`agent.engines.driver`
checkpoints and restores it unchanged.

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
:func:`_guard`; an exception is logged and answered safely (no hit, no load,
an error reply). ``offload`` returns False: nothing is written through.

Limits: MHA KV pools (``MHATokenToKVPool``: ``k_buffer``/``v_buffer``), TP =
PP = 1, no overlap scheduling (CPU turns it off; on a GPU run with
``--disable-overlap-schedule``), no HiCache (SGLang does not combine it with
a linker).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)
from sglang.srt.mem_cache.utils import get_storage_hash_str, storage_namespace_seed

from agent import fs
from agent.engines import control, staging
from agent.engines.offers import OfferBook
from agent.engines.sglang import ledger as ledger_mod
from agent.fs import Trust

log = logging.getLogger("gpuckpt.sglang")

#: The page-hash scheme of SGLang's storage keys (recorded in the namespace and the pins).
HASH_SCHEME = "sglang-storage-sha256/sglang-cache-namespace-v1"
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


_F = TypeVar("_F", bound=Callable[..., Any])


def _guard(recover: Callable[..., Any]) -> Callable[[_F], _F]:
    """Run a linker method so that nothing it raises reaches SGLang: log it, count it, and return
    ``recover(self, *args, **kwargs)`` (which must not raise; if it does, ``None``)."""

    def deco(fn: _F) -> _F:
        name = fn.__name__

        @functools.wraps(fn)
        def wrapper(self: GpuckptLinker, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception:
                log.exception("gpuckpt: %s failed; the server goes on without it", name)
                self._failures[name] = self._failures.get(name, 0) + 1
                try:
                    return recover(self, *args, **kwargs)
                except Exception:
                    log.exception("gpuckpt: recovering from a failed %s failed", name)
                    return None

        return wrapper  # type: ignore[return-value]

    return deco


@dataclass
class _Waiter:
    """A control call waiting for a step boundary (answered on the scheduler thread)."""

    kind: str  # "capture" or "wait"
    when: dict[str, int] | None = None
    full: bool = False
    prefix_only: bool = False
    event: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] | None = None
    requested: float = field(default_factory=time.monotonic)


def _condition(raw: Any) -> dict[str, int] | None:
    if not raw:
        return None
    if not isinstance(raw, dict) or not set(raw) <= {"live", "min_outputs"}:
        raise ValueError(f"a condition is {{'live': n, 'min_outputs': k}}, not {raw!r}")
    return {k: int(v) for k, v in raw.items()}


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


class GpuckptLinker(UnifiedCacheLinker):  # type: ignore[misc]
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
        self.forward_stream = forward_stream
        self._failures: dict[str, int] = {}
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
        tag = hashlib.sha256(str(extra.get("control_socket", "")).encode()).hexdigest()[:12]
        self._staging_dir = str(extra.get("staging_dir") or staging.default_dir(f"sglang-{tag}"))
        self._trust = Trust.of(extra.get("shared_group") or None)
        self._lock = threading.Lock()
        self._waiters: list[_Waiter] = []
        self._any_waiter = False  # read without the lock on every loop: set under it
        self._step = 0
        self._seq = 0
        self._stream: dict[str, Any] | None = None  # the capture not yet acknowledged: seq, index, touched
        self._last_stream: dict[str, Any] = {}
        self._offers = OfferBook(self._expire_offer)  # the restore offer and the durable keys
        self._files: dict[str, staging.PageFile] = {}  # open mappings of offered files
        self._retired: list[str] = []  # ended offers' files: closed and deleted at the next boundary
        self._pending: dict[str, tuple[torch.Tensor, list[tuple[str, bytes]]]] = {}
        self._restored: dict[str, int] = {}  # rid → tokens loaded from offered pages
        self._lookups = 0
        self._seen: OrderedDict[str, Any] = OrderedDict()  # rid → Req, most recent last
        self._facts: dict[str, Any] | None = None
        self._facts_lock = threading.Lock()
        self._server: control.ControlServer | None = None
        sock = extra.get("control_socket")
        if sock:
            path = Path(str(sock))
            fs.ensure_socket_dir(path.parent, self._trust)
            self._server = control.ControlServer(path, self._handle)
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
        if self._retired:
            with self._lock:
                self._retire()
        if not self._any_waiter:
            return
        with self._lock:
            due = [w for w in self._waiters if self._met(w.when, live)]
            self._waiters = [w for w in self._waiters if w not in due]
            self._any_waiter = bool(self._waiters)
        for w in due:
            if w.kind == "wait":
                w.reply = {"ok": True, **self._progress(live)}
            else:
                try:
                    w.reply = self._capture(w, live)
                except Exception as exc:
                    log.exception("gpuckpt: capture failed")
                    self._failures["capture"] = self._failures.get("capture", 0) + 1
                    w.reply = {"ok": False, "error": f"capture failed: {type(exc).__name__}: {exc}"}
            w.event.set()
        with self._lock:
            st = self._stream
            if st is not None and time.monotonic() - st["touched"] > STREAM_IDLE_S:
                self._end_stream("no word from the agent")

    def _retire(self) -> None:
        """Close and delete the page files of ended offers (lock held, scheduler thread: no load runs)."""
        out, self._retired = self._retired, []
        for path in out:
            pf = self._files.pop(path, None)
            if pf is not None:
                pf.close()
            try:
                staging.unlink_pair(path)
            except OSError as exc:
                log.warning("gpuckpt: could not delete the page file %s: %s", path, exc)

    def _page_shape(self) -> tuple[int, ...]:
        k = self._k[0]
        return (len(self._k), 2, self.page_size, int(k.shape[1]), int(k.shape[2]))

    def _dtype(self) -> str:
        return str(self._k[0].dtype).removeprefix("torch.")

    def _capture(self, w: _Waiter, live: list[Any]) -> dict[str, Any]:
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
        skipped = [] if w.full else [k for k in pages if k in self._offers.durable]
        copy = [(k, v) for k, v in pages.items() if w.full or k not in self._offers.durable]
        plan_s = time.monotonic() - t0
        with self._lock:
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
        with self._lock:
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
            self._staging_dir,
            name,
            dtype=self._dtype(),
            page_shape=self._page_shape(),
            layers=[f"layer.{i}" for i in range(len(self._k))],
            trust=self._trust,
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

    @_guard(_no_hit)
    def lookup(self, rid: str, transfers: list[Any]) -> list[int]:
        """The prefix lengths (pages) whose every page key is offered: ``[1, …, n]``."""
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is None or not kv.keys or not self._offers.keys:
            return []
        self._lookups += 1
        offer = self._offers.keys  # replaced, never mutated: a consistent snapshot
        n = 0
        for kh in kv.keys:
            if bytes.fromhex(kh) not in offer:
                break
            n += 1
        return list(range(1, n + 1))

    def _refuse(self, *args: Any, **kwargs: Any) -> bool:
        return False

    @_guard(_refuse)
    def load(self, rid: str, transfers: list[Any]) -> bool:
        """Queue the offered pages of ``transfers``' keys for the request's device slots."""
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is None or kv.device_indices is None or not kv.keys:
            return False
        offer = self._offers.keys
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

    @_guard(_failed_start)
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
            with self._lock:
                files = []
                for path, _ in plan:
                    pf = self._files.get(path)
                    if pf is None:
                        raise RuntimeError(f"page file {path} is no longer offered")
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

    @_guard(_landed_false)
    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return bool(self.layer_done_counter.finish(counter_index))

    @_guard(_refuse)
    def cancel_queued_load(self, rid: str) -> bool:
        return self._pending.pop(rid, None) is not None

    def offload(self, transfers: list[Any], session_id: str | None = None) -> bool:
        """Nothing is written through: a capture reads the pools directly."""
        return False

    def _zero(self, *args: Any, **kwargs: Any) -> int:
        return 0

    @_guard(_zero)
    def num_completed_offloads(self) -> int:
        """Never any (see :meth:`offload`); called once per scheduler loop: the step boundary."""
        self._boundary()
        return 0

    def pop_completed_offload(self) -> bool:
        return False

    @_guard(lambda self: None)
    def reset(self) -> None:
        """SGLang flushed its cache: queued loads go (the offer stays)."""
        self._pending.clear()
        self.layer_done_counter.reset()

    @_guard(lambda self: None)
    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        with self._lock:
            self._end_offer()
            self._retire()

    # ------------------------------------------------------------------ control channel (control threads)

    def _handle(self, req: dict[str, Any]) -> dict[str, Any]:
        """One control request → its reply (``ok`` and the rest); an exception becomes an error reply."""
        commands: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "ping": lambda r: {"ok": True, "pid": os.getpid()},
            "describe": lambda r: {"ok": True, **self._describe()},
            "capture": self._cmd_capture,
            "wait": self._cmd_capture,
            "next": self._cmd_next,
            "cancel": self._cmd_cancel,
            "offer": self._cmd_offer,
            "keys": self._cmd_keys,
            "withdraw": self._cmd_withdraw,
            "durable": self._cmd_durable,
            "sweep": self._cmd_sweep,
            "stats": self._cmd_stats,
        }
        cmd = req.get("cmd")
        handler = commands.get(cmd) if isinstance(cmd, str) else None
        if handler is None:
            return {"ok": False, "error": f"unknown command {cmd!r}"}
        return handler(req)

    def _cmd_capture(self, req: dict[str, Any]) -> dict[str, Any]:
        """``capture {"when", "full", "prefix_only", "timeout"}`` → chunk 0 with the ledger;
        ``wait {"when", "timeout"}`` → the step boundary where ``when`` held."""
        kind = str(req["cmd"])
        w = _Waiter(
            kind, _condition(req.get("when")), bool(req.get("full", False)), bool(req.get("prefix_only", False))
        )
        with self._lock:
            self._waiters.append(w)
            self._any_waiter = True
        if w.event.wait(float(req.get("timeout", 60))):
            assert w.reply is not None
            return w.reply
        with self._lock:
            if w in self._waiters:
                self._waiters.remove(w)
                self._any_waiter = bool(self._waiters)
        if w.event.is_set() and w.reply is not None:  # answered as the wait ran out
            if w.kind == "capture" and w.reply.get("ok"):
                with self._lock:
                    self._end_stream("the capture call timed out")
                return {"ok": False, "error": "the capture call timed out as it was answered"}
            return w.reply
        what = f"waiting for {w.when}" if w.when else "is the scheduler paused?"
        return {"ok": False, "error": f"no step boundary answered the {kind} within the timeout ({what})"}

    def _end_stream(self, error: str | None) -> None:
        """Close the capture stream (lock held); with ``error``, delete what it staged."""
        st = self._stream
        if st is None:
            return
        if error is not None:
            staging.unlink_pair(st["index"])
        self._last_stream = {"seq": st["seq"], "error": error, "chunks": 1, "lost_pages": 0}
        self._stream = None

    def _cmd_next(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{"seq", "ack"}``: a capture is one chunk, so the next call after it is ``done``."""
        seq = int(req.get("seq", -1))
        with self._lock:
            st = self._stream
            if st is not None and st["seq"] == seq:
                self._end_stream(None)
            last = self._last_stream
            if last.get("seq") == seq and last.get("error") is None:
                return {"ok": True, "done": True, **last}
            why = last.get("error") if last.get("seq") == seq else "no such capture in flight"
        return {"ok": False, "error": f"capture {seq}: {why}"}

    def _cmd_cancel(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            st = self._stream
            if st is not None and st["seq"] == int(req.get("seq", -1)):
                self._end_stream("cancelled by the agent")
                return {"ok": True, "cancelled": True}
        return {"ok": True, "cancelled": False}

    def _cmd_sweep(self, req: dict[str, Any]) -> dict[str, Any]:
        """End any capture stream and delete capture page files no stream owns (a killed agent's)."""
        with self._lock:
            self._end_stream("the agent restarted (sweep)")
        removed: list[str] = []
        d = Path(self._staging_dir)
        if d.is_dir():
            for pat in ("capture-*.json", "capture-*.bin"):
                for p in sorted(d.glob(pat)):
                    p.unlink(missing_ok=True)
                    removed.append(p.name)
        return {"ok": True, "removed": removed}

    def _cmd_offer(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{"index", "requests", "ttl", "generation"}``: offer a page file's pages (request states:
        none apply to SGLang, all are accepted and ignored)."""
        index = req.get("index")
        pf: staging.PageFile | None = None
        if index:
            pf = staging.PageFile(index, trust=self._trust)
            want = (self._dtype(), self._page_shape()) if self._k else None
            got = (pf.index.dtype, tuple(pf.index.page_shape))
            if got != want:
                pf.close()
                return {"ok": False, "error": f"offered pages are {got}, this server's are {want}"}
        ttl = req.get("ttl")
        with self._lock:
            gen = req.get("generation")
            if not self._offers.admit(gen):
                if pf is not None:
                    pf.close()
                    staging.unlink_pair(str(index))
                return {"ok": False, "error": f"the offer of generation {gen} has ended", "ended": True}
            keys: list[bytes] = []
            if pf is not None:
                path = str(index)
                old = self._files.pop(path, None)
                if old is not None:
                    old.close()
                self._files[path] = pf
                keys = list(pf.index.keys)
                self._offers.add(path, keys)
            if ttl is not None:
                self._offers.expire_after(float(ttl))
            generation = self._offers.generation
        states = req.get("requests") or {}
        return {"ok": True, "offered": len(keys), "requests": len(states), "rejected": {}, "generation": generation}

    def _end_offer(self) -> None:
        """Withdraw every offered page (lock held); the files go at the next boundary."""
        self._retired.extend(self._offers.end())

    def _expire_offer(self) -> None:
        with self._lock:
            n = len(self._offers.keys)
            files = self._offers.expired()
            if files is not None:
                log.info("gpuckpt: the restore offer expired (%d pages)", n)
                self._retired.extend(files)

    def _cmd_withdraw(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            files = len(self._offers.files)
            self._end_offer()
        return {"ok": True, "files": files}

    def _cmd_durable(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return self._offers.mark(req)

    def _cmd_keys(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{"requests": [{"token_ids", "kv_tokens", "extra_key", "cache_salt"}]}`` → each request's
        page keys (hex) in order: full pages, then the tail key of a partial last page."""
        out = []
        p = self.page_size
        for r in req.get("requests") or []:
            ids = [int(t) for t in r.get("token_ids") or []]
            n = min(int(r.get("kv_tokens", len(ids))), len(ids))
            extra_key, salt = r.get("extra_key"), r.get("cache_salt")
            keys = page_keys(ids, n, p, extra_key, salt)
            if n > len(keys) * p:
                keys.append(tail_key(keys[-1] if keys else None, ids[len(keys) * p : n], extra_key, salt).hex())
            out.append(keys)
        return {"ok": True, "keys": out}

    def _cmd_stats(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return {
                "ok": True,
                "restored_tokens": dict(self._restored),
                "step": self._step,
                "lookups": self._lookups,
                "offered": len(self._offers.keys),
                "offer_files": sorted(self._offers.files),
                "files_to_delete": len(self._retired),
                "durable": len(self._offers.durable),
                "tracked_requests": len(self._seen),
                "captures_pending": sum(1 for w in self._waiters if w.kind == "capture"),
                "waits_pending": sum(1 for w in self._waiters if w.kind == "wait"),
                "stream": None if self._stream is None else {"seq": self._stream["seq"]},
                "last_stream": dict(self._last_stream),
                "hook_failures": dict(self._failures),
                "disabled": self._disabled,
            }

    def _describe(self) -> dict[str, Any]:
        with self._facts_lock:
            if self._facts is None:
                self._facts = describe(self._server_args, self._k, self.page_size, self._tp, self._pp)
            return self._facts


def describe(server_args: Any, k: list[torch.Tensor], page_size: int, tp: int, pp: int) -> dict[str, Any]:
    """The server's pins, layout and namespace fields (see :class:`agent.engines.base.WorkerDescription`)."""
    import sglang

    from ckpt import ABSENT, fingerprint

    model = str(getattr(server_args, "model_path", "") or "")
    tok = str(getattr(server_args, "tokenizer_path", None) or model)
    model_digest = fingerprint.model_digest(model) if os.path.isdir(model) else None
    tokenizer_digest = fingerprint.tokenizer_digest(tok) if os.path.isdir(tok) else None
    backend = getattr(server_args, "attention_backend", None)
    device = str(k[0].device.type) if k else str(getattr(server_args, "device", None))
    heads = int(k[0].shape[1]) if k else None
    head_dim = int(k[0].shape[2]) if k else None
    dtype = str(k[0].dtype).removeprefix("torch.") if k else None
    layout = f"sglang:{device}:{backend}:mha:[slot,kv_heads,head_dim]:k{head_dim}+v{head_dim}" if k else None
    revision = getattr(server_args, "revision", None)
    facts = {
        "engine": "sglang",
        "engine_version": str(sglang.__version__),
        "attention_backend": backend,
        "kv_layout": layout,
        "block_size": page_size,
        "kv_dtype": dtype,
        "num_kv_heads": heads,
        "head_size": head_dim,
        # the scheduler loop: with overlap scheduling a step boundary sees outputs one step behind
        "model_runner": "overlap" if not getattr(server_args, "disable_overlap_schedule", False) else "normal",
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "rank": 0,
        "model": model,
        "model_revision": revision if revision or not os.path.isdir(model) else ABSENT,
        "model_digest": model_digest,
        "tokenizer_digest": tokenizer_digest,
        "prefix_hash_algo": HASH_SCHEME.split("/")[0],
        "prefix_hash_seed": HASH_SCHEME.split("/")[1],
    }
    layout_doc = {
        "device": device,
        "attention_backend": backend,
        "page_size": page_size,
        "block_size": page_size,
        "num_kv_heads": heads,
        "head_size": head_dim,
        "dtype": dtype,
        "layers": len(k),
        "tensor_parallel_size": tp,
        "page": "one page across all layers, layer-major: [layers, 2 (K, V), page_size, kv_heads, head_dim]",
    }
    ns = {
        "engine": "sglang",
        "model": model_digest or f"path:{model}",
        "layout": layout or "unknown",
        "kv": f"{dtype}/ps{page_size}/h{heads}x{head_dim}/l{len(k)}",
        "hash": HASH_SCHEME,
    }
    return {"facts": facts, "layout": layout_doc, "namespace": ns}
