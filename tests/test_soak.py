"""Soak: four writer processes and a gc loop on one repository, random SIGKILLs and store faults.

Bounded in time (about 40 s of traffic). At the end every checkpoint ``ls``
shows loads whole, a last gc leaves only live objects, and ``verify`` is clean.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from ckpt import GpuckptError, Repository
from ckpt.lock import list_locks
from ckpt.store.local import LocalStore

pytestmark = pytest.mark.slow
WRITER = Path(__file__).with_name("soak_writer.py")
TRAFFIC_S = 40.0


def start(root: Path, worker: str, seed: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(WRITER), str(root), worker, str(seed)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_writers_gc_and_sigkills_lose_no_committed_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    Repository.init(LocalStore(root), pack_size=64 << 10)
    rng = random.Random(1)
    procs = {f"w{i}": start(root, f"w{i}", i) for i in range(4)}
    kills = gcs = 0
    seed = 100
    end = time.monotonic() + TRAFFIC_S
    try:
        while time.monotonic() < end:
            try:
                Repository.open(LocalStore(root)).gc(grace=timedelta(0), lock_wait=2)
                gcs += 1
            except GpuckptError:
                pass  # locked by the writers, most of the time
            if rng.random() < 0.5:
                w = rng.choice(sorted(procs))
                os.kill(procs[w].pid, signal.SIGKILL)
                procs[w].wait()
                kills += 1
                seed += 1
                procs[w] = start(root, w, seed)
            time.sleep(rng.uniform(0.1, 0.6))
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    repo = Repository.open(LocalStore(root))
    infos = repo.list()
    assert len(infos) > 10, "the writers hardly saved anything"
    assert kills > 5
    for info in infos:
        m = repo.manifest(info)
        assert len(list(repo.load(m.id))) == len(m.blocks), info.id
    # The dead writers' locks are stale at once; one gc leaves only live objects.
    repo.gc(grace=timedelta(0))
    assert list_locks(repo.store) == []
    referenced = {b.pack for m in repo.manifests() for b in m.blocks}
    repo.index.refresh(repo.store, repo.keyring)
    on_disk = {o.name.rsplit("/", 1)[-1] for o in repo.store.list("packs/")}
    assert on_disk == set(repo.index.packs), "a pack no index lists"
    assert referenced <= on_disk
    report = repo.verify(read_data=True)
    assert report.ok, report.problems
    print(f"soak: {len(infos)} checkpoints, {kills} SIGKILLs, {gcs} gcs")
