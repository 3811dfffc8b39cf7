"""Locks fail closed, age by the store's clock, free a dead holder's lock at once, and `gpuckpt unlock`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import ckpt.lock as lock_mod
from ckpt import OperationAborted, Repository, RepositoryLocked
from ckpt.errors import AccessDenied, StoreUnavailable
from ckpt.lock import KIND, Lock, list_locks, read_lock, remove_stale_locks
from ckpt.store.base import Buffer, Store
from ckpt.store.local import LocalStore
from ckpt.testing import Fault, FaultyStore
from tests.harness.repo import NS, make_block, sample_pins

GRACE0 = timedelta(0)


def save(repo: Repository, i: int = 0) -> Any:
    return repo.save([make_block(i, "bfloat16", (4, 8), i)], worker_id="w0", namespace=NS, pins=sample_pins())


@pytest.fixture
def repo(tmp_path: Path) -> Repository:
    r = Repository.init(LocalStore(tmp_path / "repo", fsync=False), pack_size=64 << 10)
    save(r)
    return r


def test_a_shared_lock_that_cannot_be_read_stops_gc(repo: Repository) -> None:
    with Lock(repo.store, exclusive=False, operation="save alive") as held:
        fs = FaultyStore(repo.store, [Fault("get", match=lambda n: n == held.name, times=100)])
        with pytest.raises(RepositoryLocked, match="cannot judge the repository's locks"):
            Repository.open(fs).gc(now=True, grace=GRACE0)
    assert [lk.operation for lk in list_locks(repo.store)] == []  # gc left no lock behind


def _plant(store: Store, name: str, data: bytes) -> None:
    store.put(name, data)


def test_a_lock_of_a_newer_version_stops_saves_and_gc(repo: Repository) -> None:
    name = "locks/" + "cd" * 16
    _plant(repo.store, name, json.dumps({"format": KIND, "version": 9, "body": {}}).encode())
    info = read_lock(repo.store, name)
    assert info is not None
    assert info.newer
    with pytest.raises(RepositoryLocked, match=name):
        repo.gc(now=True, grace=GRACE0)
    with pytest.raises(RepositoryLocked, match=name):
        repo.save([make_block(1, "bfloat16", (4, 8), 1)], worker_id="w0", namespace=NS, pins=sample_pins(), lock_wait=0)


def test_a_torn_lock_stops_gc_until_it_is_stale_by_the_stores_clock_and_never_stops_saves(
    repo: Repository, tmp_path: Path
) -> None:
    name = "locks/" + "ef" * 16
    _plant(repo.store, name, b'{"format": "gpuckpt-lock", "vers')
    save(repo, 1)  # saves go on
    with pytest.raises(RepositoryLocked, match="unreadable lock"):
        repo.gc(now=True, grace=GRACE0)
    old = time.time() - 3 * 3600
    os.utime(tmp_path / "repo" / name, (old, old))
    report = repo.gc(now=True, grace=GRACE0)
    assert report.removed_locks == 1


HOLDER = """
import sys, time
from ckpt.lock import Lock
from ckpt.store.local import LocalStore
lock = Lock(LocalStore(sys.argv[1], fsync=False), exclusive=sys.argv[2] == "x", operation="gc killed")
print(lock.name, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("kind", ["x", "s"])
def test_a_sigkilled_holders_lock_on_this_host_is_stale_at_once(repo: Repository, tmp_path: Path, kind: str) -> None:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "repo"), kind], stdout=subprocess.PIPE)
    assert p.stdout is not None
    name = p.stdout.readline().decode().strip()
    assert name.startswith("locks/")
    if kind == "x":  # while it lives, a gc's lock holds saves off
        with pytest.raises(RepositoryLocked, match="gc killed"):
            repo.save(
                [make_block(2, "bfloat16", (4, 8), 2)], worker_id="w0", namespace=NS, pins=sample_pins(), lock_wait=0
            )
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    save(repo, 3)  # not held off for 30 minutes
    report = repo.gc(now=True, grace=GRACE0)
    assert report.removed_locks == 1
    assert list_locks(repo.store) == []


def test_a_writers_clock_is_not_the_judge_of_staleness(repo: Repository) -> None:
    """A live holder whose clock is an hour behind wrote its lock just now: it is live."""
    with Lock(repo.store, exclusive=False, operation="save skewed") as held:
        info = read_lock(repo.store, held.name, repo.store.stat(held.name).mtime)
        assert info is not None
        body = {**info.__dict__}
        assert not info.stale(repo.store.stat(held.name).mtime + 60, 1800)
        assert body["operation"] == "save skewed"
        with pytest.raises(RepositoryLocked, match="save skewed"):
            repo.gc(now=True, grace=GRACE0)


