"""The repository: the public face of the checkpoint format.

::

    repo = Repository.open("s3://bucket/ckpts", key=KeySource.parse("file:/etc/gpuckpt/key"),
                           create=True)
    m = repo.save(blocks, worker_id="w0", namespace=ns, pins=pins, ledger=ledger)
    for block in repo.load(m.id):
        ...

The object layout, the write and read orders and the rules each reader
applies are specified in ``ckpt/FORMAT.md``. A :class:`Repository` composes
the modules named after its nouns: it opens the ``config``
(:mod:`ckpt.config`), holds a :class:`~ckpt.blobstore.BlobStore`, takes the
locks (:mod:`ckpt.lock`), and hands each operation to its module — saving
(:mod:`ckpt.save`), loading (:mod:`ckpt.load`), finding checkpoints
(:mod:`ckpt.manifest`), retention (:mod:`ckpt.retention`), verification
(:mod:`ckpt.verify`) and garbage collection (:mod:`ckpt.gc`).
"""

from __future__ import annotations

import builtins
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

from ckpt import gc as gc_mod
from ckpt import retention
from ckpt import verify as verify_mod
from ckpt.blobstore import BlobStore
from ckpt.blocks import Block, Existing, LoadedBlock, Namespace
from ckpt.config import CONFIG_NAME, DEFAULT_PACK_SIZE, RepoConfig, as_keyring, create_config, read_config
from ckpt.errors import (
    CheckpointNotFound,
    ConfigError,
    FormatError,
    IntegrityError,
    ObjectNotFound,
    RepositoryExists,
    RepositoryNotFound,
)
from ckpt.gc import GcReport
from ckpt.index import PREFIX as INDEX_PREFIX
from ckpt.index import MasterIndex
from ckpt.keys import Keyring, KeySource
from ckpt.load import BlockFailure, load_blocks
from ckpt.lock import DEFAULT_STALE_AFTER, Lock
from ckpt.lock import PREFIX as LOCK_PREFIX
from ckpt.manifest import (
    DEFAULT_MAX_BYTES,
    MAX_CLOCK_SKEW,
    CheckpointInfo,
    Ledger,
    Manifest,
    by_store_time,
    check_worker_id,
    list_checkpoints,
    read_manifest,
)
from ckpt.manifest import PREFIX as MANIFEST_PREFIX
from ckpt.pack import PREFIX as PACK_PREFIX
from ckpt.pack import BlobEntry
from ckpt.pins import Pins
from ckpt.save import SaveOptions, SaveProgress, save_checkpoint, store_blocks
from ckpt.store.base import Store, deadline_scope
from ckpt.url import open_store
from ckpt.verify import VerifyReport

log = logging.getLogger("gpuckpt.repository")

#: the longest a save may run, from taking its lock to writing its manifest;
#: a concurrent gc deletes a condemned pack only twice this long after
#: condemning it (FORMAT.md §9). Every writer of a repository must agree.
MAX_SAVE_SECONDS = 30 * 60.0


