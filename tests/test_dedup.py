"""Content-addressed dedup: what a second checkpoint, a second worker and a
second namespace actually write, measured in the manifest and in the store."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from ckpt import Block, Keyring, Manifest, Namespace, Repository, SaveOptions
from ckpt.pack import read_trailer
from tests.harness.repo import (
    NS,
    added_bytes,
    block_bytes,
    key,
    make_block,
    repo_factory,
    sample_pins,
    store_sizes,
)

PAGE = (4, 16, 128)  # 16 KiB of bf16 per block


def save(repo: Repository, blocks: list[Block], worker: str = "w0", ns: Namespace = NS) -> Manifest:
    return repo.save(
        blocks,
        worker_id=worker,
        namespace=ns,
        pins=sample_pins(),
        options=SaveOptions(pack_size=256 * 1024),
    )


def all_blob_ids(repo: Repository) -> list[str]:
    """Every blob stored in any pack (from the packs themselves)."""
    out = []
    for o in repo.store.list("packs/"):
        pid = o.name.rsplit("/", 1)[-1]
        out += [e.id for e in read_trailer(repo.store.get(o.name), pid, repo.keyring)]
    return out


def assert_loads(repo: Repository, m: Manifest, blocks: list[Block]) -> None:
    want = {b.key: block_bytes(b) for b in blocks}
    got = {lb.key: bytes(lb.data) for lb in repo.load(m.id)}
    assert got == want


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_second_checkpoint_writes_only_what_changed(tmp_path: Path, encrypted: bool) -> None:
    repo = repo_factory(str(tmp_path), Keyring(os.urandom(32)) if encrypted else None)
    first = [make_block(i, "bfloat16", PAGE, seed=i) for i in range(100)]
    s0 = store_sizes(repo.store)
    m1 = save(repo, first)
    s1 = store_sizes(repo.store)
    first_added = added_bytes(s0, s1)
    assert m1.sizes.new_blocks == 100
    assert first_added >= m1.sizes.new_stored_bytes > 0

    # 90 blocks the same (same key, same bytes), 10 new ones.
    second = first[:90] + [make_block(1000 + i, "bfloat16", PAGE, seed=1000 + i) for i in range(10)]
    m2 = save(repo, second)
    s2 = store_sizes(repo.store)
    assert m2.sizes.blocks == 100
    assert m2.sizes.new_blocks == 10
    assert m2.sizes.new_raw_bytes == 10 * first[0].nbytes
    assert m2.sizes.new_stored_bytes <= 0.15 * m1.sizes.new_stored_bytes
    # What the store really grew by: packs, index and manifest together.
    assert added_bytes(s1, s2) <= 0.15 * first_added
    # The shared blocks are references to the first checkpoint's blobs.
    old = {r.key: r for r in m1.blocks}
    for r in m2.blocks[:90]:
        o = old[r.key]
        assert (r.blob, r.pack, r.offset, r.length) == (o.blob, o.pack, o.offset, o.length)
    assert m2.parent == m1.id
    assert len(all_blob_ids(repo)) == 110
    assert_loads(repo, m2, second)
    assert_loads(repo, m1, first)


def test_two_workers_sharing_a_system_prompt_store_it_once(tmp_path: Path) -> None:
    system = [make_block(i, "bfloat16", PAGE, seed=i) for i in range(12)]
    a_own = [make_block(100 + i, "bfloat16", PAGE, seed=100 + i) for i in range(5)]
    b_own = [make_block(200 + i, "bfloat16", PAGE, seed=200 + i) for i in range(5)]
    # Two workers, two processes: each opens the repository itself.
    repo_a = repo_factory(str(tmp_path))
    repo_b = repo_factory(str(tmp_path), create=False)
    ma = save(repo_a, system + a_own, worker="worker-a")
    before_b = store_sizes(repo_b.store)
    mb = save(repo_b, system + b_own, worker="worker-b")
    assert mb.sizes.new_blocks == 5
    assert mb.parent is None  # another worker's checkpoint is not its parent
    a_refs = {r.key: r for r in ma.blocks}
    for r in mb.blocks[:12]:
        assert (r.blob, r.pack, r.offset) == (a_refs[r.key].blob, a_refs[r.key].pack, a_refs[r.key].offset)
    ids = all_blob_ids(repo_a)
    assert len(ids) == len(set(ids)) == 22
    assert added_bytes(before_b, store_sizes(repo_b.store)) < 0.6 * sum(r.length for r in ma.blocks)
    assert_loads(repo_a, mb, system + b_own)
    assert_loads(repo_b, ma, system + a_own)


def test_a_different_namespace_does_not_dedup(tmp_path: Path) -> None:
    repo = repo_factory(str(tmp_path))
    blocks = [make_block(i, "bfloat16", PAGE, seed=i) for i in range(10)]
    m1 = save(repo, blocks)
    other = Namespace({**NS.fields, "model": "sha256:" + "cd" * 32})
    assert other.id != NS.id
    m2 = save(repo, blocks, ns=other)
    assert m2.sizes.new_blocks == 10
    assert m2.sizes.new_stored_bytes == m1.sizes.new_stored_bytes
    assert {r.blob for r in m1.blocks}.isdisjoint({r.blob for r in m2.blocks})
    assert len(all_blob_ids(repo)) == 20
    # The same namespace with its fields in another order is the same namespace.
    same = Namespace(dict(reversed(list(NS.fields.items()))))
    assert same.id == NS.id
    m3 = save(repo, blocks, ns=same)
    assert m3.sizes.new_blocks == 0
    assert m3.sizes.packs_written == 0
    assert_loads(repo, m2, blocks)


def test_a_stored_block_of_another_size_under_the_same_key_is_refused_not_referenced(tmp_path: Path) -> None:
    """A blob is found by namespace and key; a page of another size under both means the namespace
    does not tell two page formats apart (as before the one-slot-per-rank pages of a state-space
    worker at TP above its KV heads had their own). Referencing the stored blob would commit a
    manifest that cannot load: the save refuses by name and commits nothing."""
    from ckpt.errors import IntegrityError

    repo = repo_factory(str(tmp_path))
    m1 = save(repo, [make_block(i, "bfloat16", PAGE, seed=i) for i in range(4)])
    wider = [make_block(i, "bfloat16", (8, 16, 128), seed=i) for i in range(4)]
    with pytest.raises(IntegrityError, match=r"4 block\(s\) are already stored .* another size .*stored 16384 bytes"):
        save(repo, wider)
    assert [m.id for m in repo.list()] == [m1.id]


def plain_blob_id(ns: Namespace, k: bytes) -> str:
    return hashlib.sha256(b"gpuckpt-blob\x00" + ns.id.encode() + b"\x00" + k).hexdigest()


def test_encrypted_blob_ids_are_hmacs_and_still_dedup(tmp_path: Path) -> None:
    k1, k2 = Keyring(os.urandom(32)), Keyring(os.urandom(32))
    plain = repo_factory(str(tmp_path / "plain"))
    enc = repo_factory(str(tmp_path / "enc"), k1)
    enc_other = repo_factory(str(tmp_path / "enc2"), k2)
    blocks = [make_block(i, "bfloat16", PAGE, seed=i) for i in range(8)]

    for b in blocks:
        assert plain.blob_id(NS, b.key) == plain_blob_id(NS, b.key)
        e = enc.blob_id(NS, b.key)
        assert len(e) == 64
        assert int(e, 16) >= 0
        assert e != plain_blob_id(NS, b.key)  # not guessable from the content key
        assert e != enc_other.blob_id(NS, b.key)  # a function of the key
        assert e == enc.blob_id(NS, b.key)  # deterministic, so dedup works

    m1 = save(enc, blocks)
    assert [r.blob for r in m1.blocks] == [enc.blob_id(NS, b.key) for b in blocks]
    assert not {r.blob for r in m1.blocks} & {plain_blob_id(NS, b.key) for b in blocks}
    # A second save (a fresh process, same key) dedups every block.
    again = repo_factory(str(tmp_path / "enc"), k1, create=False)
    s1 = store_sizes(again.store)
    m2 = save(again, [*blocks, make_block(50, "bfloat16", PAGE, seed=50)])
    assert m2.sizes.new_blocks == 1
    assert [r.blob for r in m2.blocks[:8]] == [r.blob for r in m1.blocks]
    assert added_bytes(s1, store_sizes(again.store)) < 0.4 * sum(r.length for r in m1.blocks)
    assert sorted(all_blob_ids(again)) == sorted({*(r.blob for r in m2.blocks)})
    assert_loads(again, m2, [*blocks, make_block(50, "bfloat16", PAGE, seed=50)])
    assert key(0) in {lb.key for lb in again.load(m1.id)}


def test_existing_blocks_are_referenced_without_their_bytes_and_missing_ones_refused(tmp_path: Path) -> None:
    """Incremental captures hand the save ``Existing`` blocks for what the repository holds: the
    checkpoint references them and loads whole; one the repository does not hold (never stored,
    condemned by gc, another size) fails the save by name, with nothing visible."""
    from datetime import timedelta

    import numpy as np

    from ckpt import Block, BlocksMissing, Existing, LocalStore, Namespace, Pins, Repository, SaveOptions, WorkerFacts
    from ckpt.pins import HostFacts

    ns, pins = Namespace({"m": "x"}), Pins(host=HostFacts(), worker=WorkerFacts())
    opts = SaveOptions(pack_size=64 << 10)
    rng = np.random.default_rng(7)
    a = [Block(f"a{i}".encode(), rng.bytes(4096), "uint8", (4096,)) for i in range(4)]
    repo = Repository.init(LocalStore(tmp_path / "r"), pack_size=64 << 10)
    first = repo.save(a, worker_id="w0", namespace=ns, pins=pins, options=opts)
    new = Block(b"n0", rng.bytes(4096), "uint8", (4096,))
    second = repo.save(
        [Existing(b.key, "uint8", (4096,)) for b in a] + [new], worker_id="w0", namespace=ns, pins=pins, options=opts
    )
    assert second.sizes.new_blocks == 1
    got = {b.key: bytes(b.data) for b in repo.load(second.id)}
    assert got == {b.key: bytes(b.data) for b in [*a, new]}
    before = [i.id for i in repo.list()]
    for bad in (Existing(b"never", "uint8", (4096,)), Existing(b"a0", "uint8", (2048,))):
        with pytest.raises(BlocksMissing) as ei:
            repo.save([bad, new], worker_id="w0", namespace=ns, pins=pins, options=opts)
        assert ei.value.keys == [bad.key]
        assert bad.key.hex()[:16] in str(ei.value)
    # a pack a gc condemned no longer counts as held
    repo.delete(first.id)
    repo.delete(second.id)
    repo.gc(grace=timedelta(0))
    with pytest.raises(BlocksMissing):
        repo.save([Existing(b"a1", "uint8", (4096,))], worker_id="w0", namespace=ns, pins=pins, options=opts)
    assert [i.id for i in repo.list()] == [i for i in before if i not in (first.id, second.id)]
