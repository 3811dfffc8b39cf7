"""Verification (FORMAT.md §3, §9.1): what ``gpuckpt verify`` checks.

One checkpoint: every block read back and verified as a restore would (or,
without reading data, every reference's pack there and long enough, or its
blobs found elsewhere after a repack). The whole repository: every manifest,
index document and pack trailer, every blob's checksums and decoding, and
that every referenced blob exists where it is said to. Verification only
reads; it reports what it finds as :class:`Problem` entries and raises only
when the store itself fails.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from ckpt.blobstore import BlobStore
from ckpt.codecs import Pipeline
from ckpt.errors import FormatError, GpuckptError, IntegrityError, ObjectNotFound
from ckpt.index import PREFIX as INDEX_PREFIX
from ckpt.load import BlockFailure, load_blocks
from ckpt.manifest import BlockRef, CheckpointInfo, Manifest, list_checkpoints, read_manifest
from ckpt.pack import PREFIX as PACK_PREFIX
from ckpt.pack import pack_name, read_trailer


@dataclass
class Problem:
    obj: str
    message: str
    blob: str | None = None


@dataclass
class VerifyReport:
    checked_checkpoints: int = 0
    checked_packs: int = 0
    checked_blobs: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(
    blobs: BlobStore,
    info: CheckpointInfo,
    *,
    read_data: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """One checkpoint: with ``read_data`` every block read back and verified (``progress`` gets
    blocks done and their total), else every reference checked to exist where it is said to."""
    report = VerifyReport()
    try:
        m = read_manifest(blobs.store, blobs.keyring, info)
    except (FormatError, IntegrityError) as exc:
        # A damaged manifest is a finding, as in the whole-repository check.
        report.problems.append(Problem(info.name, str(exc)))
        return report
    report.checked_checkpoints = 1
    failures: list[BlockFailure] = []
    if read_data:
        total = len(m.blocks)
        for n, _ in enumerate(load_blocks(blobs, m, errors=failures), 1):
            report.checked_blobs += 1
            if progress:
                progress(n, total)
        for f in failures:
            obj = getattr(f.error, "obj", None) or "?"
            report.problems.append(Problem(obj, str(f.error), getattr(f.error, "blob", None)))
    else:
        _check_refs_exist(blobs, m, report)
        report.checked_blobs += len(m.blocks)
    return report


def _check_refs_exist(blobs: BlobStore, m: Manifest, report: VerifyReport) -> None:
    sizes: dict[str, int | None] = {}
    by_pack: dict[str, list[BlockRef]] = {}
    for b in m.blocks:
        by_pack.setdefault(b.pack, []).append(b)
    for b in m.blocks:
        if b.pack not in sizes:
            try:
                sizes[b.pack] = blobs.store.stat(pack_name(b.pack)).size
            except ObjectNotFound:
                sizes[b.pack] = None
                # Repacked by gc? Then every blob must be found elsewhere.
                refs = by_pack[b.pack]
                moved = blobs.relocate(b.pack, [r.blob for r in refs])
                # The reference's own copy: same stored checksum and length.
                lost = [
                    r
                    for r in refs
                    if not any(e.checksum == r.checksum and e.length == r.length for e in moved.get(r.blob, ()))
                ]
                if lost:
                    report.problems.append(
                        Problem(
                            pack_name(b.pack),
                            f"missing pack referenced by {m.name} ({len(lost)} blobs not found elsewhere)",
                        )
                    )
        size = sizes[b.pack]
        if size is not None and b.offset + b.length > size:
            report.problems.append(
                Problem(
                    pack_name(b.pack),
                    f"truncated: blob {b.blob} of {m.name} lies past its end",
                    b.blob,
                )
            )


def verify_repository(
    blobs: BlobStore, *, read_data: bool = True, progress: Callable[[int, int], None] | None = None
) -> VerifyReport:
    """The whole repository: every manifest, index and pack, every blob's checksums, and that every
    referenced blob exists where it is said to (without ``read_data``, no pack's bytes are read)."""
    report = VerifyReport()
    manifests: list[Manifest] = []
    for info in list_checkpoints(blobs.store):
        try:
            manifests.append(read_manifest(blobs.store, blobs.keyring, info))
        except GpuckptError as exc:
            report.problems.append(Problem(info.name, str(exc)))
    report.checked_checkpoints = len(manifests)
    for n in {o.name for o in blobs.store.list(INDEX_PREFIX)}:
        try:
            blobs.store.get(n)
        except GpuckptError as exc:
            report.problems.append(Problem(n, str(exc)))
    try:
        blobs.refresh_index()
    except GpuckptError as exc:
        report.problems.append(Problem("index/", str(exc)))
    report.problems += [Problem(n, why) for n, why in sorted(blobs.index.unreadable.items())]
    for m in manifests:
        _check_refs_exist(blobs, m, report)
    if not read_data:
        report.checked_blobs = sum(len(m.blocks) for m in manifests)
        return report
    packs = sorted(blobs.store.list(PACK_PREFIX), key=lambda o: o.name)
    for i, o in enumerate(packs, 1):
        pid = o.name.rsplit("/", 1)[-1]
        try:
            data = blobs.store.get(o.name)
            entries = read_trailer(data, pid, blobs.keyring)
        except GpuckptError as exc:
            report.problems.append(Problem(o.name, str(exc)))
            continue
        report.checked_packs += 1
        for e in entries:
            try:
                blobs.decode(
                    Pipeline.from_specs(json.loads(e.codec)),
                    memoryview(data)[e.offset : e.offset + e.length],
                    obj=o.name,
                    blob=e.id,
                    checksum=e.checksum,
                    raw_checksum=e.raw_checksum,
                    raw_length=e.raw_length,
                )
            except GpuckptError as exc:
                report.problems.append(Problem(o.name, str(exc), e.id))
            report.checked_blobs += 1
        if progress:
            progress(i, len(packs))
    return report
