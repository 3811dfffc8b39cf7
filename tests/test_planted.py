"""Planted, rotten and future-dated objects, and skewed clocks, never stop the fleet nor lose a checkpoint.

Someone with write access to the bucket but no key, a disk that rots a byte,
a host whose clock steps back: saves and gc go on, ``latest`` and
``forget`` look at real checkpoints only (ordered by the store's clock),
and every committed checkpoint still loads whole.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import ckpt.save as save_mod
from ckpt import FormatError, IntegrityError, Keyring, Repository
from ckpt.store.local import LocalStore
from tests.harness.repo import NS, make_block, sample_pins

GRACE0 = timedelta(0)


def save(repo: Repository, i: int, worker: str = "w0") -> Any:
    blocks = [make_block(100 * i + j, "bfloat16", (2, 8, 16), seed=100 * i + j) for j in range(3)]
    return repo.save(blocks, worker_id=worker, namespace=NS, pins=sample_pins())


def loads_whole(repo: Repository, m: Any) -> None:
    assert len(list(repo.load(m.id))) == len(m.blocks)


@pytest.fixture(params=[None, "aes"], ids=["plain", "encrypted"])
def repo(request: pytest.FixtureRequest, tmp_path: Path) -> Repository:
    key = Keyring(os.urandom(32)) if request.param else None
    return Repository.init(LocalStore(tmp_path / "repo"), key=key, pack_size=64 << 10)


@pytest.mark.parametrize("damage", ["planted", "rotten"])
def test_an_unreadable_index_document_stops_neither_saves_nor_gc(repo: Repository, tmp_path: Path, damage: str) -> None:
    m1 = save(repo, 1)
    if damage == "planted":
        name = "index/" + "ab" * 16
        repo.store.put(name, b'{"format": "gpuckpt-index", "version": 1, "body": "garbage"}')
    else:
        name = next(o.name for o in repo.store.list("index/"))
        data = bytearray(repo.store.get(name))
        data[len(data) // 2] ^= 0x20
        repo.store.put(name, bytes(data))
    fresh = Repository.open(repo.store, key=repo.keyring)
    m2 = save(fresh, 2)
    report = fresh.gc(now=True, grace=GRACE0)
    assert any(name in u for u in report.unreadable), report.unreadable
    assert repo.store.stat(name)  # reported, never deleted
    for m in (m1, m2):
        loads_whole(Repository.open(repo.store, key=repo.keyring), m)
    problems = fresh.verify().problems
    assert any(p.obj == name for p in problems), problems


def _plant_future_manifests(repo: Repository, n: int) -> list[str]:
    names = []
    for i in range(n):
        cid = f"2099010{i + 1}T000000000Z-{i:08x}"
        name = f"manifests/w0/{cid}"
        repo.store.put(name, json.dumps({"format": "gpuckpt-manifest", "version": 1, "body": {"x": i}}).encode())
        names.append(name)
    return names


def test_future_dated_garbage_manifests_fool_neither_latest_nor_forget_nor_gc(repo: Repository) -> None:
    real = [save(repo, i) for i in range(5)]
    planted = _plant_future_manifests(repo, 3)
    assert repo.resolve("w0:latest").id == real[-1].id
    assert repo.latest("w0")[1].id == real[-1].id
    forgotten = repo.forget(keep_last=3, worker_id="w0")
    assert sorted(c.id for c in forgotten) == sorted(m.id for m in real[:2])
    for m in real[2:]:
        loads_whole(repo, m)
    for name in planted:
        assert repo.store.stat(name)  # not forgotten either: retention never deletes what it cannot read
    report = repo.gc(now=True, grace=GRACE0)
    assert len([u for u in report.unreadable if "2099" in u]) == 3


def test_a_rotten_newest_manifest_does_not_hide_the_one_before(repo: Repository) -> None:
    a, b = save(repo, 1), save(repo, 2)
    data = bytearray(repo.store.get(b.name))
    data[len(data) // 3] ^= 0x01
    repo.store.put(b.name, bytes(data))
    assert repo.latest("w0")[1].id == a.id
    assert repo.resolve("latest").id == a.id


def test_a_host_clock_that_steps_back_does_not_reorder_checkpoints(
    repo: Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = save(repo, 1)

    class Behind(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz) - timedelta(days=2)

    monkeypatch.setattr(save_mod, "datetime", Behind)
    second = save(repo, 2)  # its id is two days older than the first's
    monkeypatch.undo()
    assert second.id < first.id
    assert repo.resolve("w0:latest").id == second.id  # the store's clock orders them
    assert [c.id for c in repo.forget(keep_last=1, worker_id="w0")] == [first.id]
    loads_whole(repo, second)


def test_a_writer_whose_clock_runs_ahead_is_ignored_by_latest_and_forget(
    repo: Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = save(repo, 1)

    class Ahead(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz) + timedelta(days=3)

    monkeypatch.setattr(save_mod, "datetime", Ahead)
    ahead = save(repo, 2)
    monkeypatch.undo()
    info = next(c for c in repo.list("w0") if c.id == ahead.id)
    assert info.future_dated(timedelta(hours=1))
    assert repo.resolve("w0:latest").id == real.id
    assert repo.forget(keep_last=1, worker_id="w0") == []
    loads_whole(repo, ahead)  # still there, by its id


def test_an_edited_pack_size_is_refused(tmp_path: Path) -> None:
    key = Keyring(os.urandom(32))
    for k in (None, key):
        root = tmp_path / ("enc" if k else "plain")
        repo = Repository.init(LocalStore(root), key=k)
        env = json.loads(repo.store.get("config"))
        from ckpt import document

        body = dict(env["body"])
        body["pack_size"] = 1 << 40
        repo.store.put("config", document.seal("gpuckpt-repository", 1, "config", body, None))
        with pytest.raises(FormatError, match=r"pack_size 1099511627776 outside"):
            Repository.open(LocalStore(root), key=k)
        if k is not None:
            body["pack_size"] = 1 << 20  # within bounds, but not what the key holder wrote
            repo.store.put("config", document.seal("gpuckpt-repository", 1, "config", body, None))
            with pytest.raises(IntegrityError, match="config: authentication failed"):
                Repository.open(LocalStore(root), key=k)


def test_created_stays_on_the_store_clock(repo: Repository) -> None:
    m = save(repo, 1)
    info = repo.resolve(m.id)
    assert abs(info.stored - datetime.now(UTC).timestamp()) < 3600
