"""Crash consistency of saving: whatever point a save dies at, the repository
shows the whole new checkpoint or nothing, the previous checkpoint still
loads, nothing that was left behind blocks later work forever, and one
``gc`` reclaims all the garbage and nothing live.

Crashes are injected three ways: a :class:`FaultyStore` raising
:class:`SimulatedCrash` at every store write a save makes, a real child
process SIGKILLed mid-save, and a real S3 server (SeaweedFS) dropping a
multipart part or going away altogether.
"""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ckpt import (
    Block,
    HostFacts,
    Manifest,
    Namespace,
    OperationAborted,
    Pins,
    Repository,
    RepositoryLocked,
    SaveOptions,
    SaveProgress,
    StoreError,
    StoreUnavailable,
    WorkerFacts,
)
from ckpt.lock import list_locks
from ckpt.store.base import Buffer, Store
from ckpt.store.local import LocalStore
from ckpt.testing import Fault, FaultyStore, KilledStore, SimulatedCrash

NS = Namespace({"model": "crash-test", "layout": "flat"})
PINS = Pins(host=HostFacts(), worker=WorkerFacts())
KiB = 1 << 10
MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent

# The fault-injected save: ~10 packs, deterministic (one encoder, one uploader).
SMALL_OPTS = SaveOptions(pack_size=64 * KiB, upload_workers=1, workers=1)


# -- builders and checks -------------------------------------------------------------------


