"""Garbage collection and retention: ``gc`` keeps everything live and only
that, respects its grace period, rewrites index documents before deleting
packs (so a gc killed at any point leaves every checkpoint loadable), refuses
to delete anything when a manifest cannot be read, and excludes saves through
locks; ``forget`` applies retention per worker and always keeps the newest.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckpt import (
    Block,
    ConfigError,
    Manifest,
    OperationAborted,
    Repository,
    RepositoryLocked,
    SaveOptions,
)
from ckpt.lock import list_locks
from ckpt.store.base import ObjectInfo, Store
from ckpt.store.local import LocalStore
from ckpt.testing import Fault, FaultyStore, KilledStore, SimulatedCrash
from tests.harness.repo import BARE_NS, BARE_PINS, indexed_packs, pack_ids

NS, PINS = BARE_NS, BARE_PINS
KiB = 1 << 10
OPTS = SaveOptions(pack_size=64 * KiB, upload_workers=1, workers=1)
GRACE0 = timedelta(0)


# -- builders and checks ---------------------------------------------------------------


def blocks(tag: str, n: int, size: int = 16 * KiB) -> list[Block]:
    """``n`` incompressible blocks: with 64 KiB packs, four to a pack."""
    rng = np.random.default_rng(zlib.crc32(tag.encode()))
    return [Block(f"{tag}{i}".encode(), rng.bytes(size), "uint8", (size,)) for i in range(n)]


def save(repo: Repository, bl: list[Block], worker: str = "w0", **kw: Any) -> Manifest:
    m = repo.save(bl, worker_id=worker, namespace=NS, pins=PINS, options=OPTS, **kw)
    time.sleep(0.002)  # checkpoint ids are per millisecond: keep them strictly ordered
    return m


def assert_loads(repo: Repository, ref: str | Manifest, bl: list[Block]) -> None:
    got = {b.key: bytes(b.data) for b in repo.load(ref)}
    assert got == {b.key: bytes(b.data) for b in bl}


def packs_of(m: Manifest) -> set[str]:
    return {b.pack for b in m.blocks}


def assert_clean(root: Path, live: dict[str, list[Block]]) -> None:
    """After a complete gc: exactly the live packs remain, all indexed, all load."""
    repo = Repository.open(LocalStore(root, fsync=False))
    referenced = {b.pack for m in repo.manifests() for b in m.blocks}
    assert pack_ids(repo.store) == referenced
    assert indexed_packs(repo.store) == referenced
    assert {c.id for c in repo.list()} == set(live)
    for cid, bl in live.items():
        assert_loads(repo, cid, bl)
    report = repo.verify()
    assert report.ok, report.problems


class History:
    """Three checkpoints of w0 sharing data, in a local repository.

    A: a0..a7 (two packs). B: a0..a3 (dedup: A's first pack) + b0..b7.
    C: c0..c3. Forgetting A leaves A's second pack dead while its first
    stays live through B, so A's index document must be *rewritten*.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = LocalStore(root, fsync=False)
        self.repo = Repository.init(self.store, pack_size=64 * KiB)
        self.a, self.b, self.c = blocks("a", 8), blocks("a", 4) + blocks("b", 8), blocks("c", 4)
        self.A = save(self.repo, self.a)
        self.B = save(self.repo, self.b)
        self.C = save(self.repo, self.c)

    def forget_a(self) -> None:
        removed = self.repo.forget(keep_last=2)
        assert [c.id for c in removed] == [self.A.id]

    @property
    def live(self) -> dict[str, list[Block]]:
        return {self.B.id: self.b, self.C.id: self.c}


# -- what gc keeps and deletes -------------------------------------------------------------------


def test_gc_keeps_live_and_deletes_dead_after_forget(tmp_path: Path) -> None:
    h = History(tmp_path)
    shared = packs_of(h.A) & packs_of(h.B)
    assert shared, "B should reference A's first pack through dedup"
    dead = packs_of(h.A) - packs_of(h.B)
    assert dead
    # Before forget, gc has nothing to do.
    nothing = h.repo.gc(now=True, grace=GRACE0)
    assert (nothing.deleted_packs, nothing.rewritten_indexes) == ([], 0)

    other = Repository.open(LocalStore(tmp_path, fsync=False))  # has the old index cached
    other.index.refresh(other.store, other.keyring)
    h.forget_a()
    sizes = {o.name.rsplit("/", 1)[-1]: o.size for o in h.store.list("packs/")}
    report = h.repo.gc(now=True, grace=GRACE0)
    assert {n.rsplit("/", 1)[-1] for n in report.deleted_packs} == dead
    assert report.deleted_bytes == sum(sizes[p] for p in dead)
    assert report.rewritten_indexes == 1  # A's document: one pack kept, one dropped
    assert report.live_blobs == len({b.blob for m in (h.B, h.C) for b in m.blocks})
    assert pack_ids(h.store) == packs_of(h.B) | packs_of(h.C)
    assert_clean(tmp_path, h.live)

    # Blobs whose packs were deleted are written anew, never referenced where
    # they were: by this repository and by one whose index predates the gc.
    for r in (h.repo, other):
        d = save(r, blocks("a", 8)[4:], worker=f"again-{id(r)}")
        assert packs_of(d).isdisjoint(dead)
        assert_loads(r, d, blocks("a", 8)[4:])
    assert h.repo.verify().ok


def test_gc_grace_keeps_young_unreferenced_packs(tmp_path: Path) -> None:
    h = History(tmp_path)
    h.forget_a()
    dead = packs_of(h.A) - packs_of(h.B)
    before = pack_ids(h.store)
    report = h.repo.gc(now=True, grace=timedelta(hours=1))
    assert report.deleted_packs == []
    assert report.kept_young_packs == len(dead)
    assert pack_ids(h.store) == before
    # Age every pack two hours: the dead ones go, the live ones stay.
    old = time.time() - 2 * 3600
    for o in h.store.list("packs/"):
        os.utime(h.store._path(o.name), (old, old))
    report = h.repo.gc(now=True, grace=timedelta(hours=1))
    assert {n.rsplit("/", 1)[-1] for n in report.deleted_packs} == dead
    assert report.kept_young_packs == 0
    assert_clean(tmp_path, h.live)


def test_dry_run_deletes_nothing(tmp_path: Path) -> None:
    h = History(tmp_path)
    doomed = h.repo.forget(keep_last=1, dry_run=True)
    assert sorted(c.id for c in doomed) == [h.A.id, h.B.id]
    assert len(h.repo.list()) == 3
    h.forget_a()
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    dry = h.repo.gc(now=True, grace=GRACE0, dry_run=True)
    assert dry.dry_run
    assert dry.deleted_packs
    assert dry.rewritten_indexes == 1
    after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert after == files
    real = h.repo.gc(now=True, grace=GRACE0)
    assert real.deleted_packs == dry.deleted_packs
    assert real.deleted_bytes == dry.deleted_bytes
    assert_clean(tmp_path, h.live)


# -- gc killed at every step ----------------------------------------------------------------------


@pytest.fixture
def forgotten_history(tmp_path: Path) -> History:
    h = History(tmp_path / "template")
    # More garbage, in several index documents: a fourth checkpoint forgotten too.
    d = save(h.repo, blocks("d", 6) + blocks("c", 2))
    h.repo.delete(d.id)
    h.forget_a()
    return h


def test_gc_order_references_before_data(forgotten_history: History, tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(forgotten_history.root, root)
    fs = FaultyStore(LocalStore(root, fsync=False))
    Repository.open(fs).gc(now=True, grace=GRACE0)
    writes = [(m, n.split("/", 1)[0]) for m, n in fs.log if m in ("put", "delete")]
    first_pack_delete = writes.index(("delete", "packs"))
    assert ("put", "index") in writes[:first_pack_delete]
    assert ("delete", "index") not in writes[first_pack_delete:]
    assert ("put", "index") not in writes[first_pack_delete:]


def test_gc_killed_at_every_write_then_rerun(forgotten_history: History, tmp_path: Path) -> None:
    h = forgotten_history
    probe = tmp_path / "probe"
    shutil.copytree(h.root, probe)
    fs = FaultyStore(LocalStore(probe, fsync=False))
    Repository.open(fs).gc(now=True, grace=GRACE0, stale_lock_after=0)
    writes = [(m, n) for m, n in fs.log if m in ("put", "delete")]
    counts = {m: sum(1 for w in writes if w[0] == m) for m in ("put", "delete")}
    assert counts["put"] >= 2  # the lock, the rewritten index
    assert counts["delete"] >= 4  # old index documents, dead packs, the lock
    live = h.live
    case = 0
    for method, total in counts.items():
        for n in range(1, total + 1):
            for after in (False, True):
                case += 1
                root = tmp_path / f"case{case}"
                shutil.copytree(h.root, root)
                inner = LocalStore(root, fsync=False)
                fs = KilledStore(inner, [Fault(method=method, nth=n, error=SimulatedCrash, after=after)])
                with pytest.raises(SimulatedCrash):
                    Repository.open(fs).gc(now=True, grace=GRACE0, stale_lock_after=0)
                what = f"gc killed at {method} #{n} (after={after})"
                # Every checkpoint still loads, and no index names a deleted pack.
                repo = Repository.open(inner)
                assert {c.id for c in repo.list()} == set(live), what
                for cid, bl in live.items():
                    assert_loads(repo, cid, bl)
                missing = indexed_packs(inner) - pack_ids(inner)
                assert not missing, f"{what}: index names deleted packs {missing}"
                # A dead gc's exclusive lock holds saves off until it goes stale...
                if list_locks(inner):
                    with pytest.raises(RepositoryLocked) as ei:
                        save(repo, blocks("x", 1), lock_wait=0)
                    assert "'gc'" in str(ei.value)
                # ...and a second gc finishes the job.
                repo.gc(now=True, grace=GRACE0, stale_lock_after=0)
                assert list_locks(inner) == [], what
                try:
                    assert_clean(root, live)
                except AssertionError as exc:
                    raise AssertionError(f"{what}: {exc}") from exc
                shutil.rmtree(root)


# -- gc on an unreadable manifest ------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["garbage", "truncated", "renamed"])
def test_gc_skips_and_reports_an_unreadable_manifest_and_keeps_every_readable_checkpoint(
    tmp_path: Path, damage: str
) -> None:
    """A rotten or planted manifest cannot be restored from: gc reports it, leaves it in place,
    and goes on (it used to stop gc for good). Every readable checkpoint still loads."""
    h = History(tmp_path)
    h.forget_a()
    good = h.store.get(h.C.name)
    bad_name = "manifests/w9/20240101T000000000Z-0badf00d"
    if damage == "garbage":
        data = b"\x00not a manifest\xff" * 10
    elif damage == "truncated":
        data = good[: len(good) // 2]
    else:  # a valid manifest copied under another name: it says it is someone else
        data = good
    h.store.put(bad_name, data)
    report = h.repo.gc(now=True, grace=GRACE0)
    assert any(bad_name in u for u in report.unreadable), report.unreadable
    assert h.store.get(bad_name) == data  # reported, never deleted
    assert list_locks(h.store) == []
    for m in (h.B, h.C):
        assert len(list(h.repo.load(m.id))) == len(m.blocks)
    assert any(p.obj == bad_name for p in h.repo.verify().problems)  # verify still names it


# -- locks: gc against saves ------------------------------------------------------------------------


def _gated(bl: list[Block], entered: threading.Event, gate: threading.Event) -> Iterator[Block]:
    yield from bl[:2]
    entered.set()
    assert gate.wait(10)
    yield from bl[2:]


def test_gc_refuses_while_a_save_holds_its_shared_lock(tmp_path: Path) -> None:
    repo = Repository.init(LocalStore(tmp_path, fsync=False), pack_size=64 * KiB)
    bl = blocks("s", 8)
    entered, gate = threading.Event(), threading.Event()
    result: list[Any] = []
    t = threading.Thread(
        target=lambda: result.append(save(repo, _gated(bl, entered, gate), worker="saver"))  # type: ignore[arg-type]
    )
    t.start()
    try:
        assert entered.wait(10)
        with pytest.raises(RepositoryLocked) as ei:
            Repository.open(LocalStore(tmp_path, fsync=False)).gc(now=True, grace=GRACE0)
        msg = str(ei.value)
        assert "'save saver'" in msg
        assert "shared lock" in msg
        assert socket.gethostname() in msg
        assert f"pid {os.getpid()}" in msg
        # Saves share: a second save runs alongside.
        other = save(repo, blocks("o", 2), worker="other", lock_wait=0)
        assert_loads(repo, other, blocks("o", 2))
    finally:
        gate.set()
        t.join(30)
    assert isinstance(result[0], Manifest)
    assert_loads(repo, result[0], bl)
    assert list_locks(repo.store) == []
    repo.gc(now=True, grace=GRACE0)


def test_a_save_whose_lock_a_gc_took_for_stale_never_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Case: a save deduplicates against an old unreferenced pack; its host is then suspended long
    enough that a gc takes its lock for stale and deletes that pack; the host wakes up. The save
    must not commit a manifest naming the deleted pack."""
    import ckpt.lock as lock_mod

    repo = Repository.init(LocalStore(tmp_path, fsync=False), pack_size=64 * KiB)
    old = blocks("old", 4)
    m0 = save(repo, old, worker="gone")
    repo.delete(m0.id)  # its pack is now indexed but unreferenced: a save may still dedup against it
    entered, gate = threading.Event(), threading.Event()
    outcome: list[BaseException | Manifest] = []

    def saver() -> None:
        try:
            outcome.append(save(repo, _gated(old + blocks("new", 2), entered, gate), worker="w1"))
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=saver)
    t.start()
    try:
        assert entered.wait(10)
        # The suspended host's lock looks stale to a gc elsewhere (here: stale at once).
        report = Repository.open(LocalStore(tmp_path, fsync=False)).gc(now=True, grace=GRACE0, stale_lock_after=0)
        assert report.deleted_packs, "the unreferenced pack was not deleted"
        real = lock_mod._boottime
        monkeypatch.setattr(lock_mod, "_boottime", lambda: real() + 3600)  # the host slept an hour
    finally:
        gate.set()
        t.join(30)
    assert isinstance(outcome[0], OperationAborted), outcome
    fresh = Repository.open(LocalStore(tmp_path, fsync=False))
    assert [c.worker_id for c in fresh.list()] == []  # nothing committed on the lost lock
    assert fresh.verify().ok


class GcGate(FaultyStore):
    """Holds the first listing of packs (only gc lists them) until ``gate`` opens."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.entered, self.gate = threading.Event(), threading.Event()

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix == "packs/" and not self.gate.is_set():
            self.entered.set()
            assert self.gate.wait(10)
        return super().list(prefix)


def test_save_waits_for_or_refuses_a_running_gc(tmp_path: Path) -> None:
    h = History(tmp_path)
    h.forget_a()
    gated = GcGate(h.store)
    reports: list[Any] = []
    t = threading.Thread(target=lambda: reports.append(Repository.open(gated).gc(now=True, grace=GRACE0)))
    t.start()
    try:
        assert gated.entered.wait(10)
        repo = Repository.open(LocalStore(tmp_path, fsync=False))
        with pytest.raises(RepositoryLocked) as ei:
            save(repo, blocks("n", 2), lock_wait=0.3)
        assert "exclusive lock" in str(ei.value)
        assert "'gc'" in str(ei.value)
        with pytest.raises(RepositoryLocked):
            repo.forget(keep_last=1)
        with pytest.raises(RepositoryLocked):
            repo.delete(h.B.id)
        # A save that may wait gets in once gc is done.
        threading.Timer(0.5, gated.gate.set).start()
        t0 = time.monotonic()
        m = save(repo, blocks("n", 2), lock_wait=15)
        assert time.monotonic() - t0 >= 0.4
        assert gated.gate.is_set(), "the save got in while gc held its lock"
    finally:
        gated.gate.set()
        t.join(30)
    assert reports[0].deleted_packs
    assert_loads(repo, m, blocks("n", 2))
    live = dict(h.live)
    live[m.id] = blocks("n", 2)
    assert_clean(tmp_path, live)


def test_gc_removes_stale_locks_only(tmp_path: Path) -> None:
    from ckpt import document
    from ckpt.lock import KIND, VERSION, Lock

    repo = Repository.init(LocalStore(tmp_path, fsync=False), pack_size=64 * KiB)
    save(repo, blocks("l", 2))
    name = "locks/" + "ab" * 16
    body = {
        "exclusive": False,
        "operation": "save dead",
        "hostname": "gone",
        "pid": 1,
        "created": time.time() - 7200,
        "refreshed": time.time() - 7200,
    }
    repo.store.put(name, document.seal(KIND, VERSION, name, body, None))
    # The writer's clock says two hours ago; the store wrote it just now: live.
    with pytest.raises(RepositoryLocked, match="save dead"):
        repo.gc(now=True, grace=GRACE0)
    # Stale is judged by the store's clock: its last write two hours ago.
    old = time.time() - 7200
    os.utime(tmp_path / name, (old, old))
    with Lock(repo.store, exclusive=False, operation="save alive"):
        # A live shared lock blocks gc; the stale one does not.
        with pytest.raises(RepositoryLocked) as ei:
            repo.gc(now=True, grace=GRACE0)
        assert "'save alive'" in str(ei.value)
    report = repo.gc(now=True, grace=GRACE0)  # stale after the default 30 minutes
    assert report.removed_locks == 1
    assert list_locks(repo.store) == []


# -- forget --------------------------------------------------------------------------------------------


@pytest.fixture
def many(tmp_path: Path) -> tuple[Repository, dict[str, list[str]]]:
    """w0: five checkpoints, w1: two, w2: one (ids oldest first)."""
    repo = Repository.init(LocalStore(tmp_path, fsync=False), pack_size=64 * KiB)
    ids: dict[str, list[str]] = {"w0": [], "w1": [], "w2": []}
    for i, w in enumerate(["w0", "w1", "w0", "w0", "w2", "w1", "w0", "w0"]):
        ids[w].append(save(repo, blocks(f"f{i}", 1, 1024), worker=w).id)
    return repo, ids


def _remaining(repo: Repository) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for c in repo.list():
        out.setdefault(c.worker_id, []).append(c.id)
    return out


def test_forget_keep_last_is_per_worker(many: tuple[Repository, dict[str, list[str]]]) -> None:
    repo, ids = many
    removed = repo.forget(keep_last=2)
    assert sorted(c.id for c in removed) == sorted(ids["w0"][:3])
    assert _remaining(repo) == {"w0": ids["w0"][3:], "w1": ids["w1"], "w2": ids["w2"]}
    removed = repo.forget(keep_last=1, worker_id="w1")
    assert [c.id for c in removed] == ids["w1"][:1]
    assert _remaining(repo) == {"w0": ids["w0"][3:], "w1": ids["w1"][1:], "w2": ids["w2"]}


def test_forget_keep_within_and_newest_always_kept(
    many: tuple[Repository, dict[str, list[str]]],
) -> None:
    repo, ids = many
    infos = {c.id: c for c in repo.list()}
    w0 = [infos[i] for i in ids["w0"]]
    now = w0[-1].created + timedelta(days=1)
    # The window reaches back exactly to w0's third checkpoint (inclusive).
    window = now - w0[2].created
    doomed = repo.forget(keep_within=window, now=now, dry_run=True)
    expect = {i for i in ids["w0"][:2]} | {
        i for w in ("w1", "w2") for i in ids[w][:-1] if now - infos[i].created > window
    }
    assert {c.id for c in doomed} == expect
    # A window nothing falls in: each worker still keeps its newest.
    removed = repo.forget(keep_within=timedelta(seconds=1), now=now)
    assert len(removed) == len(infos) - 3
    assert _remaining(repo) == {w: ids[w][-1:] for w in ids}


def test_forget_keep_last_and_keep_within_union(
    many: tuple[Repository, dict[str, list[str]]],
) -> None:
    repo, ids = many
    infos = {c.id: c for c in repo.list()}
    now = infos[ids["w0"][-1]].created
    window = now - infos[ids["w0"][1]].created  # covers w0's second checkpoint onwards
    repo.forget(keep_last=1, keep_within=window, now=now)
    left = _remaining(repo)
    assert left["w0"] == ids["w0"][1:]
    assert left["w2"] == ids["w2"]
    assert ids["w1"][-1] in left["w1"]


def test_forget_argument_checks(many: tuple[Repository, dict[str, list[str]]]) -> None:
    repo, _ = many
    with pytest.raises(ConfigError):
        repo.forget()
    with pytest.raises(ConfigError):
        repo.forget(keep_last=0)
    with pytest.raises(ConfigError):
        repo.forget(keep_last=1, worker_id="bad/worker")
    assert len(repo.list()) == 8


def test_forget_then_gc_reclaims_and_keeps_loading(
    many: tuple[Repository, dict[str, list[str]]],
    tmp_path: Path,
) -> None:
    repo, _ = many
    repo.forget(keep_last=1)
    repo.gc(now=True, grace=GRACE0)
    referenced = {b.pack for m in repo.manifests() for b in m.blocks}
    assert pack_ids(repo.store) == referenced
    for c in repo.list():
        assert sum(1 for _ in repo.load(c.id)) == 1
    assert repo.verify().ok
