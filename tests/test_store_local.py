"""LocalStore passes the conformance suite, plus what only a directory has."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

import pytest

from ckpt.errors import StorageFull
from ckpt.store.local import LocalStore
from tests.store_suite import RawAccess, StoreTests


class DirRaw(RawAccess):
    def __init__(self, root: Path) -> None:
        self.root = root

    def put(self, name: str, data: bytes) -> None:
        p = self.root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)

    def get(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def names(self) -> set[str]:
        return {p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file()}


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> LocalStore:
        return LocalStore(tmp_path / "repo")

    @pytest.fixture
    def raw(self, tmp_path: Path) -> DirRaw:
        (tmp_path / "repo").mkdir(exist_ok=True)
        return DirRaw(tmp_path / "repo")


def test_files_and_dirs_are_private(tmp_path: Path) -> None:
    s = LocalStore(tmp_path / "r")
    s.put("a/b/c", b"secret")
    assert stat.S_IMODE(os.stat(tmp_path / "r/a/b/c").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "r/a/b").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "r/a").st_mode) == 0o700


def test_temp_files_are_invisible_and_cleaned(tmp_path: Path) -> None:
    s = LocalStore(tmp_path / "r")
    s.put("p/x", b"1")
    # A temp file left by a killed writer.
    debris = tmp_path / "r/p/y#tmp-deadbeef"
    debris.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(debris, (old, old))
    assert [i.name for i in s.list("")] == ["p/x"]
    assert s.cleanup(older_than=time.time() - 60) == 1
    assert not debris.exists()
    assert s.get("p/x") == b"1"


def test_enospc_maps_to_storage_full_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = LocalStore(tmp_path / "r")
    s.put("keep", b"old")
    real_write = os.write
    written = [0]

    def write(fd: int, data: bytes | memoryview) -> int:
        if written[0] > 1000:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real_write(fd, bytes(data[:500]))
        written[0] += n
        return n

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(StorageFull) as ei:
        s.put("new", b"x" * 10_000)
    monkeypatch.undo()
    assert ei.value.key == "new"
    assert "storage full" in str(ei.value)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["keep"]
    assert s.get("keep") == b"old"


@pytest.mark.parametrize("size", [1 << 20, (4 << 20) + 1, (9 << 20) - 4095])
def test_large_objects_bypass_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """Objects of 1 MiB and more are written with O_DIRECT through an aligned
    bounce buffer; sizes that are not a multiple of the alignment or span
    several bounce chunks come back exact."""
    flags_seen: list[int] = []
    real_open = os.open

    def spy_open(path: str | os.PathLike[str], flags: int, mode: int = 0o777, **kw: object) -> int:
        flags_seen.append(flags)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", spy_open)
    s = LocalStore(tmp_path / "r")
    data = os.urandom(size)
    s.put("packs/aa/big", data)
    monkeypatch.undo()
    if not s._direct:
        pytest.skip("this filesystem refuses O_DIRECT; the fallback test covers it")
    assert any(f & os.O_DIRECT for f in flags_seen)
    assert s.stat("packs/aa/big").size == size
    assert s.get("packs/aa/big") == data
    assert stat.S_IMODE(os.stat(tmp_path / "r/packs/aa/big").st_mode) == 0o600


def test_filesystem_refusing_o_direct_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path: str | os.PathLike[str], flags: int, mode: int = 0o777, **kw: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_direct)
    s = LocalStore(tmp_path / "r")
    data = os.urandom(3 << 20)
    s.put("big", data, if_absent=True)
    s.put("big2", data)
    monkeypatch.undo()
    assert s._direct is False
    assert s.get("big") == data
    assert s.get("big2") == data
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["big", "big2"]
