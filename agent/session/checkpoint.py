"""A checkpoint: capture a running worker and save it; and a pre-copy between checkpoints.

The heavy work (hashing, compression, upload) runs here, in the agent, as the
capture streams (:func:`agent.session.capture`); the worker only copies its
pages into page files. With a ``generate`` callable (or a ``canary`` record)
the checkpoint records the canary (:mod:`agent.engines.canary`) just before
the capture, which a warm restore re-runs on the new worker.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from agent.engines import canary as canary_mod
from agent.engines import staging
from agent.engines.control import ControlError
from agent.engines.types import Capture, CaptureStats, Checkpointed, CheckpointStats, PrecopyStats, Staging
from agent.session.capture import capture
from agent.session.worker import WorkerLike, describe, host_pins, reach
from ckpt import Block, BlocksMissing, Existing, Ledger, Pins, Repository
from ckpt.save import SaveOptions, SaveProgress

__all__ = ["CheckpointOptions", "checkpoint", "precopy"]

log = logging.getLogger("gpuckpt.session")


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """Everything a checkpoint (or a pre-copy) can be told; each field's use is in :func:`checkpoint`.

    The worker's side: ``where`` its page files may be (default: an Engine's staging, else any
    directory :func:`agent.fs.check_dir` accepts), the ``engine`` it must run (default: an
    Engine's name), ``timeout`` for each control call of the capture, ``when`` to capture,
    ``max_staging`` and ``copy_per_step`` (the worker's settings when unset). The checkpoint's:
    ``trust_domain`` (default: the worker itself), ``labels``, the canary (``generate`` or a
    ``canary`` record), ``deadline`` and ``cancel``, and the caller's hooks ``progress``,
    ``on_captured`` and ``complete_ledger`` (what only the worker's server knows of the captured
    requests — vLLM: the logprobs it gave out — added to the ledger before it is saved)."""

    labels: Mapping[str, str] | None = None
    timeout: float = 60.0
    generate: canary_mod.Generate | None = None
    canary: dict[str, Any] | None = None
    when: dict[str, int] | None = None
    deadline: float | None = None
    cancel: threading.Event | None = None
    progress: Callable[[SaveProgress], None] | None = None
    on_captured: Callable[[CaptureStats], None] | None = None
    complete_ledger: Callable[[Ledger], Ledger] | None = None
    max_staging: int | None = None
    copy_per_step: int | None = None
    trust_domain: str | None = None
    where: Staging | None = None
    engine: str | None = None

    def within(self, timeout: float) -> float:
        """``timeout``, shortened to what is left before the deadline (at least 0.1 s)."""
        return timeout if self.deadline is None else max(0.1, min(timeout, self.deadline - time.monotonic()))


def _save_options(repo: Repository, cap: Capture) -> SaveOptions:
    """The repository's save options, with the save's queue of read chunks' pages held to half the
    capture's staging bound (those pages are still mapped staging)."""
    opts = repo.default_save_options()
    bound = cap.stats.get("max_staging_bytes")
    return dataclasses.replace(opts, max_queued_raw=staging.save_queue_bound(int(bound))) if bound else opts


def checkpoint(
    worker: WorkerLike, repo: Repository, worker_id: str, options: CheckpointOptions | None = None, /, **fields: Any
) -> Checkpointed:
    """Capture ``worker`` and save it; returns the visible manifest and the checkpoint's stats
    (``fields``: any of :class:`CheckpointOptions`' as keywords, over ``options``).

    Blocks deduplicate by key only within ``trust_domain`` (default: the
    worker itself, ``worker_id``): see :meth:`WorkerDescription.in_domain`.

    The stats are the capture's, the save's and the canary's: pause, copy,
    staging peak (:class:`~agent.engines.types.CheckpointStats`).

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
    after the consistent point (see :func:`agent.session.capture`); the
    worker's settings when unset.
    """
    opts = dataclasses.replace(options or CheckpointOptions(), **fields)
    w = reach(worker, where=opts.where, engine=opts.engine)
    timeout = opts.within(opts.timeout)
    desc = describe(w.channel, w.engine)
    t_canary = time.monotonic()
    canary = opts.canary
    if canary is None and opts.generate is not None:
        canary = canary_mod.record(opts.generate)
    canary_s = time.monotonic() - t_canary

    def take(when: dict[str, int] | None, seconds: float) -> Capture:
        return capture(
            w.channel,
            seconds,
            when,
            max_staging=opts.max_staging,
            copy_per_step=opts.copy_per_step,
            where=w.where,
        )

    cap = take(opts.when, timeout)
    if opts.on_captured is not None:
        opts.on_captured(CaptureStats(**cap.stats))
    recaptured = 0
    labels = dict(opts.labels) if opts.labels is not None else None
    while True:
        try:
            t0 = time.monotonic()
            ledger = cap.ledger
            if ledger is not None and opts.complete_ledger is not None:
                ledger = opts.complete_ledger(ledger)
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
                namespace=desc.in_domain(opts.trust_domain or worker_id),
                pins=Pins(host=host_pins(desc), worker=desc.facts),
                layout=layout,
                ledger=ledger,
                labels=labels,
                canary=canary,
                deadline=opts.deadline,
                progress=opts.progress,
                cancel=opts.cancel,
            )
            stats = CheckpointStats(**cap.stats, save_s=time.monotonic() - t0, canary_s=canary_s, recaptured=recaptured)
            break
        except BlocksMissing as exc:
            # Keys the worker took for durable that the repository no longer holds (gc, another
            # repository): the worker forgets them and a capture at the next step boundary
            # copies them — never a checkpoint that names what is not stored.
            if recaptured:
                raise
            recaptured = len(exc.keys)
            w.channel.durable(remove=[k.hex() for k in exc.keys])
        finally:
            cap.close()
        cap = take(None, opts.within(timeout))
    # The repository holds every key of the checkpoint now: the next capture need not copy them.
    try:
        w.channel.durable(add=sorted({b.key for b in m.blocks}))
    except (OSError, ControlError) as exc:  # only costs the next capture a full copy
        log.warning("could not acknowledge durable keys", extra={"error": str(exc)})
    return Checkpointed(m, stats)


def precopy(
    worker: WorkerLike, repo: Repository, options: CheckpointOptions | None = None, /, **fields: Any
) -> PrecopyStats:
    """Store the worker's cached full blocks the repository does not hold yet, between checkpoints
    (in ``trust_domain``, which must be given: the one its checkpoints use, or they cannot
    deduplicate against them; ``fields``: :class:`CheckpointOptions`' as keywords).

    Full blocks do not change while cached, so they can be stored ahead of
    the checkpoint that names them: the worker copies them a bounded
    ``copy_per_step`` bytes per step (serving goes on), the repository stores
    them without a manifest (:meth:`ckpt.Repository.store_blocks`) and the
    worker then holds them for durable, so the next checkpoint copies only
    what changed since. A checkpoint's capture supersedes a pre-copy in
    flight (the pre-copy then fails and stores nothing more). Returns counts.
    """
    opts = dataclasses.replace(options or CheckpointOptions(), **fields)
    if opts.trust_domain is None:
        raise TypeError("precopy needs the trust_domain its checkpoints use")
    w = reach(worker, where=opts.where, engine=opts.engine)
    t0 = time.monotonic()
    desc = describe(w.channel, w.engine)
    cap = capture(
        w.channel,
        opts.timeout,
        None,
        prefix_only=True,
        copy_per_step=opts.copy_per_step,
        max_staging=opts.max_staging,
        where=w.where,
    )
    keys: list[bytes] = []

    def pages() -> Iterator[Block | Existing]:
        for b in cap.pages:
            keys.append(b.key)
            yield b

    try:
        out = repo.store_blocks(
            pages(),
            namespace=desc.in_domain(opts.trust_domain),
            deadline=opts.deadline,
            cancel=opts.cancel,
            options=_save_options(repo, cap),
        )
    finally:
        cap.close()
    if keys:
        w.channel.durable(add=sorted(k.hex() for k in keys))
    stats = PrecopyStats(
        lost_pages=cap.stats.get("lost_pages"),
        chunks=cap.stats.get("chunks"),
        staged_peak_bytes=cap.stats.get("staged_peak_bytes"),
        total_s=time.monotonic() - t0,
    )
    return {**out, **stats}  # type: ignore[typeddict-item]
