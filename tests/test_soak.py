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
from tests.harness.scripts import soak_writer

pytestmark = pytest.mark.slow
WRITER = Path(soak_writer.__file__)
TRAFFIC_S = 40.0
MAX_SAVE_S = 3.0  # writers abort a save that runs longer; gc deletes 6 s after condemning


def start(
    root: Path, worker: str, seed: int, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(WRITER), str(root), worker, str(seed), str(MAX_SAVE_S), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
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


def test_two_trust_domains_and_a_hostile_writer_share_a_bucket_and_the_honest_load_their_own_bytes(
    tmp_path: Path,
) -> None:
    """Two honest domains (a: two writers, b: one) and a hostile writer that stores chosen bytes
    under the shared prompt's keys, on one encrypted repository, with gc, forget and SIGKILLs: at
    the end every honest checkpoint loads whole with the prompt's true bytes, the honest domains
    stored the prompt's true bytes once between them, and verify is clean."""
    from ckpt import Keyring

    system_bytes = soak_writer.system_bytes

    key = os.urandom(32)
    env = {"GPUCKPT_SOAK_KEY": key.hex()}
    root = tmp_path / "repo"
    Repository.init(LocalStore(root), key=Keyring(key), pack_size=64 << 10)
    rng = random.Random(2)
    roles = {"a0": ("a",), "a1": ("a",), "b0": ("b",), "x0": ("x", "hostile")}
    procs = {w: start(root, w, i, *r, env=env) for i, (w, r) in enumerate(roles.items())}
    kills = 0
    end = time.monotonic() + TRAFFIC_S / 2
    try:
        while time.monotonic() < end:
            gc_repo = Repository.open(LocalStore(root), key=Keyring(key))
            gc_repo.max_save_seconds = MAX_SAVE_S
            try:
                if rng.random() < 0.3:
                    gc_repo.forget(keep_last=2)
                gc_repo.gc(grace=timedelta(0))
            except GpuckptError:
                pass
            if rng.random() < 0.5:
                w = rng.choice(sorted(procs))
                os.kill(procs[w].pid, signal.SIGKILL)
                procs[w].wait()
                kills += 1
                procs[w] = start(root, w, 100 + kills, *roles[w], env=env)
            time.sleep(rng.uniform(0.1, 0.6))
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    repo = Repository.open(LocalStore(root), key=Keyring(key))
    truth = {f"system-{i}".encode(): system_bytes(i) for i in range(4)}
    honest = [i for i in repo.list() if not i.worker_id.startswith("x")]
    assert len(honest) > 5, "the honest writers hardly saved anything"
    assert any(i.worker_id.startswith("x") for i in repo.list()), "the hostile writer never saved"
    for info in honest:
        m = repo.manifest(info)
        got = {b.key: bytes(b.data) for b in repo.load(m.id)}
        assert len(got) == len(m.blocks), info.id
        assert all(got[k] == v for k, v in truth.items()), f"{info.id} loads the hostile writer's bytes"
    assert repo.verify(read_data=True).ok
    # a new domain holding the true prompt stores none of it again: shared by content, never by key
    from ckpt import Block, Namespace, Pins, WorkerFacts
    from ckpt.pins import HostFacts

    m = repo.save(
        [Block(k, v, "uint8", (len(v),)) for k, v in truth.items()],
        worker_id="c0",
        namespace=Namespace({"engine": "soak", "trust_domain": "c"}),
        pins=Pins(host=HostFacts(), worker=WorkerFacts()),
    )
    assert m.sizes.new_blocks == 0, "the true prompt was stored again"
    print(f"trust-domain soak: {len(honest)} honest checkpoints, {kills} SIGKILLs")
