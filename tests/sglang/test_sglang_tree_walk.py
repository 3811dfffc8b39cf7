"""The SGLang linker's tree walk and stream bookkeeping on their own (no SGLang: :mod:`.tree` takes a
tree core's walk result, :mod:`.stream` is plain bookkeeping). The real tree core's walk is
covered by tests/sglang/test_sglang_capture.py.

A walk gives page numbers and pinning nodes only; a page's key is looked up as its chunk is taken
(:class:`Planned`), so these tests name a walk's pages through the index as a chunk does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from agent.engines.sglang.stream import Pending, Pin, Planned, Stream
from agent.engines.sglang.tree import NO_NODE, TreeIndex, Walk
from agent.engines.streams import chunk_pages

P = 4  # page size


def _core(rows: list[tuple[int, int, int]]) -> SimpleNamespace:
    """A tree core of ``rows`` of (slot, position, previous slot), depth-first: its
    ``walk_for_kv_canary`` answers them (and counts its calls in ``walks``), its
    ``all_values_flatten`` their slots."""
    slots, pos, prev = (torch.tensor(c, dtype=torch.int64) for c in zip(*rows, strict=True))
    walk = SimpleNamespace(slot_indices=slots, positions=pos, prev_slot_indices=prev)
    core = SimpleNamespace(walks=0, all_values_flatten=lambda: slots.clone())

    def walk_for_kv_canary(unlocked_only: bool, swa_resident_only: bool) -> SimpleNamespace:
        core.walks += 1
        return walk

    core.walk_for_kv_canary = walk_for_kv_canary
    return core


def _named(idx: TreeIndex, walk: Walk) -> set[tuple[str, int, int | None]]:
    """``(key hex, page, pinning node or None)`` of each page of ``walk``, named as a chunk names them."""
    pages, pins = walk.pages.tolist(), walk.pins.tolist()
    keys = idx.keys(pages, walk.generation)
    return {(k.hex(), pg, None if pin == NO_NODE else pin) for k, pg, pin in zip(keys, pages, pins, strict=True)}


def _planned(pages: list[Pending]) -> Planned:
    """A stream's plan of ``pages``, named from their own keys (as the index would)."""
    by_page = {p.page: p.key for p in pages}
    return Planned(
        [p.page for p in pages],
        [NO_NODE if p.pin is None else p.pin for p in pages],
        lambda pgs: [by_page[pg] for pg in pgs],
    )


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
    assert _named(idx, walk) == {("aa", 1, 7), ("bb", 2, 7), ("cc", 5, 7), ("dd", 9, 9)}
    assert walk.unnamed == 1  # C


def test_a_page_with_no_node_takes_a_pinned_page_below_it_in_any_child_and_none_outside_its_subtree() -> None:
    # root → A (page 1, loaded: no node) → B (page 2, loaded) and → C (page 3, node 5);
    # root → D (page 4, loaded, nothing pinned below: copied at the consistent point);
    # root → E (page 6, node 8): after D in the walk, but not below it
    rows = _node(4, 0, -1, 1) + _node(8, 4, 7, 1) + _node(12, 4, 7, 1) + _node(16, 0, -1, 1) + _node(24, 0, -1, 1)
    idx = TreeIndex(P)
    idx.learn(["aa", "bb"], torch.tensor([*range(4, 8), *range(8, 12)]), None)
    idx.learn(["cc"], torch.arange(12, 16), 5)
    idx.learn(["dd"], torch.arange(16, 20), None)
    idx.learn(["ee"], torch.arange(24, 28), 8)
    walk = idx.walk(_core(rows))
    assert _named(idx, walk) == {("aa", 1, 5), ("bb", 2, None), ("cc", 3, 5), ("dd", 4, None), ("ee", 6, 8)}
    assert walk.unnamed == 0