class BlockingPuts(Store):
    """Passes through, but a put of ``name`` after the first waits for ``gate``."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities
        self.name = ""
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.puts = 0

    @property
    def url(self) -> str:
        return self.inner.url

    def put(self, name: str, data: Buffer, *, if_absent: bool = False) -> None:
        if name == self.name:
            self.puts += 1
            if self.puts > 1:
                self.entered.set()
                self.gate.wait(30)
        self.inner.put(name, data, if_absent=if_absent)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        return self.inner.get(name, offset, length)

    def stat(self, name: str) -> Any:
        return self.inner.stat(name)

    def list(self, prefix: str = "") -> Any:
        return self.inner.list(prefix)

    def delete(self, name: str) -> None:
        self.inner.delete(name)


def test_a_refresh_in_flight_cannot_undo_the_release(repo: Repository, monkeypatch: pytest.MonkeyPatch) -> None:
    store = BlockingPuts(repo.store)
    monkeypatch.setattr(lock_mod.secrets, "token_hex", lambda n: "77" * n)
    store.name = "locks/" + "77" * 16
    lk = Lock(store, exclusive=False, operation="save", stale_after=3.0)  # refreshes every second
    assert store.entered.wait(20), "the refresh never started"
    releasing = threading.Thread(target=lk.release)
    releasing.start()
    time.sleep(6)  # longer than release used to wait for the refresher before deleting anyway
    store.gate.set()
    releasing.join(20)
    assert not releasing.is_alive()
    assert list_locks(repo.store) == []


def test_a_role_that_may_not_delete_leaves_a_released_marker(repo: Repository) -> None:
    fs = FaultyStore(
        repo.store,
        [
            Fault(
                "delete",
                match=lambda n: n.startswith("locks/"),
                times=10**6,
                error=lambda: AccessDenied("injected: AccessDenied"),
            )
        ],
    )
    Repository.open(fs).save([make_block(5, "bfloat16", (4, 8), 5)], worker_id="w0", namespace=NS, pins=sample_pins())
    assert [o.name for o in repo.store.list("locks/")]  # the object is still there...
    assert list_locks(repo.store) == []  # ...as a released marker
    repo.gc(now=True, grace=GRACE0)  # which does not hold gc off (and gc may delete it)


def test_a_lock_whose_refresh_failed_or_that_slept_commits_nothing(
    repo: Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = FaultyStore(repo.store, [Fault("put", nth=2, match=lambda n: n.startswith("locks/"), times=10**6)])
    lk = Lock(fs, exclusive=False, operation="save", stale_after=3.0)
    deadline = time.monotonic() + 20
    while lk._refresh_failed is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(OperationAborted, match="could not be refreshed"):
        lk.confirm()
    lk.release()
    lk = Lock(repo.store, exclusive=False, operation="save")
    lk.confirm()
    real = lock_mod._boottime
    monkeypatch.setattr(lock_mod, "_boottime", lambda: real() + 3600)  # the host was suspended an hour
    with pytest.raises(OperationAborted, match="last refreshed"):
        lk.confirm()
    lk._write()  # refreshed again after the sleep: the gap still forbids the commit
    with pytest.raises(OperationAborted, match="last refreshed"):
        lk.confirm()
    lk.release()
    # A save whose lock cannot be confirmed makes nothing visible.
    monkeypatch.setattr(Lock, "confirm", lambda self, *a: (_ for _ in ()).throw(OperationAborted("lock not fresh")))
    before = [c.id for c in repo.list()]
    with pytest.raises(OperationAborted):
        save(repo, 9)
    assert [c.id for c in repo.list()] == before


def test_gpuckpt_unlock_removes_stale_locks_and_refuses_live_ones(repo: Repository, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    root = tmp_path / "repo"
    stale = "locks/" + "12" * 16
    _plant(repo.store, stale, b"garbage")
    old = time.time() - 7200
    os.utime(root / stale, (old, old))
    with Lock(repo.store, exclusive=False, operation="save live") as live:
        r = CliRunner().invoke(app, ["unlock", "--repo", str(root), "--json"])
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        assert [x["name"] for x in doc["removed"]] == [stale]
        assert [x["name"] for x in doc["live"]] == [live.name]
        r = CliRunner().invoke(app, ["unlock", "--repo", str(root), "--remove-all"])
        assert r.exit_code == 0, r.output
        assert "save live" in r.stdout
    assert list_locks(repo.store) == []
    assert remove_stale_locks(repo.store) == []


def test_an_unreachable_store_is_not_taken_for_no_locks(repo: Repository) -> None:
    fs = FaultyStore(repo.store, [Fault("list", match=lambda p: p.startswith("locks"), times=10**6)])
    with pytest.raises((RepositoryLocked, StoreUnavailable)):
        Repository.open(fs).gc(now=True, grace=GRACE0)
