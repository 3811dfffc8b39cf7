"""Garbage collection (FORMAT.md §9): mark, repack, condemn and sweep.

gc works on a :class:`~ckpt.blobstore.BlobStore` and the checkpoints its
store lists; :meth:`ckpt.Repository.gc` is its public face. The order of its
writes is the one that keeps every committed checkpoint readable through a
crash at any point: new packs durable, then one rewritten index document,
then the replaced index documents deleted, then packs deleted.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from dataclasses import dataclass, field
from datetime import timedelta

from ckpt import checksum as cks
from ckpt import claims
from ckpt.blobstore import BlobStore
from ckpt.errors import (
    CheckpointNotFound,
    ConfigError,
    FormatError,
    GpuckptError,
    IntegrityError,
    ObjectNotFound,
    UnsupportedVersion,
)
from ckpt.index import PackRecord, encode_index, index_name
from ckpt.lock import DEFAULT_STALE_AFTER, Lock, check_stale_limit, remove_stale_locks, store_now
from ckpt.manifest import Manifest, list_checkpoints, read_manifest
from ckpt.pack import PREFIX as PACK_PREFIX
from ckpt.pack import BlobEntry, PackWriter, pack_name, read_trailer
from ckpt.store.base import ObjectInfo

log = logging.getLogger("gpuckpt.repository")


@dataclass
class GcReport:
    live_blobs: int = 0
    deleted_packs: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
    repacked_packs: list[str] = field(default_factory=list)
    reclaimed_bytes: int = 0  # store bytes freed, deleted and repacked packs together
    kept_young_packs: int = 0
    rewritten_indexes: int = 0
    removed_locks: int = 0
    removed_debris: int = 0
    # claim objects of checkpoints that are gone (ckpt/claims.py), older than the grace period
    removed_claims: int = 0
    dry_run: bool = False
    exclusive: bool = False  # gc --now: saves waited for, deletes at once
    # condemned by this gc: deleted by a later one, once no save can still reference them
    condemned_packs: list[str] = field(default_factory=list)
    pending_packs: int = 0  # condemned earlier, not yet ripe
    rescued_packs: list[str] = field(default_factory=list)  # condemned, but a manifest needs them
    # skipped, reported, never deleted: manifests and index documents that do not read
    unreadable: list[str] = field(default_factory=list)


def collect(
    blobs: BlobStore,
    *,
    grace: timedelta = timedelta(hours=1),
    dry_run: bool = False,
    lock_wait: float = 0.0,
    stale_lock_after: float = DEFAULT_STALE_AFTER,
    repack_below: float = 0.5,
    now: bool = False,
    delete_delay: timedelta | None = None,
    max_save_seconds: float,
) -> GcReport:
    """Mark, repack, condemn and sweep (FORMAT.md §9).

    Live = every blob any manifest references. Among packs older than
    ``grace`` (young ones may belong to a save that crashed a moment ago):
    a pack with no live blob is dead; a pack whose live blobs fill less
    than ``repack_below`` of it is sparse, and has them copied, verbatim
    and verified, into new packs (0 turns repacking off). Dead and
    repacked packs are then *condemned*: from then on no save
    deduplicates against them.

    By default gc runs beside saves (its lock keeps only other gcs out)
    and deletes a condemned pack only at a later gc, once it has been
    condemned for ``delete_delay`` on the store's clock (at least twice
    the longest a save may run, ``max_save_seconds``): by then every
    save that could have deduplicated against it has committed — and its
    manifest, read now, rescues the pack — or has aborted. With ``now``
    gc takes the full exclusive lock (waiting ``lock_wait`` for running
    saves and keeping new ones out) and deletes at once.

    Order: new packs durable → one rewritten index document → old index
    documents deleted → packs deleted: references go before data. If any
    manifest cannot be fetched, nothing is deleted; one that was fetched
    and does not read is reported and protects nothing.
    """
    check_stale_limit(stale_lock_after)
    if not 0.0 <= repack_below <= 1.0:
        raise ConfigError("repack_below must be between 0 and 1")
    delay = delete_delay.total_seconds() if delete_delay is not None else 2 * max_save_seconds
    if not now and delay < 2 * max_save_seconds:
        raise ConfigError(
            f"delete_delay {delay:.0f}s is shorter than twice the longest a save may run "
            f"({max_save_seconds:.0f}s): a save still running could lose data; use gc --now"
        )
    report = GcReport(dry_run=dry_run, exclusive=now)
    with Lock(
        blobs.store,
        exclusive=True,
        mode="" if now else "gc",
        operation="gc",
        wait=lock_wait if now else 0.0,
        stale_after=stale_lock_after,
    ) as held:
        # The store's time before the manifests are read: a condemnation
        # ripe at this time was visible to every save whose manifest can
        # still appear after the read below (FORMAT.md §9).
        t_now = store_now(blobs.store, held.name)
        manifests = _manifests(blobs, report)
        named_packs: set[str] = set()
        live_blobs: set[str] = set()
        for m in manifests:
            for b in m.blocks:
                live_blobs.add(b.blob)
                named_packs.add(b.pack)
        report.live_blobs = len(live_blobs)
        blobs.refresh_index()
        if blobs.index.unsupported:
            # a newer writer's index: the packs it lists are not garbage
            raise next(iter(blobs.index.unsupported.values()))
        report.unreadable += [f"{n}: {why}" for n, why in blobs.index.unreadable.items()]
        indexed = blobs.index.packs
        superseded = blobs.index.superseded
        condemned = blobs.index.condemned
        cutoff = t_now - grace.total_seconds()
        existing: dict[str, ObjectInfo] = {}
        dead: list[ObjectInfo] = []
        to_repack: list[tuple[ObjectInfo, list[BlobEntry]]] = []
        for o in blobs.store.list(PACK_PREFIX):
            pid = o.name.rsplit("/", 1)[-1]
            existing[pid] = o
            if pid in condemned or pid in superseded:
                continue  # already on its way out
            rec = indexed.get(pid)
            live = [e for e in rec.entries if e.id in live_blobs] if rec is not None else []
            if rec is None and pid in named_packs:
                continue  # a manifest names it but no index does: keep, never guess
            total = sum(e.length for e in rec.entries) if rec is not None else 0
            live_bytes = sum(e.length for e in live)
            if live and live_bytes >= repack_below * total:
                continue
            if o.mtime > cutoff:
                report.kept_young_packs += 1
                continue
            if live:
                to_repack.append((o, live))
            else:
                dead.append(o)
        if dry_run:
            written: list[PackRecord] = []
            report.repacked_packs = sorted(o.name for o, _ in to_repack)
        else:
            written = _repack(blobs, to_repack, report)
        repacked = {n.rsplit("/", 1)[-1] for n in report.repacked_packs}
        fresh = {o.name.rsplit("/", 1)[-1] for o in dead} | repacked
        # Ripe: deletable now, unless a manifest still needs it (rescue below).
        ripe = {p for p, t in condemned.items() if now or t_now - t >= delay} | set(superseded)
        if now:
            ripe |= fresh
        ripe &= set(existing)
        rescued = _rescue(blobs, manifests, ripe, written, set(existing))
        doomed = ripe - rescued
        report.rescued_packs = sorted(existing[p].name for p in rescued)
        # this run's repacked packs are reported as repacked, not deleted
        report.deleted_packs = sorted(existing[p].name for p in doomed - repacked)
        report.deleted_bytes = sum(existing[p].size for p in doomed - repacked)
        newly = {} if now else {p: 0.0 for p in fresh}
        report.condemned_packs = sorted(existing[p].name for p in newly)
        report.pending_packs = len(set(condemned) - ripe)
        if dry_run:
            report.rewritten_indexes = len(_stale_docs(blobs, doomed, rescued))
            return report
        # A gc that was suspended may have had its lock taken for stale by another gc, which
        # may have rescued (un-condemned) what this one is about to delete: do not delete then.
        held.confirm(stale_after=DEFAULT_STALE_AFTER)  # other gcs judge our lock by the default
        _rewrite_index(blobs, written, doomed, rescued, newly, set(existing), report)
        # _repack counted what repacking frees (old size − live bytes copied)
        report.reclaimed_bytes += report.deleted_bytes
        report.removed_debris = blobs.store.cleanup(cutoff)
        report.removed_claims = len(claims.sweep(blobs.store, older_than=cutoff))
        report.removed_locks = len(remove_stale_locks(blobs.store, stale_lock_after, keep=held.name))
    log.info(
        "gc done",
        extra={
            "deleted_packs": len(report.deleted_packs),
            "condemned_packs": len(report.condemned_packs),
            "rescued_packs": len(report.rescued_packs),
            "repacked_packs": len(report.repacked_packs),
            "deleted_bytes": report.deleted_bytes,
            "reclaimed_bytes": report.reclaimed_bytes,
        },
    )
    return report


def _manifests(blobs: BlobStore, report: GcReport) -> list[Manifest]:
    manifests = []
    for info in list_checkpoints(blobs.store):
        # A store failure aborts gc: deleting data on a manifest we could
        # not fetch could destroy a checkpoint, and so could one of a
        # format version we do not know (a newer writer's). A manifest that
        # was fetched and does not read (rotten, planted) cannot be
        # restored from: it is reported, left in place, and protects nothing.
        try:
            try:
                manifests.append(read_manifest(blobs.store, blobs.keyring, info))
            except UnsupportedVersion:
                raise
            except (FormatError, IntegrityError):
                manifests.append(
                    read_manifest(blobs.store, blobs.keyring, info)
                )  # a second read: never judge on one torn GET
        except UnsupportedVersion:
            raise  # a newer writer's checkpoint: its references are unknown, delete nothing
        except CheckpointNotFound:
            continue  # forgotten since the listing: it protects nothing
        except (FormatError, IntegrityError) as exc:
            log.warning("gc skips an unreadable manifest", extra={"object": info.name, "error": str(exc)})
            report.unreadable.append(f"{info.name}: {exc}")
    return manifests


def _rescue(
    blobs: BlobStore,
    manifests: list[Manifest],
    ripe: set[str],
    written: list[PackRecord],
    existing: set[str] | None = None,
) -> set[str]:
    """The ripe packs some manifest still needs: a ripe pack holding a referenced blob (by its
    reference's checksum and length) is kept unless another copy is *shown* to be elsewhere —
    in a pack this gc just wrote, or in a pack that exists, is not going, and whose trailer
    lists the blob with bytes that match its checksum (checked here). An index document's word
    alone never lets a needed pack go: a planted one listing phantom copies rescues nothing
    away (FORMAT.md §9 step 6)."""
    mine: dict[str, list[BlobEntry]] = {}
    for rec in written:
        for e in rec.entries:
            mine.setdefault(e.id, []).append(e)
    present = set(blobs.index.packs) if existing is None else existing
    # (blob, checksum, length) → the ripe packs holding it, and where else the index says it is
    need: dict[tuple[str, str, int], tuple[set[str], set[str]]] = {}
    for m in manifests:
        for b in m.blocks:
            want = (b.blob, b.checksum, b.length)
            if want in need:
                continue
            if any(e.checksum == b.checksum and e.length == b.length for e in mine.get(b.blob, ())):
                need[want] = (set(), set())  # copied by this gc: shown
                continue
            holders = {
                e.pack for e in blobs.index.copies(b.blob) if e.checksum == b.checksum and e.length == b.length
            } | {b.pack}
            need[want] = (holders & ripe, holders - ripe)
    # only the blobs a going pack holds need their other copies shown (rare: a save that raced
    # a condemnation, or a planted document): the usual gc reads no pack here
    shown = _copies_shown(blobs, {(w, q) for w, (going, others) in need.items() if going for q in others}, present)
    rescued: set[str] = set()
    for want, (going, others) in need.items():
        if going and not any((want, q) in shown for q in others):
            rescued |= going
    return rescued


def _copies_shown(
    blobs: BlobStore, claims: set[tuple[tuple[str, str, int], str]], present: set[str]
) -> set[tuple[tuple[str, str, int], str]]:
    """The claims ``((blob, checksum, length), pack)`` that hold on the store: the pack exists,
    its trailer lists the blob with that checksum and length, and those bytes match it. Each
    pack is read once; one that does not read shows nothing."""
    by_pack: dict[str, list[tuple[str, str, int]]] = {}
    for want, q in claims:
        if q in present:
            by_pack.setdefault(q, []).append(want)
    out: set[tuple[tuple[str, str, int], str]] = set()
    for q, wants in by_pack.items():
        try:
            data = memoryview(blobs.store.get(pack_name(q)))
            listed = {(e.id, e.checksum, e.length): e for e in read_trailer(data, q, blobs.keyring)}
        except GpuckptError as exc:
            log.warning("a pack the index names shows nothing", extra={"pack": q, "error": str(exc)})
            continue
        for want in wants:
            e = listed.get(want)
            if e is None:
                continue
            try:
                cks.verify(data[e.offset : e.offset + e.length], e.checksum, obj=pack_name(q), blob=e.id)
            except GpuckptError:
                continue
            out.add((want, q))
    return out


def _stale_docs(blobs: BlobStore, doomed: set[str], rescued: set[str]) -> list[str]:
    """Index documents a rewrite replaces: those naming a doomed pack, or condemning or
    superseding a pack that is going now or was rescued."""
    touched = doomed | rescued
    return [
        n
        for n, recs in blobs.index.documents.items()
        if any(p.id in doomed for p in recs)
        or touched & blobs.index.condemned_by(n).keys()
        or touched & blobs.index.superseded_by(n)
    ]


def _rewrite_index(
    blobs: BlobStore,
    added: list[PackRecord],
    doomed: set[str],
    rescued: set[str],
    newly: dict[str, float],
    existing: set[str],
    report: GcReport,
) -> None:
    """One new index document (new packs, the survivors of the documents it replaces, their
    still-pending condemnations with their times, new condemnations, and the doomed packs as
    superseded), then the replaced documents deleted, then the doomed packs deleted."""
    stale = _stale_docs(blobs, doomed, rescued)
    keep: dict[str, PackRecord] = {p.id: p for p in added}
    pending: dict[str, float] = dict(newly)
    superseded = set(doomed)
    docs = blobs.index.documents
    for n in stale:
        for rec in docs.get(n, ()):
            if rec.id not in doomed:
                keep.setdefault(rec.id, rec)
        for pid, t in blobs.index.condemned_by(n).items():
            if pid not in doomed and pid not in rescued and pid in existing:
                pending[pid] = min(t, pending.get(pid, t))
        # carried until the packs are really gone: a crash before the deletes leaves the next gc the list
        superseded |= {pid for pid in blobs.index.superseded_by(n) if pid in existing and pid not in rescued}
    if keep or superseded or pending:
        name = index_name(secrets.token_hex(16))
        blobs.store.put(name, encode_index(name, keep.values(), blobs.keyring, superseded, pending))
    for n in stale:
        with contextlib.suppress(ObjectNotFound):
            blobs.store.delete(n)
    report.rewritten_indexes = len(stale)
    for p in sorted(doomed):
        with contextlib.suppress(ObjectNotFound):
            blobs.store.delete(pack_name(p))
    blobs.refresh_index()


def _repack(
    blobs: BlobStore, to_repack: list[tuple[ObjectInfo, list[BlobEntry]]], report: GcReport
) -> list[PackRecord]:
    """Copy live blobs of sparse packs into new packs; returns the new packs.

    A pack whose live blobs do not verify is left alone (and reported by
    ``verify``): gc never rewrites bytes it cannot vouch for.
    """
    written: list[PackRecord] = []
    pw: PackWriter | None = None

    def flush() -> None:
        nonlocal pw
        if pw is not None and pw.entries:
            data = pw.finish(blobs.keyring)
            blobs.store.put(pw.name, data)
            written.append(PackRecord(pw.id, len(data), tuple(pw.entries)))
        pw = None

    for o, live in to_repack:
        try:
            data = memoryview(blobs.store.get(o.name))
            for e in live:
                cks.verify(data[e.offset : e.offset + e.length], e.checksum, obj=o.name, blob=e.id)
        except GpuckptError as exc:
            log.warning("not repacking a pack that does not verify", extra={"object": o.name, "error": str(exc)})
            continue
        for e in live:
            if pw is None:
                pw = PackWriter(secrets.token_hex(16), blobs.config.pack_size + (1 << 20))
            # the content id moves with the blob: other trust domains deduplicate against it (FORMAT.md §10)
            pw.add(
                e.id, data[e.offset : e.offset + e.length], e.raw_length, e.checksum, e.raw_checksum, e.codec, e.content
            )
            if pw.size >= blobs.config.pack_size:
                flush()
        report.repacked_packs.append(o.name)
        report.reclaimed_bytes += o.size - sum(e.length for e in live)
    flush()
    return written
