"""A full disk mid-save: StorageFull naming the object, nothing partial
visible, the previous checkpoint intact, and the space back after ``gc``.

Once on a real 4 MiB tmpfs (mounting needs root; skipped only when the kernel
refuses with EPERM), once through a quota that makes the local store's own
``os.write`` fail with ENOSPC (always runs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckpt.store.local as local_mod
from ckpt import (
    Block,
    HostFacts,
    Namespace,
    Pins,
    Repository,
    SaveOptions,
    StorageFull,
    WorkerFacts,
)
from ckpt.lock import list_locks
from ckpt.store.local import LocalStore

NS = Namespace({"model": "full-disk"})
PINS = Pins(host=HostFacts(), worker=WorkerFacts())
KiB = 1 << 10
MiB = 1 << 20
# Small packs, and little memory so the caller is held back by backpressure
# (waiting on the encoders and uploads) when the disk fills: the error must
# still be the disk's, not a generic abort.
OPTS = SaveOptions(pack_size=256 * KiB, max_memory=512 * KiB, workers=1, upload_workers=1)


def random_blocks(tag: str, n: int, size: int, seed: int) -> list[Block]:
    rng = np.random.default_rng(seed)
    return [Block(f"{tag}{i}".encode(), rng.bytes(size), "uint8", (size,)) for i in range(n)]


def assert_loads_exact(repo: Repository, ref: str, blocks: list[Block]) -> None:
    got = {b.key: bytes(b.data) for b in repo.load(ref)}
    assert got == {b.key: bytes(b.data) for b in blocks}


def pack_ids(repo: Repository) -> set[str]:
    return {o.name.rsplit("/", 1)[-1] for o in repo.store.list("packs/")}


def fill_the_disk(root: Path, free: Callable[[], int]) -> None:
    """The scenario, on a store at ``root`` with about 4 MiB of room."""
    repo = Repository.init(LocalStore(root), pack_size=256 * KiB)
    first = random_blocks("first", 16, 64 * KiB, 1)  # 1 MiB: fits
    m1 = repo.save(first, worker_id="w0", namespace=NS, pins=PINS, options=OPTS)
    free_before = free()
    assert free_before < 4 * MiB

    second = random_blocks("second", 96, 64 * KiB, 2)  # 6 MiB: does not
    with pytest.raises(StorageFull) as ei:
        repo.save(second, worker_id="w0", namespace=NS, pins=PINS, options=OPTS)
    err = ei.value
    msg = str(err)
    assert "storage full" in msg.lower()
    assert err.key is not None
    assert err.key in msg, "the message must name the object that did not fit"
    assert err.key.startswith(("packs/", "index/", "manifests/", "locks/"))

    # Nothing partial is visible; the first checkpoint is intact.
    fresh = Repository.open(LocalStore(root))
    assert [c.id for c in fresh.list()] == [m1.id]
    assert_loads_exact(fresh, m1.id, first)

    # gc gives the space back and leaves a clean repository.
    fresh.gc(now=True, grace=timedelta(0), stale_lock_after=0)
    assert pack_ids(fresh) == {b.pack for b in m1.blocks}
    assert list_locks(fresh.store) == []
    assert not [p for p in root.rglob("*") if "#tmp-" in p.name]
    assert free() >= free_before - 16 * KiB, (free(), free_before)
    report = fresh.verify()
    assert report.ok, report.problems
    assert_loads_exact(fresh, m1.id, first)

    # And the repository takes a checkpoint that fits.
    third = random_blocks("third", 8, 64 * KiB, 3)
    m3 = fresh.save(third, worker_id="w0", namespace=NS, pins=PINS, options=OPTS)
    assert_loads_exact(fresh, m3.id, third)


# -- a real tmpfs --------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted at a fresh directory, unmounted afterwards."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    target = os.fsencode(mnt)
    if libc.mount(b"tmpfs", target, b"tmpfs", 0, b"size=4m,mode=0700") != 0:
        code = ctypes.get_errno()
        if code == errno.EPERM:
            pytest.skip("mounting a tmpfs is not permitted here (EPERM: not root in this namespace)")
        pytest.fail(f"mount -t tmpfs failed: {os.strerror(code)}")
    try:
        yield mnt
    finally:
        if libc.umount2(target, 0) != 0:
            libc.umount2(target, 2)  # MNT_DETACH: never leave a mount behind


def test_tmpfs_fills_up(tmpfs: Path) -> None:
    def free() -> int:
        st = os.statvfs(tmpfs)
        return st.f_bavail * st.f_frsize

    assert 3 * MiB < free() <= 4 * MiB
    fill_the_disk(tmpfs / "repo", free)


# -- a quota on the local store's writes ----------------------------------------------------------


class _QuotaOs:
    """Stands in for ``os`` inside ckpt.store.local: writes under ``root`` fail
    with ENOSPC once the files there would exceed ``quota`` bytes."""

    def __init__(self, root: Path, quota: int) -> None:
        self.root, self.quota = root, quota

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def write(self, fd: int, data: Any) -> int:
        if self.used() + memoryview(data).nbytes > self.quota:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def test_enospc_from_the_store_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "repo"
    root.mkdir()
    fake = _QuotaOs(root, 4 * MiB)
    monkeypatch.setattr(local_mod, "os", fake)
    fill_the_disk(root, lambda: fake.quota - fake.used())