class Repository:
    """A checkpoint repository over a :class:`~ckpt.store.Store`. Thread-safe for
    concurrent loads; saves from several processes coordinate through locks."""

    def __init__(self, store: Store, config: RepoConfig, keyring: Keyring | None) -> None:
        #: what save, load, gc and verify work on: the store, keyring, config and master index
        self.blobs = BlobStore(store, config, keyring)
        #: a save that would commit later than this after taking its lock aborts instead
        self.max_save_seconds = MAX_SAVE_SECONDS

    # -- opening -------------------------------------------------------------------

    @classmethod
    def init(
        cls,
        target: str | Store,
        *,
        key: KeySource | Keyring | str | None = None,
        pack_size: int = DEFAULT_PACK_SIZE,
    ) -> Repository:
        """Create a repository. With a key, everything in it is encrypted."""
        store = open_store(target) if isinstance(target, str) else target
        keyring = as_keyring(key)
        return cls(store, create_config(store, keyring, pack_size), keyring)

    @classmethod
    def open(
        cls,
        target: str | Store,
        *,
        key: KeySource | Keyring | str | None = None,
        create: bool = False,
        pack_size: int = DEFAULT_PACK_SIZE,
    ) -> Repository:
        """Open an existing repository (or create it, with ``create``).

        Refuses unknown format versions (UnsupportedVersion), a missing key
        for an encrypted repository (KeyMissing) and a wrong key (KeyMismatch).
        """
        store = open_store(target, create=create) if isinstance(target, str) else target
        try:
            data = store.get(CONFIG_NAME)
        except ObjectNotFound:
            if create:
                try:
                    return cls.init(store, key=key, pack_size=pack_size)
                except RepositoryExists:
                    data = store.get(CONFIG_NAME)  # lost a creation race: open the winner's
            else:
                raise RepositoryNotFound(f"no gpuckpt repository at {store.url}") from None
        cfg, keyring = read_config(store, data, key)
        return cls(store, cfg, keyring)

    def close(self) -> None:
        self.blobs.close()

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the blob store holds -------------------------------------------------------

    @property
    def store(self) -> Store:
        return self.blobs.store

    @store.setter
    def store(self, store: Store) -> None:
        self.blobs.store = store

    @property
    def config(self) -> RepoConfig:
        return self.blobs.config

    @property
    def keyring(self) -> Keyring | None:
        return self.blobs.keyring

    @property
    def index(self) -> MasterIndex:
        return self.blobs.index

    @property
    def url(self) -> str:
        return self.blobs.url

    @property
    def encrypted(self) -> bool:
        return self.blobs.encrypted

    def default_save_options(self) -> SaveOptions:
        return SaveOptions(pack_size=self.config.pack_size)

    def blob_id(self, ns: Namespace, key: bytes) -> str:
        """The blob id of a block (:meth:`ckpt.blobstore.BlobStore.blob_id`)."""
        return self.blobs.blob_id(ns, key)

    def content_id(self, raw: Any) -> str | None:
        """The content id of a block's raw bytes (:meth:`ckpt.blobstore.BlobStore.content_id`)."""
        return self.blobs.content_id(raw)

    def relocate(self, missing_pack: str, blob_ids: Iterable[str]) -> dict[str, builtins.list[BlobEntry]]:
        """Where blobs a manifest places in ``missing_pack`` live now
        (:meth:`ckpt.blobstore.BlobStore.relocate`)."""
        return self.blobs.relocate(missing_pack, blob_ids)

    # -- saving and loading -------------------------------------------------------------

    def save(
        self,
        blocks: Iterable[Block | Existing],
        *,
        worker_id: str,
        namespace: Namespace,
        pins: Pins,
        layout: dict[str, Any] | None = None,
        ledger: Ledger | dict[str, Any] | None = None,
        canary: dict[str, Any] | None = None,
        labels: dict[str, str] | None = None,
        parent: str | None = "auto",
        options: SaveOptions | None = None,
        progress: Callable[[SaveProgress], None] | None = None,
        deadline: float | None = None,
        lock_wait: float = 30.0,
        cancel: threading.Event | None = None,
    ) -> Manifest:
        """Save a checkpoint; returns its manifest once it is visible.

        Blocks already in the repository (same namespace and key) are
        referenced, not rewritten; :class:`~ckpt.Existing` blocks are referenced
        without their bytes (:class:`~ckpt.errors.BlocksMissing` if the
        repository does not hold them). ``parent="auto"`` records this worker's
        newest checkpoint. ``deadline`` is a ``time.monotonic()`` value past
        which the save aborts with OperationAborted, leaving nothing visible;
        so does setting ``cancel`` (an agent making way for a preemption checkpoint).
        """
        check_worker_id(worker_id)
        # a deadline also bounds the store's retries (ckpt.store.base.deadline_scope), lock release included
        with (
            deadline_scope(deadline),
            Lock(self.store, exclusive=False, operation=f"save {worker_id}", wait=lock_wait) as held,
        ):
            self.blobs.refresh_index()
            if parent == "auto":
                mine = self.list(worker_id)
                parent = mine[-1].id if mine else None
            return save_checkpoint(
                self.blobs,
                blocks,
                worker_id=worker_id,
                namespace=namespace,
                pins=pins,
                layout=layout,
                ledger=ledger,
                canary=canary,
                labels=labels,
                parent=parent,
                options=options,
                progress=progress,
                deadline=deadline,
                before_commit=lambda: held.confirm(self.max_save_seconds),
                cancel=cancel,
            )

    def store_blocks(
        self,
        blocks: Iterable[Block | Existing],
        *,
        namespace: Namespace,
        deadline: float | None = None,
        cancel: threading.Event | None = None,
        options: SaveOptions | None = None,
        lock_wait: float = 30.0,
    ) -> dict[str, Any]:
        """Store blocks no checkpoint names yet (a pre-copy between checkpoints; see
        :func:`ckpt.save.store_blocks`), under a save's shared lock. A block already stored is
        skipped. Returns counts: ``blocks``, ``new_blocks``, ``new_raw_bytes``, ``packs_written``."""
        with (
            deadline_scope(deadline),
            Lock(self.store, exclusive=False, operation="store blocks", wait=lock_wait) as held,
        ):
            self.blobs.refresh_index()
            out = store_blocks(self.blobs, blocks, namespace, options=options, deadline=deadline, cancel=cancel)
            held.confirm(self.max_save_seconds)
            return out

    def load(
        self,
        ref: str | Manifest,
        *,
        keys: Iterable[bytes] | None = None,
        workers: int = 8,
        errors: list[BlockFailure] | None = None,
    ) -> Iterator[LoadedBlock]:
        """Stream a checkpoint's blocks back, each verified before it is yielded."""
        m = ref if isinstance(ref, Manifest) else self.manifest(ref)
        return load_blocks(self.blobs, m, keys=keys, workers=workers, errors=errors)

    # -- checkpoints -------------------------------------------------------------------------

    def list(self, worker_id: str | None = None) -> list[CheckpointInfo]:
        """Checkpoints (oldest first) from manifest names alone: no manifest is read."""
        return list_checkpoints(self.store, worker_id)

    def latest(
        self, worker_id: str | None = None, *, skew: timedelta = MAX_CLOCK_SKEW
    ) -> tuple[CheckpointInfo, Manifest]:
        """The newest checkpoint whose manifest reads (by the store's clock); unreadable ones are
        skipped and logged, so one rotten or planted manifest never hides the checkpoints before it."""
        cps = by_store_time(self.store, worker_id, skew)
        problems = []
        for c in reversed(cps):
            try:
                return c, self.manifest(c)
            except (FormatError, IntegrityError, CheckpointNotFound) as exc:
                log.warning("skipping an unreadable checkpoint", extra={"object": c.name, "error": str(exc)})
                problems.append(f"{c.id}: {exc}")
        where = f" for worker {worker_id!r}" if worker_id else ""
        more = "; …" if len(problems) > 1 else ""
        detail = f" ({len(problems)} unreadable: {problems[0]}{more})" if problems else ""
        raise CheckpointNotFound(f"no readable checkpoints{where} in {self.url}{detail}")

    def resolve(self, ref: str) -> CheckpointInfo:
        """Find a checkpoint by id, unique id prefix, ``latest`` or ``WORKER:latest``."""
        if not isinstance(ref, str) or not ref:
            # An empty prefix would match every checkpoint (and pick the only one).
            raise ConfigError(f"checkpoint reference {ref!r} is empty")
        if ref == "latest" or ref.endswith(":latest"):
            worker = None if ref == "latest" else check_worker_id(ref[: -len(":latest")])
            return self.latest(worker)[0]
        if "/" in ref:  # WORKER/ID
            worker, _, cid = ref.partition("/")
            matches = [c for c in self.list(worker) if c.id == cid]
        else:
            matches = [c for c in self.list() if c.id.startswith(ref)]
        if not matches:
            raise CheckpointNotFound(f"no checkpoint {ref!r} in {self.url}")
        if len(matches) > 1:
            raise CheckpointNotFound(
                f"checkpoint reference {ref!r} is ambiguous: {', '.join(c.id for c in matches[:5])}"
            )
        return matches[0]

    def manifest(self, ref: str | CheckpointInfo, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Manifest:
        """Read and check a manifest. Oversized, malformed, tampered or
        unknown-version manifests raise before any block is read."""
        info = ref if isinstance(ref, CheckpointInfo) else self.resolve(ref)
        return read_manifest(self.store, self.keyring, info, max_bytes)

    def manifests(self, worker_id: str | None = None) -> builtins.list[Manifest]:
        infos = self.list(worker_id)
        if not infos:
            return []
        with ThreadPoolExecutor(min(8, len(infos))) as ex:
            return list(ex.map(self.manifest, infos))

    def delete(self, ref: str) -> CheckpointInfo:
        """Remove one checkpoint's manifest; its data goes at the next ``gc``."""
        info = self.resolve(ref)
        with Lock(self.store, exclusive=False, operation=f"delete {info.id}"):
            self.store.delete(info.name)
        return info

    # -- maintenance -------------------------------------------------------------------------

    def forget(
        self,
        *,
        keep_last: int | None = None,
        keep_within: timedelta | None = None,
        worker_id: str | None = None,
        dry_run: bool = False,
        now: datetime | None = None,
    ) -> builtins.list[CheckpointInfo]:
        """Apply retention per worker (:func:`ckpt.retention.forget`): keep the newest ``keep_last``
        and any newer than ``keep_within``; the newest checkpoint of each worker is always kept.
        Removes manifests only; ``gc`` reclaims the data. Returns what was removed."""
        return retention.forget(
            self.blobs, keep_last=keep_last, keep_within=keep_within, worker_id=worker_id, dry_run=dry_run, now=now
        )

    def verify(
        self,
        ref: str | None = None,
        *,
        read_data: bool = True,
        progress: Callable[[int, int], None] | None = None,
    ) -> VerifyReport:
        """Check one checkpoint (every block read back and verified) or, with no
        ref, the whole repository: every manifest, index and pack, every blob's
        checksums, and that every referenced blob exists where it is said to
        (:mod:`ckpt.verify`)."""
        if ref is not None:
            return verify_mod.verify_checkpoint(self.blobs, self.resolve(ref), read_data=read_data, progress=progress)
        return verify_mod.verify_repository(self.blobs, read_data=read_data, progress=progress)

    def gc(
        self,
        *,
        grace: timedelta = timedelta(hours=1),
        dry_run: bool = False,
        lock_wait: float = 0.0,
        stale_lock_after: float = DEFAULT_STALE_AFTER,
        repack_below: float = 0.5,
        now: bool = False,
        delete_delay: timedelta | None = None,
    ) -> GcReport:
        """Mark, repack, condemn and sweep (FORMAT.md §9; :func:`ckpt.gc.collect` states the
        contract). By default beside saves, deleting a condemned pack only at a later gc once
        ``delete_delay`` (at least twice :attr:`max_save_seconds`) has passed; with ``now`` under
        the full exclusive lock, deleting at once. Packs younger than ``grace`` are left alone;
        sparse packs (live bytes under ``repack_below``) are repacked."""
        return gc_mod.collect(
            self.blobs,
            grace=grace,
            dry_run=dry_run,
            lock_wait=lock_wait,
            stale_lock_after=stale_lock_after,
            repack_below=repack_below,
            now=now,
            delete_delay=delete_delay,
            max_save_seconds=self.max_save_seconds,
        )

    def stats(self) -> dict[str, int]:
        """Object counts and bytes by kind (packs, index, manifests, locks)."""
        out: dict[str, int] = {}
        for prefix in (PACK_PREFIX, INDEX_PREFIX, MANIFEST_PREFIX, LOCK_PREFIX):
            n = size = 0
            for o in self.store.list(prefix):
                n += 1
                size += o.size
            out[prefix.rstrip("/") + "_count"] = n
            out[prefix.rstrip("/") + "_bytes"] = size
        return out
