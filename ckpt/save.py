"""The save pipeline: blocks in, packs and an index out, the manifest last.

Stages, each on its own threads so the whole runs close to its slowest::

    caller thread        dedup: blob id known? reference it, else submit
    encode pool          checksum → byte planes → zstd → AES-GCM → checksum
                         → append to the open pack (under a lock)
    upload pool          a sealed pack → store.put (parallel; multipart on S3)

Memory is bounded: at most ``max_memory`` bytes of raw blocks wait for the
encoders, and at most ``max_packs_in_flight`` packs (the open one included)
exist at once; a full budget blocks the caller, which is the backpressure.

Write order (FORMAT.md, "Writing a checkpoint"): every pack durable → one
index document → the manifest with a conditional create. A failure before the
manifest leaves no visible checkpoint; packs already written are removed on a
best-effort basis and otherwise reclaimed by ``gc`` after its grace period.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

from ckpt import checksum as cks
from ckpt.blobstore import BlobStore
from ckpt.blocks import DTYPES, Block, Existing, Namespace
from ckpt.codecs import AesGcm, BytePlane, Codec, CodecContext, Pipeline, Zstd
from ckpt.commit import CARRY_ROUNDS, carry_forward
from ckpt.errors import BlocksMissing, ConfigError, GpuckptError, IntegrityError, OperationAborted
from ckpt.index import PackRecord, encode_index, index_name
from ckpt.manifest import DEFAULT_MAX_BYTES as MANIFEST_MAX_BYTES
from ckpt.manifest import (
    BlockRef,
    CodecSpec,
    Encryption,
    Ledger,
    Manifest,
    Sizes,
    check_worker_id,
    new_checkpoint_id,
)
from ckpt.pack import BlobEntry, PackWriter, pack_name
from ckpt.pins import Pins

log = logging.getLogger("gpuckpt.save")
MiB = 1 << 20
#: past its deadline, a save waits this long for uploads in flight before leaving them behind
UPLOAD_GRACE = 1.0


@dataclass(frozen=True)
class SaveOptions:
    """Tuning for one save. The defaults suit a 2-core host and object storage."""

    #: target pack size; a pack is sealed when it reaches this
    pack_size: int = 32 * MiB
    #: "zstd" or "none"
    compression: str = "zstd"
    zstd_level: int = 1
    #: split multi-byte dtypes into byte planes before compressing
    byteplane: bool = True
    #: encoder threads (zstd and numpy release the GIL)
    workers: int = field(default_factory=lambda: os.cpu_count() or 2)
    #: parallel pack uploads
    upload_workers: int = 4
    #: bound on raw bytes queued for the encoders plus packs in memory
    max_memory: int = 512 * MiB
    #: a tighter bound on the raw bytes queued for the encoders alone (a caller whose blocks are
    #: views of host staging bounds that staging with it); None: what ``max_memory`` leaves
    max_queued_raw: int | None = None

    def __post_init__(self) -> None:
        if self.compression not in ("zstd", "none"):
            raise ConfigError(f"compression must be 'zstd' or 'none', not {self.compression!r}")
        if self.pack_size < 64 * 1024:
            raise ConfigError("pack_size must be at least 64 KiB")
        if self.workers < 1 or self.upload_workers < 1:
            raise ConfigError("workers and upload_workers must be at least 1")
        if self.max_memory < 2 * self.pack_size:
            raise ConfigError("max_memory must be at least twice pack_size")

    @property
    def max_packs_in_flight(self) -> int:
        return max(1, min(self.upload_workers + 1, (self.max_memory // 2) // self.pack_size))

    @property
    def encode_budget(self) -> int:
        budget = max(self.max_memory - self.max_packs_in_flight * self.pack_size, self.pack_size)
        return budget if self.max_queued_raw is None else max(1, min(budget, self.max_queued_raw))


@dataclass
class SaveProgress:
    """Counters a progress callback receives (a snapshot; safe to keep)."""

    blocks: int = 0
    raw_bytes: int = 0
    new_blocks: int = 0
    new_raw_bytes: int = 0
    shared_blocks: int = 0  # new to this trust domain, but stored already with the same bytes
    stored_bytes: int = 0  # bytes of new blobs after encoding
    uploaded_bytes: int = 0
    packs_written: int = 0
    phase: str = "blocks"


class _Budget:
    """A byte-counting semaphore; ``acquire`` of more than the total waits for
    everything else to drain, so one huge block cannot deadlock."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self.cond = threading.Condition()

    def acquire(self, n: int, abort: threading.Event) -> None:
        with self.cond:
            while self.used > 0 and self.used + n > self.total:
                if abort.is_set():
                    raise OperationAborted("save aborted")
                self.cond.wait(0.1)
            self.used += n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


