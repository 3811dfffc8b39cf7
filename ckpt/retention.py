"""Retention (FORMAT.md §9): ``forget`` keeps the newest *N* and anything newer than *T* per
worker, always the newest, and deletes the other manifests only; ``gc`` reclaims their data.

Checkpoints are ordered by the store's clock, future-dated ones are ignored, and a checkpoint
whose manifest does not read is neither counted as kept nor deleted (FORMAT.md §6).

Claims (FORMAT.md §13, :mod:`ckpt.claims`): a checkpoint with a claim and no ``done`` — being
restored by a replacement worker, or about to be — is never forgotten. A worker whose newest
checkpoint is ``done`` (adopted: its sessions went on in the adopter) is *retired*: neither its
newest nor its last ``keep_last`` are kept for it any more, only those within ``keep_within``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

from ckpt import claims
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
    claimed, adopted = claims.protected(blobs.store)
    retired = {w for w, cps in by_worker.items() if (w, cps[-1].id) in adopted}
    doomed = expired(by_worker.values(), keep_last=keep_last, keep_within=keep_within, now=now, retired=retired)
    doomed = [c for c in doomed if (c.worker_id, c.id) not in claimed]
    if doomed and not dry_run:
        with Lock(blobs.store, exclusive=False, operation="forget"):
            for c in doomed:
                blobs.store.delete(c.name)
    return doomed


def expired(
    workers: Iterable[list[CheckpointInfo]],
    *,
    keep_last: int | None,
    keep_within: timedelta | None,
    now: datetime,
    retired: Collection[str] = (),
) -> list[CheckpointInfo]:
    """The policy: of each worker's checkpoints (oldest first), those neither the newest, nor
    among the newest ``keep_last``, nor created within ``keep_within`` of ``now``; of a
    ``retired`` worker's (adopted), those not created within ``keep_within``."""
    doomed = []
    for cps in workers:
        gone = bool(cps) and cps[0].worker_id in retired
        for i, c in enumerate(reversed(cps)):
            keep = i == 0 and not gone
            keep |= keep_last is not None and i < keep_last and not gone
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