def make_blocks(tag: str, n: int, size: int, seed: int) -> list[Block]:
    """``n`` blocks of ``size`` bytes: odd ones random, even ones compressible."""
    import numpy as np

    from ckpt import Block

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        data = rng.bytes(size) if i % 2 else rng.integers(0, 8, size, dtype=np.uint8).tobytes()
        out.append(Block(f"{tag}-{i:05d}".encode(), data, "bfloat16", (size // 16, 8)))
    return out


def expected(blocks: list[Block]) -> dict[bytes, tuple[bytes, str, tuple[int, ...]]]:
    return {b.key: (bytes(b.data), b.dtype, tuple(b.shape)) for b in blocks}


def assert_loads_exact(repo: Repository, ref: str | Manifest, blocks: list[Block]) -> None:
    got = {lb.key: (bytes(lb.data), lb.dtype, tuple(lb.shape)) for lb in repo.load(ref)}
    want = expected(blocks)
    assert got.keys() == want.keys()
    bad = [k for k in want if got[k] != want[k]]
    assert not bad, f"{len(bad)} blocks differ, first {bad[0]!r}"


def pack_ids(store: Store) -> set[str]:
    return {o.name.rsplit("/", 1)[-1] for o in store.list("packs/")}


def referenced_packs(repo: Repository) -> set[str]:
    return {b.pack for m in repo.manifests() for b in m.blocks}


def live_packs(repo: Repository) -> set[str]:
    """Packs holding a blob some manifest references, by the index: after a gc
    repack a manifest's blob may live in another pack than the one it names."""
    live = {b.blob for m in repo.manifests() for b in m.blocks}
    repo.index.refresh(repo.store, repo.keyring)
    return {pid for pid, rec in repo.index.packs.items() if any(e.id in live for e in rec.entries)}


def tmp_debris(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if "#tmp-" in p.name]


def save(
    repo: Repository,
    blocks: list[Block],
    worker: str = "w0",
    opts: SaveOptions = SMALL_OPTS,
    **kw: Any,
) -> Manifest:
    return repo.save(blocks, worker_id=worker, namespace=NS, pins=PINS, options=opts, **kw)


def check_after_crash(
    root: Path,
    prev: Manifest,
    prev_blocks: list[Block],
    new_blocks: list[Block],
    *,
    later_blocks: list[Block] | None = None,
) -> Manifest | None:
    """The invariants a crashed save must leave, checked by a fresh process.

    Returns the new checkpoint's manifest if the crashed save became visible.
    """
    repo = Repository.open(LocalStore(root, fsync=False))
    # All or nothing: the previous checkpoint plus at most the whole new one.
    infos = repo.list()
    assert prev.id in [c.id for c in infos]
    others = [c for c in infos if c.id != prev.id]
    assert len(others) <= 1, others
    new = repo.manifest(others[0]) if others else None
    if new is not None:
        assert_loads_exact(repo, new, new_blocks)
    assert_loads_exact(repo, prev.id, prev_blocks)

    # A lock a crashed save left behind holds gc off until it goes stale, unless its
    # holder is a process of this host that is gone (a SIGKILLed one): then at once.
    locks = list_locks(repo.store)
    if any(not lk.holder_dead() for lk in locks):
        with pytest.raises(RepositoryLocked) as ei:
            repo.gc(now=True, grace=timedelta(0), dry_run=True)
        assert "save" in str(ei.value)
    elif locks:
        repo.gc(now=True, grace=timedelta(0), dry_run=True)  # not held off
    # ...but never blocks a later save (shared locks do not conflict).
    later_blocks = later_blocks or (new_blocks[:6] + make_blocks("later", 3, 16 * KiB, 99))
    later = save(repo, later_blocks, worker="w1", lock_wait=0)
    assert_loads_exact(repo, later, later_blocks)

    # One gc treating every lock as stale reclaims all the garbage, nothing live.
    repo.gc(now=True, grace=timedelta(0), stale_lock_after=0)
    fresh = Repository.open(LocalStore(root, fsync=False))
    assert list_locks(fresh.store) == []
    on_disk = pack_ids(fresh.store)
    assert on_disk == live_packs(fresh), "gc left garbage or deleted live data"
    fresh.index.refresh(fresh.store, fresh.keyring)
    assert set(fresh.index.packs) == on_disk, "the index and the packs disagree after gc"
    assert tmp_debris(root) == []
    assert_loads_exact(fresh, prev.id, prev_blocks)
    assert_loads_exact(fresh, later.id, later_blocks)
    if new is not None:
        assert_loads_exact(fresh, new.id, new_blocks)
    report = fresh.verify()
    assert report.ok, report.problems
    assert report.checked_checkpoints == len(fresh.list())
    return new


# -- a save killed at every store write ---------------------------------------------------------


PREV = make_blocks("prev", 8, 16 * KiB, 1)
# Some blocks dedup against the previous checkpoint; 36 are new (~10 packs).
NEW = PREV[:4] + make_blocks("new", 36, 16 * KiB, 2)


def _fresh_repo(root: Path) -> tuple[LocalStore, Manifest]:
    inner = LocalStore(root, fsync=False)
    repo = Repository.init(inner, pack_size=64 * KiB)
    prev = save(repo, PREV)
    return inner, prev


def _full_save_puts(tmp: Path) -> list[str]:
    inner, _ = _fresh_repo(tmp)
    fs = FaultyStore(inner)
    save(Repository.open(fs), NEW)
    return [n for m, n in fs.log if m == "put"]


@pytest.mark.parametrize("after", [False, True], ids=["before-write", "after-write"])
@pytest.mark.parametrize("mode", ["killed", "crash"])
def test_save_crashed_at_every_put(tmp_path: Path, mode: str, after: bool) -> None:
    puts = _full_save_puts(tmp_path / "probe")
    kinds = [p.split("/", 1)[0] for p in puts]
    # lock, packs..., one index document, the manifest last
    assert kinds[0] == "locks", kinds
    assert kinds[-2:] == ["index", "manifests"], kinds
    assert kinds.count("packs") >= 5
    hits: dict[str, int] = {}
    for n in range(1, len(puts) + 1):
        root = tmp_path / f"n{n}"
        inner, prev = _fresh_repo(root)
        before = pack_ids(inner)
        cls = KilledStore if mode == "killed" else FaultyStore
        fs = cls(inner, [Fault(method="put", nth=n, error=SimulatedCrash, after=after)])
        repo = Repository.open(fs)
        with pytest.raises(SimulatedCrash):
            save(repo, NEW)
        hit = [name for m, name in fs.log if m == "put"][n - 1]
        kind = hit.split("/", 1)[0]
        hits[kind] = hits.get(kind, 0) + 1
        visible = [c.id for c in Repository.open(inner).list() if c.id != prev.id]
        # The checkpoint exists iff its manifest create took effect.
        assert bool(visible) == (kind == "manifests" and after), (n, hit, visible)
        if mode == "crash" and not after and kind in ("locks", "packs"):
            # The failed save's own clean-up removed every pack it had written.
            assert pack_ids(inner) == before, (n, hit)
        try:
            new = check_after_crash(root, prev, PREV, NEW)
        except AssertionError as exc:
            raise AssertionError(f"crash at put {n} ({hit}, after={after}): {exc}") from exc
        assert (new is not None) == bool(visible)
    assert (hits["locks"], hits["index"], hits["manifests"]) == (1, 1, 1), hits


def test_crash_after_lock_write_leaves_a_stale_able_lock(tmp_path: Path) -> None:
    inner, prev = _fresh_repo(tmp_path)
    fs = KilledStore(inner, [Fault(method="put", nth=1, error=SimulatedCrash, after=True)])
    with pytest.raises(SimulatedCrash):
        save(Repository.open(fs), NEW)
    locks = list_locks(inner)
    assert len(locks) == 1
    assert (locks[0].exclusive, locks[0].operation, locks[0].pid) == (False, "save w0", os.getpid())
    repo = Repository.open(inner)
    with pytest.raises(RepositoryLocked) as ei:
        repo.gc(now=True)
    assert locks[0].name in str(ei.value)
    assert "'save w0'" in str(ei.value)
    report = repo.gc(now=True, grace=timedelta(0), stale_lock_after=0)
    assert report.removed_locks == 1
    assert list_locks(inner) == []
    assert_loads_exact(repo, prev.id, PREV)


# -- a real process SIGKILLed mid-save -------------------------------------------------------------

BIG_N, BIG_SIZE, BIG_SEED = 200, 256 * KiB, 7
BIG_PREV_N = 12

_CHILD = textwrap.dedent(
    """
    import sys
    from ckpt import HostFacts, Namespace, Pins, Repository, SaveOptions, WorkerFacts
    from ckpt.store.local import LocalStore

    root, n, size, seed, prev_n = sys.argv[1], *map(int, sys.argv[2:6])
    blocks = make_blocks("prev", prev_n, size, seed + 1)[: prev_n // 2]
    blocks += make_blocks("big", n, size, seed)
    repo = Repository.open(LocalStore(root))

    def progress(p):
        print("progress", p.phase, p.packs_written, flush=True)

    print("ready", flush=True)
    sys.stdin.readline()
    m = repo.save(
        blocks, worker_id="w0", namespace=Namespace({fields!r}),
        pins=Pins(host=HostFacts(), worker=WorkerFacts()),
        options=SaveOptions(pack_size=1 << 20, workers=2, upload_workers=2, max_memory=8 << 20),
        progress=progress,
    )
    print("saved", m.id, flush=True)
    """
).replace("{fields!r}", repr(dict(NS.fields)))


@pytest.fixture(scope="module")
def big_blocks() -> tuple[list[Block], list[Block]]:
    prev = make_blocks("prev", BIG_PREV_N, BIG_SIZE, BIG_SEED + 1)
    new = prev[: BIG_PREV_N // 2] + make_blocks("big", BIG_N, BIG_SIZE, BIG_SEED)
    return prev, new


def _run_child(root: Path, kill: Callable[[str, float], bool]) -> tuple[bool, float]:
    """Run the saving child; SIGKILL it once ``kill(last line, seconds since go)``
    says so. Returns (killed, seconds from go to the end)."""
    script = "from __future__ import annotations\n" + inspect.getsource(make_blocks) + _CHILD
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(root), str(BIG_N), str(BIG_SIZE), str(BIG_SEED), str(BIG_PREV_N)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        text=True,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
        lines: list[str] = []
        done = threading.Event()

        def reader() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line.strip())
            done.set()

        threading.Thread(target=reader, daemon=True).start()
        t0 = time.monotonic()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        killed = False
        while not done.is_set():
            if kill(lines[-1] if lines else "", time.monotonic() - t0):
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
            time.sleep(0.001)
        proc.wait(30)
        elapsed = time.monotonic() - t0
        if not killed:
            err = proc.stderr.read() if proc.stderr else ""
            assert proc.returncode == 0, err
        else:
            assert proc.returncode in (-signal.SIGKILL, 0)
        return killed, elapsed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _after(seconds: float) -> Callable[[str, float], bool]:
    return lambda _line, t: t >= seconds


@pytest.mark.slow
def test_real_process_sigkilled_mid_save(tmp_path: Path, big_blocks: tuple[list[Block], list[Block]]) -> None:
    prev_blocks, new_blocks = big_blocks

    def fresh(name: str) -> tuple[Path, Manifest]:
        root = tmp_path / name
        repo = Repository.init(LocalStore(root), pack_size=1 * MiB)
        return root, save(repo, prev_blocks, opts=SaveOptions(pack_size=1 * MiB))

    # Calibrate: how long a whole save takes here.
    root, prev = fresh("calibrate")
    killed, full = _run_child(root, lambda _line, _t: False)
    assert not killed
    assert check_after_crash(root, prev, prev_blocks, new_blocks) is not None

    triggers: dict[str, Callable[[str, float], bool]] = {
        "first-pack": lambda line, _t: line.startswith("progress") and line.split()[2] != "0",
        # The forced report after the last upload: the index and manifest come next.
        "flush": lambda line, _t: line.startswith("progress flush"),
    }
    for frac in (0.05, 0.3, 0.6, 0.85, 0.97, 1.05):
        triggers[f"t={frac}"] = _after(max(full * frac, 0.02))
    outcomes = {}
    for name, trigger in triggers.items():
        root, prev = fresh(name)
        killed, _ = _run_child(root, trigger)
        before = Repository.open(LocalStore(root))
        partial_packs = len(pack_ids(before.store)) - len(referenced_packs(before))
        try:
            new = check_after_crash(
                root, prev, prev_blocks, new_blocks, later_blocks=new_blocks[8:11] + prev_blocks[:2]
            )
        except AssertionError as exc:
            raise AssertionError(f"kill at {name}: {exc}") from exc
        outcomes[name] = (killed, new is not None, partial_packs)
    # Whatever the timing, some kill must have landed mid-save with packs written
    # and no manifest (else this test exercised nothing).
    assert any(k and not vis and parts > 0 for k, vis, parts in outcomes.values()), outcomes


# -- deadlines -----------------------------------------------------------------------------


class SlowStore(FaultyStore):
    """Puts whose name passes ``slow`` take ``delay`` seconds."""

    def __init__(self, inner: Store, delay: float, slow: Callable[[str], bool]) -> None:
        super().__init__(inner)
        self.delay = delay
        self.slow = slow

    def put(self, name: str, data: Buffer, *, if_absent: bool = False) -> None:
        if self.slow(name):
            time.sleep(self.delay)
        super().put(name, data, if_absent=if_absent)


def test_deadline_during_uploads_aborts_and_removes_its_packs(tmp_path: Path) -> None:
    inner, prev = _fresh_repo(tmp_path)
    before_packs, before_index = pack_ids(inner), {o.name for o in inner.list("index/")}
    fs = SlowStore(inner, 0.1, lambda n: n.startswith("packs/"))
    repo = Repository.open(fs)
    t0 = time.monotonic()
    with pytest.raises(OperationAborted) as ei:
        save(repo, NEW, deadline=t0 + 0.35)
    assert time.monotonic() - t0 < 2.0, "the save did not abort promptly"
    assert "deadline" in str(ei.value)
    assert any(m == "put" and n.startswith("packs/") for m, n in fs.log)
    assert [c.id for c in repo.list()] == [prev.id]
    # past its deadline the save removes its packs in the background (it must not wait on the store)
    end = time.monotonic() + 30
    while pack_ids(inner) != before_packs and time.monotonic() < end:
        time.sleep(0.02)
    assert pack_ids(inner) == before_packs, "the aborted save left its packs behind"
    assert {o.name for o in inner.list("index/")} == before_index
    assert list_locks(inner) == []
    check_after_crash(tmp_path, prev, PREV, NEW)


class HungStore(FaultyStore):
    """Pack puts hang until the test releases them (a PUT that never answers)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.hung = threading.Event()
        self.release = threading.Event()
        self.inflight = 0
        self.count = threading.Condition()

    def put(self, name: str, data: Buffer, *, if_absent: bool = False) -> None:
        if not name.startswith("packs/"):
            super().put(name, data, if_absent=if_absent)
            return
        with self.count:
            self.inflight += 1
        self.hung.set()
        self.release.wait(120)
        try:
            super().put(name, data, if_absent=if_absent)
        finally:
            with self.count:
                self.inflight -= 1
                self.count.notify_all()


def test_a_deadline_bounds_a_save_whose_upload_hangs(tmp_path: Path) -> None:
    inner, prev = _fresh_repo(tmp_path)
    fs = HungStore(inner)
    repo = Repository.open(fs)
    try:
        with pytest.raises(OperationAborted, match="deadline"):
            save(repo, NEW, deadline=time.monotonic() + 1.0)
        assert fs.hung.is_set()
        assert not fs.release.is_set()  # it returned while the upload still hangs
        assert [c.id for c in repo.list()] == [prev.id]
    finally:
        fs.release.set()
    with fs.count:  # the abandoned uploads land packs nothing names: gc's to remove
        assert fs.count.wait_for(lambda: fs.inflight == 0, 60)
    check_after_crash(tmp_path, prev, PREV, NEW)


def test_deadline_after_index_leaves_only_gc_able_garbage(tmp_path: Path) -> None:
    inner, prev = _fresh_repo(tmp_path)
    fs = SlowStore(inner, 0.6, lambda n: n.startswith("index/"))
    repo = Repository.open(fs)
    with pytest.raises(OperationAborted):
        save(repo, NEW, deadline=time.monotonic() + 0.4)
    assert not any(n.startswith("manifests/") for m, n in fs.log if m == "put")
    assert [c.id for c in repo.list()] == [prev.id]
    assert list_locks(inner) == []
    check_after_crash(tmp_path, prev, PREV, NEW)


# -- S3: a dropped multipart part, a server that goes away --------------------------------


def _s3_repo(endpoint: str, bucket: str, **store_kw: Any) -> Repository:
    from ckpt.store.s3 import S3Store

    store = S3Store(bucket, "repo", endpoint_url=endpoint, max_attempts=2, **store_kw)
    return Repository.init(store, pack_size=20 * MiB)


def _uploads(repo: Repository) -> list[str]:
    store: Any = repo.store
    resp = store.client.list_multipart_uploads(Bucket=store.bucket)
    return [u["Key"] for u in resp.get("Uploads", [])]


@pytest.fixture
def s3_repo(seaweed: Any, s3_bucket: str) -> Iterator[Repository]:
    repo = _s3_repo(seaweed.endpoint, s3_bucket)
    yield repo
    repo.close()


@pytest.mark.s3
@pytest.mark.parametrize("abort_fails", [False, True], ids=["aborted", "abort-lost"])
def test_s3_multipart_part_dropped(s3_repo: Repository, abort_fails: bool) -> None:
    from botocore.exceptions import ConnectionClosedError

    repo = s3_repo
    prev_blocks = make_blocks("prev", 4, 64 * KiB, 11)
    prev = save(repo, prev_blocks, opts=SaveOptions(pack_size=20 * MiB))
    before = pack_ids(repo.store)
    client = repo.store.client  # type: ignore[attr-defined]
    dropped: list[str] = []

    def drop_part_2(request: Any, **_: Any) -> None:
        if "partNumber=2" in request.url:
            dropped.append(request.url)
            raise ConnectionClosedError(endpoint_url=request.url)

    def drop_abort(request: Any, **_: Any) -> None:
        raise ConnectionClosedError(endpoint_url=request.url)

    client.meta.events.register("before-send.s3.UploadPart", drop_part_2)
    if abort_fails:
        client.meta.events.register("before-send.s3.AbortMultipartUpload", drop_abort)
    # 24 MiB of random data: a first pack of ~20 MiB goes up in two parts.
    big = make_blocks("big", 48, 1 * MiB, 12)
    big = [b for i, b in enumerate(big) if i % 2] + prev_blocks[:1]
    with pytest.raises(StoreError) as ei:
        save(repo, big, opts=SaveOptions(pack_size=20 * MiB, upload_workers=1))
    client.meta.events.unregister("before-send.s3.UploadPart", drop_part_2)
    client.meta.events.unregister("before-send.s3.AbortMultipartUpload", drop_abort)
    assert isinstance(ei.value, StoreUnavailable), repr(ei.value)
    assert "packs/" in str(ei.value)
    assert len(dropped) == 2  # every attempt of part 2 was dropped
    assert [c.id for c in repo.list()] == [prev.id]
    assert pack_ids(repo.store) == before
    assert_loads_exact(repo, prev.id, prev_blocks)
    if abort_fails:
        assert len(_uploads(repo)) == 1  # invisible debris, until gc
        time.sleep(1.1)  # S3 records upload initiation to the second
        repo.gc(now=True, grace=timedelta(0))
    assert _uploads(repo) == []
    assert pack_ids(repo.store) == live_packs(repo)
    assert repo.verify().ok
    # The repository is fine for the next save.
    again = save(repo, big, opts=SaveOptions(pack_size=20 * MiB))
    assert_loads_exact(repo, again, big)


@pytest.mark.s3
@pytest.mark.slow
def test_s3_server_goes_away_mid_save(seaweed: Any, tmp_path: Path) -> None:
    from tests.harness.seaweed import SeaweedServer

    # A server of its own: stopping the shared one would disturb other tests.
    server = SeaweedServer(tmp_path / "seaweed", weed=seaweed.weed)
    server.start()
    try:
        bucket = server.make_bucket(f"gone-{uuid.uuid4().hex[:10]}")
        repo = _s3_repo(server.endpoint, bucket)
        prev_blocks = make_blocks("prev", 6, 64 * KiB, 21)
        prev = save(repo, prev_blocks, opts=SaveOptions(pack_size=1 * MiB))
        stopped: list[SaveProgress] = []

        def progress(p: SaveProgress) -> None:
            if p.packs_written >= 1 and not stopped:
                stopped.append(p)
                server.stop()

        blocks = make_blocks("mid", 120, 64 * KiB, 22)
        opts = SaveOptions(pack_size=1 * MiB, max_memory=2 * MiB, workers=1, upload_workers=1)
        with pytest.raises(StoreError) as ei:
            save(repo, blocks, opts=opts, progress=progress)
        assert stopped, "the server was never stopped: the save finished first"
        assert isinstance(ei.value, StoreUnavailable), repr(ei.value)
        # The message names the store, the object and the cause.
        assert f"bucket '{bucket}'" in str(ei.value)
        # Which object that is depends on timing: the next pack, the index of
        # the packs already written, or the save's lock (all written while it runs).
        assert re.search(r"'(packs|index|locks)/[0-9a-f/]{8,}'", str(ei.value)), str(ei.value)
        # Refused connections, or a 5xx from the server while it shuts down.
        msg = str(ei.value).lower()
        assert "connect" in msg or "(http 5" in msg, msg
        server.start()
        assert [c.id for c in repo.list()] == [prev.id]
        assert_loads_exact(repo, prev.id, prev_blocks)
        # The failed save could neither remove its packs nor its lock: gc does.
        repo.gc(now=True, grace=timedelta(0), stale_lock_after=0)
        assert pack_ids(repo.store) == live_packs(repo)
        assert list_locks(repo.store) == []
        assert repo.verify().ok
        assert_loads_exact(repo, prev.id, prev_blocks)
        repo.close()
    finally:
        server.close()