def choose_pipeline(dtype: str, opts: SaveOptions, key_id: str | None) -> tuple[Codec, ...]:
    codecs: list[Codec] = []
    if opts.compression == "zstd":
        width = DTYPES[dtype]
        if opts.byteplane and width > 1:
            # Planes compressed apart: see ckpt/codecs/zstd.py.
            codecs.append(BytePlane(width))
            codecs.append(Zstd(opts.zstd_level, segments=width, tuning="planes"))
        else:
            codecs.append(Zstd(opts.zstd_level))
    if key_id is not None:
        codecs.append(AesGcm.for_writing(key_id))
    return tuple(codecs)


def _canon(pipeline: Pipeline) -> str:
    return json.dumps(pipeline.specs(), sort_keys=True, separators=(",", ":"))


class _Saver:
    def __init__(
        self,
        blobs: BlobStore,
        opts: SaveOptions,
        progress: Callable[[SaveProgress], None] | None,
        deadline: float | None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.blobs = blobs
        self.opts = opts
        self.progress_cb = progress
        self.deadline = deadline
        self.cancel = cancel
        self.key_id = blobs.keyring.key_id if blobs.keyring else None
        self.abort = threading.Event()
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.budget = _Budget(opts.encode_budget)
        self.pack_slots = threading.BoundedSemaphore(opts.max_packs_in_flight)
        self.pack: PackWriter | None = None
        self.entries: dict[str, BlobEntry] = {}  # blob id -> entry, for blobs new in this save
        self.written: list[PackRecord] = []
        self.uploads: list[Future[None]] = []
        self.prog = SaveProgress()
        self._last_progress = 0.0
        self._pipelines: dict[str, tuple[Pipeline, Pipeline, str, str]] = {}
        self._unreleased: dict[int, Block] = {}  # blocks received and not yet released
        self._free_buffers: list[bytearray] = []  # pack buffers whose upload finished
        self.encode_pool = ThreadPoolExecutor(opts.workers, thread_name_prefix="gpuckpt-encode")
        self.upload_pool = ThreadPoolExecutor(opts.upload_workers, thread_name_prefix="gpuckpt-upload")

    # -- helpers -----------------------------------------------------------

    def _pipelines_for(self, dtype: str) -> tuple[Pipeline, Pipeline, str, str]:
        """(preferred, fallback-without-compression) pipelines and their canonical specs."""
        p = self._pipelines.get(dtype)
        if p is None:
            full = Pipeline(choose_pipeline(dtype, self.opts, self.key_id))
            plain = Pipeline(choose_pipeline(dtype, SaveOptions(compression="none"), self.key_id))
            p = (full, plain, _canon(full), _canon(plain))
            self._pipelines[dtype] = p
        return p

    def _release(self, block: Block | Existing) -> None:
        """Call the block's release exactly once (the Block contract)."""
        if isinstance(block, Existing):
            return
        with self.lock:
            # held here until released, so no other block can have its id meanwhile
            if self._unreleased.pop(id(block), None) is None:
                return
        if block.release is not None:
            block.release()

    def _fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc
        self.abort.set()

    def expired(self) -> str | None:
        """Why this save must stop now (its deadline passed, or it was cancelled), or None."""
        if self.cancel is not None and self.cancel.is_set():
            return "save cancelled (a more urgent checkpoint needs the way); nothing was made visible"
        if self.deadline is not None and time.monotonic() > self.deadline:
            return "save did not finish before its deadline; nothing was made visible"
        return None

    def _check(self) -> None:
        if self.error is not None:
            raise self.error
        why = self.expired()
        if why is not None:
            exc = OperationAborted(why)
            self._fail(exc)
            raise exc

    def _report(self, force: bool = False) -> None:
        if self.progress_cb is None:
            return
        now = time.monotonic()
        if force or now - self._last_progress > 0.1:
            self._last_progress = now
            with self.lock:
                snap = SaveProgress(**vars(self.prog))
            self.progress_cb(snap)

    # -- encode stage ------------------------------------------------------------

    def _encode(self, blob_id: str, block: Block) -> None:
        n = block.nbytes
        try:
            if self.abort.is_set():
                return
            content = self.blobs.content_id(block.data)
            if content is not None and (same := self.blobs.index.lookup_content(content, n)) is not None:
                # these exact bytes are stored already (another trust domain's key): referenced, not
                # stored again; the content id is a keyed hash the save computed itself
                with self.lock:
                    self.entries[blob_id] = same
                    self.prog.new_blocks -= 1
                    self.prog.new_raw_bytes -= n
                    self.prog.shared_blocks += 1
                return
            full, plain, full_c, plain_c = self._pipelines_for(block.dtype)
            raw_sum = cks.checksum(block.data)
            ctx = CodecContext(self.blobs.keyring, blob_id.encode(), "pack", blob_id)
            stored = full.encode(block.data, ctx)
            codec = full_c
            if full_c != plain_c and memoryview(stored).nbytes >= n + (28 if self.key_id else 0):
                # Incompressible (already-random data): keep it raw, skip the
                # decompression cost on restore.
                stored, codec = plain.encode(block.data, ctx), plain_c
            stored_sum = cks.checksum(stored)
            self._add_to_pack(blob_id, stored, n, stored_sum, raw_sum, codec, content or "")
        except BaseException as exc:
            self._fail(exc)
        finally:
            self.budget.release(n)
            self._release(block)

    def _add_to_pack(
        self, blob_id: str, stored: Any, raw_len: int, s: str, rs: str, codec: str, content: str = ""
    ) -> None:
        sealed: PackWriter | None = None
        while True:
            with self.lock:
                if self.pack is not None:
                    e = self.pack.add(blob_id, stored, raw_len, s, rs, codec, content)
                    self.entries[blob_id] = e
                    self.prog.stored_bytes += e.length
                    if self.pack.size >= self.opts.pack_size:
                        sealed, self.pack = self.pack, None
                    break
            # No open pack: take a slot (may wait for an upload to finish).
            self._acquire_slot()
            with self.lock:
                opened = self._open_pack_if_none()
            if not opened:
                self.pack_slots.release()  # another thread opened one first
        if sealed is not None:
            self._submit_upload(sealed)

    def _open_pack_if_none(self) -> bool:
        """Open a new pack unless one is open; call with ``self.lock`` held."""
        if self.pack is not None:
            return False
        buffer = self._free_buffers.pop() if self._free_buffers else None
        self.pack = PackWriter(secrets.token_hex(16), self.opts.pack_size + (1 << 20), buffer)
        return True

    def _acquire_slot(self) -> None:
        while not self.pack_slots.acquire(timeout=0.1):
            if self.abort.is_set():
                raise OperationAborted("save aborted")

    # -- upload stage ------------------------------------------------------------------

    def _submit_upload(self, pw: PackWriter) -> None:
        # the upload carries this save's context: its deadline bounds the store's retries
        fut = self.upload_pool.submit(contextvars.copy_context().run, self._upload, pw)
        with self.lock:
            self.uploads.append(fut)

    def _upload(self, pw: PackWriter) -> None:
        try:
            if self.abort.is_set():
                return
            data = pw.finish(self.blobs.keyring)
            size = len(data)
            self.blobs.store.put(pw.name, data)
            try:
                data.release()
                reusable = True
            except BufferError:  # the store still holds a view: do not reuse
                reusable = False
            with self.lock:
                self.written.append(PackRecord(pw.id, size, tuple(pw.entries)))
                self.prog.uploaded_bytes += size
                self.prog.packs_written += 1
                if reusable:
                    self._free_buffers.append(pw.buf)
        except BaseException as exc:
            self._fail(exc)
        finally:
            self.pack_slots.release()

    # -- the whole ------------------------------------------------------------------------

    def run(
        self, blocks: Iterable[Block | Existing], ns: Namespace
    ) -> tuple[list[tuple[Existing, str]], dict[str, BlobEntry]]:
        """Stream blocks through the pipeline; returns (block, blob id) in input
        order and the entry for every blob referenced."""
        index = self.blobs.index
        # (key, dtype, shape) of each block in input order: not the block, whose buffer (a view of
        # the caller's staging) must be let go as soon as it is encoded or found stored
        refs: list[tuple[Existing, str]] = []
        known: dict[str, BlobEntry] = {}
        submitted: set[str] = set()
        encodes: list[Future[None]] = []
        missing: list[bytes] = []  # Existing blocks the repository does not hold
        mismatched: list[tuple[bytes, int, int]] = []  # blocks stored before at another size
        try:
            for block in blocks:
                self._check()
                if not isinstance(cast(object, block), Block | Existing):
                    raise ConfigError(f"save takes ckpt.Block or ckpt.Existing objects, got {type(block).__name__}")
                blob_id = self.blobs.blob_id(ns, block.key)
                if isinstance(block, Existing):
                    refs.append((block, blob_id))
                else:
                    refs.append((Existing(block.key, block.dtype, tuple(block.shape)), blob_id))
                    with self.lock:
                        self._unreleased[id(block)] = block
                n = block.nbytes
                with self.lock:
                    self.prog.blocks += 1
                    self.prog.raw_bytes += n
                if blob_id in submitted or blob_id in known:
                    self._release(block)
                    continue
                entry = index.lookup(blob_id)
                if isinstance(block, Existing):
                    if entry is None or entry.raw_length != n:
                        missing.append(block.key)  # gone (gc, another repository), condemned, or another size
                    else:
                        known[blob_id] = entry
                    continue
                if entry is not None:
                    if entry.raw_length != n:
                        # the same key and namespace naming another page format: the namespace
                        # fails to tell two formats apart, and this page must not refer to that blob
                        mismatched.append((block.key, entry.raw_length, n))
                    known[blob_id] = entry
                    self._release(block)
                    continue
                submitted.add(blob_id)
                with self.lock:
                    self.prog.new_blocks += 1
                    self.prog.new_raw_bytes += n
                self.budget.acquire(n, self.abort)
                encodes.append(self.encode_pool.submit(self._encode, blob_id, block))
                self._report()
            if mismatched:
                key, stored, page = mismatched[0]
                raise IntegrityError(
                    f"{len(mismatched)} block(s) are already stored under this worker's namespace with another "
                    f"size (first: {key.hex()[:16]}, stored {stored} bytes, this page {page}): the namespace does "
                    "not tell this worker's page format from another's; nothing was made visible"
                )
            if missing:
                shown = ", ".join(k.hex()[:16] for k in missing[:3])
                raise BlocksMissing(
                    f"{len(missing)} block(s) given as already stored are not in the repository "
                    f"(first: {shown}); nothing was made visible",
                    missing,
                )
            self.prog.phase = "flush"
            for f in encodes:
                while True:
                    self._check()
                    try:
                        f.result(timeout=0.1)
                        break
                    except TimeoutError:
                        continue
            self._check()
            with self.lock:
                last, self.pack = self.pack, None
            if last is not None:
                if last.entries:
                    self._submit_upload(last)
                else:
                    self.pack_slots.release()
            while True:
                with self.lock:
                    pending = [u for u in self.uploads if not u.done()]
                if not pending:
                    break
                self._check()
                time.sleep(0.01)
            self._check()
            self._report(force=True)
        except BaseException as exc:
            self._fail(exc)
            root = self.error
            if isinstance(exc, OperationAborted) and root is not None and root is not exc:
                # We were only woken by the abort: report what caused it.
                raise root from None
            raise
        finally:
            # Encoders read the caller's blocks: always waited for (CPU work,
            # short). A hung upload is not, once the deadline has passed: a
            # deadline bounds the save's wall time. Such an upload may still
            # land a pack later: no index or manifest names it, gc removes it.
            self.encode_pool.shutdown(wait=True, cancel_futures=True)
            if self.expired() is not None:
                with self.lock:
                    uploads = list(self.uploads)
                concurrent.futures.wait(uploads, timeout=UPLOAD_GRACE)  # let quick ones land (and be discarded)
                self.upload_pool.shutdown(wait=False, cancel_futures=True)
            else:
                self.upload_pool.shutdown(wait=True, cancel_futures=True)
            # Encodes cancelled by a failure never ran: release their blocks.
            with self.lock:
                left = list(self._unreleased.values())
            for b in left:
                self._release(b)
        with self.lock:
            known.update(self.entries)
        return refs, known

    def discard_written(self) -> None:
        """Best-effort removal of packs this failed save wrote (no index or
        manifest references them, so nothing else can)."""
        for p in self.written:
            # On failure gc reclaims it after the grace period.
            with contextlib.suppress(GpuckptError):
                self.blobs.store.delete(pack_name(p.id))


def _write_blobs(
    blobs: BlobStore,
    blocks: Iterable[Block | Existing],
    namespace: Namespace,
    options: SaveOptions | None,
    progress: Callable[[SaveProgress], None] | None,
    deadline: float | None,
    cancel: threading.Event | None,
) -> tuple[_Saver, list[tuple[Existing, str]], dict[str, BlobEntry], list[PackRecord]]:
    """Packs for every block not stored yet, then one index document naming them."""
    saver = _Saver(blobs, options or SaveOptions(pack_size=blobs.config.pack_size), progress, deadline, cancel)
    try:
        refs, entries = saver.run(blocks, namespace)
    except BaseException:
        if saver.expired() is not None:
            # past the deadline the caller must not wait on a store that may be hanging:
            # the clean-up is best effort anyway (gc reclaims what it leaves)
            threading.Thread(target=saver.discard_written, name="gpuckpt-discard", daemon=True).start()
        else:
            saver.discard_written()
        raise
    written = sorted(saver.written, key=lambda p: p.id)
    # A failure from here on leaves at most an index document; it names only
    # durable packs, so it is harmless, and later saves may dedup against it.
    if written:
        saver.prog.phase = "index"
        name = index_name(secrets.token_hex(16))
        blobs.store.put(name, encode_index(name, written, blobs.keyring))
        blobs.index.add(name, written)
    return saver, refs, entries, written


def store_blocks(
    blobs: BlobStore,
    blocks: Iterable[Block | Existing],
    namespace: Namespace,
    *,
    options: SaveOptions | None = None,
    progress: Callable[[SaveProgress], None] | None = None,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
) -> dict[str, Any]:
    """Store blocks ahead of the checkpoint that will name them (a pre-copy): packs and an index
    document, no manifest. A later save finds them stored and references them; until one does,
    gc keeps their packs for its grace period and then reclaims them as any unreferenced pack."""
    t0 = time.monotonic()
    saver, refs, _, written = _write_blobs(blobs, blocks, namespace, options, progress, deadline, cancel)
    return {
        "blocks": len(refs),
        "new_blocks": saver.prog.new_blocks,
        "new_raw_bytes": saver.prog.new_raw_bytes,
        "stored_bytes": saver.prog.stored_bytes,
        "packs_written": len(written),
        "seconds": time.monotonic() - t0,
    }


def save_checkpoint(
    blobs: BlobStore,
    blocks: Iterable[Block | Existing],
    *,
    worker_id: str,
    namespace: Namespace,
    pins: Pins,
    layout: dict[str, Any] | None = None,
    ledger: Ledger | dict[str, Any] | None = None,
    canary: dict[str, Any] | None = None,
    labels: dict[str, str] | None = None,
    parent: str | None = None,
    options: SaveOptions | None = None,
    progress: Callable[[SaveProgress], None] | None = None,
    deadline: float | None = None,
    before_commit: Callable[[], None] | None = None,
    cancel: threading.Event | None = None,
) -> Manifest:
    """Write the blocks, the index and then the manifest (the commit point).

    ``before_commit`` runs right before the manifest is written and may
    raise to abort (a save re-confirms its lock there: nothing is committed
    on a lock another process may already take for stale).
    """
    check_worker_id(worker_id)
    if isinstance(ledger, dict):
        ledger = Ledger.model_validate(ledger)
    t0 = time.monotonic()
    started = datetime.now(UTC)
    saver, refs, entries, written = _write_blobs(blobs, blocks, namespace, options, progress, deadline, cancel)
    t_blocks = time.monotonic() - t0
    # the last look at the packs on the store before the commit (a round that copied re-checks the others)
    for _ in range(CARRY_ROUNDS):
        entries, copied = carry_forward(blobs, entries, written)
        written = [*written, *copied]
        if not copied:
            break
    else:
        raise OperationAborted(f"gc kept condemning packs this save uses through {CARRY_ROUNDS} rounds; not committing")

    codec_table: dict[str, int] = {}
    block_refs = []
    for block, blob_id in refs:
        e = entries[blob_id]
        ci = codec_table.setdefault(e.codec, len(codec_table))
        block_refs.append(
            BlockRef(
                key=block.key.hex(),
                blob=e.id,  # another blob id where the bytes were shared by content
                pack=e.pack,
                offset=e.offset,
                length=e.length,
                raw_length=e.raw_length,
                checksum=e.checksum,
                raw_checksum=e.raw_checksum,
                codec=ci,
                dtype=block.dtype,
                shape=list(block.shape),
            )
        )
    prog = saver.prog
    manifest = Manifest(
        id=new_checkpoint_id(started),
        worker_id=worker_id,
        created=started,
        parent=parent,
        namespace=dict(namespace.fields),
        pins=pins,
        layout=layout or {},
        codecs=[[CodecSpec(**s) for s in json.loads(c)] for c in codec_table],
        blocks=block_refs,
        ledger=ledger,
        canary=canary,
        labels=labels or {},
        sizes=Sizes(
            blocks=len(block_refs),
            raw_bytes=sum(b.raw_length for b in block_refs),
            stored_bytes=sum(b.length for b in block_refs),
            new_blocks=prog.new_blocks,
            new_raw_bytes=prog.new_raw_bytes,
            new_stored_bytes=prog.stored_bytes,
            packs_written=len(written),
        ),
        timings={"blocks_s": round(t_blocks, 6), "total_s": round(time.monotonic() - t0, 6)},
        encryption=Encryption(alg="aes-256-gcm", key_id=saver.key_id) if saver.key_id else None,
    )
    why = saver.expired()
    if why is not None:
        raise OperationAborted(why)
    if before_commit is not None:
        before_commit()
    saver.prog.phase = "manifest"
    encoded = manifest.encode(blobs.keyring)
    if len(encoded) > MANIFEST_MAX_BYTES:
        # readers refuse it (ckpt.manifest.DEFAULT_MAX_BYTES): `latest` would skip it and gc take its data
        raise OperationAborted(
            f"the manifest of {len(block_refs)} blocks is {len(encoded)} bytes, more than readers accept "
            f"({MANIFEST_MAX_BYTES}); not committing: checkpoint fewer blocks (a smaller prefix cache)"
        )
    # The commit point: the checkpoint exists once this create succeeds.
    blobs.store.put(manifest.name, encoded, if_absent=True)
    saver.prog.phase = "done"
    saver._report(force=True)
    log.info(
        "checkpoint saved",
        extra={
            "checkpoint": manifest.id,
            "worker": worker_id,
            "blocks": manifest.sizes.blocks,
            "new_blocks": manifest.sizes.new_blocks,
            "stored_bytes": manifest.sizes.new_stored_bytes,
            "seconds": manifest.timings["total_s"],
        },
    )
    return manifest