def test_a_tree_no_restore_loaded_into_is_walked_by_node_not_slot_by_slot() -> None:
    """Every page has the node it was offered under: the nodes' values are enough (one copy per
    node), and SGLang's walk of every slot with its position is not taken."""
    rows = _node(4, 0, -1, 2) + _node(20, 8, 11, 1) + _node(36, 0, -1, 1)
    idx = TreeIndex(P)
    idx.learn(["aa", "bb"], torch.arange(4, 12), 3)
    idx.learn(["cc"], torch.arange(20, 24), 7)
    idx.learn(["dd"], torch.arange(36, 40), 9)
    core = _core(rows)
    walk = idx.walk(core)
    assert core.walks == 0
    assert walk.pages.tolist() == [1, 2, 5, 9]  # depth-first, as the tree lists its nodes
    assert _named(idx, walk) == {("aa", 1, 3), ("bb", 2, 3), ("cc", 5, 7), ("dd", 9, 9)}
    # a page a restore loaded (no node of its own) needs the depths: the slot walk is taken for it
    idx.learn(["ee"], torch.arange(44, 48), None)
    core = _core(rows + _node(44, 12, 23, 1))
    assert _named(idx, idx.walk(core)) == {("aa", 1, 3), ("bb", 2, 3), ("cc", 5, 7), ("dd", 9, 9), ("ee", 11, None)}
    assert core.walks == 1
    # unless no page is pinned from below (tensor parallel: such pages are copied at the consistent point)
    core = _core(rows + _node(44, 12, 23, 1))
    assert _named(idx, idx.walk(core, pin_below=False))
    assert core.walks == 0


def test_a_page_offered_again_under_a_new_node_takes_the_new_name() -> None:
    idx = TreeIndex(P)
    idx.learn(["aa"], torch.arange(8, 12), 1)
    idx.learn(["ee"], torch.arange(8, 12), 2)  # the slots freed and reused by another insert
    walk = idx.walk(_core(_node(8, 0, -1, 1)))
    assert _named(idx, walk) == {("ee", 2, 2)}
    idx.clear()
    assert idx.walk(_core(_node(8, 0, -1, 1))).unnamed == 1
    with pytest.raises(LookupError, match="flushed"):  # a page planned before the flush is not named after it
        idx.keys([2], walk.generation)


def test_keys_are_looked_up_as_chunks_are_taken_and_a_key_taken_before_is_copied_once() -> None:
    idx = TreeIndex(P)
    idx.learn(["aa", "bb", "cc"], torch.arange(4, 16), 7)
    walk = idx.walk(_core(_node(4, 0, -1, 3)))
    asked: list[list[int]] = []

    def name(pages: list[int]) -> list[bytes]:
        asked.append(pages)
        return idx.keys(pages, walk.generation)

    st = Stream(
        seq=1,
        name="n",
        directory="/x",
        info={},
        pending=Planned(walk.pages, walk.pins, name),
        chunk_pages=2,
        page_bytes=10,
        max_staging=100,
    )
    st.pins = {7: Pin("lock7", 3)}
    st.seen = {bytes.fromhex("aa")}  # chunk 0 carries a live request's copy of it
    assert asked == []  # nothing named at the consistent point
    first = st.take()
    assert [(p.key.hex(), p.page) for p in first] == [("bb", 2), ("cc", 3)]
    assert asked == [[1, 2], [3]]  # a chunk's worth, then one more for the page left out
    assert [p.lock for p in st.copied(first)] == ["lock7"]  # the page left out counts off its pin too
    assert st.take() == []
    assert not st.pending


def test_a_pin_is_released_with_its_last_page_and_every_pin_when_the_stream_ends() -> None:
    pages = _planned([Pending(b"a", 1, 7), Pending(b"b", 2, 7), Pending(b"c", 3, 9)])
    st = Stream(
        seq=1, name="capture-1-1", directory="/x", info={}, pending=pages, chunk_pages=2, page_bytes=10, max_staging=100
    )
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
    st = Stream(
        seq=1,
        name="n",
        directory="/x",
        info={},
        pending=_planned([]),
        chunk_pages=1,
        page_bytes=10,
        max_staging=100,
        ring=2,
    )
    st.pending = _planned([Pending(bytes([i]), i) for i in range(3)])
    for _ in range(2):
        st.issue(len(st.take()), 0.0)
    assert not st.can_issue()  # two chunks staged, none acknowledged
    st.ack(0)
    assert st.can_issue()
    st.issue(len(st.take()), 0.0)
    assert st.last_chunk == 2
