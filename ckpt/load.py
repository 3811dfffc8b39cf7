"""The load pipeline: a manifest's blocks back, verified, streaming.

Blocks are grouped by pack and neighbouring blobs coalesced into ranged reads
(one GET for many blocks), fetched in parallel, and each blob is checked
twice before it is handed out: the stored bytes against their checksum (and,
when encrypted, the AEAD tag) before decoding, the decoded bytes against the
raw checksum after. No byte reaches the caller unverified. Results stream as
ranges arrive, so the first blocks can be loaded into the engine while later
ones are still downloading; memory is bounded by the ranges in flight.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ckpt.blobstore import BlobStore
from ckpt.blocks import DTYPES, LoadedBlock
from ckpt.codecs import Pipeline
from ckpt.errors import GpuckptError, IntegrityError, ObjectNotFound
from ckpt.manifest import BlockRef, Manifest
from ckpt.pack import pack_name

MiB = 1 << 20
#: neighbouring blobs closer than this are fetched in one ranged read
COALESCE_GAP = 1 * MiB
#: ...as long as the read stays under this: small enough that a few packs' worth of blocks (a
#: restore's in-flight pages, stored together) still spread over every worker, and that the
#: ranges in flight (``2 × workers``) hold at most 128 MiB
MAX_RANGE = 8 * MiB
#: no block decodes to more than this, whatever its manifest entry says
MAX_BLOCK_BYTES = 4 << 30


@dataclass(frozen=True)
class BlockFailure:
    """A block that could not be loaded, and why (collected with ``errors=``)."""

    key: bytes
    error: GpuckptError


@dataclass(frozen=True)
class _Range:
    pack: str
    start: int
    end: int
    refs: tuple[BlockRef, ...]


def plan_ranges(refs: Iterable[BlockRef], order: dict[str, int] | None = None) -> list[_Range]:
    """Coalesce ``refs`` into ranged reads, pack by pack. With ``order`` (key → rank), the ranges
    come in the order of the first-ranked block each holds: what a caller needs first is read first."""
    by_pack: dict[str, list[BlockRef]] = {}
    for r in refs:
        by_pack.setdefault(r.pack, []).append(r)
    out = []
    for pack, rs in by_pack.items():
        rs.sort(key=lambda r: r.offset)
        cur: list[BlockRef] = []
        start = end = 0
        for r in rs:
            if cur and (r.offset - end > COALESCE_GAP or r.offset + r.length - start > MAX_RANGE):
                out.append(_Range(pack, start, end, tuple(cur)))
                cur = []
            if not cur:
                start = r.offset
                end = r.offset
            cur.append(r)
            end = max(end, r.offset + r.length)
        if cur:
            out.append(_Range(pack, start, end, tuple(cur)))
    if order is not None:
        out.sort(key=lambda rg: min(order[r.key] for r in rg.refs))
    return out


def expected_raw_length(ref: BlockRef, obj: str) -> int:
    """The bytes ``ref`` must decode to: its dtype × shape, checked against ``raw_length`` and the cap
    before anything is allocated (a stored length is never trusted on its own)."""
    itemsize = DTYPES.get(ref.dtype)
    if itemsize is None:
        raise IntegrityError(f"block {ref.key} in {obj}: unknown dtype {ref.dtype!r}", obj=obj, blob=ref.blob)
    n = itemsize
    for d in ref.shape:
        n *= d
    if n != ref.raw_length:
        raise IntegrityError(
            f"block {ref.key} in {obj}: raw_length {ref.raw_length} is not {ref.dtype} × {list(ref.shape)} = {n} bytes",
            obj=obj,
            blob=ref.blob,
        )
    if n > MAX_BLOCK_BYTES:
        raise IntegrityError(
            f"block {ref.key} in {obj}: {n} bytes exceeds the {MAX_BLOCK_BYTES}-byte block limit",
            obj=obj,
            blob=ref.blob,
        )
    return n


def _decode_ref(blobs: BlobStore, pipelines: list[Pipeline], ref: BlockRef, stored: memoryview) -> LoadedBlock:
    expected_raw_length(ref, pack_name(ref.pack))
    data = blobs.decode(
        pipelines[ref.codec],
        stored,
        obj=pack_name(ref.pack),
        blob=ref.blob,
        checksum=ref.checksum,
        raw_checksum=ref.raw_checksum,
        raw_length=ref.raw_length,
    )
    return LoadedBlock(bytes.fromhex(ref.key), data, ref.dtype, tuple(ref.shape))


def _as_integrity(exc: Exception, obj: str, ref: BlockRef) -> GpuckptError:
    if isinstance(exc, GpuckptError):
        return exc
    why = f"{type(exc).__name__}: {exc}"
    err = IntegrityError(f"block {ref.key} in {obj} could not be decoded: {why}", obj=obj, blob=ref.blob)
    err.__cause__ = exc
    return err


def load_blocks(
    blobs: BlobStore,
    manifest: Manifest,
    *,
    keys: Iterable[bytes] | None = None,
    workers: int = 8,
    errors: list[BlockFailure] | None = None,
) -> Iterator[LoadedBlock]:
    """Yield the manifest's blocks (or those whose key is in ``keys``), verified.

    Blocks come in the order their ranges arrive, not manifest order; with
    ``keys``, ranges are read in the order of the keys they hold (a streaming
    restore names the first request's pages first). Without
    ``errors`` the first failure raises (IntegrityError names the pack and
    blob); with a list, failures are appended there and the rest still load,
    so a caller can recompute just the affected blocks.
    """
    order: dict[str, int] | None = None
    if keys is not None:
        order = {}
        for k in keys:  # a key's rank: where it is first named
            order.setdefault(k.hex(), len(order))
    refs = [r for r in manifest.blocks if order is None or r.key in order]
    pipelines = [Pipeline.from_specs([s.model_dump() for s in p]) for p in manifest.codecs]
    ranges = plan_ranges(refs, order)
    stop = threading.Event()

    def fetch(rg: _Range) -> list[LoadedBlock | BlockFailure]:
        if stop.is_set():
            return []
        obj = pack_name(rg.pack)
        try:
            data = memoryview(blobs.store.get(obj, rg.start, rg.end - rg.start))
        except ObjectNotFound as exc:
            return relocated(rg, exc)
        except GpuckptError as exc:
            return [BlockFailure(bytes.fromhex(r.key), exc) for r in rg.refs]
        out: list[LoadedBlock | BlockFailure] = []
        for r in rg.refs:
            try:
                out.append(_decode_ref(blobs, pipelines, r, data[r.offset - rg.start : r.offset - rg.start + r.length]))
            except Exception as exc:  # anything while decoding one block is that block's failure
                out.append(BlockFailure(bytes.fromhex(r.key), _as_integrity(exc, obj, r)))
        return out

    def relocated(rg: _Range, exc: ObjectNotFound) -> list[LoadedBlock | BlockFailure]:
        """The manifest's pack is gone: gc may have repacked its live blobs.
        Find them through the index and read them there. The stored bytes were
        copied verbatim, so the manifest's checksums still vouch for them: the
        index is trusted for locations only. A blob id may have several
        copies (two saves of one block in an encrypted repository store two
        ciphertexts): only a copy whose length and stored checksum are the
        manifest's is this reference's copy, and each candidate is tried."""
        obj = pack_name(rg.pack)
        moved = blobs.relocate(rg.pack, [r.blob for r in rg.refs])
        out: list[LoadedBlock | BlockFailure] = []
        for r in rg.refs:
            # this reference's copy first (its stored checksum), then any other of its length
            copies = [e for e in moved.get(r.blob, ()) if e.length == r.length]
            candidates = sorted(copies, key=lambda e: e.checksum != r.checksum)
            failure: GpuckptError | None = None
            if not candidates:
                failure = IntegrityError(f"pack {obj} referenced by checkpoint {manifest.id} is missing", obj=obj)
                failure.__cause__ = exc
            for e in candidates:
                try:
                    stored = memoryview(blobs.store.get(pack_name(e.pack), e.offset, e.length))
                    out.append(_decode_ref(blobs, pipelines, r, stored))
                    failure = None
                    break
                except Exception as other:  # try the next copy
                    failure = _as_integrity(other, pack_name(e.pack), r)
            if failure is not None:
                out.append(BlockFailure(bytes.fromhex(r.key), failure))
        return out

    window = max(2, workers * 2)
    pool = ThreadPoolExecutor(max(1, min(workers, len(ranges) or 1)), thread_name_prefix="gpuckpt-load")
    pending: deque[Future[list[LoadedBlock | BlockFailure]]] = deque()
    it = iter(ranges)
    try:
        for rg in it:
            pending.append(pool.submit(fetch, rg))
            if len(pending) >= window:
                break
        while pending:
            fut = pending.popleft()
            results = fut.result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(fetch, nxt))
            for res in results:
                if isinstance(res, BlockFailure):
                    if errors is None:
                        raise res.error
                    errors.append(res)
                else:
                    yield res
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
