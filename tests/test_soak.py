"""Soak: four writer processes and a gc loop on one repository, random SIGKILLs and store faults.

The gc loop runs beside the saves (condemning, then deleting what was
condemned twice a save's limit ago), now and then as ``gc --now``, and
applies retention (``forget --keep-last 2``) so that packs the writers keep
deduplicating against (a shared "system prompt") die and come back. Bounded
in time (about 40 s of traffic). At the end every checkpoint ``ls``
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
MAX_SAVE_S = 3.0  # writers abort a save that runs longer; gc deletes 6 s after condemning


def start(root: Path, worker: str, seed: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(WRITER), str(root), worker, str(seed), str(MAX_SAVE_S)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_writers_gc_and_sigkills_lose_no_committed_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    Repository.init(LocalStore(root), pack_size=64 << 10)
    rng = random.Random(1)
    procs = {f"w{i}": start(root, f"w{i}", i) for i in range(4)}
    kills = gcs = deleted = 0
    seed = 100
    end = time.monotonic() + TRAFFIC_S
    try:
        while time.monotonic() < end:
            gc_repo = Repository.open(LocalStore(root))
            gc_repo.max_save_seconds = MAX_SAVE_S
            try:
                if rng.random() < 0.3:
                    gc_repo.forget(keep_last=2)
                now = rng.random() < 0.2
                report = gc_repo.gc(grace=timedelta(0), now=now, lock_wait=2 if now else 0)
                deleted += len(report.deleted_packs)
                gcs += 1
            except GpuckptError:
                pass  # gc --now locked out by the writers, most of the time
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
    assert gcs > 10
    assert deleted > 0, "gc never deleted anything: the soak did not exercise deletion"
    for info in infos:
        m = repo.manifest(info)
        assert len(list(repo.load(m.id))) == len(m.blocks), info.id
    # The dead writers' locks are stale at once; one gc leaves only live objects.
    repo.gc(grace=timedelta(0), now=True)
    assert list_locks(repo.store) == []
    referenced = {b.pack for m in repo.manifests() for b in m.blocks}
    repo.index.refresh(repo.store, repo.keyring)
    on_disk = {o.name.rsplit("/", 1)[-1] for o in repo.store.list("packs/")}
    assert on_disk == set(repo.index.packs), "a pack no index lists"
    assert referenced <= on_disk
    report = repo.verify(read_data=True)
    assert report.ok, report.problems
    print(f"soak: {len(infos)} checkpoints, {kills} SIGKILLs, {gcs} gcs, {deleted} packs deleted")
