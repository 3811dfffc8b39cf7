"""gc beside saves: a save and a gc raced at every step of each, with store faults.

gc runs beside saves (its lock keeps only other gcs out) and deletes in two
phases (FORMAT.md §9): what is garbage is *condemned*, saves stop
deduplicating against it, and a later gc deletes it once it has been
condemned for twice the longest a save may run — unless a manifest committed
since needs it. These tests drive both sides on one store with a virtual
clock (:class:`ckpt.testing.VirtualClock`): at every store call of a gc a
whole save runs (deduplicating against the very packs that gc is condemning,
sometimes crashing), and at every store call of a save a whole gc runs
(sometimes after the clock jumped past the deletion delay, sometimes
crashing). After each case every committed checkpoint loads whole, ``verify``
is clean, and a final ``gc --now`` leaves only live objects.
"""

from __future__ import annotations

import contextlib
import random
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from ckpt import Block, OperationAborted, RepositoryLocked, SaveOptions
from ckpt import lock as lock_mod
from ckpt.errors import GpuckptError
from ckpt.lock import Lock, LockInfo, list_locks
from ckpt.repository import Repository
from ckpt.store.base import Store
from ckpt.store.local import LocalStore
from ckpt.testing import ClockedStore, Fault, FaultyStore, KilledStore, SimulatedCrash, VirtualClock
from ckpt.url import open_store as url_store
from tests.harness.repo import BARE_NS, BARE_PINS, indexed_packs, pack_ids

NS, PINS = BARE_NS, BARE_PINS
KiB = 1 << 10
OPTS = SaveOptions(pack_size=64 * KiB, upload_workers=1, workers=1)
MAX_SAVE = 100.0  # virtual seconds; the clock ticks 1 s per store call
DELAY = 2 * MAX_SAVE
GRACE0 = timedelta(0)
Hook = Callable[[int, str, str], None]
Faults = list[Fault] | None


def data_of(key: bytes) -> bytes:
    rng = np.random.default_rng(zlib.crc32(key))
    return rng.bytes(16 * KiB)


def blocks(tag: str, idx: range) -> list[Block]:
    return [Block(f"{tag}{i}".encode(), data_of(f"{tag}{i}".encode()), "uint8", (16 * KiB,)) for i in idx]


class World:
    """One repository on a virtual clock.

    Live: B = a0..a3 (deduplicated against A's first pack) + b0..b3. Dead:
    A's second pack (a4..a7; A was forgotten) and a crashed save's pack
    (d0..d3: indexed, never named by a manifest). The racing save reuses
    both dead packs' blocks, so it deduplicates against exactly what gc
    condemns.
    """

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.inner = LocalStore(root, fsync=False)
        self.clock = VirtualClock()
        # the locks' own clock (a save's age, refresh gaps) is the same timeline
        monkeypatch.setattr(lock_mod, "_boottime", self.clock.now)
        Repository.init(ClockedStore(self.inner, self.clock), pack_size=64 * KiB)
        repo = self.repo()
        repo.save(blocks("a", range(8)), worker_id="w0", namespace=NS, pins=PINS, options=OPTS)
        repo.save(blocks("a", range(4)) + blocks("b", range(4)), worker_id="w0", namespace=NS, pins=PINS, options=OPTS)
        assert len(repo.forget(keep_last=1)) == 1
        crashing = self.repo(faults=[Fault("put", match=lambda n: n.startswith("manifests/"), error=SimulatedCrash)])
        with pytest.raises(SimulatedCrash):
            crashing.save(blocks("d", range(4)), worker_id="w1", namespace=NS, pins=PINS, options=OPTS)
        self.clock.advance(10)

    def repo(
        self, faults: list[Fault] | None = None, hook: Callable[[int, str, str], None] | None = None
    ) -> Repository:
        store = ClockedStore(KilledStore(self.inner, faults), self.clock, hook=hook)
        r = Repository.open(store)
        r.max_save_seconds = MAX_SAVE
        return r

    def racing_save(self, tag: str, faults: list[Fault] | None = None) -> None:
        bl = blocks("a", range(3, 7)) + blocks("d", range(2)) + blocks(tag, range(3))
        # a save may crash or abort; it must then leave nothing visible
        with contextlib.suppress(SimulatedCrash, GpuckptError):
            self.repo(faults).save(bl, worker_id="w2", namespace=NS, pins=PINS, options=OPTS, lock_wait=0)

    def gc(self, faults: list[Fault] | None = None, hook: Hook | None = None) -> None:
        with contextlib.suppress(SimulatedCrash, RepositoryLocked):
            self.repo(faults, hook).gc(grace=GRACE0, stale_lock_after=10 * DELAY)

    def check(self, what: str) -> None:
        """Every committed checkpoint loads whole and verifies; no index names a missing pack."""
        repo = self.repo()
        for info in repo.list():
            got = {b.key: bytes(b.data) for b in repo.load(info.id)}
            assert got, f"{what}: {info.id} has no blocks"
            assert all(v == data_of(k) for k, v in got.items()), f"{what}: {info.id} loads wrong"
        report = repo.verify()
        assert report.ok, f"{what}: {report.problems}"

    def finish(self, what: str) -> None:
        """Later gcs delete what is due and nothing needed; a final gc --now leaves only live objects."""
        for _ in range(2):
            self.clock.advance(DELAY + 1)
            self.gc()
            self.check(f"{what}, then a later gc")
        repo = self.repo()
        repo.gc(now=True, grace=GRACE0, stale_lock_after=0)
        self.check(f"{what}, then gc --now")
        # only live objects: every pack is indexed and holds a blob some checkpoint references
        live = {b.blob for m in repo.manifests() for b in m.blocks}
        assert pack_ids(self.inner) == indexed_packs(self.inner), what
        repo.index.refresh(repo.store, repo.keyring)
        for pid, rec in repo.index.packs.items():
            assert any(e.id in live for e in rec.entries), f"{what}: pack {pid} holds no live blob"
        assert repo.index.condemned == {}, what


