"""gc repacks sparse packs: live blobs move, old manifests still load.

Manifests record where each blob was written; after a repack they name a pack
that is gone, and readers find the blob again through the index, checking it
against the manifest's own checksums.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from ckpt import Block, Keyring, Manifest, Namespace, Pins, Repository, SaveOptions, WorkerFacts
from ckpt.pins import HostFacts
from ckpt.store.local import LocalStore
from ckpt.testing import Fault, FaultyStore, SimulatedCrash

NS = Namespace({"engine": "t"})
PINS = Pins(host=HostFacts(), worker=WorkerFacts())
KiB = 1024


def blocks(tag: str, n: int, seed: int) -> list[Block]:
    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(0.05, 3.0, 64)
    return [
        Block.from_tensor(f"{tag}-{i}".encode(), (torch.randn(2, 4, 16, 64, generator=g) * spread).to(torch.bfloat16))
        for i in range(n)
    ]


def save(repo: Repository, bs: list[Block], worker: str = "w") -> Manifest:
    return repo.save(bs, worker_id=worker, namespace=NS, pins=PINS, options=SaveOptions(pack_size=1 << 20))


def loads_exact(repo: Repository, ref: str, bs: list[Block]) -> None:
    got = {b.key: bytes(b.data) for b in repo.load(ref)}
    assert got == {b.key: bytes(b.data) for b in bs}


def store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "packs").rglob("*") if p.is_file())


@pytest.fixture(params=[None, "aes"], ids=["plain", "encrypted"])
def key(request: pytest.FixtureRequest) -> Keyring | None:
    return Keyring(os.urandom(32)) if request.param else None


def sparse_repo(root: Path, key: Keyring | None) -> tuple[Repository, Manifest, list[Block]]:
    """A: 16 blocks in one pack; B keeps 3 of them and adds 16 new; A forgotten."""
    repo = Repository.init(LocalStore(root), key=key, pack_size=1 << 20)
    a = blocks("a", 16, 1)
    save(repo, a)
    b_blocks = a[:3] + blocks("b", 16, 2)
    b = save(repo, b_blocks)
    assert repo.forget(keep_last=1)
    return repo, b, b_blocks


def test_sparse_pack_is_repacked_and_old_manifest_still_loads(tmp_path: Path, key: Keyring | None) -> None:
    root = tmp_path / "r"
    repo, b, b_blocks = sparse_repo(root, key)
    before = store_bytes(root)
    report = repo.gc(now=True, grace=timedelta(0))
    assert len(report.repacked_packs) == 1
    assert report.deleted_packs == []
    assert report.reclaimed_bytes > 0
    assert store_bytes(root) < before - report.reclaimed_bytes // 2
    # The manifest still names the old pack, which is gone.
    old_pack = report.repacked_packs[0].rsplit("/", 1)[-1]
    assert old_pack in {r.pack for r in b.blocks}
    assert not (root / report.repacked_packs[0]).exists()
    # This process, and a fresh one, find the moved blobs through the index.
    loads_exact(repo, b.id, b_blocks)
    fresh = Repository.open(LocalStore(root), key=key)
    loads_exact(fresh, b.id, b_blocks)
    assert fresh.verify(b.id).ok
    assert fresh.verify(b.id, read_data=False).ok
    assert fresh.verify().ok
    # A second gc has nothing left to do, and the data still loads.
    again = fresh.gc(now=True, grace=timedelta(0))
    assert again.repacked_packs == []
    assert again.deleted_packs == []
    loads_exact(fresh, b.id, b_blocks)


def test_a_repository_object_with_a_stale_index_loads_after_repack(tmp_path: Path) -> None:
    root = tmp_path / "r"
    repo, b, b_blocks = sparse_repo(root, None)
    other = Repository.open(LocalStore(root))
    other.index.refresh(other.store, other.keyring)  # cached before the gc
    repo.gc(now=True, grace=timedelta(0))
    loads_exact(other, b.id, b_blocks)
    # A later save from the stale object dedups against the moved blobs.
    c = save(other, b_blocks[:5], worker="w2")
    assert c.sizes.new_blocks == 0
    loads_exact(other, c.id, b_blocks[:5])


def test_repack_can_be_turned_off_and_dry_run_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "r"
    repo, b, b_blocks = sparse_repo(root, None)
    before = sorted(p.name for p in (root / "packs").rglob("*") if p.is_file())
    dry = repo.gc(now=True, grace=timedelta(0), dry_run=True)
    assert len(dry.repacked_packs) == 1
    off = repo.gc(now=True, grace=timedelta(0), repack_below=0)
    assert off.repacked_packs == []
    assert sorted(p.name for p in (root / "packs").rglob("*") if p.is_file()) == before
    loads_exact(repo, b.id, b_blocks)


def test_a_pack_that_does_not_verify_is_not_repacked(tmp_path: Path) -> None:
    root = tmp_path / "r"
    repo, b, _ = sparse_repo(root, None)
    sparse = next(p for p in (root / "packs").rglob("*") if p.is_file() and p.name in {r.pack for r in b.blocks[:3]})
    raw = bytearray(sparse.read_bytes())
    first = min(r.offset for r in b.blocks[:3] if r.pack == sparse.name)
    raw[first + 5] ^= 0xFF
    sparse.write_bytes(raw)
    report = repo.gc(now=True, grace=timedelta(0))
    assert report.repacked_packs == []
    assert sparse.exists()


@pytest.mark.parametrize("method", ["put", "delete"])
def test_gc_repack_crashed_at_every_write_loses_nothing(tmp_path: Path, method: str) -> None:
    probe_root = tmp_path / "probe"
    repo, _, _ = sparse_repo(probe_root, None)
    fs = FaultyStore(repo.store)
    Repository.open(fs).gc(now=True, grace=timedelta(0), stale_lock_after=0)
    n_calls = fs.calls.get(method, 0)
    assert n_calls >= 2
    for n in range(1, n_calls + 1):
        root = tmp_path / f"{method}{n}"
        _, b, b_blocks = sparse_repo(root, None)
        crashing = Repository.open(FaultyStore(LocalStore(root), [Fault(method=method, nth=n, error=SimulatedCrash)]))
        with pytest.raises(SimulatedCrash):
            crashing.gc(now=True, grace=timedelta(0), stale_lock_after=0)
        fresh = Repository.open(LocalStore(root))
        loads_exact(fresh, b.id, b_blocks)
        fresh.gc(now=True, grace=timedelta(0), stale_lock_after=0)
        loads_exact(fresh, b.id, b_blocks)
        assert fresh.verify().ok
        # ...and converges: no pack is left that no index lists (a superseded pack
        # the dead gc did not get to delete is deleted by this one).
        fresh.index.refresh(fresh.store, fresh.keyring)
        on_disk = {o.name.rsplit("/", 1)[-1] for o in fresh.store.list("packs/")}
        assert on_disk == set(fresh.index.packs), f"{method} #{n}: leaked {on_disk - set(fresh.index.packs)}"


@pytest.mark.parametrize("seed", range(8))
def test_two_copies_of_one_blob_in_an_encrypted_repository_survive_a_repack(tmp_path: Path, seed: int) -> None:
    """Two workers save the same block at once (neither sees the other's index): an encrypted
    repository then holds two ciphertexts of one blob id. Both are indexed; after a repack moves
    them, each checkpoint reads its own copy, and ``verify`` checks each reference against it."""
    key = Keyring(os.urandom(32))
    root = tmp_path / "repo"
    Repository.init(LocalStore(root), key=key, pack_size=1 << 20)
    shared = blocks("system-prompt", 3, 100 + seed)

    def open_repo() -> Repository:
        return Repository.open(LocalStore(root), key=key)

    # w1 stores copy 1 of the shared blocks (with junk), then a checkpoint that dedups against it.
    m0 = save(open_repo(), shared + blocks("junk1", 4, seed), worker="w1")
    m1 = save(open_repo(), shared + blocks("w1", 2, seed + 10), worker="w1")
    # w2 runs as if at the same time: it does not see w1's index, and stores copy 2.
    hidden = tmp_path / "hidden"
    (root / "index").rename(hidden)
    (root / "index").mkdir(mode=0o700)
    m2a = save(open_repo(), shared + blocks("junk2", 4, seed + 20), worker="w2")
    m2 = save(open_repo(), shared + blocks("w2", 2, seed + 30), worker="w2")
    for doc in hidden.iterdir():
        doc.rename(root / "index" / doc.name)
    assert {b.blob for b in m1.blocks[:3]} == {b.blob for b in m2.blocks[:3]}
    assert {b.checksum for b in m1.blocks[:3]}.isdisjoint({b.checksum for b in m2.blocks[:3]})
    # Forgetting the junk makes both copies' packs sparse: gc repacks them.
    repo = open_repo()
    repo.delete(m0.id)
    repo.delete(m2a.id)
    report = repo.gc(now=True, grace=timedelta(0), repack_below=1.0)
    assert report.repacked_packs
    for m in (m1, m2):
        fresh = Repository.open(LocalStore(root), key=key)
        got = {b.key: bytes(b.data) for b in fresh.load(m.id)}
        assert len(got) == len(m.blocks)
    v = Repository.open(LocalStore(root), key=key).verify(read_data=True)
    assert v.ok, v.problems


def test_a_repacked_blob_keeps_its_content_id(tmp_path: Path) -> None:
    """Another trust domain holding the same bytes stores none of them again after a repack: the
    content id moves with the blob (a repack without it lost the sharing; seen in the soak)."""
    root = tmp_path / "r"
    key = Keyring(os.urandom(32))
    repo, _, b_blocks = sparse_repo(root, key)
    assert repo.gc(now=True, grace=timedelta(0)).repacked_packs
    fresh = Repository.open(LocalStore(root), key=key)
    m = fresh.save(
        b_blocks[:3],
        worker_id="other",
        namespace=Namespace({"engine": "t", "trust_domain": "other"}),
        pins=PINS,
        options=SaveOptions(pack_size=1 << 20),
    )
    assert m.sizes.new_blocks == 0, "the repacked blobs' bytes were stored again"
