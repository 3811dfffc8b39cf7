"""The agent side of every engine adapter: checkpoint a running worker into a
repository, and restore a checkpoint into a fresh one.

Both talk to the adapter inside the serving process (vLLM's connector,
:mod:`agent.engines.vllm.connector`; SGLang's cache linker,
:mod:`agent.engines.sglang.linker`) over its control socket, one protocol for
both, so they work the same for any engine and any way it is served; the heavy work (hashing, compression,
upload, download, verification) runs here, never in the serving process.

Restore order: read the manifest → ask the new worker for its pins → run the
compatibility rules (:func:`ckpt.decide`) → on a match, load and verify the
blocks into a page file and offer it to the connector → hand back the
requests to resubmit. On a refusal, the same requests are returned for a
cold replay, with the reasons. With a ``generate`` callable, the checkpoint
records the canary (:mod:`agent.engines.canary`) just before the
capture, and a warm restore re-runs it after the offer, before anything is
resubmitted: a different continuation withdraws the offer and turns the plan
cold (fail closed: never serve from a cache the new worker disagrees with).
Blocks that fail verification are not offered: the requests that needed them
recompute that part (never a wrong token).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from agent import fs
from agent.engines import canary as canary_mod
from agent.engines import control, ledgers, shards, staging
from agent.engines.base import TRUST_DOMAIN, Capture, RestorePlan, Resubmission, WorkerDescription
from agent.engines.offers import AWAIT_S, WANT_S
from agent.fs import Trust
from ckpt import (
    Block,
    BlockFailure,
    BlocksMissing,
    EngineMismatch,
    Existing,
    Ledger,
    Manifest,
    Pins,
    Policy,
    Repository,
    WorkerFacts,
    decide,
    host_facts,
)
from ckpt.compat import STRICT, RuleResult, rule_json
from ckpt.save import SaveOptions, SaveProgress

Socket = str | os.PathLike[str]
log = logging.getLogger("gpuckpt.driver")


def describe(sock: Socket, engine: str | None = None) -> WorkerDescription:
    """The worker's pins, layout and namespace; with ``engine``, :class:`ckpt.EngineMismatch` if it
    runs another engine (before anything else is asked of it)."""
    r = control.call(sock, "describe")
    desc = WorkerDescription(WorkerFacts.model_validate(r["facts"]), r["layout"], r["namespace"])
    if engine and desc.facts.engine and desc.facts.engine != engine:
        raise EngineMismatch(
            f"the worker on {sock} runs {desc.facts.engine}, not {engine} (the agent's `engine` setting)"
        )
    return desc


@dataclasses.dataclass(frozen=True)
class Staging:
    """Where the connector's page files may be, and who may own them: the staging directory the
    worker was configured with (``None``: any directory :func:`agent.fs.check_dir` accepts) and
    the accounts trusted with it (the shared group's, where worker and agent are two accounts)."""

    directory: str | os.PathLike[str] | None = None
    trust: Trust = dataclasses.field(default_factory=Trust.of)


def _not_restore_staging(index: str) -> None:
    """A capture's page file is never in a restore's staging: those are the agent's own files (a
    worker naming one would have the agent read and then delete its restore pages)."""
    restore_dirs = staging.default_dir(RESTORE_TAG).name  # gpuckpt-<uid>-restore-
    if Path(os.path.realpath(Path(index).parent)).name.startswith(restore_dirs):
        raise fs.UnsafePath(f"{index} is in a restore's staging, not a capture's; refusing it")


class _Chunk:
    """One chunk of a capture stream: every rank's page file of the same pages, opened and checked."""

    def __init__(self, reply: dict[str, Any], tp: int, where: Staging) -> None:
        self.number = int(reply.get("chunk", 0))
        self.recs = reply.get("shards") or [{"rank": 0, "index": reply["index"]}]
        self.files: list[staging.PageFile] = []
        try:
            for rec in self.recs:
                _not_restore_staging(rec["index"])
                # the connector names the files: only those in the staging directory, ours to read
                # read, never mapped: a file the worker truncates under a mapping would kill the agent
                self.files.append(
                    staging.PageFile(rec["index"], directory=where.directory, trust=where.trust, mapped=False)
                )
            first = self.files[0].index
            self.shard_shape = tuple(first.page_shape)
            self.head_axis = int(self.recs[0].get("head_axis", 0))
            self.total = int(self.recs[0].get("total_kv_heads", self.shard_shape[1 + self.head_axis]))
            for rec in self.recs:
                rec.setdefault("kv_heads", [0, self.shard_shape[1 + self.head_axis]])
            shards.check_cover(self.recs, self.total, tp)
            for rec, pf in zip(self.recs, self.files, strict=True):
                same = pf.index.keys == first.keys and tuple(pf.index.page_shape) == self.shard_shape
                if not same or pf.index.dtype != first.dtype:
                    raise shards.ShardError(
                        f"rank {rec['rank']}'s page file does not match rank 0's (keys, shape, dtype)"
                    )
            self.index = first
            self.shape = shards.full_shape(self.shard_shape, self.head_axis, self.total)
        except BaseException:
            self.close()
            raise

    def blocks(self) -> Iterator[Block]:
        joined = shards.join(
            [(v for _, v in pf.items()) for pf in self.files],
            self.recs,
            dtype=self.index.dtype,
            shard_shape=self.shard_shape,
            head_axis=self.head_axis,
            total=self.total,
        )
        for key, view in zip(self.index.keys, joined, strict=True):
            yield Block(key, view, self.index.dtype, self.shape)

    def close(self) -> None:
        """Unmap and delete this chunk's page files (a mapping a queued block still reads stays until
        that block is released: the save's own budget bounds those)."""
        for pf in self.files:
            pf.close()
            # only files that passed the checks: a path the reply names is not deleted on its word
            staging.unlink_pair(pf.index_path)


def capture(
    sock: Socket,
    timeout: float = 60.0,
    when: dict[str, int] | None = None,
    *,
    full: bool = False,
    prefix_only: bool = False,
    max_staging: int | None = None,
    copy_per_step: int | None = None,
    where: Staging | None = None,
) -> Capture:
    """Ask the connector for a snapshot at the next step boundary.

    The connector copies at that boundary what may change after it and the
    first share of the cached full blocks; the rest streams in chunks over
    the next steps, at most ``copy_per_step`` bytes a step, with at most
    ``max_staging`` bytes staged at once (the connector's settings when
    unset). Iterating ``pages`` reads each chunk, deletes it and asks for the
    next: a consumer that is slow to store pages holds the copying up
    (backpressure), never the staging bound. A full block evicted before its
    turn is left out (counted in ``stats["lost_pages"]``): whoever needs it
    recomputes it.

    A tensor-parallel worker answers with one page file per rank and chunk;
    their pages are joined here into stored pages holding every KV head
    (:mod:`agent.engines.shards`), so a checkpoint restores into any TP
    size. A chunk whose ranks' parts do not cover every head is refused
    (:class:`~agent.engines.shards.ShardError`, naming the rank). ``close``
    deletes every page file and cancels a stream not read to its end. With
    ``when`` (``{"live": n, "min_outputs": k}``) the capture is taken at the
    first step boundary where n unfinished requests have k outputs each. The
    capture is incremental: pages whose keys the connector holds for durable
    (acknowledged after a commit, or offered by a restore) are not copied and
    come as :class:`ckpt.Existing` blocks; ``full`` copies every page.
    ``prefix_only`` (a pre-copy) copies the cached full blocks that are not
    durable and records no ledger. Page files are read only from ``where``
    (see :class:`Staging`): a reply naming a file elsewhere, behind a
    symlink, or owned by an untrusted account is refused
    (:class:`agent.fs.UnsafePath`), and such a file is never deleted.
    """
    where = where or Staging()
    t0 = time.monotonic()
    r = control.call(
        sock,
        "capture",
        io_timeout=timeout + 5,
        timeout=timeout,
        when=when,
        full=full,
        prefix_only=prefix_only,
        max_staging=max_staging,
        copy_per_step=copy_per_step,
    )
    seq = int(r["seq"])
    tp = int(r.get("tensor_parallel_size", len(r.get("shards") or [1])))
    state: dict[str, Any] = {"chunk": None, "done": False}  # done: the connector closed the stream
    read: list[int] = []  # chunks read and deleted, to acknowledge with the next call

    def cancel() -> None:
        if not state["done"]:
            state["done"] = True
            try:
                control.call(sock, "cancel", seq=seq)
            except (OSError, control.ControlError) as exc:  # the connector abandons it after its idle timeout
                log.warning("could not cancel capture stream", extra={"seq": seq, "error": str(exc)})

    def close() -> None:
        ch = state["chunk"]
        state["chunk"] = None
        if ch is not None:
            ch.close()
        cancel()

    try:
        first = state["chunk"] = _Chunk(r, tp, where)
    except BaseException:
        cancel()
        raise
    skipped = [bytes.fromhex(k) for k in r.get("skipped") or []]
    lost = [bytes.fromhex(k) for k in r.get("lost") or []]
    keys = ("step", "pages", "prefix_pages", "tail_pages", "requests", "plan_s", "wait_s", "copy_s", "bytes")
    stats = {k: r[k] for k in keys if k in r}
    stats["write_s"] = r.get("write_s", 0.0)  # the worker's page-file write, off the engine's step
    stats["capture_s"] = time.monotonic() - t0  # to the consistent point's chunk
    stats["page_shape"] = list(first.shape)
    stats["page_dtype"] = first.index.dtype
    stats["layers"] = list(first.index.layers)
    stats["inexact_requests"] = r.get("inexact_requests", 0)
    stats["skipped_pages"] = len(skipped)
    stats["chunk_pages"] = r.get("chunk_pages")
    stats["max_staging_bytes"] = r.get("max_staging_bytes")
    stats["shards"] = [
        {k: rec[k] for k in ("rank", "device", "kv_heads", "pages_written", "bytes", "copy_s") if k in rec}
        for rec in first.recs
    ]
    stats["head_axis"] = first.head_axis
    stats["tensor_parallel_size"] = tp

    def pages() -> Iterator[Block | Existing]:
        todo: list[dict[str, Any]] = []  # chunks handed over, not yet read
        ch: _Chunk | None = first
        copied = copied_bytes = 0
        while True:
            if ch is not None:
                if tuple(ch.shape) != tuple(first.shape) or ch.index.dtype != first.index.dtype:
                    raise shards.ShardError(f"chunk {ch.number}'s pages {ch.shape} differ from chunk 0's {first.shape}")
                for b in ch.blocks():
                    copied += 1
                    copied_bytes += b.nbytes
                    yield b
                read.append(ch.number)
                state["chunk"] = None
                ch.close()
            if todo:
                part = todo.pop(0)
                ch = state["chunk"] = _Chunk(part, tp, where)
                continue
            ch = None
            # one round trip acknowledges what was read and brings every chunk complete since
            reply = control.call(sock, "next", io_timeout=timeout + 5, seq=seq, ack=read, timeout=timeout)
            read.clear()
            if reply.get("done"):
                state["done"] = True
                for k in ("chunks", "lost_pages", "staged_peak_bytes", "max_chunk_copy_s", "mean_chunk_latency_s"):
                    if k in reply:
                        stats[k] = reply[k]
                break
            parts = reply.get("parts") or []
            if not parts:
                raise control.ControlError(f"capture {seq}: the connector answered with no chunk")
            for part in parts:
                lost.extend(bytes.fromhex(k) for k in part.get("lost") or [])
                todo.append(part)
        stats["pages"] = copied  # copied and stored; planned pages that were evicted first are lost
        stats["bytes"] = copied_bytes
        stats["lost_pages"] = len(lost)
        stats["stream_s"] = time.monotonic() - t0
        for key in skipped:  # durable: the repository holds them (or the save says it does not)
            yield Existing(key, first.index.dtype, tuple(first.shape))

    ledger = Ledger.model_validate(r["ledger"]) if r.get("ledger") is not None else None
    return Capture(pages(), ledger, stats, close)


#: how long a restore's blocks stay offered (for conversations whose next turn comes later)
DEFAULT_OFFER_TTL = 600.0
RESTORE_TAG = "restore-"


def checkpoint(
    sock: Socket,
    repo: Repository,
    worker_id: str,
    *,
    labels: dict[str, str] | None = None,
    timeout: float = 60.0,
    generate: canary_mod.Generate | None = None,
    deadline: float | None = None,
    progress: Callable[[SaveProgress], None] | None = None,
    on_captured: Callable[[dict[str, Any]], None] | None = None,
    canary: dict[str, Any] | None = None,
    when: dict[str, int] | None = None,
    cancel: threading.Event | None = None,
    max_staging: int | None = None,
    copy_per_step: int | None = None,
    where: Staging | None = None,
    stats: dict[str, Any] | None = None,
    engine: str | None = None,
    trust_domain: str | None = None,
) -> Manifest:
    """Capture the worker behind ``sock`` and save it; returns the visible manifest.

    Blocks deduplicate by key only within ``trust_domain`` (default: the
    worker itself, ``worker_id``): see :meth:`WorkerDescription.in_domain`.

    ``stats``, when given, receives the checkpoint's timings and counts (the
    capture's, the save's, the canary's): pause, copy, staging peak.

    ``generate(prompt_ids, n)`` (greedy, on this worker) records the canary
    just before the capture; without it the manifest has no canary.
    ``deadline`` (a ``time.monotonic()`` value) bounds the capture and the
    save: past it the checkpoint is abandoned (:class:`ckpt.OperationAborted`)
    and nothing becomes visible. ``on_captured(stats)`` is called once the
    worker's pages are staged (the worker is no longer involved).
    ``canary`` is a record from an earlier :func:`canary.record` on this
    worker, reused instead of probing again (the agent records it once: a
    probe costs engine steps, which a final checkpoint cannot spare).
    ``cancel`` abandons the save when set (nothing becomes visible).
    ``max_staging`` bounds the host memory the capture's pages take at once
    (page files staged by the worker plus pages of read ones still queued
    in the save), ``copy_per_step`` the bytes the worker copies per step
    after the consistent point (see :func:`capture`); the connector's
    settings when unset.
    """
    if deadline is not None:
        timeout = max(0.1, min(timeout, deadline - time.monotonic()))
    desc = describe(sock, engine)
    t_canary = time.monotonic()
    if canary is None and generate is not None:
        canary = canary_mod.record(generate)
    canary_s = time.monotonic() - t_canary
    cap = capture(sock, timeout, when, max_staging=max_staging, copy_per_step=copy_per_step, where=where)
    if on_captured is not None:
        on_captured(dict(cap.stats))
    recaptured = 0
    while True:
        try:
            t0 = time.monotonic()
            layout = {
                **desc.layout,
                "page_shape": cap.stats["page_shape"],
                "page_dtype": cap.stats["page_dtype"],
                "page_layers": cap.stats["layers"],
                "head_axis": cap.stats["head_axis"],
                # which rank held which heads when the checkpoint was taken
                "shards": cap.stats["shards"],
            }
            m = repo.save(
                cap.pages,
                options=_save_options(repo, cap),
                worker_id=worker_id,
                namespace=desc.in_domain(trust_domain or worker_id),
                pins=Pins(host=host_facts(), worker=desc.facts),
                layout=layout,
                ledger=cap.ledger,
                labels=labels,
                canary=canary,
                deadline=deadline,
                progress=progress,
                cancel=cancel,
            )
            timings = {**cap.stats, "save_s": time.monotonic() - t0, "canary_s": canary_s, "recaptured": recaptured}
            break
        except BlocksMissing as exc:
            # Keys the connector took for durable that the repository no longer holds (gc, another
            # repository): the connector forgets them and a capture at the next step boundary
            # copies them — never a checkpoint that names what is not stored.
            if recaptured:
                raise
            recaptured = len(exc.keys)
            control.call(sock, "durable", remove=[k.hex() for k in exc.keys])
        finally:
            cap.close()
        remaining = timeout if deadline is None else max(0.1, min(timeout, deadline - time.monotonic()))
        cap = capture(sock, remaining, None, max_staging=max_staging, copy_per_step=copy_per_step, where=where)
    # The repository holds every key of the checkpoint now: the next capture need not copy them.
    try:
        control.call(sock, "durable", add=sorted({b.key for b in m.blocks}))
    except (OSError, control.ControlError) as exc:  # only costs the next capture a full copy
        log.warning("could not acknowledge durable keys", extra={"error": str(exc)})
    if stats is not None:
        stats.update(timings)
    return m


def _save_options(repo: Repository, cap: Capture) -> SaveOptions:
    """The repository's save options, with the save's queue of read chunks' pages held to half the
    capture's staging bound (those pages are still mapped staging)."""
    opts = repo.default_save_options()
    bound = cap.stats.get("max_staging_bytes")
    return dataclasses.replace(opts, max_queued_raw=staging.save_queue_bound(int(bound))) if bound else opts


def _failures(errors: list[BlockFailure]) -> list[str]:
    return [f"{f.key.hex()[:16]}: {f.error}" for f in errors]


def precopy(
    sock: Socket,
    repo: Repository,
    *,
    timeout: float = 60.0,
    copy_per_step: int | None = None,
    max_staging: int | None = None,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
    where: Staging | None = None,
    engine: str | None = None,
    trust_domain: str,
) -> dict[str, Any]:
    """Store the worker's cached full blocks the repository does not hold yet, between checkpoints
    (in ``trust_domain``: the one its checkpoints use, or they cannot deduplicate against them).

    Full blocks do not change while cached, so they can be stored ahead of
    the checkpoint that names them: the worker copies them a bounded
    ``copy_per_step`` bytes per step (serving goes on), the repository stores
    them without a manifest (:meth:`ckpt.Repository.store_blocks`) and the
    connector then holds them for durable, so the next checkpoint copies only
    what changed since. A checkpoint's capture supersedes a pre-copy in
    flight (the pre-copy then fails and stores nothing more). Returns counts.
    """
    t0 = time.monotonic()
    desc = describe(sock, engine)
    cap = capture(
        sock, timeout, None, prefix_only=True, copy_per_step=copy_per_step, max_staging=max_staging, where=where
    )
    keys: list[bytes] = []

    def pages() -> Iterator[Block | Existing]:
        for b in cap.pages:
            keys.append(b.key)
            yield b

    try:
        out = repo.store_blocks(
            pages(),
            namespace=desc.in_domain(trust_domain),
            deadline=deadline,
            cancel=cancel,
            options=_save_options(repo, cap),
        )
    finally:
        cap.close()
    if keys:
        control.call(sock, "durable", add=sorted(k.hex() for k in keys))
    return {
        **out,
        **{k: cap.stats.get(k) for k in ("lost_pages", "chunks", "staged_peak_bytes")},
        "total_s": time.monotonic() - t0,
    }


def _request_states(m: Manifest, *, warm: bool) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """What each ledger entry needs beyond its tokens, by request id, and why some cannot have it
    (the ledger's own engine package judges: :func:`agent.engines.ledgers.format_of`)."""
    if m.ledger is None:
        return {}, {}
    return ledgers.format_of(m.ledger).request_states(m.ledger, warm=warm)


def _annotate(requests: list[Resubmission], problems: dict[str, list[str]]) -> list[Resubmission]:
    out = []
    for r in requests:
        extra = problems.get(r.request_id, [])
        if extra:
            reasons = (*r.reasons, *extra)
            r = dataclasses.replace(r, exact=False, reasons=reasons)
        out.append(r)
    return out


def _offer_states(sock: Socket, states: dict[str, dict[str, Any]], problems: dict[str, list[str]]) -> int:
    """Offer request states alone (no pages); the connector's rejections become per-request problems."""
    if not states:
        return 0
    reply = control.call(sock, "offer", index=None, requests=states)
    for cid, why in (reply.get("rejected") or {}).items():
        problems.setdefault(cid, []).append(f"request state rejected by the worker: {why}")
    return int(reply.get("requests", 0))


#: when a streaming restore's resubmitted requests run (see :func:`restore`)
Release = Literal["each", "together"]

#: pages per restore page file of the rest of a streaming restore (each offered once verified)
RESTORE_CHUNK_BYTES = 64 << 20
#: the rest of a streaming restore (the prefix cache) starts once the resubmitted requests have
#: each produced a token, or this long after the probe passed if they have not: its reads would
#: otherwise take the host's cores (and the worker's bus) from their first steps
REST_AFTER_S = 2.0


def default_restore_staging(directory: Path) -> int:
    """The default bound on a restore's staging: half of what the staging filesystem has free."""
    try:
        st = os.statvfs(directory if directory.exists() else directory.parent)
        return max(RESTORE_CHUNK_BYTES, st.f_bavail * st.f_frsize // 2)
    except OSError:
        return 4 << 30


def _first_keys(sock: Socket, m: Manifest) -> tuple[list[tuple[str, list[bytes]]], list[bytes]]:
    """The checkpoint's pages each resubmitted request reads — (client id, keys), in the ledger's
    order — and those the canary probe reads: keys computed by the new worker's engine from their
    tokens (the ``keys`` command)."""
    if m.ledger is None and m.canary is None:
        return [], []
    reqs = ledgers.format_of(m.ledger).key_requests(m.ledger) if m.ledger is not None else []
    ids = [str(r.pop("request_id", "")) for r in reqs]
    if m.canary is not None:
        toks = list(m.canary.get("prompt_token_ids", [])) + list(m.canary.get("expected", []))
        reqs.append({"token_ids": toks, "kv_tokens": max(0, len(toks) - 1), "cache_salt": None})
    try:
        got = control.call(sock, "keys", requests=reqs).get("keys") or []
    except control.ControlError as exc:  # an older connector: no order, the whole checkpoint at once
        log.warning("the worker cannot name the in-flight pages", extra={"error": str(exc)})
        return [], []
    have = {r.key for r in m.blocks}

    def held(keys: list[str]) -> list[bytes]:
        return list(dict.fromkeys(bytes.fromhex(k) for k in keys if k in have))

    per_request = [(cid, held(keys)) for cid, keys in zip(ids, got, strict=False)]
    probe = held(got[len(ids)]) if m.canary is not None and len(got) > len(ids) else []
    return per_request, probe


def _page_writer(m: Manifest, out: Staging, name: str) -> staging.PageWriter:
    """A restore page file ``name`` in ``out`` for checkpoint ``m``'s pages."""
    assert out.directory is not None
    return staging.PageWriter(
        out.directory,
        name,
        dtype=m.layout["page_dtype"],
        page_shape=m.layout["page_shape"],
        layers=m.layout["page_layers"],
        trust=out.trust,
    )


def _write_pages(
    repo: Repository, m: Manifest, keys: list[bytes] | None, out: Staging, name: str, errors: list[BlockFailure]
) -> tuple[staging.PageWriter, int]:
    """Load and verify ``keys`` (None: every block) into page file ``name``; returns it committed."""
    w = _page_writer(m, out, name)
    try:
        for lb in repo.load(m, keys=keys, errors=errors):
            w.write(lb.key, lb.data)
        idx = w.commit()
    except BaseException:
        w.abort()
        raise
    return w, len(idx.keys)


def _probe(canary: dict[str, Any], generate: canary_mod.Generate) -> tuple[bool, list[int], str | None, float]:
    """Run the canary probe: (match, tokens got, why not, seconds). A probe that cannot run fails."""
    t = time.monotonic()
    try:
        ok, got, why = canary_mod.check(canary, generate)
    except Exception as exc:
        ok, got, why = False, [], f"canary: probe failed: {type(exc).__name__}: {exc}"
    return ok, list(got), why, time.monotonic() - t


def _offer_file(
    sock: Socket,
    w: staging.PageWriter | None,
    generation: int,
    ready: list[str] | None = None,
    *,
    done: bool = False,
    coming: list[bytes] | None = None,
) -> dict[str, Any]:
    """Offer committed page file ``w`` (None: no pages) as a later part of offer ``generation``;
    ``ready`` are requests whose pages are all offered (or failed) now, ``coming`` the pages later
    parts bring, ``done`` says no part follows. Returns the worker's reply: ``offered`` (the
    blocks it took) and ``wanted`` (hex keys requests wait on, when it says). A refused part (the
    offer ended: the connector deleted it; or the worker refused it) raises
    :class:`control.ControlError`, its file deleted either way."""
    index = str(w.index_path) if w is not None else None
    extra: dict[str, Any] = {"done": True} if done else {}
    if coming is not None:
        extra.update(coming=[k.hex() for k in coming], want_s=WANT_S)
    try:
        return control.call(sock, "offer", index=index, generation=generation, ready=ready or [], **extra)
    except BaseException:
        if w is not None:
            staging.unlink_pair(w.index_path)  # refused: still ours to delete
        raise


class _RestoreRest:
    """The rest of a streaming restore, behind its first part, on a thread of its own.

    First the in-flight requests' pages, request by request, beside the
    canary probe: loads of 1, 2, 4, … requests' pages in the requests'
    order, cut into a page file each time a request's pages are complete,
    which is
    offered naming that request ``ready`` (a worker holds a resubmitted
    request until then — see the connector's ``awaiting``). Then, once
    ``go`` is set (the probe passed), the prefix cache: the worker is told
    which blocks come (``coming``), then page files of verified blocks are
    offered one by one (``keys``: those within the staging bound). Blocks
    the worker's requests wait on (a reply's ``wanted``: a returning
    conversation whose history has not arrived) go into the next part, ahead
    of the rest. Stops when the offer ends (withdrawn, expired:
    the connector refuses a later part by its generation) or :meth:`stop`
    is called; then, or once all is offered, tells the worker that nothing
    more comes (a part with ``done``).
    """

    def __init__(
        self,
        repo: Repository,
        m: Manifest,
        sock: Socket,
        waiting: list[tuple[str, list[bytes]]],
        keys: list[bytes],
        out: Staging,
        generation: int,
        not_offered: int,
        go: threading.Event,
        each: bool = True,
        resubmitted: int = 0,
    ) -> None:
        self.offered = 0
        self.stats: dict[str, Any] = {
            "blocks": 0,
            "failed_blocks": 0,
            "failures": [],
            "parts": 0,
            "not_offered": not_offered,
            "inflight_blocks": 0,
            "inflight_parts": 0,
            "wanted_blocks": 0,
        }
        self.inflight_done = threading.Event()  # every in-flight request's pages offered (or failed)
        self._repo, self._m, self._sock, self._out = repo, m, sock, out
        self._keys, self._generation = keys, generation
        self._waiting = waiting
        self._front: dict[bytes, None] = {}  # blocks a request waits on: the next part's first
        self._each = each
        self._resubmitted = resubmitted
        self._go = go
        self._stopped = threading.Event()
        self._seq = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuckpt-restore-rest", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def stop(self) -> None:
        """Offer nothing more (a failed canary: the offer is withdrawn)."""
        self._stopped.set()
        self._go.set()

    def _writer(self) -> staging.PageWriter:
        self._seq += 1
        return _page_writer(self._m, self._out, f"restore-{self._m.id}-{self._seq}")

    def _part(self, w: staging.PageWriter | None, ready: list[str], *, inflight: bool) -> None:
        """Commit and offer ``w`` (if it holds pages) naming ``ready``."""
        n = 0
        if w is not None:
            n = len(w.keys)
            if n:
                w.commit()
            else:
                w.abort()
                w = None
        if w is None and not ready:
            return
        reply = _offer_file(self._sock, w, self._generation, ready)
        self.offered += int(reply.get("offered", 0))
        for k in reply.get("wanted") or ():
            self._front[bytes.fromhex(k)] = None
        if n:
            self.stats["blocks"] += n
            self.stats["parts"] += 1
            if inflight:
                self.stats["inflight_blocks"] += n
                self.stats["inflight_parts"] += 1

    def _requests(self, waiting: list[tuple[str, list[bytes]]], done: set[bytes]) -> None:
        """Load the pages of ``waiting`` requests not in ``done``, in their order, offering a part
        each time some request's pages are all in (or failed)."""
        need: dict[str, set[bytes]] = {cid: set(ks) - done for cid, ks in waiting}
        by_key: dict[bytes, list[str]] = {}
        for cid in need:
            for k in need[cid]:
                by_key.setdefault(k, []).append(cid)
        ready = [cid for cid, ks in need.items() if not ks]
        order = list(dict.fromkeys(k for cid, ks in waiting for k in ks if k in by_key))
        errors: list[BlockFailure] = []
        seen_errors = 0
        w: staging.PageWriter | None = self._writer()

        def settle(key: bytes) -> None:
            done.add(key)
            for cid in by_key.pop(key, ()):
                need[cid].discard(key)
                if not need[cid]:
                    ready.append(cid)

        try:
            for lb in self._repo.load(self._m, keys=order, errors=errors) if order else ():
                if self._stopped.is_set():
                    return
                assert w is not None
                w.write(lb.key, lb.data)
                settle(lb.key)
                for f in errors[seen_errors:]:
                    settle(f.key)
                seen_errors = len(errors)
                if ready:
                    self._part(w, ready, inflight=True)
                    ready, w = [], self._writer()
            for f in errors[seen_errors:]:
                settle(f.key)
            self._part(w, ready + [cid for cid, ks in need.items() if ks], inflight=True)
            w = None
        finally:
            self._close(w, errors)

    def _after_resumed(self) -> None:
        """Wait (at most :data:`REST_AFTER_S`) until the resubmitted requests each produced a token."""
        t = time.monotonic()
        try:
            wait_until(self._sock, live=self._resubmitted, min_outputs=1, timeout=REST_AFTER_S)
        except control.ControlError as exc:  # not in time (not resubmitted yet, or some failed): go on
            self.stats["rest_wait"] = str(exc)[:200]
        self.stats["rest_waited_s"] = time.monotonic() - t

    def _close(self, w: staging.PageWriter | None, errors: list[BlockFailure]) -> None:
        """After a load: an unoffered page file deleted, its failed blocks counted."""
        if w is not None:
            w.abort()
        self.stats["failed_blocks"] += len(errors)
        self.stats["failures"] += _failures(errors)[:10]

    def _run(self) -> None:
        m, keys = self._m, self._keys
        t0 = time.monotonic()
        page = max(1, m.blocks[0].raw_length if m.blocks else 1)
        per_part = max(1, RESTORE_CHUNK_BYTES // page)
        try:
            if self._waiting:
                done: set[bytes] = set()
                # In waves of 1, 2, 4, … requests: one load shares its reads out over every range it
                # is given, so all of its requests' pages arrive together, no sooner than the last's;
                # doubling waves keep the reads parallel and still free the first requests first.
                # Released together (``each`` false), they are one load: the most parallel reads.
                i, wave = 0, 1 if self._each else len(self._waiting)
                while i < len(self._waiting):
                    self._requests(self._waiting[i : i + wave], done)
                    if not i:
                        self.stats["first_request_s"] = time.monotonic() - t0
                    i, wave = i + wave, wave * 2
                self.stats["inflight_s"] = time.monotonic() - t0
            self.inflight_done.set()
            if keys:
                # what the rest brings (here, off the in-flight requests' path): a request that needs
                # it waits for it and asks for it
                _offer_file(self._sock, None, self._generation, coming=keys)
            self._go.wait()  # the prefix cache once the probe passed
            if self._stopped.is_set():
                return
            if keys and self._resubmitted:
                self._after_resumed()
            pending = dict.fromkeys(keys)
            while pending:
                # blocks a request waits on first (the worker's word since the last part; what does not
                # fit it names again: a waiting request asks at every step), then in order
                batch = [k for k in self._front if k in pending][:per_part]
                self._front = {}
                self.stats["wanted_blocks"] += len(batch)
                for k in batch:
                    del pending[k]
                more = list(itertools.islice(pending, per_part - len(batch)))
                for k in more:
                    del pending[k]
                batch += more
                errors: list[BlockFailure] = []
                w: staging.PageWriter | None = self._writer()
                try:
                    for lb in self._repo.load(m, keys=batch, errors=errors):
                        assert w is not None
                        if self._stopped.is_set():
                            return
                        w.write(lb.key, lb.data)
                    self._part(w, [], inflight=False)
                    w = None
                finally:
                    self._close(w, errors)
        except control.ControlError as exc:  # the offer ended, or the worker refused a part
            self.stats["ended"] = str(exc)
        except Exception as exc:  # never harms the worker: what was offered stays, the rest recomputes
            log.exception("streaming the rest of a restore failed", extra={"checkpoint": m.id})
            self.stats["error"] = f"{type(exc).__name__}: {exc}"
            if not self.inflight_done.is_set():  # the held requests go on with what they have
                with contextlib.suppress(Exception):
                    _offer_file(self._sock, None, self._generation, [cid for cid, _ in self._waiting])
        finally:
            self.stats["rest_s"] = time.monotonic() - t0
            self.inflight_done.set()
            if keys and "ended" not in self.stats:  # told what comes: now nothing more does
                with contextlib.suppress(Exception):
                    _offer_file(self._sock, None, self._generation, done=True)
            self._done.set()


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether checkpoint ``checkpoint`` restores warm into a worker, and why not: the one
    verdict the CLI, the agent's API and :func:`restore` give, serialized one way (:meth:`to_json`)."""

    checkpoint: str
    warm: bool
    reasons: list[str]
    results: list[RuleResult]
    policy: Policy
    requests: int
    blocks: int

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "warm": self.warm,
            "reasons": list(self.reasons),
            "requests": self.requests,
            "blocks": self.blocks,
            "results": [rule_json(r, self.policy) for r in self.results],
        }


def restore_decision(
    m: Manifest, desc: WorkerDescription, policy: Policy | None = None, trust_domain: str | None = None
) -> Decision:
    """The restore decision for checkpoint ``m`` and the worker ``desc`` describes, on this host:
    the pins' rules (:func:`ckpt.decide` under ``policy``), the block namespace, the trust domain
    and the TP shards. (The canary is judged by :func:`restore`, on the worker.)

    With ``trust_domain``, a checkpoint taken in another domain is refused by name: its bytes came
    from workers this one does not trust. A checkpoint that names no domain (an older agent's) is
    allowed: those deduplicated across every worker of the repository (docs/agent.md)."""
    policy = policy or STRICT
    decision = decide(m.pins, Pins(host=host_facts(), worker=desc.facts), policy)
    reasons = list(decision.reasons)
    fields = {k: v for k, v in m.namespace.items() if k != TRUST_DOMAIN}
    if fields != dict(desc.namespace_fields):
        reasons.append(f"namespace: checkpoint {fields} != worker {dict(desc.namespace_fields)}")
    theirs = m.namespace.get(TRUST_DOMAIN)
    if trust_domain is not None and theirs is not None and theirs != trust_domain:
        reasons.append(f"trust domain: checkpoint {theirs!r} != this worker's {trust_domain!r}")
    reasons += _shard_reasons(m)
    return Decision(
        m.id, not reasons, reasons, decision.results, policy, ledgers.request_count(m.ledger), m.sizes.blocks
    )


def restore(
    repo: Repository,
    ref: str,
    sock: Socket,
    *,
    staging_dir: str | os.PathLike[str] | None = None,
    policy: Policy = STRICT,
    generate: canary_mod.Generate | None = None,
    require_canary: bool = True,
    offer_ttl: float | None = DEFAULT_OFFER_TTL,
    max_staging: int | None = None,
    wait: bool = False,
    trust: Trust | None = None,
    engine: str | None = None,
    release: Release | None = None,
    trust_domain: str | None = None,
) -> RestorePlan:
    """Plan and prepare the restore of checkpoint ``ref`` into the worker behind ``sock``
    (with ``trust_domain``, a checkpoint of another trust domain is a cold plan that says so).

    Streaming, in-flight first: the pages the canary probe and the
    resubmitted requests read — keys the new worker computes from their
    tokens — are fetched, verified and offered first, request by request
    (:class:`_RestoreRest`). ``release`` says when the resubmitted requests
    run. ``"each"``: the plan is returned once the probe passed, and a
    worker that holds awaited requests (the offer's ``awaiting``; the vLLM
    connector does) runs each as soon as its own pages are offered, while
    later requests' pages still arrive. ``"together"``: the plan waits for
    every in-flight page (so does ``"each"`` with a worker that cannot hold
    requests). The default is ``"each"``, but ``"together"`` for a worker
    that computes on the host's CPU: there the requests running early take
    the cores the fetch of the others needs (2 cores, 16 requests, medians
    of three runs ÷ the whole fetch: the first request resumed at 0.22 with
    ``"each"`` and 0.35 together, but the median request at 1.2 against
    0.42; ``docs/benchmarks.md``). The prefix cache follows once the
    resubmitted requests have each produced a token (at most
    :data:`REST_AFTER_S` after the probe), in page files of verified blocks
    offered as each is written (``plan.rest``; ``plan.wait_offered()`` waits
    for it; ``wait`` does so before returning), up to ``max_staging`` bytes
    of staging in all (default: half the staging filesystem's free space);
    blocks past it are not offered and recompute when asked for. A request
    that needs blocks still to come waits for them briefly and the worker
    asks for them: they come in the next part (see :class:`_RestoreRest`).
    A block that fails verification is never offered: whoever needs it
    recomputes it.

    The page files go to ``staging_dir``; the connector owns each once
    offered and deletes them when the offer ends — :func:`withdraw`, or
    ``offer_ttl`` seconds after the first part (returning conversations find
    their prefix warm until then) — and they are deleted here on any failure
    before that.

    A warm restore is never handed back on an unchecked cache: unless
    ``require_canary`` is false, a checkpoint without a recorded canary, or
    a caller without ``generate``, gets a cold plan that says so.

    Returns the requests to resubmit either way; ``warm`` says whether the
    worker was offered the checkpoint's blocks, ``reasons`` why not. Each
    request carries ``exact`` / ``reasons``: a request the restore cannot
    continue from the exact next token (a ledger that judged it so, a seeded
    request on a cold plan, a state the worker rejected) is a cold replay of
    that request, and says why. With ``generate`` (greedy, on the new
    worker) and a canary in the manifest, the probe runs after the first
    part's offer, on the probe's own restored pages, while the requests'
    pages are fetched behind it; on a mismatch the offer is withdrawn (the
    rest is then refused) and the plan is cold.
    """
    t0 = time.monotonic()
    phases: dict[str, float] = {}  # where the time to the first offer goes (stats["phases"])

    def lap(name: str, since: float) -> float:
        now = time.monotonic()
        phases[name] = now - since
        return now

    m = repo.manifest(ref)
    t = lap("manifest_s", t0)
    requests = ledgers.format_of(m.ledger).resubmissions(m.ledger) if m.ledger is not None else []
    desc = describe(sock, engine)
    t = lap("describe_s", t)
    reasons = list(restore_decision(m, desc, policy, trust_domain).reasons)
    if require_canary and m.canary is None:
        reasons.append(f"canary: checkpoint {m.id} recorded no probe, so a warm restore could not be checked")
    elif require_canary and generate is None:
        reasons.append("canary: no worker API to run the probe on, so a warm restore could not be checked")

    def cold(why: list[str], stats: dict[str, Any]) -> RestorePlan:
        states, problems = _request_states(m, warm=False)
        stats["request_states"] = _offer_states(sock, states, problems)
        stats["plan_s"] = time.monotonic() - t0
        return RestorePlan(False, why, _annotate(requests, problems), stats=stats)

    if reasons:
        return cold(reasons, {})
    states, problems = _request_states(m, warm=True)
    out_dir = Path(staging_dir) if staging_dir else staging.default_dir(f"{RESTORE_TAG}{os.getpid()}")
    # the worker reads these files: with two accounts, through the shared group (see agent.fs)
    out = Staging(out_dir, trust or Trust.of())
    budget = max_staging if max_staging is not None else default_restore_staging(out_dir)
    t = time.monotonic()
    per_request, probe_keys = _first_keys(sock, m)
    t = lap("keys_s", t)
    page = max(1, m.blocks[0].raw_length if m.blocks else 1)
    probing = m.canary is not None and generate is not None
    if not probing:
        probe_keys = []  # the probe's pages are then part of the prefix cache like any other
    first = list(dict.fromkeys([*probe_keys, *(k for _, ks in per_request for k in ks)]))
    if len(first) * page > budget:
        first = first[: budget // page]
    chosen = set(first)
    rest = [] if not first else [k for k in (bytes.fromhex(r.key) for r in m.blocks) if k not in chosen]
    # The first part: the probe's own pages (it runs on them while the requests' pages are fetched
    # behind it; no request is resubmitted before it passed: the plan is returned after it), or
    # without a probe the first request's. Without an order (no in-flight request, an older
    # worker) the whole checkpoint is one part.
    waiting = [(cid, [k for k in ks if k in chosen]) for cid, ks in per_request]
    waiting = [(cid, ks) for cid, ks in waiting if ks]
    if not first:
        part0: list[bytes] | None = None
    elif probing:
        part0 = [k for k in probe_keys if k in chosen]
    else:
        part0 = waiting[0][1] if waiting else []
    in_part0 = set(part0 or ())
    waiting = [(cid, ks) for cid, ks in waiting if not set(ks) <= in_part0]
    errors: list[BlockFailure] = []
    w: staging.PageWriter | None = None
    n = 0
    if part0 is None or part0:
        w, n = _write_pages(repo, m, part0, out, f"restore-{m.id}-0", errors)
    stats: dict[str, Any] = {
        "phases": phases,
        "generators": sum(1 for st in states.values() if st.get("generator_state")),
    }

    def count() -> None:
        stats.update(blocks=n, first_blocks=n, failed_blocks=len(errors), failures=_failures(errors))
        stats["first_s"] = time.monotonic() - t0

    if errors and not n and not rest and not waiting:
        count()
        if w is not None:
            staging.unlink_pair(w.index_path)
        none_ok = f"no block of checkpoint {m.id} could be verified ({len(errors)} failed; first: {errors[0].error})"
        return cold([none_ok], stats)
    index = str(w.index_path) if w is not None and n else None
    if w is not None and not n:
        staging.unlink_pair(w.index_path)
    each = release == "each" or (release is None and desc.layout.get("device") != "cpu")
    allowed = max(0, (budget - len(first) * page) // page)
    not_offered = max(0, len(rest) - allowed)
    if not_offered:
        log.warning(
            "restore staging bound reached: the rest of the checkpoint is not offered",
            extra={"checkpoint": m.id, "not_offered": not_offered, "bound": budget},
        )
        rest = rest[:allowed]
    try:
        reply = control.call(
            sock,
            "offer",
            index=index,
            requests=states,
            ttl=offer_ttl,
            awaiting=[cid for cid, _ in waiting] if each else [],
            await_s=AWAIT_S,
        )
    except BaseException:
        if index is not None:
            staging.unlink_pair(index)  # not offered: still ours to delete
        raise
    offered = int(reply["offered"])
    generation = int(reply.get("generation", 0))
    # a worker that does not hold awaited requests gets every in-flight page before the plan
    holds = bool(reply.get("awaits"))
    for cid, rejected in (reply.get("rejected") or {}).items():
        problems.setdefault(cid, []).append(f"request state rejected by the worker: {rejected}")
    go = threading.Event()
    tail = None
    if waiting or rest:
        tail = _RestoreRest(
            repo,
            m,
            sock,
            waiting,
            rest,
            out,
            generation,
            not_offered,
            go,
            each=each and holds,
            resubmitted=len(requests),
        )
    count()
    if not probing:
        go.set()
        stats["canary"] = {"checked": False, "recorded": m.canary is not None}
    else:
        assert m.canary is not None
        assert generate is not None
        ok, got, why, secs = _probe(m.canary, generate)
        stats["canary"] = {
            "checked": True,
            "match": ok,
            "expected": list(m.canary.get("expected", [])),
            "got": got,
            "canary_s": secs,
            "on_restored_pages": n > 0,
        }
        if not ok:
            if tail is not None:
                tail.stop()
            control.call(sock, "withdraw")  # fail closed: nothing of this checkpoint is served
            stats["withdrawn"] = offered
            return cold([str(why)], stats)
        go.set()
    stats["release"] = "each" if each and holds else "together"
    if tail is not None and stats["release"] == "together":
        tail.inflight_done.wait()
    lap("fetch_s", t)
    stats["plan_s"] = time.monotonic() - t0
    plan = RestorePlan(True, [], _annotate(requests, problems), blocks_offered=offered, stats=stats, rest=tail)
    if wait:
        plan.wait_offered()
    return plan


def withdraw(sock: Socket) -> int:
    """End the worker's restore offer: no block or request state of it is used from the next step
    boundary on, and its page files are deleted; returns how many page files it held."""
    return int(control.call(sock, "withdraw").get("files", 0))


def sweep(sock: Socket) -> list[str]:
    """Ask the connector to delete capture page files no capture in flight owns (a killed agent's)."""
    return list(control.call(sock, "sweep").get("removed", []))


def sweep_restore_dirs() -> list[str]:
    """Delete this user's restore staging directories whose agent process is gone (a killed agent
    leaves its verified pages — users' KV — in ``/dev/shm``)."""
    return staging.sweep_dead(RESTORE_TAG)


def _shard_reasons(m: Manifest) -> list[str]:
    """Why the checkpoint's pages are not whole (a rank's part missing or inconsistent), naming the rank."""
    layout = m.layout
    recs = layout.get("shards")
    if recs is None:  # written before tensor parallelism was carried: one rank, whole pages
        return []
    try:
        total = int(layout["num_kv_heads"])
        tp = int(layout.get("tensor_parallel_size", len(recs)))
        shards.check_cover(recs, total, tp)
        head_axis = int(layout.get("head_axis", 0))
        if int(layout["page_shape"][1 + head_axis]) != total:
            raise shards.ShardError(f"stored pages hold {layout['page_shape'][1 + head_axis]} of {total} KV heads")
    except (shards.ShardError, KeyError, TypeError, ValueError, IndexError) as exc:
        return [f"tensor parallel: {exc}"]
    return []


def stats(sock: Socket) -> dict[str, Any]:
    """The connector's counters: tokens loaded per restored request, current step."""
    return control.call(sock, "stats")


def _around(sock: Socket, pending: str, call: Callable[[], Any], start: Callable[[], None], timeout: float) -> Any:
    """Run ``call`` (a blocking control call that registers a waiter) in a thread; once the
    connector counts it under ``pending``, run ``start``; return what ``call`` returned."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, name="gpuckpt-around", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    # the connector counts pending waiters: a condition, polled (no event crosses the socket)
    while t.is_alive() and int(stats(sock).get(pending, 0)) < 1:
        if time.monotonic() > deadline:
            raise control.ControlError(f"the connector did not register the waiter within {timeout:.0f} s")
        time.sleep(0.02)
    if errors:
        raise errors[0]
    start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


def checkpoint_around(
    sock: Socket,
    start: Callable[[], None],
    repo: Repository,
    worker_id: str,
    *,
    when: dict[str, int],
    timeout: float = 60.0,
    **kw: Any,
) -> Manifest:
    """Checkpoint traffic the caller makes: register a capture at condition ``when``, *then* call
    ``start()`` (which sends the requests), and return the checkpoint.

    The capture is pending in the connector before any of the traffic
    exists, so a condition the traffic meets only for a moment (every request
    live with k outputs) cannot pass before the capture is asked for, however
    busy the host — for tests, demos and benchmarks. Pair it with
    :func:`hold` so that the requests start at one step boundary.
    """
    m = _around(
        sock,
        "captures_pending",
        lambda: checkpoint(sock, repo, worker_id, when=when, timeout=timeout, **kw),
        start,
        timeout,
    )
    assert isinstance(m, Manifest)
    return m


def wait_around(
    sock: Socket, start: Callable[[], None], *, live: int, min_outputs: int = 0, timeout: float = 120.0
) -> dict[str, Any]:
    """:func:`wait_until`, registered before ``start()`` sends the traffic (see :func:`checkpoint_around`)."""
    r = _around(
        sock,
        "waits_pending",
        lambda: wait_until(sock, live=live, min_outputs=min_outputs, timeout=timeout),
        start,
        timeout,
    )
    assert isinstance(r, dict)
    return r


def hold(sock: Socket, requests: int, *, timeout: float = 60.0) -> None:
    """Hold new requests in the engine's queue until ``requests`` have arrived (or ``timeout`` s
    passed), then let them start at one step boundary."""
    control.call(sock, "hold", requests=requests, timeout=timeout)


def wait_until(sock: Socket, *, live: int, min_outputs: int = 0, timeout: float = 120.0) -> dict[str, Any]:
    """Block until a step boundary where ``live`` unfinished requests have ``min_outputs`` outputs each.

    The condition is judged by the connector on the engine's scheduler
    thread at every step, so it cannot be missed between two polls (requests
    that come and go between them); returns the step, live count and each
    request's outputs at that boundary.
    """
    when = {"live": live, "min_outputs": min_outputs}
    return control.call(sock, "wait", io_timeout=timeout + 5, timeout=timeout, when=when)
