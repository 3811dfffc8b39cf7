"""The linker's capture side: the consistent point, then the pinned pages chunk by chunk.

:class:`Capturer` is the half of :class:`agent.engines.sglang.linker.GpuckptLinker`
that captures (the linker is one object, as SGLang loads one class; this
module keeps its capture methods apart). The stream's bookkeeping is
:mod:`.stream`, the tree walk :mod:`.tree`, the requests' keys and ledger
entries :mod:`.state`.

At the consistent point (:meth:`Capturer._capture`, on the scheduler
thread) the linker writes the ledger, reads the live requests' pages and
walks the tree, then plans the tree's pages as page numbers and pinning
nodes only: one lock reference per node, no Python per page (the
durable-key filter of an incremental capture names each tree page, in one
pass of dictionary lookups). Each pinned page's key is looked up as its
chunk is taken (:class:`.stream.Planned`): a locked page keeps its slots,
so the key the tree offered for it is still the index's. What may change
after the consistent point — the live requests' pages the tree does not
hold under the same key with a lock, and tree pages no lock could hold — is
named and copied at it, in chunk 0. Locks are released as their last page
is copied and on any end of the stream (:meth:`Capturer.end_stream`:
their release waits for the next boundary on the scheduler thread).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from functools import partial
from typing import Any

import torch

from agent.engines import staging
from agent.engines.service import Waiter, WorkerService
from agent.engines.sglang import ledger as ledger_mod
from agent.engines.sglang import state
from agent.engines.sglang.stream import Pending, Pin, Planned, Stream
from agent.engines.sglang.tree import NO_NODE, TreeIndex, Walk
from agent.engines.shards import Heads, full_shape
from agent.engines.streams import chunk_pages

__all__ = ["HEAD_AXIS", "STREAM_IDLE_S", "Capturer"]

log = logging.getLogger("gpuckpt.sglang")

#: A stream with no word from the agent for this long is abandoned (its page files deleted).
STREAM_IDLE_S = 300.0
#: The KV heads' axis in a layer's page (``[2 (K, V), page_size, kv_heads, head_dim]``).
HEAD_AXIS = 2


class Capturer(WorkerService):
    """The capture methods of the linker (state set by the linker's ``__init__``)."""

    page_size: int
    max_staging: int
    copy_per_step: int
    _k: list[torch.Tensor]
    _v: list[torch.Tensor]
    _req_to_token: Any
    _scheduler: Any
    _disabled: str | None
    _tree: TreeIndex
    _step: int
    _seq: int
    stream: Stream | None
    _unpin: list[Pin]
    _last_plan: dict[str, Any]  # the last consistent point's planning, by phase (engine_stats)
    _rank: int  # this scheduler's tensor-parallel rank (0: the one the agent talks to)
    _tp: int
    _heads: Heads  # the KV heads this rank's pools hold

    # ------------------------------------------------------------------ what tensor parallelism changes
    # (the defaults are a single rank's; :class:`.ranks.TensorParallel` overrides them)

    def _skip_keys(self) -> set[bytes]:
        """The keys an incremental capture leaves out (the repository holds them)."""
        return self.offers.durable

    def _stream_tag(self) -> str:
        """What names this server's capture streams (the same on every rank)."""
        return str(os.getpid())

    def _stream_opened(self, st: Stream) -> None:
        """``st`` became :attr:`stream` (lock held)."""

    def _keeps_pins(self, st: Stream) -> bool:
        """Whether an ended ``st`` keeps its locks for the next announcement (lock held)."""
        return False

    # ------------------------------------------------------------------ engine state

    def _cache(self) -> Any:
        return getattr(self._scheduler, "tree_cache", None)

    def _walk(self) -> Walk:
        """The radix tree's full pages now (none without a tree: a linker hosted on bare pools).

        Tensor parallel: every rank's tree holds the same nodes, but the tree core walks a node's
        children in an order of its own process (its hash map's), so the ranks' walks list the same
        pages in different orders. The pages are put in page order (pool pages are allocated alike
        on every rank), and a page with no node of its own (a restore loaded it) is not pinned by
        a node below it — which one the walk meets first differs by rank too — but copied at the
        consistent point: every rank then locks the same nodes and cuts the same chunks."""
        core = getattr(self._cache(), "tree_core", None)
        if core is None or not hasattr(core, "walk_for_kv_canary"):
            empty = torch.empty(0, dtype=torch.int64)
            return Walk(empty, empty, 0, self._tree.generation)
        if self._tp == 1:
            return self._tree.walk(core)
        w = self._tree.walk(core, pin_below=False)
        order = torch.argsort(w.pages)
        return Walk(w.pages[order], w.pins[order], w.unnamed, w.generation)

    def _page_shape(self) -> tuple[int, ...]:
        k = self._k[0]
        return (len(self._k), 2, self.page_size, int(k.shape[1]), int(k.shape[2]))

    def _page_bytes(self) -> int:
        n = 1
        for d in self._page_shape():
            n *= d
        return n * self._k[0].element_size()

    def _stored_shape(self) -> tuple[int, ...]:
        """A stored page: every KV head of the model (``ckpt/FORMAT.md``), whatever this rank holds."""
        return full_shape(self._page_shape(), HEAD_AXIS, self._heads.total)

    def _stored_page_bytes(self) -> int:
        return self._page_bytes() // self._heads.count * self._heads.total

    def _dtype(self) -> str:
        return str(self._k[0].dtype).removeprefix("torch.")

    def _page_of(self, first_slot: int) -> int:
        if first_slot % self.page_size:
            raise ValueError(
                f"slot {first_slot} does not start a page of {self.page_size}: a KV pool gpuckpt cannot read"
            )
        return int(first_slot) // self.page_size

    def _live_pages(self, live: list[Any], entries: list[dict[str, Any]]) -> dict[bytes, Pending]:
        """The ledger's entries of ``live`` (appended to ``entries``) and their pages by key."""
        p = self.page_size
        pages: dict[bytes, Pending] = {}
        row = self._req_to_token.req_to_token
        for r in live:
            toks = state.tokens(r)
            n = state.kv_tokens(r)
            extra_key, salt = getattr(r, "extra_key", None), getattr(r, "cache_salt", None)
            entries.append(state.ledger_entry(r, n))
            # a prompt given as embeddings has made-up token ids: its pages have no key of their own
            if n <= 0 or getattr(r, "input_embeds", None) is not None:
                continue
            firsts = row[r.kv.req_pool_idx, :n:p].tolist()  # each page's first slot
            keys = state.page_keys(toks, n, p, extra_key, salt)
            for kh, first in zip(keys, firsts, strict=False):
                pages.setdefault(bytes.fromhex(kh), Pending(bytes.fromhex(kh), self._page_of(first)))
            rest = n - len(keys) * p
            if rest:
                tk = state.tail_key(keys[-1] if keys else None, toks[len(keys) * p : n], extra_key, salt)
                pages.setdefault(tk, Pending(tk, self._page_of(firsts[len(keys)]), valid=rest))
        return pages

    def _mutable(self, live_pages: dict[bytes, Pending], walk: Walk) -> dict[bytes, Pending]:
        """The live requests' pages that may change or be freed once their request moves on (decode
        KV, the tail, a prompt not inserted yet): all but those the walk holds at the same page,
        under the same key, with a pin — those are the tree's, and stream."""
        if not live_pages or walk.pages.numel() == 0:
            return dict(live_pages)
        where = torch.full((int(walk.pages.max()) + 1,), -1, dtype=torch.int64)
        where[walk.pages] = torch.arange(walk.pages.numel(), dtype=torch.int64)
        lp = torch.tensor([pg.page for pg in live_pages.values()], dtype=torch.int64)
        at = torch.full_like(lp, -1)
        inside = lp < where.numel()
        at[inside] = where[lp[inside]]
        pinned = torch.where(at >= 0, walk.pins[at.clamp(min=0)], torch.full_like(lp, NO_NODE)) != NO_NODE
        named = self._tree.key_of
        return {
            key: pg
            for (key, pg), held in zip(live_pages.items(), pinned.tolist(), strict=True)
            if not held or named.get(pg.page) != key
        }

    # ------------------------------------------------------------------ the consistent point

    def _capture(self, waiters: list[Waiter], live: list[Any]) -> None:
        """The consistent point: the ledger, the pages planned, the tree's nodes locked and chunk 0
        copied; its page file is written by a thread, whose completion answers ``waiters``."""
        if self._disabled:
            self.answer(waiters, {"ok": False, "error": f"gpuckpt cannot capture this server: {self._disabled}"})
            return
        t0 = time.monotonic()
        prefix_only = all(w.prefix_only for w in waiters)
        full = any(w.full for w in waiters)
        entries: list[dict[str, Any]] = []
        live_pages = {} if prefix_only else self._live_pages(live, entries)
        t_walk = time.monotonic()
        walk = self._walk()
        parts = {"live_s": t_walk - t0, "walk_s": time.monotonic() - t_walk}
        name = partial(self._tree.keys, generation=walk.generation)
        mutable = self._mutable(live_pages, walk)
        skip = set() if full else self._skip_keys()
        pages, pins = walk.pages, walk.pins
        skipped = dict.fromkeys(k for k in mutable if k in skip)
        if skip and pages.numel():  # an incremental capture: the durable tree pages are named now
            keys = name(pages.tolist())
            durable = [k in skip for k in keys]
            if any(durable):
                skipped.update(dict.fromkeys(k for k, d in zip(keys, durable, strict=True) if d and k not in mutable))
                gone = torch.tensor(durable, dtype=torch.bool)
                pages, pins = pages[~gone], pins[~gone]
        mutable = {k: v for k, v in mutable.items() if k not in skip}

        def now(loose: torch.Tensor) -> None:  # tree pages no lock holds: named and copied now
            for key, pg in zip(name(loose.tolist()), loose.tolist(), strict=True):
                mutable.setdefault(key, Pending(key, pg))

        held = pins != NO_NODE
        now(pages[~held])
        pages, pins = pages[held], pins[held]
        nodes, counts = torch.unique(pins, return_counts=True)
        cache = self._cache()
        locks: dict[int, Pin] = {}
        t_lock = time.monotonic()
        try:
            failed = []
            for node, count in zip(nodes.tolist(), counts.tolist(), strict=True):
                try:
                    locks[node] = Pin(cache.lock(node), count)
                except Exception:  # gone since it was offered: its pages are copied now
                    log.debug("gpuckpt: no lock on tree node %s", node, exc_info=True)
                    failed.append(node)
            if failed:
                gone = torch.isin(pins, torch.tensor(failed, dtype=torch.int64))
                now(pages[gone])
                pages, pins = pages[~gone], pins[~gone]
            parts["lock_s"] = time.monotonic() - t_lock
            pending = Planned(pages, pins, name)
            self._open_stream(waiters, entries, walk, mutable, pending, locks, list(skipped), t0, parts)
        except BaseException:
            with self.lock:
                owned = self.stream is not None and self.stream.pins is locks
            if not owned:  # an open stream releases its own locks as it ends
                self._unlock(list(locks.values()))
            raise

    def _open_stream(
        self,
        waiters: list[Waiter],
        entries: list[dict[str, Any]],
        walk: Walk,
        mutable: dict[bytes, Pending],
        pending: Planned,
        pins: dict[int, Pin],
        skipped: list[bytes],
        t0: float,
        parts: dict[str, float],
    ) -> None:
        """The capture's stream, with chunk 0 copied (``pins`` are the stream's once it is open);
        ``parts``: the planning's phases (seconds: the live requests, the tree walk, the locks)."""
        prefix_only = all(w.prefix_only for w in waiters)
        with self.lock:
            if self.stream is not None:
                self.end_stream(self.stream, "superseded by a new capture")
            self._seq += 1
            seq = self._seq
        w0 = waiters[0]
        bound = w0.max_staging or self.max_staging
        # sized by stored pages (every rank's heads): the staging bound holds every rank's files, and
        # every rank cuts the same chunks
        per_chunk, ring = chunk_pages(
            self._stored_page_bytes(), max_staging=bound, copy_per_step=w0.copy_per_step or self.copy_per_step
        )
        info: dict[str, Any] = {
            "seq": seq,
            "step": self._step,
            "pages": len(mutable) + len(pending),
            "prefix_pages": int(walk.pages.numel()),
            "unnamed_pages": walk.unnamed,
            "pinned_nodes": len(pins),
            "tail_pages": sum(1 for pg in mutable.values() if pg.valid is not None),
            "requests": len(entries),
            "inexact_requests": sum(1 for e in entries if e.get("inexact_reasons")),
            "left_requests": sum(1 for e in entries if ledger_mod.LEFT in e),
            "skipped": [k.hex() for k in skipped],
            "prefix_only": prefix_only,
            "plan_s": time.monotonic() - t0,
            "wait_s": t0 - min(w.requested for w in waiters),
        }
        self._last_plan = {"seq": seq, "pages": info["pages"], "plan_s": info["plan_s"], **parts}
        if not prefix_only and self._rank == 0:  # the ledger is rank 0's to give
            info["ledger"] = ledger_mod.make_ledger(entries, page_size=self.page_size).model_dump(by_alias=True)
        st = Stream(
            seq=seq,
            name=f"capture-{self._stream_tag()}-{seq}",
            directory=self.staging_dir,
            info=info,
            pending=pending,
            chunk_pages=per_chunk,
            page_bytes=self._stored_page_bytes(),
            max_staging=bound,
            ring=ring,
            prefix_only=prefix_only,
            idle_timeout=STREAM_IDLE_S,
            waiters=list(waiters),
            pins=pins,
            seen=set(mutable),
        )
        if len(mutable) > per_chunk:
            log.warning(
                "gpuckpt: capture %d: %d pages may change after the consistent point and are copied at it, "
                "more than a chunk within the staging bound of %d bytes",
                seq,
                len(mutable),
                bound,
            )
        t1 = time.monotonic()
        with self.lock:
            self.stream = st
            self._stream_opened(st)
            taken = self._take(st, max(0, per_chunk - len(mutable)))
            if taken is None:
                return
        self._copy_chunk(st, list(mutable.values()) + taken, t1)

    # ------------------------------------------------------------------ the later steps

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

    def _take(self, st: Stream, n: int | None = None) -> list[Pending] | None:
        """``st``'s next chunk, named (lock held); None if a page can no longer be named (the
        stream is ended: nothing is guessed)."""
        try:
            return st.take(n)
        except LookupError as exc:
            self.end_stream(st, f"naming pinned pages failed: {exc}")
            return None

    def _pump(self, st: Stream) -> None:
        """A stream's share of this step: the next chunk, if the staging bound has room."""
        with self.lock:
            if self.stream is not st:
                return
            if st.idle(time.monotonic()):
                self.end_stream(st, "no word from the agent")
                return
            if not st.can_issue():
                return
            t0 = time.monotonic()
            pages = self._take(st)
            if pages is None:
                return
        self._copy_chunk(st, pages, t0)

    def _copy_chunk(self, st: Stream, pages: list[Pending], t0: float) -> None:
        """Copy ``pages`` off the pools (the scheduler's pause), release the locks that held only
        them, and hand the page file's writing to a thread. The chunk's ``copy_s`` runs from ``t0``:
        its pages' naming (when they were taken) and their copy."""
        try:
            host = self._gather(pages)
        except BaseException as exc:
            with self.lock:
                self.end_stream(st, f"copying pages failed: {type(exc).__name__}: {exc}")
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

    def _pump_now(self, st: Stream) -> None:
        """Issue ``st``'s next chunk now, as rank 0 decided for every rank at this step (a
        tensor-parallel server: see :mod:`.ranks`); nothing when no page is left."""
        with self.lock:
            if st.last_chunk is not None:
                return
            t0 = time.monotonic()
            pages = self._take(st)
            if pages is None:
                return
        self._copy_chunk(st, pages, t0)

    def _write_chunk(self, st: Stream, k: int, pages: list[Pending], host: torch.Tensor, copy_s: float) -> None:
        """Write this rank's page file of chunk ``k`` (a thread) and report it (:meth:`_chunk_written`)."""
        t0 = time.monotonic()
        w = staging.PageWriter(
            self.staging_dir,
            f"{st.name}-c{k}" + (f"-r{self._rank}" if self._tp > 1 else ""),
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
            rec = {
                "rank": self._rank,
                "index": str(w.index_path),
                "head_axis": HEAD_AXIS,
                "total_kv_heads": self._heads.total,
                "kv_heads": [self._heads.start, self._heads.count],
                "device": str(self._k[0].device),
                "pages_written": len(idx.keys),
                "bytes": idx.page_bytes * len(idx.keys),
                "copy_s": copy_s,
                "write_s": time.monotonic() - t0,
            }
        except Exception as exc:
            w.abort()
            log.exception("gpuckpt: writing capture %d chunk %d failed", st.seq, k)
            rec = {"rank": self._rank, "error": f"{type(exc).__name__}: {exc}"}
        self._chunk_written(st, k, rec)

    def _chunk_written(self, st: Stream, k: int, rec: dict[str, Any]) -> None:
        """This rank's page file of chunk ``k`` is written (or failed)."""
        with self.lock:
            self._take_report(st, k, rec)

    def _take_report(self, st: Stream, k: int, rec: dict[str, Any]) -> None:
        """Rank ``rec["rank"]``'s page file of chunk ``k`` is written, or failed (lock held): once
        every rank's is, the chunk is complete — chunk 0 answers the capture call; a failure ends
        the stream. A file of a stream that ended meanwhile is deleted (nobody reads it)."""
        if self.stream is not st or st.error is not None:
            if rec.get("index"):
                staging.unlink_pair(str(rec["index"]))
            return
        if not st.report(k, int(rec["rank"]), rec, self._tp):
            return
        if rec.get("error"):  # the stream's error now names the chunk and the rank
            self.end_stream(st, f"chunk {k}, rank {rec['rank']}: {rec['error']}")
            return
        if k == 0:
            self.answer(st.waiters, self._first_reply(st))
            st.waiters = []
        self.cond.notify_all()

    def _first_reply(self, st: Stream) -> dict[str, Any]:
        """The capture call's answer: the consistent point's facts and chunk 0 (every rank's file)."""
        recs = list(st.reports[0].values())
        return {
            "ok": True,
            **st.info,
            **st.part(0),
            "index": st.reports[0][0]["index"],
            "tensor_parallel_size": self._tp,
            "copy_s": max(float(r["copy_s"]) for r in recs),
            "write_s": max(float(r["write_s"]) for r in recs),
            "bytes": sum(int(r["bytes"]) for r in recs),
            "pages_written": st.reports[0][0]["pages_written"],
            "chunk_pages": st.chunk_pages,
            "max_staging_bytes": st.max_staging,
        }

    # ------------------------------------------------------------------ the stream's end, the agent's calls

    def forget_waiter(self, w: Waiter) -> None:
        """A capture call gave up (lock held): a stream whose chunk 0 nobody awaits any more ends."""
        st = self.stream
        if st is not None and w in st.waiters:
            st.waiters.remove(w)
            if not st.waiters:
                self.end_stream(st, "the capture call timed out")

    def end_stream(self, st: Stream, error: str | None) -> None:
        """Close a capture stream (lock held): its locks go to the next boundary's release; with
        ``error``, delete what it staged and tell whoever waits for it. Ending it again does nothing."""
        if st.ended:
            return
        st.ended = True
        if error is not None:
            st.error = st.error or error
            for path in st.files():
                staging.unlink_pair(path)
            self.answer(st.waiters, {"ok": False, "error": f"capture {st.seq} failed: {st.error}"})
            log.warning("gpuckpt: capture %d ended: %s", st.seq, st.error)
        st.waiters = []
        if not self._keeps_pins(st):
            self._unpin.extend(st.take_pins())
        self.last_stream = {"seq": st.seq, "error": st.error, **st.summary()}
        if self.stream is st:
            self.stream = None
        self.cond.notify_all()