def gc_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    w = World(tmp_path / "count", monkeypatch)
    r = w.repo()
    w.clock.advance(DELAY + 1)
    r.gc(grace=GRACE0)
    store = r.store
    assert isinstance(store, ClockedStore)
    return store.count


def test_a_save_at_every_step_of_a_gc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While gc condemns (or deletes condemned) packs, a save deduplicating against them runs at
    each of gc's store calls — sometimes crashing, sometimes followed by a clock jump."""
    rng = random.Random(20261201)
    total = gc_calls(tmp_path, monkeypatch)
    assert total >= 10
    for k in range(1, total + 2):
        for phase in ("condemn", "delete"):
            w = World(tmp_path / f"{phase}{k}", monkeypatch)
            if phase == "delete":
                w.gc()  # condemns; the gc below deletes what is due
                w.clock.advance(DELAY + 1)
            faults = (
                [Fault("put", nth=rng.randint(1, 8), error=SimulatedCrash, after=rng.random() < 0.5)]
                if rng.random() < 0.3
                else None
            )
            jump = rng.choice([0.0, MAX_SAVE / 2, DELAY + 1])

            def hook(
                n: int, method: str, name: str, k: int = k, w: World = w, f: Faults = faults, j: float = jump
            ) -> None:
                if n == k:
                    w.racing_save("s", f)
                    w.clock.advance(j)

            w.gc(hook=hook)
            what = f"save at gc call {k} ({phase}, faults={bool(faults)}, jump={jump})"
            w.check(what)
            w.racing_save("t")  # a save after the gc: never references a condemned pack
            w.check(what + ", then a save")
            w.finish(what)


