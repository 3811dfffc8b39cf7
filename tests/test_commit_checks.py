"""A commit that needs no clock: a save re-confirms, on the store, right before its manifest, that
its lock is still there and its own and that no pack it deduplicated against is condemned or gone.

Each case stalls a save after it deduplicated against a pack, lets a gc take that pack away by a
path the save's own clocks cannot see, and lets the save go on: it must abort, naming why, and no
committed checkpoint may name a missing pack.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ckpt import Block, ConfigError, HostFacts, Namespace, OperationAborted, Pins, WorkerFacts
from ckpt.lock import SHORT_STALE_ENV, remove_stale_locks
from ckpt.repository import Repository
from ckpt.store.local import LocalStore
from ckpt.testing import ClockedStore, VirtualClock

NS = Namespace({"model": "commit-test"})
PINS = Pins(host=HostFacts(), worker=WorkerFacts())
KiB = 1 << 10


def block(name: str) -> Block:
    data = np.random.default_rng(zlib.crc32(name.encode())).bytes(16 * KiB)
    return Block(name.encode(), data, "uint8", (16 * KiB,))


class StalledSave:
    """A save in a thread that deduplicates against checkpoint A's blocks, then waits."""

    def __init__(self, repo: Repository) -> None:
        self.stalled, self.go = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(repo,))
        self.thread.start()
        assert self.stalled.wait(60), "the save never reached its stall"

    def _blocks(self) -> Iterator[Block]:
        yield from (block(f"a{i}") for i in range(4))  # looked up (and found) as each is taken
        self.stalled.set()
        assert self.go.wait(60)
        yield block("s0")

    def _run(self, repo: Repository) -> None:
        try:
            repo.save(self._blocks(), worker_id="w1", namespace=NS, pins=PINS)
        except BaseException as exc:
            self.error = exc

    def finish(self) -> BaseException | None:
        self.go.set()
        self.thread.join(60)
        return self.error


@pytest.fixture
def world(tmp_path: Path) -> tuple[LocalStore, VirtualClock]:
    inner = LocalStore(tmp_path / "repo", fsync=False)
    clock = VirtualClock(tick=0.0)
    Repository.init(ClockedStore(inner, clock), pack_size=64 * KiB)
    repo = Repository.open(ClockedStore(inner, clock))
    a = repo.save([block(f"a{i}") for i in range(4)], worker_id="w0", namespace=NS, pins=PINS)
    repo.delete(a.id)  # A's pack is garbage, not yet condemned
    return inner, clock


def every_checkpoint_loads(repo: Repository) -> None:
    for info in repo.list():
        assert sum(1 for _ in repo.load(info.id)) == len(repo.manifest(info.id).blocks), info.id


def test_a_store_clock_an_hour_ahead_during_a_stalled_save_never_commits_a_dangling_manifest(
    world: tuple[LocalStore, VirtualClock],
) -> None:
    inner, clock = world
    save = StalledSave(Repository.open(ClockedStore(inner, clock)))
    gc_repo = Repository.open(ClockedStore(inner, clock))
    gc_repo.gc(grace=timedelta(0))  # condemns A's pack, beside the save
    clock.advance(3600 + 60)  # the store's host steps forward; the save's own clock does not
    gc_repo.gc(grace=timedelta(0))  # deletes what has been condemned for the delay
    err = save.finish()
    assert isinstance(err, OperationAborted), err
    assert "not committing" in str(err)
    repo = Repository.open(ClockedStore(inner, clock))
    assert repo.list() == []
    every_checkpoint_loads(repo)


def test_unlock_and_gc_now_beside_a_live_save_abort_it_instead_of_a_dangling_commit(
    world: tuple[LocalStore, VirtualClock],
) -> None:
    inner, clock = world
    save = StalledSave(Repository.open(ClockedStore(inner, clock)))
    clock.advance(5)
    store = ClockedStore(inner, clock)
    removed = remove_stale_locks(store, 1.0)  # an operator's `gpuckpt unlock --stale-after 1s`
    assert [x.operation for x in removed] == ["save w1"]
    Repository.open(store).gc(now=True, grace=timedelta(0), stale_lock_after=1.0)
    err = save.finish()
    assert isinstance(err, OperationAborted), err
    assert "removed from the store" in str(err) or "gone from the store" in str(err)
    repo = Repository.open(store)
    assert repo.list() == []
    every_checkpoint_loads(repo)


