"""The worker halves' restore offer bookkeeping (agent/engines/offers.py), shared by the vLLM
connector and the SGLang linker; the real engines exercise it in tests/vllm and tests/sglang."""

from __future__ import annotations

import threading
import time

from agent.engines.offers import MAX_AWAIT_S, OfferBook


def test_a_later_part_of_an_ended_offer_is_refused() -> None:
    book = OfferBook(lambda: None)
    assert book.admit(None)  # a restore's first part starts generation 1
    first = book.generation
    assert book.add("/s/a.json", [b"k1", b"k2"]) == 2
    assert book.admit(first)  # its later part
    book.add("/s/b.json", [b"k3"])
    assert book.keys == {b"k1": "/s/a.json", b"k2": "/s/a.json", b"k3": "/s/b.json"}
    assert book.durable == {b"k1", b"k2", b"k3"}  # read from the repository: it holds them
    assert book.end() == ["/s/a.json", "/s/b.json"]  # the owner deletes these
    assert book.keys == {}
    assert not book.admit(first), "a part of a withdrawn offer"
    assert book.admit(None)  # the next restore
    assert book.generation == first + 2


def test_the_offer_ends_after_its_ttl_and_a_snapshot_stays_consistent() -> None:
    expired = threading.Event()
    book = OfferBook(expired.set)
    book.admit(None)
    book.add("/s/a.json", [b"k1"])
    snapshot = book.keys
    book.expire_after(0.01)
    assert expired.wait(30)  # the timer fires on its own (an idle engine or not)
    assert book.expired() == ["/s/a.json"]
    assert snapshot == {b"k1": "/s/a.json"}  # replaced, not mutated, under a reader
    assert book.expired() is None  # nothing offered any more


def test_durable_keys_follow_the_agents_word() -> None:
    book = OfferBook(lambda: None)
    assert book.mark({"add": ["aa", "bb"]}) == {"ok": True, "durable": 2}
    assert book.mark({"remove": ["aa"]}) == {"ok": True, "durable": 1}
    assert book.durable == {b"\xbb"}
    bad = book.mark({"add": ["not hex"]})
    assert bad["ok"] is False
    assert "hex" in bad["error"]
    assert book.durable == {b"\xbb"}  # nothing applied from a bad request


def test_awaited_requests_are_held_until_ready_the_wait_runs_out_or_the_offer_ends() -> None:
    book = OfferBook(lambda: None)
    book.admit(None)
    book.expect(["r1", "r2", "r3"], [], await_s=60)
    assert book.holds("r1")
    assert book.holds("r2")
    assert not book.holds("other")
    book.expect([], ["r1"])  # a part completed r1
    assert not book.holds("r1")
    assert book.holds("r2")
    book.expect([], [], await_s=0)  # no part for the whole wait: none waits any more
    assert not book.holds("r2")
    assert book.awaiting == set()
    book.expect(["r4"], [], await_s=1e9)  # an agent cannot ask for more than MAX_AWAIT_S
    assert book.holds("r4")
    assert book._await_until - time.monotonic() <= MAX_AWAIT_S
    book.end()  # withdrawn (or expired): nothing is held for an offer that is gone
    assert not book.holds("r4")