def test_a_gc_at_every_step_of_a_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save deduplicating against condemned-or-dead packs has a whole gc run at each of its store
    calls — with the clock short of, or past, the deletion delay, and sometimes crashing."""
    rng = random.Random(4242)
    w0 = World(tmp_path / "count", monkeypatch)
    counter = w0.repo()
    counter.save(
        blocks("a", range(3, 7)) + blocks("s", range(3)), worker_id="w2", namespace=NS, pins=PINS, options=OPTS
    )
    assert isinstance(counter.store, ClockedStore)
    total = counter.store.count
    assert total >= 8
    for k in range(1, total + 2):
        for condemned_first in (False, True):
            w = World(tmp_path / f"s{k}{condemned_first}", monkeypatch)
            if condemned_first:
                w.gc()  # the dead packs are condemned before the save starts
            jump = rng.choice([0.0, MAX_SAVE / 2, DELAY + 1])
            faults = (
                [Fault(rng.choice(["put", "delete"]), nth=rng.randint(1, 4), error=SimulatedCrash)]
                if rng.random() < 0.3
                else None
            )

            def hook(
                n: int, method: str, name: str, k: int = k, w: World = w, f: Faults = faults, j: float = jump
            ) -> None:
                if n == k:
                    w.clock.advance(j)
                    w.gc(faults=f)

            saver = w.repo(hook=hook)
            bl = blocks("a", range(3, 7)) + blocks("d", range(2)) + blocks("s", range(3))
            what = f"gc at save call {k} (condemned first={condemned_first}, jump={jump}, faults={bool(faults)})"
            try:
                saver.save(bl, worker_id="w2", namespace=NS, pins=PINS, options=OPTS, lock_wait=0)
                committed = True
            except OperationAborted:
                committed = False
            assert isinstance(saver.store, ClockedStore)
            calls = saver.store.log
            commit_at = next(
                (i + 1 for i, (m, n) in enumerate(calls) if m == "put" and n.startswith("manifests/")), None
            )
            # a save that ran longer than a save may (the jump came before its commit) commits nothing;
            # any other commits
            assert committed == (not (jump > MAX_SAVE and (commit_at is None or k <= commit_at))), what
            assert committed == any(i.worker_id == "w2" for i in w.repo().list()), what
            w.check(what)
            w.finish(what)


def test_gc_runs_beside_saves_and_saves_beside_gc(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    Repository.init(store, pack_size=64 * KiB)
    repo = Repository.open(store)
    with Lock(store, exclusive=False, operation="save w9"):
        repo.gc(grace=GRACE0)  # not held off by a save
        with pytest.raises(RepositoryLocked, match="shared lock"):
            repo.gc(now=True, grace=GRACE0)  # gc --now waits for saves
    with Lock(store, exclusive=True, mode="gc", operation="gc"):
        # a final checkpoint is never held up by a gc running somewhere in the fleet
        repo.save(blocks("x", range(2)), worker_id="w0", namespace=NS, pins=PINS, options=OPTS, lock_wait=0)
        with pytest.raises(RepositoryLocked, match="gc-only exclusive lock"):
            repo.gc(grace=GRACE0)  # one gc at a time
    with Lock(store, exclusive=True, operation="gc"), pytest.raises(RepositoryLocked, match="exclusive lock"):
        repo.save(blocks("y", range(2)), worker_id="w0", namespace=NS, pins=PINS, options=OPTS, lock_wait=0)


def test_an_older_gpuckpt_save_keeps_a_concurrent_gc_out() -> None:
    """A shared lock without ``protocol: 2`` is an older save, which deduplicates against condemned
    packs: only a gc that keeps saves out may run beside it (and older saves see a gc-only lock as
    exclusive, because it is)."""
    old = LockInfo("locks/x", False, "save w0", "h", 1, 0.0, 0.0, protocol=1)
    new = LockInfo("locks/y", False, "save w0", "h", 1, 0.0, 0.0, protocol=2)
    gc_only = LockInfo("locks/z", True, "gc", "h", 1, 0.0, 0.0, mode="gc", protocol=2)
    assert old.blocks(True, "gc")
    assert not new.blocks(True, "gc")
    assert new.blocks(True)
    assert old.blocks(True)
    assert gc_only.blocks(True, "gc")
    assert not gc_only.blocks(False)


def test_a_save_longer_than_the_limit_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(tmp_path, monkeypatch)
    repo = w.repo(hook=lambda n, m, name: w.clock.advance(MAX_SAVE + 1) if n == 3 else None)
    before = {i.id for i in repo.list()}
    with pytest.raises(OperationAborted, match="longer than the repository's limit"):
        repo.save(blocks("z", range(2)), worker_id="w0", namespace=NS, pins=PINS, options=OPTS)
    assert {i.id for i in w.repo().list()} == before
    assert [lk.operation for lk in list_locks(w.inner)] == ["save w1"]  # only the setup's crashed save


def test_a_delete_delay_shorter_than_twice_a_save_is_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    repo = Repository.init(store, pack_size=64 * KiB)
    with pytest.raises(GpuckptError, match="delete_delay"):
        repo.gc(delete_delay=timedelta(minutes=30))
    repo.gc(delete_delay=timedelta(minutes=30), now=True)  # --now needs no delay


class HookStore(FaultyStore):
    """Calls ``hook(method, name)`` before every call (the real store's clock stays)."""

    def __init__(self, inner: Store, hook: Callable[[str, str], None]) -> None:
        super().__init__(inner)
        self.hook = hook

    def _run(self, method: str, name: str, fn: Callable[[], object]) -> object:
        self.hook(method, name)
        return super()._run(method, name, fn)


def test_on_seaweedfs_a_save_racing_a_gc_is_rescued_not_lost(s3_url: str) -> None:
    """On a real S3 server (its LastModified as the store's clock): a save that deduplicated against
    a dead pack before gc condemned it commits — having copied its blobs out of the condemned pack
    before the commit (FORMAT.md §9: a commit names no condemned pack, whatever the clocks); the
    later gc that finds the condemnation due deletes the pack; the checkpoint loads whole and
    verifies. A save after the condemnation never references the condemned pack."""
    base = Repository.init(url_store(s3_url), pack_size=64 * KiB)
    base.save(blocks("a", range(8)), worker_id="w0", namespace=NS, pins=PINS, options=OPTS)
    base.save(blocks("a", range(4)) + blocks("b", range(4)), worker_id="w0", namespace=NS, pins=PINS, options=OPTS)
    time.sleep(0.002)  # checkpoint ids are per millisecond
    assert len(base.forget(keep_last=1)) == 1  # a4..a7's pack is dead
    gc_repo = Repository.open(url_store(s3_url))
    gc_repo.max_save_seconds = 1.0  # lets this test's gc use a 2 s delay (the racing save is done long before)
    condemned: list[str] = []

    def gc_once(method: str, name: str) -> None:
        if method == "put" and name.startswith("packs/") and not condemned:
            # the save has read the index (a4..a7 live there) and is writing its new blocks
            condemned.extend(gc_repo.gc(grace=GRACE0, delete_delay=timedelta(seconds=2)).condemned_packs)

    racing = Repository.open(HookStore(url_store(s3_url), gc_once))
    racing_blocks = blocks("a", range(4, 8)) + blocks("s", range(4))
    m = racing.save(racing_blocks, worker_id="w1", namespace=NS, pins=PINS, options=OPTS)
    assert condemned, "gc condemned nothing"
    dead = {c.rsplit("/", 1)[-1] for c in condemned}
    assert not dead & {b.pack for b in m.blocks}, "the commit names a condemned pack"
    assert m.sizes.new_blocks == 4, "it deduplicated against the dead pack's a4..a7 (then copied them forward)"
    # a4 and a5 again: written anew; a6 and a7 stay only in the condemned pack
    after = Repository.open(url_store(s3_url)).save(
        blocks("a", range(4, 6)), worker_id="w2", namespace=NS, pins=PINS, options=OPTS
    )
    assert not dead & {b.pack for b in after.blocks}, "a save referenced a condemned pack"
    # wait, on the store's clock, until the condemnation is due
    deadline = time.monotonic() + 120
    while True:
        report = gc_repo.gc(grace=GRACE0, delete_delay=timedelta(seconds=2))
        if report.rescued_packs or report.deleted_packs:
            break
        assert time.monotonic() < deadline, f"the condemnation never came due: {report}"
        time.sleep(0.2)
    assert dead <= {r.rsplit("/", 1)[-1] for r in report.deleted_packs}, report
    assert not report.rescued_packs, report
    check = Repository.open(url_store(s3_url))
    for ref, bl in ((m, racing_blocks), (after, blocks("a", range(4, 6)))):
        got = {b.key: bytes(b.data) for b in check.load(ref.id)}
        assert got == {b.key: bytes(b.data) for b in bl}
    assert check.verify().ok
