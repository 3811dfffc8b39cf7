"""Claims (ckpt/claims.py, FORMAT.md §13) against the local store and a real SeaweedFS: exactly one
claimant of racing ones wins, a lease that ran out (by the store's clock) is taken over, a done
checkpoint is never claimed again, a claim object that does not read is refused by name and
left as it was; and retention and gc around claims."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from ckpt import Block, Repository, claims
from ckpt.claims import Claim, ClaimLost, Refusal, try_claim
from ckpt.document import seal
from ckpt.store.base import Store
from ckpt.url import open_store
from tests.harness.repo import BARE_NS, BARE_PINS, key
from tests.harness.seaweed import SeaweedServer
from tests.harness.waiting import wait_for

W, C = "a-xyz", "20260101T000000000Z-0000abcd"


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "local":
        s = open_store(str(tmp_path / "repo"))
    else:
        seaweed: SeaweedServer = request.getfixturevalue("seaweed")
        bucket = request.getfixturevalue("s3_bucket")
        s = open_store(f"s3://{bucket}/repo?endpoint={seaweed.endpoint}")
    yield s
    s.close()


def claim_of(got: Claim | Refusal) -> Claim:
    assert isinstance(got, Claim), f"expected a claim, got the refusal {got}"
    return got


def refusal_of(got: Claim | Refusal) -> str:
    assert isinstance(got, Refusal), f"expected a refusal, got {got!r}"
    return got.reason


def objects(store: Store) -> dict[str, bytes]:
    return {o.name: store.get(o.name) for o in store.list(claims.PREFIX)}


def expired_clock(store: Store, generation: int = 1) -> float:
    """The store's time a little after the lease of ``generation`` ran out."""
    mtime = store.stat(claims.generation_name(W, C, generation)).mtime
    return mtime + claims.DEFAULT_LEASE_S + claims.STAMP_SLACK_S + 1


# -- one winner ------------------------------------------------------------------------------------


def test_of_racing_claimants_exactly_one_wins(store: Store) -> None:
    n = 8
    barrier = threading.Barrier(n)
    got: dict[str, Claim | Refusal] = {}

    def go(i: int) -> None:
        barrier.wait()
        got[f"pod-{i}"] = try_claim(store, W, C, f"pod-{i}")

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [k for k, v in got.items() if isinstance(v, Claim)]
    assert len(winners) == 1, got
    losers = [v for v in got.values() if isinstance(v, Refusal)]
    assert all("another claimant won generation 1" in r.reason or "held by" in r.reason for r in losers), losers
    state = claims.read_state(store, W, C)
    assert state.latest is not None
    assert state.latest.claimant == winners[0]
    assert state.generations == 1


