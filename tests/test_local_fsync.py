"""LocalStore deletes are durable when they return: the directory is fsynced after the unlink.

gc deletes references before data (FORMAT.md §9 step 7); without a directory
fsync a power cut could bring back an index document after the packs it
names were deleted. These tests watch ``os.fsync`` and check what each call
synced, at the moment of the call.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckpt.errors import StoreError
from ckpt.store.local import LocalStore


@dataclass(frozen=True)
class Synced:
    ino: int
    is_dir: bool
    target_exists: bool  # whether the object being deleted was still there when the sync ran


def watch_fsync(monkeypatch: pytest.MonkeyPatch, target: Path) -> list[Synced]:
    calls: list[Synced] = []
    real = os.fsync

    def spy(fd: int) -> None:
        st = os.fstat(fd)
        calls.append(Synced(st.st_ino, stat.S_ISDIR(st.st_mode), target.exists()))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


def test_delete_fsyncs_the_directory_after_the_unlink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = LocalStore(tmp_path / "r")
    s.put("packs/ab/abcd", b"data")
    path = tmp_path / "r" / "packs" / "ab" / "abcd"
    calls = watch_fsync(monkeypatch, path)
    s.delete("packs/ab/abcd")
    assert not path.exists()
    parent = os.stat(path.parent).st_ino
    assert Synced(parent, True, False) in calls


def test_deleting_a_missing_object_still_syncs_its_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process may have unlinked it without syncing yet; the caller proceeds on our return."""
    s = LocalStore(tmp_path / "r")
    s.put("index/a", b"1")
    calls = watch_fsync(monkeypatch, tmp_path / "r" / "index" / "b")
    s.delete("index/b")
    assert Synced(os.stat(tmp_path / "r" / "index").st_ino, True, False) in calls
    # No directory at all: nothing to sync, and no error.
    s.delete("nowhere/x")


def test_a_failed_directory_sync_fails_the_delete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = LocalStore(tmp_path / "r")
    s.put("index/a", b"1")

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(StoreError, match="deleting 'index/a': Input/output error") as ei:
        s.delete("index/a")
    assert ei.value.key == "index/a"


def test_without_fsync_nothing_is_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = LocalStore(tmp_path / "r", fsync=False)
    s.put("index/a", b"1")
    calls = watch_fsync(monkeypatch, tmp_path / "r" / "index" / "a")
    s.delete("index/a")
    assert calls == []


def test_cleanup_syncs_each_directory_it_removed_debris_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = LocalStore(tmp_path / "r")
    s.put("packs/aa/x", b"1")
    s.put("index/y", b"1")
    old = time.time() - 3600
    for d in ("packs/aa", "index"):
        debris = tmp_path / "r" / d / "z#tmp-deadbeef"
        debris.write_bytes(b"partial")
        os.utime(debris, (old, old))
    calls = watch_fsync(monkeypatch, tmp_path / "r" / "index" / "z#tmp-deadbeef")
    assert s.cleanup(older_than=time.time() - 60) == 2
    synced = {c.ino for c in calls if c.is_dir}
    assert {os.stat(tmp_path / "r" / d).st_ino for d in ("packs/aa", "index")} <= synced
