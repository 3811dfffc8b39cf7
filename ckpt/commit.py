"""A save's last look before its commit (FORMAT.md §6 step 6, §9 "A commit that needs no clock").

Right before the manifest is written, on the store and with no clock involved:
every pack the save deduplicated against must still exist, and one that an
index document now condemns or supersedes has this save's blobs copied out of
it into a new pack, which the manifest then names. What gc publishes is
always visible before it deletes, so a manifest committed after this look
names no pack a gc is about to delete.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from ckpt import checksum as cks
from ckpt.blobstore import BlobStore
from ckpt.errors import GpuckptError, ObjectNotFound, OperationAborted
from ckpt.index import PackRecord, encode_index, index_name
from ckpt.pack import BlobEntry, PackWriter, pack_name

log = logging.getLogger("gpuckpt.save")


def _dedup_packs(entries: dict[str, BlobEntry], written: Iterable[PackRecord]) -> set[str]:
    return {e.pack for e in entries.values()} - {p.id for p in written}


def _gone(blobs: BlobStore, packs: Iterable[str]) -> list[str]:
    """The packs of ``packs`` whose objects are not on the store (stat in parallel)."""
    names = sorted(packs)
    if not names:
        return []

    def gone(pid: str) -> bool:
        try:
            blobs.store.stat(pack_name(pid))
            return False
        except ObjectNotFound:
            return True

    with ThreadPoolExecutor(min(8, len(names))) as ex:
        return [pid for pid, g in zip(names, ex.map(gone, names), strict=True) if g]


#: rounds of :func:`carry_forward` before a save gives up on a gc that keeps condemning its packs
CARRY_ROUNDS = 3


def carry_forward(
    blobs: BlobStore, entries: dict[str, BlobEntry], written: list[PackRecord]
) -> tuple[dict[str, BlobEntry], list[PackRecord]]:
    """Before a commit, on the store: every pack the save deduplicated against must still be there,
    and one a gc condemned or superseded meanwhile (what gc publishes is always visible before it
    deletes) has this save's blobs copied out of it, verbatim and verified, into a new pack — the
    manifest then names the copy, never a pack a gc is about to delete. Needs no clock: however
    long the save stalled, and whatever the store's clock did. A pack that is gone, or a blob that
    does not verify, aborts the save (:class:`OperationAborted`, naming the pack). Returns the
    entries to commit and the packs written here (indexed already)."""
    deduped = _dedup_packs(entries, written)
    if not deduped:
        return entries, []
    blobs.refresh_index()
    missing = _gone(blobs, deduped)
    if missing:
        raise OperationAborted(
            f"{len(missing)} pack(s) this save deduplicated against are gone from the store "
            f"(first: {missing[0]}); not committing"
        )
    doomed = deduped & (blobs.index.superseded | blobs.index.condemned.keys())
    if not doomed:
        return entries, []
    moved: dict[str, BlobEntry] = {}
    out: list[PackRecord] = []
    pw = PackWriter(secrets.token_hex(16), blobs.config.pack_size + (1 << 20))
    copies: dict[str, BlobEntry] = {}  # by the stored blob's own id (a shared blob is copied once)
    for pid in sorted(doomed):
        try:
            data = memoryview(blobs.store.get(pack_name(pid)))
        except ObjectNotFound:
            raise OperationAborted(f"pack {pid} was deleted while this save copied out of it; not committing") from None
        for bid, e in entries.items():
            if e.pack != pid:
                continue
            if e.id not in copies:
                blob = data[e.offset : e.offset + e.length]
                try:
                    cks.verify(blob, e.checksum, obj=pack_name(pid), blob=e.id)
                except GpuckptError as exc:
                    why = f"a blob of condemned pack {pid} does not verify ({exc}); not committing"
                    raise OperationAborted(why) from None
                copies[e.id] = pw.add(e.id, blob, e.raw_length, e.checksum, e.raw_checksum, e.codec, e.content)
            moved[bid] = copies[e.id]
    raw = pw.finish(blobs.keyring)
    blobs.store.put(pw.name, raw)
    rec = PackRecord(pw.id, len(raw), tuple(pw.entries))
    out.append(rec)
    name = index_name(secrets.token_hex(16))
    blobs.store.put(name, encode_index(name, out, blobs.keyring))
    blobs.index.add(name, out)
    log.info(
        "copied blobs out of condemned packs before the commit", extra={"packs": sorted(doomed), "blobs": len(moved)}
    )
    return {**entries, **moved}, out