def test_a_save_commits_when_nothing_took_its_packs(world: tuple[LocalStore, VirtualClock]) -> None:
    inner, clock = world
    save = StalledSave(Repository.open(ClockedStore(inner, clock)))
    assert save.finish() is None
    repo = Repository.open(ClockedStore(inner, clock))
    (info,) = repo.list()
    every_checkpoint_loads(repo)
    assert repo.manifest(info.id).sizes.new_blocks == 1, "deduplicated against A's pack"


def test_stale_limits_below_the_default_are_refused_outside_tests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cli.main import app

    monkeypatch.delenv(SHORT_STALE_ENV)
    root = tmp_path / "r"
    Repository.init(LocalStore(root, fsync=False))
    r = CliRunner().invoke(app, ["unlock", "--repo", str(root), "--stale-after", "1s"])
    assert r.exit_code != 0
    assert "below the default" in (r.output + str(r.exception))
    with pytest.raises(ConfigError, match="below the default"):
        Repository.open(str(root)).gc(now=True, stale_lock_after=1.0)
    assert CliRunner().invoke(app, ["unlock", "--repo", str(root)]).exit_code == 0


def test_a_pack_condemned_during_the_save_is_copied_forward_and_the_commit_names_the_copy(
    world: tuple[LocalStore, VirtualClock],
) -> None:
    inner, clock = world
    save = StalledSave(Repository.open(ClockedStore(inner, clock)))
    gc_repo = Repository.open(ClockedStore(inner, clock))
    gc_repo.gc(grace=timedelta(0))  # condemns A's pack, beside the save
    condemned = set(gc_repo.index.condemned)
    assert condemned, "the gc condemned nothing"
    assert save.finish() is None, "a gc beside a save must not make it fail"
    repo = Repository.open(ClockedStore(inner, clock))
    (info,) = repo.list()
    m = repo.manifest(info.id)
    assert not {b.pack for b in m.blocks} & condemned, "the commit names a condemned pack"
    clock.advance(3600 + 60)
    gc_repo.gc(grace=timedelta(0))  # deletes the condemned pack: the checkpoint does not need it
    every_checkpoint_loads(Repository.open(ClockedStore(inner, clock)))


def test_a_planted_index_of_phantom_copies_rescues_nothing_away(tmp_path: Path) -> None:
    """In a plain repository an attacker with PutObject plants one index document listing a copy of
    every referenced blob in a pack that does not exist, and condemning every real pack long ago:
    the next ordinary gc keeps every pack a committed checkpoint needs (rescue from evidence)."""
    import dataclasses
    import secrets

    from ckpt.index import PackRecord, encode_index, index_name
    from ckpt.pack import pack_name

    store = LocalStore(tmp_path / "repo", fsync=False)
    repo = Repository.init(store, pack_size=64 * KiB)
    for w in range(3):
        repo.save([block(f"c{w}-{i}") for i in range(4)], worker_id=f"w{w}", namespace=NS, pins=PINS)
    repo.index.refresh(repo.store, repo.keyring)
    real = set(repo.index.packs)
    phantom = secrets.token_hex(16)
    entries = tuple(dataclasses.replace(e, pack=phantom) for rec in repo.index.packs.values() for e in rec.entries)
    name = index_name(secrets.token_hex(16))
    store.put(
        name, encode_index(name, [PackRecord(phantom, 1 << 20, entries)], None, condemned=dict.fromkeys(real, 1.0))
    )
    report = Repository.open(store).gc(grace=timedelta(0))
    assert not report.deleted_packs, report
    assert set(report.rescued_packs) == {pack_name(p) for p in real}
    fresh = Repository.open(store)
    assert len(fresh.list()) == 3
    every_checkpoint_loads(fresh)
