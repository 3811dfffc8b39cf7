"""A restore's page files: where they are staged, how they are written, and the rest of a
streaming restore, offered behind its first part (:class:`RestoreRest`).

The agent writes verified blocks into page files in a staging directory of
its own (``gpuckpt-<uid>-restore-<pid>``, :data:`RESTORE_TAG`) and offers
each to the worker, which owns it once offered and deletes it when the offer
ends; a file not offered is deleted here. A killed agent's directories are
swept by the next one (:func:`sweep_restore_dirs`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from agent.engines import staging
from agent.engines.channel import WorkerChannel
from agent.engines.control import ControlError
from agent.engines.offers import WANT_S
from agent.engines.protocol import OfferReply
from agent.engines.types import RestStats, Staging
from agent.session.worker import wait_until
from ckpt import BlockFailure, Manifest, Repository

__all__ = [
    "RESTORE_CHUNK_BYTES",
    "RESTORE_TAG",
    "REST_AFTER_S",
    "RestoreRest",
    "default_restore_staging",
    "failures",
    "page_writer",
    "sweep_restore_dirs",
    "write_pages",
]

log = logging.getLogger("gpuckpt.session")

#: the staging directories of restores are named ``gpuckpt-<uid>-`` + this + the agent's pid
RESTORE_TAG = "restore-"
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


def sweep_restore_dirs() -> list[str]:
    """Delete this user's restore staging directories whose agent process is gone (a killed agent
    leaves its verified pages — users' KV — in ``/dev/shm``)."""
    return staging.sweep_dead(RESTORE_TAG)


def failures(errors: list[BlockFailure]) -> list[str]:
    """Blocks that failed verification, one line each (key prefix and error)."""
    return [f"{f.key.hex()[:16]}: {f.error}" for f in errors]


def page_writer(m: Manifest, out: Staging, name: str) -> staging.PageWriter:
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


def write_pages(
    repo: Repository, m: Manifest, keys: list[bytes] | None, out: Staging, name: str, errors: list[BlockFailure]
) -> tuple[staging.PageWriter, int]:
    """Load and verify ``keys`` (None: every block) into page file ``name``; returns it committed."""
    w = page_writer(m, out, name)
    try:
        for lb in repo.load(m, keys=keys, errors=errors):
            w.write(lb.key, lb.data)
        idx = w.commit()
    except BaseException:
        w.abort()
        raise
    return w, len(idx.keys)


def _offer_file(
    channel: WorkerChannel,
    w: staging.PageWriter | None,
    generation: int,
    ready: list[str] | None = None,
    *,
    done: bool = False,
    coming: list[bytes] | None = None,
) -> OfferReply:
    """Offer committed page file ``w`` (None: no pages) as a later part of offer ``generation``;
    ``ready`` are requests whose pages are all offered (or failed) now, ``coming`` the pages later
    parts bring, ``done`` says no part follows. Returns the worker's reply: ``offered`` (the
    blocks it took) and ``wanted`` (hex keys requests wait on, when it says). A refused part (the
    offer ended: the worker deleted it; or the worker refused it) raises
    :class:`~agent.engines.control.ControlError`, its file deleted either way."""
    index = str(w.index_path) if w is not None else None
    extra: dict[str, Any] = {}
    if coming is not None:
        extra.update(coming=[k.hex() for k in coming], want_s=WANT_S)
    try:
        return channel.offer(index=index, generation=generation, ready=ready or [], done=done, **extra)
    except BaseException:
        if w is not None:
            staging.unlink_pair(w.index_path)  # refused: still ours to delete
        raise


class RestoreRest:
    """The rest of a streaming restore, behind its first part, on a thread of its own.

    First the in-flight requests' pages, request by request, beside the
    canary probe: loads of 1, 2, 4, … requests' pages in the requests'
    order, cut into a page file each time a request's pages are complete,
    which is offered naming that request ``ready`` (a worker holds a
    resubmitted request until then — see the offer's ``awaiting``). Then,
    once ``go`` is set (the probe passed), the prefix cache: the worker is told
    which blocks come (``coming``), then page files of verified blocks are
    offered one by one (``keys``: those within the staging bound). Blocks
    the worker's requests wait on (a reply's ``wanted``: a returning
    conversation whose history has not arrived) go into the next part, ahead
    of the rest. Stops when the offer ends (withdrawn, expired:
    the worker refuses a later part by its generation) or :meth:`stop`
    is called; then, or once all is offered, tells the worker that nothing
    more comes (a part with ``done``).
    """

    def __init__(
        self,
        repo: Repository,
        m: Manifest,
        channel: WorkerChannel,
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
        self.stats = RestStats(
            blocks=0,
            failed_blocks=0,
            failures=[],
            parts=0,
            not_offered=not_offered,
            inflight_blocks=0,
            inflight_parts=0,
            wanted_blocks=0,
        )
        self.inflight_done = threading.Event()  # every in-flight request's pages offered (or failed)
        self._repo, self._m, self._channel, self._out = repo, m, channel, out
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
        return page_writer(self._m, self._out, f"restore-{self._m.id}-{self._seq}")

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
        reply = _offer_file(self._channel, w, self._generation, ready)
        self.offered += reply.offered
        for k in reply.wanted:
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
            wait_until(self._channel, live=self._resubmitted, min_outputs=1, timeout=REST_AFTER_S)
        except ControlError as exc:  # not in time (not resubmitted yet, or some failed): go on
            self.stats["rest_wait"] = str(exc)[:200]
        self.stats["rest_waited_s"] = time.monotonic() - t

    def _close(self, w: staging.PageWriter | None, errors: list[BlockFailure]) -> None:
        """After a load: an unoffered page file deleted, its failed blocks counted."""
        if w is not None:
            w.abort()
        self.stats["failed_blocks"] += len(errors)
        self.stats["failures"] += failures(errors)[:10]

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
                _offer_file(self._channel, None, self._generation, coming=keys)
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
        except ControlError as exc:  # the offer ended, or the worker refused a part
            self.stats["ended"] = str(exc)
        except Exception as exc:  # never harms the worker: what was offered stays, the rest recomputes
            log.exception("streaming the rest of a restore failed", extra={"checkpoint": m.id})
            self.stats["error"] = f"{type(exc).__name__}: {exc}"
            if not self.inflight_done.is_set():  # the held requests go on with what they have
                with contextlib.suppress(Exception):
                    _offer_file(self._channel, None, self._generation, [cid for cid, _ in self._waiting])
        finally:
            self.stats["rest_s"] = time.monotonic() - t0
            self.inflight_done.set()
            if keys and "ended" not in self.stats:  # told what comes: now nothing more does
                with contextlib.suppress(Exception):
                    _offer_file(self._channel, None, self._generation, done=True)
            self._done.set()