def test_the_loser_of_a_race_takes_the_next_checkpoint(store: Store) -> None:
    barrier = threading.Barrier(2)
    order = [C, "20260101T000000000Z-0000ffff"]
    got: dict[str, str | None] = {}

    def pod(name: str) -> None:
        barrier.wait()
        for cid in order:
            if isinstance(try_claim(store, W, cid, name), Claim):
                got[name] = cid
                return
        got[name] = None

    threads = [threading.Thread(target=pod, args=(p,)) for p in ("pod-c", "pod-d")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(v for v in got.values() if v) == sorted(order), got


# -- the lease -------------------------------------------------------------------------------------


def test_a_live_claim_is_refused_by_the_stores_clock(store: Store) -> None:
    claim_of(try_claim(store, W, C, "pod-a"))
    # no clock injected: the store's own time, read from a probe object (which is gone afterwards)
    assert "held by pod-a" in refusal_of(try_claim(store, W, C, "pod-b"))
    assert not [n for n in objects(store) if "/clock-" in n]


def test_a_renewal_moves_the_stores_time_of_the_claim(store: Store) -> None:
    a = claim_of(try_claim(store, W, C, "pod-a"))
    first = store.stat(a.name).mtime

    def moved() -> bool:
        a.renew()
        return store.stat(a.name).mtime > first

    wait_for(moved, 10, "the store to stamp a renewal later than the claim")  # stamps are to the second
    assert "held by pod-a" in refusal_of(try_claim(store, W, C, "pod-b", clock=lambda: first + 300.5))


def test_a_claim_whose_lease_ran_out_is_taken_over_and_its_holder_lost_it(store: Store) -> None:
    a = claim_of(try_claim(store, W, C, "pod-a"))
    b = claim_of(try_claim(store, W, C, "pod-b", clock=lambda: expired_clock(store)))
    assert b.generation == 2
    with pytest.raises(ClaimLost, match="generation 2 exists"):
        a.renew()
    with pytest.raises(ClaimLost):
        a.finish("warm", "pins match")
    assert not store.exists(claims.done_name(W, C)), "the holder that lost wrote done"
    done = b.finish("warm", "pins match")
    assert (done.claimant, done.generation) == ("pod-b", 2)


def test_a_holder_that_could_not_renew_for_half_its_lease_counts_itself_lost(store: Store) -> None:
    t = [0.0]
    a = Claim(store, W, C, 1, "pod-a", monotonic=lambda: t[0])
    store.put(a.name, a._encode("active"), if_absent=True)
    t[0] = 100.0
    a.renew()
    t[0] = 100.0 + claims.DEFAULT_LEASE_S / 2 + 1
    with pytest.raises(ClaimLost, match="half the lease"):
        a.renew()


def test_a_released_claim_is_taken_at_once(store: Store) -> None:
    claim_of(try_claim(store, W, C, "pod-a")).release("worker never answered")
    b = claim_of(try_claim(store, W, C, "pod-b"))
    assert b.generation == 2


def test_a_checkpoint_is_given_up_after_max_attempts(store: Store) -> None:
    for i in range(claims.MAX_ATTEMPTS):
        claim_of(try_claim(store, W, C, f"pod-{i}")).release("failed")
    why = refusal_of(try_claim(store, W, C, "pod-x"))
    assert why.startswith("abandoned")
    state = claims.read_state(store, W, C)
    assert state.done is not None
    assert state.done.outcome == "abandoned"
    assert refusal_of(try_claim(store, W, C, "pod-y")).startswith("done: abandoned")


# -- done ------------------------------------------------------------------------------------------


def test_a_done_checkpoint_is_never_claimed_again(store: Store) -> None:
    a = claim_of(try_claim(store, W, C, "pod-a"))
    a.finish("cold", "cuda_driver_version: 12.4 != 12.8")
    far = expired_clock(store) + 10**6
    for who in ("pod-b", "pod-c"):
        why = refusal_of(try_claim(store, W, C, who, clock=lambda: far))
        assert why == "done: cold by pod-a (cuda_driver_version: 12.4 != 12.8)"
    assert claims.read_state(store, W, C).generations == 1


def test_keep_renews_on_a_thread_until_finished(store: Store) -> None:
    a = claim_of(try_claim(store, W, C, "pod-a", lease_s=10))
    first = store.stat(a.name).mtime
    a.keep(interval=0.2)
    wait_for(lambda: store.stat(a.name).mtime > first, 10, "a renewal by the lease thread")
    a.finish("warm", "pins match")
    assert a.state == "done"
    assert claims.read_state(store, W, C).done is not None


# -- hostile objects -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "planted",
    [
        b"not json",
        b'{"format": "gpuckpt-claim", "version": 99, "checksum": "x", "body": {}}',
        seal(claims.KIND, 1, claims.generation_name(W, C, 1), {"claimant": "pod-z"}, None),
        # a claim for another checkpoint copied under this one's name
        seal(
            claims.KIND,
            1,
            "x",
            {
                "claimant": "pod-z",
                "worker_id": W,
                "checkpoint": "20990101T000000000Z-00000000",
                "generation": 1,
                "state": "active",
                "lease_s": 300,
                "pool": None,
                "hostname": "h",
                "at": 0,
            },
            None,
        ),
    ],
    ids=["garbage", "unknown-version", "missing-fields", "another-checkpoints"],
)
def test_a_claim_that_does_not_read_is_refused_by_name_and_left_alone(store: Store, planted: bytes) -> None:
    name = claims.generation_name(W, C, 1)
    store.put(name, planted)
    before = objects(store)
    why = refusal_of(try_claim(store, W, C, "pod-a", clock=lambda: 1e12))
    assert why.startswith("refused: ")
    assert name in why
    assert objects(store) == before, "a refused claim object was changed or a new one written"


