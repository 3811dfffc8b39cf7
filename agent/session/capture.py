"""A capture: the worker's pages and ledger at one step boundary, streamed in chunks.

The worker half copies at that boundary what may change after it and the
first share of the cached full blocks; the rest streams in chunks over the
next steps (:func:`capture`). The heavy work (hashing, compression, upload)
is the consumer's, here in the agent, never the serving process's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from agent import fs
from agent.engines import shards, staging
from agent.engines.control import ControlError
from agent.engines.types import Capture, CaptureStats, Staging
from agent.session.restore_rest import RESTORE_TAG
from agent.session.worker import WorkerLike, reach
from ckpt import Block, Existing, Ledger

__all__ = ["capture"]

log = logging.getLogger("gpuckpt.session")


def _not_restore_staging(index: str) -> None:
    """A capture's page file is never in a restore's staging: those are the agent's own files (a
    worker naming one would have the agent read and then delete its restore pages)."""
    restore_dirs = staging.default_dir(RESTORE_TAG).name  # gpuckpt-<uid>-restore-
    if Path(os.path.realpath(Path(index).parent)).name.startswith(restore_dirs):
        raise fs.UnsafePath(f"{index} is in a restore's staging, not a capture's; refusing it")


class _Chunk:
    """One chunk of a capture stream: every rank's page file of the same pages, opened and checked."""

    def __init__(self, reply: Mapping[str, Any], tp: int, where: Staging) -> None:
        self.number = int(reply.get("chunk", 0))
        recs = reply.get("shards") or [{"rank": 0, "index": reply["index"]}]
        self.recs: list[dict[str, Any]] = [dict(r) for r in recs]
        self.files: list[staging.PageFile] = []
        try:
            for rec in self.recs:
                _not_restore_staging(rec["index"])
                # the worker names the files: only those in the staging directory, ours to read
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


#: the worker's reply fields a capture's stats carry as they came
_REPLY_STATS = ("step", "pages", "prefix_pages", "tail_pages", "requests", "plan_s", "wait_s", "copy_s", "bytes")
#: the stream's summary fields, from its last ``next`` reply
_DONE_STATS = ("chunks", "lost_pages", "staged_peak_bytes", "max_chunk_copy_s", "mean_chunk_latency_s")


def capture(
    worker: WorkerLike,
    timeout: float = 60.0,
    when: dict[str, int] | None = None,
    *,
    full: bool = False,
    prefix_only: bool = False,
    max_staging: int | None = None,
    copy_per_step: int | None = None,
    where: Staging | None = None,
) -> Capture:
    """Ask the worker half for a snapshot at the next step boundary.

    The worker copies at that boundary what may change after it and the
    first share of the cached full blocks; the rest streams in chunks over
    the next steps, at most ``copy_per_step`` bytes a step, with at most
    ``max_staging`` bytes staged at once (the worker's settings when unset).
    Iterating ``pages`` reads each chunk, deletes it and asks for the next:
    a consumer that is slow to store pages holds the copying up
    (backpressure), never the staging bound. A full block evicted before its
    turn is left out (counted in ``stats["lost_pages"]``): whoever needs it
    recomputes it.

    A tensor-parallel worker answers with one page file per rank and chunk;
    their pages are joined here into stored pages holding every KV head
    (:mod:`agent.engines.shards`), so a checkpoint restores into any TP
    size (a worker whose pages hold one slot per rank, ``page_heads``, into
    its own TP size only). A chunk whose ranks' parts do not cover every head is refused
    (:class:`~agent.engines.shards.ShardError`, naming the rank). ``close``
    deletes every page file and cancels a stream not read to its end. With
    ``when`` (``{"live": n, "min_outputs": k}``) the capture is taken at the
    first step boundary where n unfinished requests have k outputs each. The
    capture is incremental: pages whose keys the worker holds for durable
    (acknowledged after a commit, or offered by a restore) are not copied and
    come as :class:`ckpt.Existing` blocks; ``full`` copies every page.
    ``prefix_only`` (a pre-copy) copies the cached full blocks that are not
    durable and records no ledger. Page files are read only from ``where``
    (default: an Engine's staging; see :class:`~agent.engines.types.Staging`):
    a reply naming a file elsewhere, behind a symlink, or owned by an
    untrusted account is refused (:class:`agent.fs.UnsafePath`), and such a
    file is never deleted.
    """
    w = reach(worker, where=where)
    channel, where = w.channel, w.where
    t0 = time.monotonic()
    reply = channel.capture(
        when=when,
        full=full,
        prefix_only=prefix_only,
        max_staging=max_staging,
        copy_per_step=copy_per_step,
        timeout=timeout,
    )
    r = reply.raw
    seq = reply.seq
    tp = int(r.get("tensor_parallel_size", len(r.get("shards") or [1])))
    state: dict[str, Any] = {"chunk": None, "done": False}  # done: the worker closed the stream
    read: list[int] = []  # chunks read and deleted, to acknowledge with the next call

    def cancel() -> None:
        if not state["done"]:
            state["done"] = True
            try:
                channel.cancel(seq)
            except (OSError, ControlError) as exc:  # the worker abandons it after its idle timeout
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
    skipped = [bytes.fromhex(k) for k in reply.skipped]
    lost = [bytes.fromhex(k) for k in r.get("lost") or []]
    stats = CaptureStats()
    for k in _REPLY_STATS:
        if k in r:
            stats[k] = r[k]  # type: ignore[literal-required]
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
        todo: list[Mapping[str, Any]] = []  # chunks handed over, not yet read
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
            nxt = channel.next(seq=seq, ack=read, timeout=timeout)
            read.clear()
            if nxt.done:
                state["done"] = True
                for k in _DONE_STATS:
                    if k in nxt.raw:
                        stats[k] = nxt.raw[k]  # type: ignore[literal-required]
                break
            if not nxt.parts:
                raise ControlError(f"capture {seq}: the connector answered with no chunk")
            for part in nxt.parts:
                lost.extend(bytes.fromhex(k) for k in part.get("lost") or [])
                todo.append(part)
        stats["pages"] = copied  # copied and stored; planned pages that were evicted first are lost
        stats["bytes"] = copied_bytes
        stats["lost_pages"] = len(lost)
        stats["stream_s"] = time.monotonic() - t0
        for key in skipped:  # durable: the repository holds them (or the save says it does not)
            yield Existing(key, first.index.dtype, tuple(first.shape))

    ledger = Ledger.model_validate(reply.ledger) if reply.ledger is not None else None
    return Capture(pages(), ledger, stats, close)
