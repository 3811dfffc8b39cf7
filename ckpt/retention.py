"""Retention (FORMAT.md §9): ``forget`` keeps the newest *N* and anything newer than *T* per
worker, always the newest, and deletes the other manifests only; ``gc`` reclaims their data.

Checkpoints are ordered by the store's clock, future-dated ones are ignored, and a checkpoint
whose manifest does not read is neither counted as kept nor deleted (FORMAT.md §6).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

from ckpt.blobstore import BlobStore
from ckpt.errors import CheckpointNotFound, ConfigError, FormatError, IntegrityError
from ckpt.lock import Lock
from ckpt.manifest import MAX_CLOCK_SKEW, CheckpointInfo, by_store_time, read_manifest

log = logging.getLogger("gpuckpt.repository")


def forget(
    blobs: BlobStore,
    *,
    keep_last: int | None = None,
    keep_within: timedelta | None = None,
    worker_id: str | None = None,
    dry_run: bool = False,
    now: datetime | None = None,
) -> list[CheckpointInfo]:
    """Apply retention per worker: keep the newest ``keep_last`` and any newer
    than ``keep_within``; the newest checkpoint of each worker is always kept.
    Removes manifests only, under a shared lock; ``gc`` reclaims the data.
    Returns what was removed (with ``dry_run``: what would be)."""
    if keep_last is None and keep_within is None:
        raise ConfigError("forget needs keep_last and/or keep_within")
    if keep_last is not None and keep_last < 1:
        raise ConfigError("keep_last must be at least 1: the newest checkpoint is always kept")
    now = now or datetime.now(UTC)
    by_worker: dict[str, list[CheckpointInfo]] = {}
    for c in _readable(blobs, by_store_time(blobs.store, worker_id, MAX_CLOCK_SKEW)):
        by_worker.setdefault(c.worker_id, []).append(c)
    doomed = expired(by_worker.values(), keep_last=keep_last, keep_within=keep_within, now=now)
    if doomed and not dry_run:
        with Lock(blobs.store, exclusive=False, operation="forget"):
            for c in doomed:
                blobs.store.delete(c.name)
    return doomed


def expired(
    workers: Iterable[list[CheckpointInfo]], *, keep_last: int | None, keep_within: timedelta | None, now: datetime
) -> list[CheckpointInfo]:
    """The policy: of each worker's checkpoints (oldest first), those neither the newest, nor
    among the newest ``keep_last``, nor created within ``keep_within`` of ``now``."""
    doomed = []
    for cps in workers:
        for i, c in enumerate(reversed(cps)):
            keep = i == 0
            keep |= keep_last is not None and i < keep_last
            keep |= keep_within is not None and now - c.created <= keep_within
            if not keep:
                doomed.append(c)
    return doomed


def _readable(blobs: BlobStore, infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """The checkpoints whose manifests read, in order; the others are logged and left alone
    (retention must never count garbage as a kept checkpoint, nor delete what it cannot read)."""
    if not infos:
        return []

    def ok(c: CheckpointInfo) -> bool:
        try:
            read_manifest(blobs.store, blobs.keyring, c)
            return True
        except (FormatError, IntegrityError, CheckpointNotFound) as exc:
            log.warning("retention skips an unreadable checkpoint", extra={"object": c.name, "error": str(exc)})
            return False

    with ThreadPoolExecutor(min(8, len(infos))) as ex:
        flags = list(ex.map(ok, infos))
    return [c for c, f in zip(infos, flags, strict=True) if f]
