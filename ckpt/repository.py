"""The repository: the public face of the checkpoint format.

::

    repo = Repository.open("s3://bucket/ckpts", key=KeySource.parse("file:/etc/gpuckpt/key"),
                           create=True)
    m = repo.save(blocks, worker_id="w0", namespace=ns, pins=pins, ledger=ledger)
    for block in repo.load(m.id):
        ...

The object layout, the write and read orders and the rules each reader
applies are specified in ``ckpt/FORMAT.md``; this module implements them.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from ckpt import checksum as cks
from ckpt import document
from ckpt.blocks import Block, Existing, LoadedBlock, Namespace
from ckpt.codecs import Pipeline
from ckpt.errors import (
    CheckpointNotFound,
    ConfigError,
    FormatError,
    GpuckptError,
    IntegrityError,
    KeyMissing,
    ManifestError,
    ObjectExists,
    ObjectNotFound,
    RepositoryExists,
    RepositoryNotFound,
    UnsupportedVersion,
)
from ckpt.index import PREFIX as INDEX_PREFIX
from ckpt.index import MasterIndex, PackRecord, encode_index, index_name
from ckpt.keys import ALG, Keyring, KeySource
from ckpt.load import BlockFailure, decode_blob, load_blocks
from ckpt.lock import DEFAULT_STALE_AFTER, Lock, check_stale_limit, remove_stale_locks, store_now
from ckpt.lock import PREFIX as LOCK_PREFIX
from ckpt.manifest import (
    DEFAULT_MAX_BYTES,
    BlockRef,
    Ledger,
    Manifest,
    check_worker_id,
    is_checkpoint_id,
    is_worker_id,
)
from ckpt.manifest import (
    PREFIX as MANIFEST_PREFIX,
)
from ckpt.pack import BlobEntry, PackWriter, pack_name, read_trailer
from ckpt.pins import Pins
from ckpt.save import SaveOptions, SaveProgress, save_checkpoint, store_blocks
from ckpt.store.base import ObjectInfo, Store, deadline_scope
from ckpt.url import open_store

log = logging.getLogger("gpuckpt.repository")

CONFIG_NAME = "config"
CONFIG_KIND = "gpuckpt-repository"
CONFIG_VERSION = 1
CONFIG_SUPPORTED = (1,)
PACK_PREFIX = "packs/"
#: ``latest`` and ``forget`` ignore checkpoints whose id is later than the
#: store's own time of writing by more than this (FORMAT.md §6)
MAX_CLOCK_SKEW = timedelta(hours=1)
#: the longest a save may run, from taking its lock to writing its manifest;
#: a concurrent gc deletes a condemned pack only twice this long after
#: condemning it (FORMAT.md §9). Every writer of a repository must agree.
MAX_SAVE_SECONDS = 30 * 60.0
#: bounds a reader enforces on ``config.pack_size``
PACK_SIZE_RANGE = (64 << 10, 1 << 30)
#: a new repository's pack size, and the one used where a config's cannot be trusted
DEFAULT_PACK_SIZE = 32 << 20


@dataclass(frozen=True)
class RepoConfig:
    id: str
    created: str
    pack_size: int
    encryption: dict[str, str] | None

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "pack_size": self.pack_size, "encryption": self.encryption}

    def mac_message(self) -> bytes:
        enc = {k: v for k, v in (self.encryption or {}).items() if k != "mac"}
        return document.canonical({**self.body(), "encryption": enc})

    @classmethod
    def parse(cls, body: dict[str, Any]) -> RepoConfig:
        try:
            enc = body["encryption"]
            if enc is not None and (not isinstance(enc, dict) or enc.get("alg") != ALG):
                raise FormatError(f"config: unsupported encryption {enc!r}")
            if type(body["pack_size"]) is not int:
                raise TypeError("pack_size is not an integer")
            cfg = cls(str(body["id"]), str(body["created"]), body["pack_size"], enc)
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"config: malformed ({exc})") from None
        lo, hi = PACK_SIZE_RANGE
        if not lo <= cfg.pack_size <= hi:
            raise FormatError(f"config: pack_size {cfg.pack_size} outside [{lo}, {hi}]")
        return cfg

    def authenticate(self, keyring: Keyring) -> RepoConfig:
        """An encrypted repository's config carries a MAC under the key: an edit
        (say of ``pack_size``) by someone without the key is refused. A config
        without one (written before configs were authenticated, or one whose MAC
        someone removed) is read, but nothing in it that a writer without the
        key could have chosen is used: the config returned has the default
        ``pack_size`` (a planted 64 KiB would make every save write thousands of
        packs, 1 GiB would make every save hold a gigabyte)."""
        assert self.encryption is not None
        mac = self.encryption.get("mac")
        if mac is None:
            log.warning(
                "the repository config is not authenticated (no MAC: an older gpuckpt, or removed): "
                "its pack_size is ignored",
                extra={"pack_size": self.pack_size, "used": DEFAULT_PACK_SIZE},
            )
            return dataclasses.replace(self, pack_size=DEFAULT_PACK_SIZE)
        if not hmac.compare_digest(str(mac), keyring.config_mac(self.mac_message())):
            raise IntegrityError("config: authentication failed: the repository config was modified", obj="config")
        return self


@dataclass(frozen=True)
class CheckpointInfo:
    """What listing knows of a checkpoint from its object name alone."""

    id: str
    worker_id: str
    name: str
    created: datetime  # the writer's clock (from the id)
    size: int  # manifest bytes
    stored: float = 0.0  # the store's clock: when the manifest object was written

    def future_dated(self, skew: timedelta) -> bool:
        """Whether the id claims a time later than the store recorded by more than ``skew``:
        a writer whose clock runs ahead, or an object someone planted."""
        return self.stored > 0 and self.created.timestamp() - self.stored > skew.total_seconds()


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
    dry_run: bool = False
    exclusive: bool = False  # gc --now: saves waited for, deletes at once
    # condemned by this gc: deleted by a later one, once no save can still reference them
    condemned_packs: list[str] = field(default_factory=list)
    pending_packs: int = 0  # condemned earlier, not yet ripe
    rescued_packs: list[str] = field(default_factory=list)  # condemned, but a manifest needs them
    # skipped, reported, never deleted: manifests and index documents that do not read
    unreadable: list[str] = field(default_factory=list)


def _ckpt_time(cid: str) -> datetime:
    return datetime.strptime(cid[:15], "%Y%m%dT%H%M%S").replace(microsecond=int(cid[15:18]) * 1000, tzinfo=UTC)


def _as_keyring(key: KeySource | Keyring | str | None) -> Keyring | None:
    if key is None or isinstance(key, Keyring):
        return key
    if isinstance(key, str):
        key = KeySource.parse(key)
    return key.load()


class Repository:
    """A checkpoint repository over a :class:`~ckpt.store.Store`. Thread-safe for
    concurrent loads; saves from several processes coordinate through locks."""

    def __init__(self, store: Store, config: RepoConfig, keyring: Keyring | None) -> None:
        self.store = store
        self.config = config
        self.keyring = keyring
        self.index = MasterIndex()
        self._relocate_lock = threading.Lock()
        #: a save that would commit later than this after taking its lock aborts instead
        self.max_save_seconds = MAX_SAVE_SECONDS

    # -- opening -------------------------------------------------------------------

    @classmethod
    def init(
        cls,
        target: str | Store,
        *,
        key: KeySource | Keyring | str | None = None,
        pack_size: int = 32 << 20,
    ) -> Repository:
        """Create a repository. With a key, everything in it is encrypted."""
        store = open_store(target) if isinstance(target, str) else target
        keyring = _as_keyring(key)
        lo, hi = PACK_SIZE_RANGE
        if not lo <= pack_size <= hi:
            raise ConfigError(f"pack_size {pack_size} outside [{lo}, {hi}]")
        enc = None
        if keyring is not None:
            enc = {"alg": ALG, "key_id": keyring.key_id, "check": keyring.make_check()}
        cfg = RepoConfig(secrets.token_hex(16), datetime.now(UTC).isoformat(), pack_size, enc)
        if keyring is not None:
            assert cfg.encryption is not None
            cfg.encryption["mac"] = keyring.config_mac(cfg.mac_message())
        data = document.seal(CONFIG_KIND, CONFIG_VERSION, CONFIG_NAME, cfg.body(), None)
        try:
            store.put(CONFIG_NAME, data, if_absent=True)
        except ObjectExists:
            raise RepositoryExists(f"a repository already exists at {store.url}") from None
        return cls(store, cfg, keyring)

    @classmethod
    def open(
        cls,
        target: str | Store,
        *,
        key: KeySource | Keyring | str | None = None,
        create: bool = False,
        pack_size: int = 32 << 20,
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
        _, body = document.open_envelope(
            data, kind=CONFIG_KIND, supported=CONFIG_SUPPORTED, name=CONFIG_NAME, keyring=None
        )
        cfg = RepoConfig.parse(body)
        keyring = _as_keyring(key)
        if cfg.encryption is not None:
            if keyring is None:
                raise KeyMissing(
                    f"the repository at {store.url} is encrypted (key {cfg.encryption.get('key_id')}); "
                    "give its key (--key file:/path or env:NAME)"
                )
            keyring.verify_check(cfg.encryption["check"], cfg.encryption["key_id"])
            cfg = cfg.authenticate(keyring)
        elif keyring is not None:
            raise ConfigError(f"the repository at {store.url} is not encrypted; do not give a key")
        return cls(store, cfg, keyring)

    def close(self) -> None:
        self.store.close()

    def relocate(self, missing_pack: str, blob_ids: Iterable[str]) -> dict[str, builtins.list[BlobEntry]]:
        """Where blobs that a manifest places in ``missing_pack`` live now
        (moved by a gc repack), from a freshly read index: every copy of each
        outside that pack. Blobs not found elsewhere are absent from the result."""
        with self._relocate_lock:
            self.index.refresh(self.store, self.keyring)
        out = {}
        for b in blob_ids:
            copies = [e for e in self.index.copies(b) if e.pack != missing_pack]
            if copies:
                out[b] = copies
        return out

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def encrypted(self) -> bool:
        return self.keyring is not None

    def default_save_options(self) -> SaveOptions:
        return SaveOptions(pack_size=self.config.pack_size)

    def blob_id(self, ns: Namespace, key: bytes) -> str:
        """The blob id of a block: SHA-256 (HMAC-SHA-256 when encrypted) over
        namespace id and content key."""
        msg = b"gpuckpt-blob\x00" + ns.id.encode() + b"\x00" + key
        if self.keyring is not None:
            return self.keyring.blob_mac(msg)
        return hashlib.sha256(msg).hexdigest()

    def content_id(self, raw: Any) -> str | None:
        """The content id of a block's raw bytes: HMAC-SHA-256 (the blob-id key) over their SHA-256,
        in an encrypted repository only — there no one without the key can claim one in an index
        document, so a save may reference another trust domain's blob of exactly these bytes
        (FORMAT.md §10, trust domains). ``None`` in a plain repository: no sharing by content."""
        if self.keyring is None:
            return None
        return self.keyring.blob_mac(b"gpuckpt-content\x00" + hashlib.sha256(raw).digest())

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
            self.index.refresh(self.store, self.keyring)
            if parent == "auto":
                mine = self.list(worker_id)
                parent = mine[-1].id if mine else None
            return save_checkpoint(
                self,
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
            self.index.refresh(self.store, self.keyring)
            out = store_blocks(self, blocks, namespace, options=options, deadline=deadline, cancel=cancel)
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
        return load_blocks(self, m, keys=keys, workers=workers, errors=errors)

    # -- checkpoints -------------------------------------------------------------------------

    def list(self, worker_id: str | None = None) -> list[CheckpointInfo]:
        """Checkpoints (oldest first) from manifest names alone: no manifest is read."""
        prefix = MANIFEST_PREFIX + (check_worker_id(worker_id) + "/" if worker_id else "")
        out = []
        for o in self.store.list(prefix):
            parts = o.name[len(MANIFEST_PREFIX) :].split("/")
            if len(parts) != 2 or not is_checkpoint_id(parts[1]):
                continue  # not ours: ignored, and left alone
            out.append(CheckpointInfo(parts[1], parts[0], o.name, _ckpt_time(parts[1]), o.size, o.mtime))
        out.sort(key=lambda c: (c.id, c.worker_id))
        return out

    def _by_store_time(self, worker_id: str | None, skew: timedelta) -> builtins.list[CheckpointInfo]:
        """Checkpoints oldest first by the store's clock (then id), without future-dated ones.

        A writer's clock can step back or run ahead; the store's time of
        writing orders checkpoints as they were committed.
        """
        out = []
        for c in self.list(worker_id):
            if c.future_dated(skew):
                log.warning(
                    "ignoring a future-dated checkpoint",
                    extra={"object": c.name, "claimed": c.created.isoformat(), "stored": c.stored},
                )
                continue
            out.append(c)
        out.sort(key=lambda c: (c.stored, c.id))
        return out

    def latest(
        self, worker_id: str | None = None, *, skew: timedelta = MAX_CLOCK_SKEW
    ) -> tuple[CheckpointInfo, Manifest]:
        """The newest checkpoint whose manifest reads (by the store's clock); unreadable ones are
        skipped and logged, so one rotten or planted manifest never hides the checkpoints before it."""
        cps = self._by_store_time(worker_id, skew)
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
        if not is_worker_id(info.worker_id):
            # listed (and shown, escaped) for what it is, but never read: a store may refuse the name
            # (InvalidName), and one planted `manifests/bad name/<id>` must not stop `latest`,
            # retention or gc, which skip an unreadable manifest and go on
            raise ManifestError(f"{info.name}: not a manifest name gpuckpt writes (a planted object?)")
        try:
            st = self.store.stat(info.name)
            if st.size > max_bytes:
                raise document_error(info.name, st.size, max_bytes)
            data = self.store.get(info.name)
        except ObjectNotFound:
            raise CheckpointNotFound(f"checkpoint {info.id} vanished (removed by forget?)") from None
        return Manifest.decode(info.name, data, self.keyring, max_bytes)

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

    def forget(
        self,
        *,
        keep_last: int | None = None,
        keep_within: timedelta | None = None,
        worker_id: str | None = None,
        dry_run: bool = False,
        now: datetime | None = None,
    ) -> builtins.list[CheckpointInfo]:
        """Apply retention per worker: keep the newest ``keep_last`` and any newer
        than ``keep_within``; the newest checkpoint of each worker is always kept.
        Removes manifests only; ``gc`` reclaims the data. Returns what was removed."""
        if keep_last is None and keep_within is None:
            raise ConfigError("forget needs keep_last and/or keep_within")
        if keep_last is not None and keep_last < 1:
            raise ConfigError("keep_last must be at least 1: the newest checkpoint is always kept")
        now = now or datetime.now(UTC)
        by_worker: dict[str, list[CheckpointInfo]] = {}
        for c in self._readable(self._by_store_time(worker_id, MAX_CLOCK_SKEW)):
            by_worker.setdefault(c.worker_id, []).append(c)
        doomed = []
        for cps in by_worker.values():
            for i, c in enumerate(reversed(cps)):
                keep = i == 0
                keep |= keep_last is not None and i < keep_last
                keep |= keep_within is not None and now - c.created <= keep_within
                if not keep:
                    doomed.append(c)
        if doomed and not dry_run:
            with Lock(self.store, exclusive=False, operation="forget"):
                for c in doomed:
                    self.store.delete(c.name)
        return doomed

    def _readable(self, infos: builtins.list[CheckpointInfo]) -> builtins.list[CheckpointInfo]:
        """The checkpoints whose manifests read, in order; the others are logged and left alone
        (retention must never count garbage as a kept checkpoint, nor delete what it cannot read)."""
        if not infos:
            return []

        def ok(c: CheckpointInfo) -> bool:
            try:
                self.manifest(c)
                return True
            except (FormatError, IntegrityError, CheckpointNotFound) as exc:
                log.warning("retention skips an unreadable checkpoint", extra={"object": c.name, "error": str(exc)})
                return False

        with ThreadPoolExecutor(min(8, len(infos))) as ex:
            flags = list(ex.map(ok, infos))
        return [c for c, f in zip(infos, flags, strict=True) if f]

    # -- verify -----------------------------------------------------------------------------

    def verify(
        self,
        ref: str | None = None,
        *,
        read_data: bool = True,
        progress: Callable[[int, int], None] | None = None,
    ) -> VerifyReport:
        """Check one checkpoint (every block read back and verified) or, with no
        ref, the whole repository: every manifest, index and pack, every blob's
        checksums, and that every referenced blob exists where it is said to."""
        report = VerifyReport()
        if ref is not None:
            info = self.resolve(ref)
            try:
                m = self.manifest(info)
            except (FormatError, IntegrityError) as exc:
                # A damaged manifest is a finding, as in the whole-repository check.
                report.problems.append(Problem(info.name, str(exc)))
                return report
            report.checked_checkpoints = 1
            failures: list[BlockFailure] = []
            if read_data:
                total = len(m.blocks)
                for n, _ in enumerate(self.load(m, errors=failures), 1):
                    report.checked_blobs += 1
                    if progress:
                        progress(n, total)
                for f in failures:
                    obj = getattr(f.error, "obj", None) or "?"
                    report.problems.append(Problem(obj, str(f.error), getattr(f.error, "blob", None)))
            else:
                self._check_refs_exist(m, report)
                report.checked_blobs += len(m.blocks)
            return report
        return self._verify_all(read_data, progress, report)

    def _check_refs_exist(self, m: Manifest, report: VerifyReport) -> None:
        sizes: dict[str, int | None] = {}
        by_pack: dict[str, builtins.list[BlockRef]] = {}
        for b in m.blocks:
            by_pack.setdefault(b.pack, []).append(b)
        for b in m.blocks:
            if b.pack not in sizes:
                try:
                    sizes[b.pack] = self.store.stat(f"packs/{b.pack[:2]}/{b.pack}").size
                except ObjectNotFound:
                    sizes[b.pack] = None
                    # Repacked by gc? Then every blob must be found elsewhere.
                    refs = by_pack[b.pack]
                    moved = self.relocate(b.pack, [r.blob for r in refs])
                    # The reference's own copy: same stored checksum and length.
                    lost = [
                        r
                        for r in refs
                        if not any(e.checksum == r.checksum and e.length == r.length for e in moved.get(r.blob, ()))
                    ]
                    if lost:
                        report.problems.append(
                            Problem(
                                f"packs/{b.pack[:2]}/{b.pack}",
                                f"missing pack referenced by {m.name} ({len(lost)} blobs not found elsewhere)",
                            )
                        )
            size = sizes[b.pack]
            if size is not None and b.offset + b.length > size:
                report.problems.append(
                    Problem(
                        f"packs/{b.pack[:2]}/{b.pack}",
                        f"truncated: blob {b.blob} of {m.name} lies past its end",
                        b.blob,
                    )
                )

    def _verify_all(
        self, read_data: bool, progress: Callable[[int, int], None] | None, report: VerifyReport
    ) -> VerifyReport:
        manifests: list[Manifest] = []
        for info in self.list():
            try:
                manifests.append(self.manifest(info))
            except GpuckptError as exc:
                report.problems.append(Problem(info.name, str(exc)))
        report.checked_checkpoints = len(manifests)
        for n in {o.name for o in self.store.list(INDEX_PREFIX)}:
            try:
                self.store.get(n)
            except GpuckptError as exc:
                report.problems.append(Problem(n, str(exc)))
        try:
            self.index.refresh(self.store, self.keyring)
        except GpuckptError as exc:
            report.problems.append(Problem("index/", str(exc)))
        report.problems += [Problem(n, why) for n, why in sorted(self.index.unreadable.items())]
        for m in manifests:
            self._check_refs_exist(m, report)
        if not read_data:
            report.checked_blobs = sum(len(m.blocks) for m in manifests)
            return report
        packs = sorted(self.store.list(PACK_PREFIX), key=lambda o: o.name)
        for i, o in enumerate(packs, 1):
            pid = o.name.rsplit("/", 1)[-1]
            try:
                data = self.store.get(o.name)
                entries = read_trailer(data, pid, self.keyring)
            except GpuckptError as exc:
                report.problems.append(Problem(o.name, str(exc)))
                continue
            report.checked_packs += 1
            for e in entries:
                try:
                    decode_blob(
                        self.keyring,
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

    # -- garbage collection --------------------------------------------------------------------

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
        the longest a save may run, :attr:`max_save_seconds`): by then every
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
        delay = delete_delay.total_seconds() if delete_delay is not None else 2 * self.max_save_seconds
        if not now and delay < 2 * self.max_save_seconds:
            raise ConfigError(
                f"delete_delay {delay:.0f}s is shorter than twice the longest a save may run "
                f"({self.max_save_seconds:.0f}s): a save still running could lose data; use gc --now"
            )
        report = GcReport(dry_run=dry_run, exclusive=now)
        with Lock(
            self.store,
            exclusive=True,
            mode="" if now else "gc",
            operation="gc",
            wait=lock_wait if now else 0.0,
            stale_after=stale_lock_after,
        ) as held:
            # The store's time before the manifests are read: a condemnation
            # ripe at this time was visible to every save whose manifest can
            # still appear after the read below (FORMAT.md §9).
            t_now = store_now(self.store, held.name)
            manifests = self._gc_manifests(report)
            named_packs: set[str] = set()
            live_blobs: set[str] = set()
            for m in manifests:
                for b in m.blocks:
                    live_blobs.add(b.blob)
                    named_packs.add(b.pack)
            report.live_blobs = len(live_blobs)
            self.index.refresh(self.store, self.keyring)
            if self.index.unsupported:
                # a newer writer's index: the packs it lists are not garbage
                raise next(iter(self.index.unsupported.values()))
            report.unreadable += [f"{n}: {why}" for n, why in self.index.unreadable.items()]
            indexed = self.index.packs
            superseded = self.index.superseded
            condemned = self.index.condemned
            cutoff = t_now - grace.total_seconds()
            existing: dict[str, ObjectInfo] = {}
            dead: list[ObjectInfo] = []
            to_repack: list[tuple[ObjectInfo, list[BlobEntry]]] = []
            for o in self.store.list(PACK_PREFIX):
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
                written = self._repack(to_repack, report)
            repacked = {n.rsplit("/", 1)[-1] for n in report.repacked_packs}
            fresh = {o.name.rsplit("/", 1)[-1] for o in dead} | repacked
            # Ripe: deletable now, unless a manifest still needs it (rescue below).
            ripe = {p for p, t in condemned.items() if now or t_now - t >= delay} | set(superseded)
            if now:
                ripe |= fresh
            ripe &= set(existing)
            rescued = self._rescue(manifests, ripe, written, set(existing))
            doomed = ripe - rescued
            report.rescued_packs = sorted(existing[p].name for p in rescued)
            # this run's repacked packs are reported as repacked, not deleted
            report.deleted_packs = sorted(existing[p].name for p in doomed - repacked)
            report.deleted_bytes = sum(existing[p].size for p in doomed - repacked)
            newly = {} if now else {p: 0.0 for p in fresh}
            report.condemned_packs = sorted(existing[p].name for p in newly)
            report.pending_packs = len(set(condemned) - ripe)
            if dry_run:
                report.rewritten_indexes = len(self._stale_docs(doomed, rescued))
                return report
            # A gc that was suspended may have had its lock taken for stale by another gc, which
            # may have rescued (un-condemned) what this one is about to delete: do not delete then.
            held.confirm(stale_after=DEFAULT_STALE_AFTER)  # other gcs judge our lock by the default
            self._rewrite_index(written, doomed, rescued, newly, set(existing), report)
            # _repack counted what repacking frees (old size − live bytes copied)
            report.reclaimed_bytes += report.deleted_bytes
            report.removed_debris = self.store.cleanup(cutoff)
            report.removed_locks = len(remove_stale_locks(self.store, stale_lock_after, keep=held.name))
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

    def _gc_manifests(self, report: GcReport) -> builtins.list[Manifest]:
        manifests = []
        for info in self.list():
            # A store failure aborts gc: deleting data on a manifest we could
            # not fetch could destroy a checkpoint, and so could one of a
            # format version we do not know (a newer writer's). A manifest that
            # was fetched and does not read (rotten, planted) cannot be
            # restored from: it is reported, left in place, and protects nothing.
            try:
                try:
                    manifests.append(self.manifest(info))
                except UnsupportedVersion:
                    raise
                except (FormatError, IntegrityError):
                    manifests.append(self.manifest(info))  # a second read: never judge on one torn GET
            except UnsupportedVersion:
                raise  # a newer writer's checkpoint: its references are unknown, delete nothing
            except CheckpointNotFound:
                continue  # forgotten since the listing: it protects nothing
            except (FormatError, IntegrityError) as exc:
                log.warning("gc skips an unreadable manifest", extra={"object": info.name, "error": str(exc)})
                report.unreadable.append(f"{info.name}: {exc}")
        return manifests

    def _rescue(
        self,
        manifests: builtins.list[Manifest],
        ripe: set[str],
        written: builtins.list[PackRecord],
        existing: set[str] | None = None,
    ) -> set[str]:
        """The ripe packs some manifest still needs: a ripe pack holding a referenced blob (by its
        reference's checksum and length) is kept unless another copy is *shown* to be elsewhere —
        in a pack this gc just wrote, or in a pack that exists, is not going, and whose trailer
        lists the blob with bytes that match its checksum (checked here). An index document's word
        alone never lets a needed pack go: a planted one listing phantom copies rescues nothing
        away (FORMAT.md §9 step 6)."""
        mine: dict[str, builtins.list[BlobEntry]] = {}
        for rec in written:
            for e in rec.entries:
                mine.setdefault(e.id, []).append(e)
        present = set(self.index.packs) if existing is None else existing
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
                    e.pack for e in self.index.copies(b.blob) if e.checksum == b.checksum and e.length == b.length
                } | {b.pack}
                need[want] = (holders & ripe, holders - ripe)
        # only the blobs a going pack holds need their other copies shown (rare: a save that raced
        # a condemnation, or a planted document): the usual gc reads no pack here
        shown = self._copies_shown({(w, q) for w, (going, others) in need.items() if going for q in others}, present)
        rescued: set[str] = set()
        for want, (going, others) in need.items():
            if going and not any((want, q) in shown for q in others):
                rescued |= going
        return rescued

    def _copies_shown(
        self, claims: set[tuple[tuple[str, str, int], str]], present: set[str]
    ) -> set[tuple[tuple[str, str, int], str]]:
        """The claims ``((blob, checksum, length), pack)`` that hold on the store: the pack exists,
        its trailer lists the blob with that checksum and length, and those bytes match it. Each
        pack is read once; one that does not read shows nothing."""
        by_pack: dict[str, builtins.list[tuple[str, str, int]]] = {}
        for want, q in claims:
            if q in present:
                by_pack.setdefault(q, []).append(want)
        out: set[tuple[tuple[str, str, int], str]] = set()
        for q, wants in by_pack.items():
            try:
                data = memoryview(self.store.get(pack_name(q)))
                listed = {(e.id, e.checksum, e.length): e for e in read_trailer(data, q, self.keyring)}
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

    def _stale_docs(self, doomed: set[str], rescued: set[str]) -> builtins.list[str]:
        """Index documents a rewrite replaces: those naming a doomed pack, or condemning or
        superseding a pack that is going now or was rescued."""
        touched = doomed | rescued
        return [
            n
            for n, recs in self.index.documents.items()
            if any(p.id in doomed for p in recs)
            or touched & self.index.condemned_by(n).keys()
            or touched & self.index.superseded_by(n)
        ]

    def _rewrite_index(
        self,
        added: builtins.list[PackRecord],
        doomed: set[str],
        rescued: set[str],
        newly: dict[str, float],
        existing: set[str],
        report: GcReport,
    ) -> None:
        """One new index document (new packs, the survivors of the documents it replaces, their
        still-pending condemnations with their times, new condemnations, and the doomed packs as
        superseded), then the replaced documents deleted, then the doomed packs deleted."""
        stale = self._stale_docs(doomed, rescued)
        keep: dict[str, PackRecord] = {p.id: p for p in added}
        pending: dict[str, float] = dict(newly)
        superseded = set(doomed)
        docs = self.index.documents
        for n in stale:
            for rec in docs.get(n, ()):
                if rec.id not in doomed:
                    keep.setdefault(rec.id, rec)
            for pid, t in self.index.condemned_by(n).items():
                if pid not in doomed and pid not in rescued and pid in existing:
                    pending[pid] = min(t, pending.get(pid, t))
            # carried until the packs are really gone: a crash before the deletes leaves the next gc the list
            superseded |= {pid for pid in self.index.superseded_by(n) if pid in existing and pid not in rescued}
        if keep or superseded or pending:
            name = index_name(secrets.token_hex(16))
            self.store.put(name, encode_index(name, keep.values(), self.keyring, superseded, pending))
        for n in stale:
            with contextlib.suppress(ObjectNotFound):
                self.store.delete(n)
        report.rewritten_indexes = len(stale)
        for p in sorted(doomed):
            with contextlib.suppress(ObjectNotFound):
                self.store.delete(pack_name(p))
        self.index.refresh(self.store, self.keyring)

    def _repack(
        self, to_repack: builtins.list[tuple[ObjectInfo, builtins.list[BlobEntry]]], report: GcReport
    ) -> builtins.list[PackRecord]:
        """Copy live blobs of sparse packs into new packs; returns the new packs.

        A pack whose live blobs do not verify is left alone (and reported by
        ``verify``): gc never rewrites bytes it cannot vouch for.
        """
        written: builtins.list[PackRecord] = []
        pw: PackWriter | None = None

        def flush() -> None:
            nonlocal pw
            if pw is not None and pw.entries:
                data = pw.finish(self.keyring)
                self.store.put(pw.name, data)
                written.append(PackRecord(pw.id, len(data), tuple(pw.entries)))
            pw = None

        for o, live in to_repack:
            try:
                data = memoryview(self.store.get(o.name))
                for e in live:
                    cks.verify(data[e.offset : e.offset + e.length], e.checksum, obj=o.name, blob=e.id)
            except GpuckptError as exc:
                log.warning("not repacking a pack that does not verify", extra={"object": o.name, "error": str(exc)})
                continue
            for e in live:
                if pw is None:
                    pw = PackWriter(secrets.token_hex(16), self.config.pack_size + (1 << 20))
                pw.add(e.id, data[e.offset : e.offset + e.length], e.raw_length, e.checksum, e.raw_checksum, e.codec)
                if pw.size >= self.config.pack_size:
                    flush()
            report.repacked_packs.append(o.name)
            report.reclaimed_bytes += o.size - sum(e.length for e in live)
        flush()
        return written

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


def document_error(name: str, size: int, limit: int) -> GpuckptError:
    from ckpt.errors import ManifestError

    return ManifestError(f"{name}: {size} bytes exceeds the manifest size limit {limit}")
