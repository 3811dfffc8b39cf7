"""The SGLang linker's tree walk and stream bookkeeping on their own (no SGLang: :mod:`.tree` takes a
tree core's walk result, :mod:`.stream` is plain bookkeeping). The real tree core's walk is
covered by tests/sglang/test_sglang_capture.py."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import torch

from agent.engines.sglang.stream import Pending, Pin, Stream, chunk_pages
from agent.engines.sglang.tree import TreeIndex

P = 4  # page size


def _core(rows: list[tuple[int, int, int]]) -> SimpleNamespace:
    """A tree core whose ``walk_for_kv_canary`` answers ``rows`` of (slot, position, previous slot)."""
    slots, pos, prev = (torch.tensor(c, dtype=torch.int64) for c in zip(*rows, strict=True))
    walk = SimpleNamespace(slot_indices=slots, positions=pos, prev_slot_indices=prev)
    return SimpleNamespace(walk_for_kv_canary=lambda unlocked_only, swa_resident_only: walk)


def _node(first_slot: int, depth: int, prev: int, pages: int) -> list[tuple[int, int, int]]:
    """A node's rows: ``pages`` pages from ``first_slot``, starting at position ``depth``."""
    rows = []
    for i in range(pages * P):
        rows.append((first_slot + i, depth + i, prev if i == 0 else first_slot + i - 1))
    return rows


def test_the_walk_names_every_page_and_pins_each_by_its_node_or_one_below() -> None:
    # root → A (pages 1, 2) → B (page 5); A → C (page 7, no offer named it); root → D (page 9)
    rows = _node(4, 0, -1, 2) + _node(20, 8, 11, 1) + _node(28, 8, 11, 1) + _node(36, 0, -1, 1)
    idx = TreeIndex(P)
    idx.learn(["aa", "bb"], torch.arange(4, 12), None)  # A: loaded by a restore, no node
    idx.learn(["cc"], torch.arange(20, 24), 7)  # B: offered as node 7
    idx.learn(["dd"], torch.arange(36, 40), 9)
    walk = idx.walk(_core(rows))
    got = {(p.key.hex(), p.page, p.pin) for p in walk.pages}
    assert got == {("aa", 1, 7), ("bb", 2, 7), ("cc", 5, 7), ("dd", 9, 9)}
    assert walk.unnamed == 1  # C


def test_a_page_offered_again_under_a_new_node_takes_the_new_name() -> None:
    idx = TreeIndex(P)
    idx.learn(["aa"], torch.arange(8, 12), 1)
    idx.learn(["ee"], torch.arange(8, 12), 2)  # the slots freed and reused by another insert
    (page,) = idx.walk(_core(_node(8, 0, -1, 1))).pages
    assert (page.key.hex(), page.pin) == ("ee", 2)
    idx.clear()
    assert idx.walk(_core(_node(8, 0, -1, 1))).unnamed == 1


def test_a_pin_is_released_with_its_last_page_and_every_pin_when_the_stream_ends() -> None:
    pages = deque([Pending(b"a", 1, 7), Pending(b"b", 2, 7), Pending(b"c", 3, 9)])
    st = Stream(1, "capture-1-1", "/x", {}, pages, chunk_pages=2, page_bytes=10, max_staging=100)
    st.pins = {7: Pin("lock7", 2), 9: Pin("lock9", 1)}
    first = st.take()
    assert [p.key for p in first] == [b"a", b"b"]
    assert [p.lock for p in st.copied(first)] == ["lock7"]
    assert st.issue(len(first), 0.0) == 0
    assert st.last_chunk is None
    assert [p.lock for p in st.take_pins()] == ["lock9"]
    assert st.pins == {}


def test_chunks_are_bounded_by_the_step_budget_and_the_staging_bound() -> None:
    assert chunk_pages(1000, max_staging=1 << 20, copy_per_step=10_000) == (10, 52)
    assert chunk_pages(1000, max_staging=8000, copy_per_step=10_000) == (2, 2)  # two chunks in half the bound
    st = Stream(1, "n", "/x", {}, deque(), chunk_pages=1, page_bytes=10, max_staging=100, ring=2)
    st.pending = deque(Pending(bytes([i]), i) for i in range(3))
    for _ in range(2):
        st.issue(len(st.take()), 0.0)
    assert not st.can_issue()  # two chunks staged, none acknowledged
    st.ack(0)
    assert st.can_issue()
    st.issue(len(st.take()), 0.0)
    assert st.last_chunk == 2
