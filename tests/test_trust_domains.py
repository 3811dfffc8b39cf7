"""Trust domains: a worker can only affect restores in its own domain.

A hostile worker A stores bytes of its choosing under the keys (prefix hashes) worker B will use.
With the default domains (each worker its own), B's checkpoint stores B's bytes and B's restore
loads B's bytes; a checkpoint of another domain is refused by name. Workers an operator puts in
one domain share blocks by key, as before (and so trust each other's bytes).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent import session
from agent.engines.types import Staging
from ckpt import Repository
from tests.fake_connector import FakeConnector


@pytest.fixture
def workers(short_tmp: Path):  # type: ignore[no-untyped-def]
    a = FakeConnector(short_tmp / "a.sock", short_tmp / "stage-a")
    b = FakeConnector(short_tmp / "b.sock", short_tmp / "stage-b")
    a.poison = 0x5A  # the same keys, other bytes
    yield a, b
    a.close()
    b.close()


def loaded(repo: Repository, ckpt_id: str) -> dict[bytes, bytes]:
    return {blk.key: bytes(blk.data) for blk in repo.load(ckpt_id)}


def test_a_hostile_worker_cannot_poison_another_domains_checkpoint(workers, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    a, b = workers
    repo = Repository.open(str(short_tmp / "repo"), create=True)
    ma = session.checkpoint(str(a.sock), repo, "wa", where=Staging(a.stage)).manifest
    mb = session.checkpoint(str(b.sock), repo, "wb", where=Staging(b.stage)).manifest
    assert mb.sizes.new_blocks == mb.sizes.blocks, "B deduplicated by key against A's bytes"
    got_a, got_b = loaded(repo, ma.id), loaded(repo, mb.id)
    assert got_a.keys() == got_b.keys()
    assert all(got_a[k] != got_b[k] for k in got_b), "B's restore would load A's bytes"
    assert ma.namespace["trust_domain"] == "wa"
    assert mb.namespace["trust_domain"] == "wb"
    # B's second checkpoint deduplicates against its own first
    mb2 = session.checkpoint(str(b.sock), repo, "wb", where=Staging(b.stage)).manifest
    assert mb2.sizes.new_blocks == 0
    # a restore into B of A's checkpoint is refused by name (a cold plan, never A's bytes)
    desc = session.describe(str(b.sock))
    d = session.restore_decision(repo.manifest(ma.id), desc, trust_domain="wb")
    assert not d.warm
    assert any("trust domain: checkpoint 'wa' != this worker's 'wb'" in r for r in d.reasons)
    assert session.restore_decision(repo.manifest(mb.id), desc, trust_domain="wb").warm


def test_workers_put_in_one_domain_share_blocks_by_key(workers, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    a, b = workers
    a.poison = 0  # trusted workers: the same KV for the same keys
    repo = Repository.open(str(short_tmp / "repo"), create=True)
    session.checkpoint(str(a.sock), repo, "wa", where=Staging(a.stage), trust_domain="fleet")
    mb = session.checkpoint(str(b.sock), repo, "wb", where=Staging(b.stage), trust_domain="fleet").manifest
    assert mb.sizes.new_blocks == 0, "one domain stores a shared prefix once"


def test_across_domains_true_bytes_are_stored_once_and_chosen_bytes_never_shared(workers, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    """In an encrypted repository (where only agents, holding the key, write index documents) a block
    new to a domain is referenced, not stored again, when a blob of exactly its bytes exists — by a
    keyed SHA-256 of the bytes the save computed itself: B shares honest A's bytes, never hostile
    A's chosen ones."""
    import os

    from ckpt import Keyring

    a, b = workers
    repo = Repository.open(str(short_tmp / "repo"), key=Keyring(os.urandom(32)), create=True)
    a.poison = 0
    ma = session.checkpoint(str(a.sock), repo, "wa", where=Staging(a.stage)).manifest
    mb = session.checkpoint(str(b.sock), repo, "wb", where=Staging(b.stage)).manifest
    assert ma.sizes.new_blocks == ma.sizes.blocks
    assert mb.sizes.new_blocks == 0, "a shared prefix with the same bytes is stored once across domains"
    assert mb.sizes.packs_written == 0
    assert loaded(repo, mb.id) == loaded(repo, ma.id)
    # a hostile worker of a third domain stores other bytes under the same keys: nothing of it is shared
    c = FakeConnector(short_tmp / "c.sock", short_tmp / "stage-c")
    c.poison = 0x33
    try:
        mc = session.checkpoint(str(c.sock), repo, "wc", where=Staging(c.stage)).manifest
    finally:
        c.close()
    assert mc.sizes.new_blocks == mc.sizes.blocks
    b.generation = 1  # B's next checkpoint: one page changed, the rest its own
    mb2 = session.checkpoint(str(b.sock), repo, "wb", where=Staging(b.stage)).manifest
    got_b, got_c = loaded(repo, mb2.id), loaded(repo, mc.id)
    assert all(got_b[k] != got_c[k] for k in got_b if k in got_c), "B loads C's chosen bytes"
    assert repo.verify().ok
