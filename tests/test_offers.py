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


def test_a_request_waits_briefly_for_coming_pages_and_asks_for_them() -> None:
    book = OfferBook(lambda: None)
    book.admit(None)
    book.add("/s/a.json", [b"\x01"])
    book.expect_keys(["01", "02", "03", "04"], want_s=60)
    assert book.coming == {b"\x02", b"\x03", b"\x04"}, "an offered key is not coming"
    assert book.want("req-a", [b"\x03", b"\x04"])  # waits, and asks
    assert book.want("req-b", [b"\x02"])
    assert book.take_wanted() == [b"\x03", b"\x04", b"\x02"]  # in the order asked
    assert book.take_wanted() == [], "asked once, taken once: a request still waiting asks again"
    book.want("req-a", [b"\x03", b"\x04"])
    book.add("/s/b.json", [b"\x03"])  # a part brought one of them
    assert book.coming == {b"\x02", b"\x04"}
    assert book.take_wanted() == [b"\x04"]
    assert book.asked() == 2
    book.expect_keys(["05"], want_s=0)
    assert not book.want("req-c", [b"\x05"]), "no wait left: it recomputes"
    book.expect_keys(["06"], want_s=1e9)
    assert book.want_s == MAX_AWAIT_S  # an agent cannot ask for more
    book.no_more()  # the rest is over: nothing is coming, nobody waits
    assert book.coming == set()
    assert book.asked() == 0


def test_a_requests_wait_for_coming_pages_is_not_renewed_by_asking_again() -> None:
    book = OfferBook(lambda: None)
    book.admit(None)
    book.expect_keys(["02"], want_s=0.05)
    assert book.want("req", [b"\x02"])
    book.take_wanted()
    end = time.monotonic() + 0.05
    while time.monotonic() < end:  # the wait's own clock, not a sleep racing it
        time.sleep(0.01)
    assert not book.want("req", [b"\x02"])
    assert not book.want("req", [b"\x02"]), "asking again after the wait ran out does not renew it"
    book.expect_keys(["02"])
    book.end()  # withdrawn: nothing more comes
    assert book.coming == set()
