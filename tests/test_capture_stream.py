"""The capture stream's bookkeeping (agent/engines/vllm/capture.py), without an engine: chunk sizes
within the staging bound, the ring's backpressure, evicted blocks reported lost, the last chunk,
errors and idle abandonment. The real engine's streams are tested in tests/vllm/test_streaming.py."""

from __future__ import annotations

from collections import deque

import pytest

from agent.engines.staging import save_queue_bound
from agent.engines.streams import RING, chunk_pages
from agent.engines.vllm.capture import Pending, Stream

PAGE = 1000


def stream(n: int, *, chunk: int = 4, bound: int = 10**9) -> Stream:
    pending = deque(Pending(i.to_bytes(4, "big"), i, ("k", i)) for i in range(n))
    return Stream(
        seq=1,
        name="capture-1-1",
        directory="/nonexistent",
        info={},
        pending=pending,
        chunk_pages=chunk,
        page_bytes=PAGE,
        max_staging=bound,
    )


def report_all(st: Stream, k: int, tp: int = 1) -> None:
    for r in range(tp):
        st.report(k, r, {"index": f"/nonexistent/c{k}-r{r}.json", "copy_s": 0.001}, tp)


@pytest.mark.parametrize(
    ("bound", "per_step", "want"),
    [
        (256 << 20, 1 << 20, ((1 << 20) // PAGE, 128)),  # the per-step rate decides; a deep ring in half the bound
        (60 * PAGE, 16 << 20, (15, 2)),  # the bound decides: two chunks in half of it
        (PAGE, 16 << 20, (1, 1)),  # never less than a page
    ],
)
def test_chunks_fit_the_bound(bound: int, per_step: int, want: tuple[int, int]) -> None:
    pages, ring = chunk_pages(PAGE, max_staging=bound, copy_per_step=per_step)
    assert (pages, ring) == want
    if bound >= 4 * PAGE:
        assert ring >= RING
        assert ring * pages * PAGE + save_queue_bound(bound) <= bound


def test_the_ring_holds_the_copying_until_the_agent_acknowledges() -> None:
    st = stream(20, chunk=4)
    issued = []
    while st.can_issue():
        issued.append(st.issue(len(st.take(lambda p: True))))
    assert issued == list(range(st.ring)), "at most a ring of chunks staged before an acknowledgement"
    assert st.staged_bytes == st.ring * 4 * PAGE
    for k in issued:
        report_all(st, k)
    part = st.hand_out()
    assert part is not None
    assert part["chunk"] == 0
    assert not part["last"]
    assert not st.can_issue(), "a chunk handed out but not acknowledged still counts"
    st.ack(0)
    assert st.can_issue()
    assert st.staged_bytes == PAGE * 4 * (RING - 1)
    assert st.peak_staged == RING * 4 * PAGE


def test_evicted_blocks_are_lost_and_the_last_chunk_is_marked() -> None:
    st = stream(10, chunk=4)
    evicted = {3, 4, 5, 9}
    chunks = []
    reported: list[int] = []
    while st.last_chunk is None:
        assert st.can_issue()
        pages = st.take(lambda p: p.block_id not in evicted)
        k = st.issue(len(pages))
        chunks.append([p.block_id for p in pages])
        report_all(st, k)
        part = st.hand_out()
        assert part is not None
        reported += [int(x, 16) for x in part["lost"]]
        st.ack(k)
    # chunks are filled past lost blocks; the last one may be short (or empty)
    assert chunks == [[0, 1, 2, 6], [7, 8]]
    assert sorted(int.from_bytes(k, "big") for k in st.lost) == sorted(evicted)
    assert st.done
    assert st.copied_pages == 6
    assert part["last"]
    assert sorted(reported) == sorted(evicted), "every lost key is reported once"


def test_the_stream_is_done_only_when_every_chunk_is_acknowledged() -> None:
    st = stream(8, chunk=4)
    k0 = st.issue(len(st.take(lambda p: True)))
    k1 = st.issue(len(st.take(lambda p: True)))
    assert st.last_chunk == k1
    report_all(st, k1)  # the last chunk's writer finished first
    st.ack(k1)
    assert not st.done, "chunk 0 is still unread"
    report_all(st, k0)
    st.ack(k0)
    assert st.done


def test_a_chunk_is_complete_only_when_every_rank_wrote_it() -> None:
    st = stream(4, chunk=4)
    k = st.issue(len(st.take(lambda p: True)))
    assert not st.report(k, 1, {"index": "r1"}, tp=2)
    assert st.hand_out() is None
    assert st.needs_steps()
    assert st.report(k, 0, {"index": "r0"}, tp=2)
    part = st.hand_out()
    assert part is not None
    assert [d["index"] for d in part["shards"]] == ["r0", "r1"]


def test_a_rank_error_fails_the_stream_and_names_the_rank() -> None:
    st = stream(8, chunk=4)
    k = st.issue(len(st.take(lambda p: True)))
    assert st.report(k, 1, {"error": "disk full"}, tp=2)
    assert st.error == "chunk 0, rank 1: disk full"
    assert not st.can_issue()
    assert not st.needs_steps()


def test_an_unread_stream_goes_idle_and_lists_its_files() -> None:
    st = stream(8, chunk=4)
    k = st.issue(len(st.take(lambda p: True)))
    report_all(st, k)
    assert not st.idle(st.touched + st.idle_timeout - 1)
    assert st.idle(st.touched + st.idle_timeout + 1)
    assert st.files() == ["/nonexistent/c0-r0.json"]
    st.ack(k)
    assert st.files() == []