def test_a_planted_done_record_is_refused_and_nothing_is_claimed(store: Store) -> None:
    store.put(claims.done_name(W, C), b"{}")
    why = refusal_of(try_claim(store, W, C, "pod-a"))
    assert claims.done_name(W, C) in why
    assert store.get(claims.done_name(W, C)) == b"{}"


def test_names_under_claims_that_are_not_claims_are_ignored(store: Store) -> None:
    store.put(f"{claims.PREFIX}{W}/{C}/zzz", b"planted")
    store.put(f"{claims.PREFIX}{W}/{C}/00000001x", b"planted")
    a = claim_of(try_claim(store, W, C, "pod-a"))
    assert a.generation == 1
    assert store.get(f"{claims.PREFIX}{W}/{C}/zzz") == b"planted"


# -- retention and gc ------------------------------------------------------------------------------


def save(repo: Repository, worker: str, trigger: str) -> str:
    blocks = [Block(key(i), bytes([i]) * 64, "uint8", (64,)) for i in range(2)]
    return repo.save(blocks, worker_id=worker, namespace=BARE_NS, pins=BARE_PINS, labels={"trigger": trigger}).id


def test_retention_keeps_a_claimed_checkpoint_and_retires_an_adopted_worker(tmp_path: Path) -> None:
    repo = Repository.open(str(tmp_path / "repo"), create=True)
    old = [save(repo, "a-xyz", "periodic") for _ in range(2)]
    final = save(repo, "a-xyz", "stop")
    other = [save(repo, "c-abc", "periodic") for _ in range(2)]
    b = claim_of(try_claim(repo.store, "a-xyz", old[0], "pod-b"))
    # a claim in progress protects even a checkpoint retention would forget
    gone = repo.forget(keep_last=1)
    assert {c.id for c in gone} == {old[1], other[0]}
    b.release("test")
    c = claim_of(try_claim(repo.store, "a-xyz", final, "pod-b"))
    assert {x.id for x in repo.list("a-xyz")} == {old[0], final}
    c.finish("warm", "pins match")
    # adopted: the worker is retired, its newest is no longer kept for it (keep_within would)
    assert repo.forget(keep_last=1, keep_within=timedelta(days=1)) == []
    gone = repo.forget(keep_last=1)
    assert {x.id for x in gone} == {old[0], final}
    assert [x.id for x in repo.list()] == [other[1]]


def test_gc_removes_the_claims_of_forgotten_checkpoints_only(tmp_path: Path) -> None:
    repo = Repository.open(str(tmp_path / "repo"), create=True)
    a = save(repo, "a-xyz", "stop")
    b = save(repo, "b-qrs", "stop")
    for w, cid in (("a-xyz", a), ("b-qrs", b)):
        claim_of(try_claim(repo.store, w, cid, "pod-n")).finish("warm", "pins match")
    repo.store.put(f"{claims.PREFIX}a-xyz/{a}/clock-{'0' * 32}", b"")  # a probe a crash left
    repo.delete(f"b-qrs/{b}")
    report = repo.gc(grace=timedelta(0), now=True)
    assert report.removed_claims == 3  # b's generation and done, a's stale probe
    assert sorted(o.name for o in repo.store.list(claims.PREFIX)) == [
        claims.generation_name("a-xyz", a, 1),
        claims.done_name("a-xyz", a),
    ]
    assert repo.verify().ok


def test_planted_names_under_claims_do_not_stop_retention_or_gc(tmp_path: Path) -> None:
    repo = Repository.open(str(tmp_path / "repo"), create=True)
    cid = save(repo, "a-xyz", "stop")
    for name in (f"{claims.PREFIX}-x/{cid}/00000001", f"{claims.PREFIX}a-xyz/{cid}/00000001", "claims/lone"):
        repo.store.put(name, b"planted")
    assert repo.forget(keep_last=1) == []  # the unreadable claim protects its checkpoint
    assert [c.id for c in repo.list()] == [cid]
    assert repo.gc(grace=timedelta(0), now=True).removed_claims == 0
    assert len(list(repo.store.list(claims.PREFIX))) == 3
