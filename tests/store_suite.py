"""The store conformance suite: every backend runs every test here.

A backend's test file subclasses :class:`StoreTests` and provides two
fixtures: ``store`` (a fresh, empty store) and ``raw`` (a :class:`RawAccess`
that reads and writes the same objects *bypassing* the store under test, so
the suite can plant hostile states and check what really landed).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckpt.errors import (
    IntegrityError,
    InvalidName,
    ObjectExists,
    ObjectNotFound,
)
from ckpt.store.base import Store


class RawAccess(ABC):
    """Direct access to a store's backing medium, bypassing the Store code."""

    @abstractmethod
    def put(self, name: str, data: bytes) -> None: ...

    @abstractmethod
    def get(self, name: str) -> bytes: ...

    @abstractmethod
    def names(self) -> set[str]: ...


HOSTILE_NAMES = [
    "",
    "/",
    "/etc/passwd",
    "../escape",
    "a/../../escape",
    "a/./b",
    "a//b",
    "a/",
    ".",
    "..",
    "a\x00b",
    "a\\b",
    "a b",
    "ünïcode",
    "x" * 1100,
    "a/b/../../../c",
    "C:\\windows",
    "%2e%2e/x",
    "~user",
]


class StoreTests:
    """Behaviour every Store must have. See ckpt/store/base.py for the contract."""

    # -- basic round trips ---------------------------------------------------

    def test_put_get_roundtrip(self, store: Store, raw: RawAccess) -> None:
        data = bytes(range(256)) * 100
        store.put("packs/ab/obj1", data)
        assert store.get("packs/ab/obj1") == data
        assert raw.get("packs/ab/obj1") == data

    def test_put_accepts_memoryview_and_bytearray(self, store: Store) -> None:
        store.put("a/mv", memoryview(b"hello world")[6:])
        store.put("a/ba", bytearray(b"xyz"))
        assert store.get("a/mv") == b"world"
        assert store.get("a/ba") == b"xyz"

    def test_empty_object(self, store: Store) -> None:
        store.put("empty", b"")
        assert store.get("empty") == b""
        assert store.stat("empty").size == 0

    def test_large_object(self, store: Store) -> None:
        # Large enough to take the multipart path on stores that have one.
        data = (bytes(range(251)) * (1 + (24 << 20) // 251))[: 24 << 20]
        store.put("big/object", data)
        assert store.stat("big/object").size == len(data)
        assert store.get("big/object") == data
        assert store.get("big/object", 10 << 20, 1000) == data[10 << 20 : (10 << 20) + 1000]

    def test_overwrite_replaces(self, store: Store) -> None:
        store.put("k", b"one")
        store.put("k", b"two-longer")
        assert store.get("k") == b"two-longer"

    def test_read_after_write_is_visible_in_list_and_stat(self, store: Store) -> None:
        store.put("dir/x", b"12345")
        info = store.stat("dir/x")
        assert info.name == "dir/x"
        assert info.size == 5
        assert info.mtime > 0
        assert [i.name for i in store.list("dir/")] == ["dir/x"]

    # -- missing objects -----------------------------------------------------

    def test_get_missing_raises_not_found(self, store: Store) -> None:
        with pytest.raises(ObjectNotFound) as ei:
            store.get("nope/missing")
        assert ei.value.key == "nope/missing"
        assert "missing" in str(ei.value)

    def test_stat_missing_raises_not_found(self, store: Store) -> None:
        with pytest.raises(ObjectNotFound):
            store.stat("nope")
        assert store.exists("nope") is False

    def test_delete_missing_is_not_an_error(self, store: Store) -> None:
        store.delete("never/there")

    def test_delete_removes(self, store: Store, raw: RawAccess) -> None:
        store.put("d/1", b"x")
        store.delete("d/1")
        assert not store.exists("d/1")
        assert "d/1" not in raw.names()

    # -- ranged reads ----------------------------------------------------------

    def test_ranged_reads(self, store: Store) -> None:
        data = bytes(range(200))
        store.put("r", data)
        assert store.get("r", 0, 10) == data[:10]
        assert store.get("r", 50, 1) == data[50:51]
        assert store.get("r", 190, 10) == data[190:]
        assert store.get("r", 100) == data[100:]
        assert store.get("r", 0, 0) == b""

    def test_range_past_end_is_integrity_error(self, store: Store) -> None:
        store.put("r", b"0123456789")
        with pytest.raises(IntegrityError) as ei:
            store.get("r", 5, 10)
        assert "r" in str(ei.value)

    # -- conditional create ------------------------------------------------------

    def test_conditional_create(self, store: Store) -> None:
        store.put("m/1", b"first", if_absent=True)
        with pytest.raises(ObjectExists) as ei:
            store.put("m/1", b"second", if_absent=True)
        assert ei.value.key == "m/1"
        assert store.get("m/1") == b"first"

    def test_conditional_create_race_has_exactly_one_winner(self, store: Store) -> None:
        n = 8
        barrier = threading.Barrier(n)
        results: list[str] = []

        def attempt(i: int) -> None:
            barrier.wait()
            try:
                store.put("race/manifest", f"writer-{i}".encode(), if_absent=True)
                results.append(f"won-{i}")
            except ObjectExists:
                results.append("lost")

        with ThreadPoolExecutor(n) as ex:
            list(ex.map(attempt, range(n)))
        winners = [r for r in results if r.startswith("won")]
        assert len(winners) == 1, results
        assert store.get("race/manifest") == f"writer-{winners[0][4:]}".encode()

    # -- listing ---------------------------------------------------------------------

    def test_list_prefixes(self, store: Store) -> None:
        names = ["packs/00/a", "packs/00/b", "packs/01/c", "index/i1", "manifests/w/1.json"]
        for n in names:
            store.put(n, n.encode())
        assert {i.name for i in store.list("packs/")} == set(names[:3])
        assert {i.name for i in store.list("packs/00/")} == set(names[:2])
        assert {i.name for i in store.list("packs/0")} == set(names[:3])
        assert {i.name for i in store.list("")} == set(names)
        assert list(store.list("absent/")) == []
        sizes = {i.name: i.size for i in store.list("")}
        assert sizes["index/i1"] == len(b"index/i1")

    def test_list_many(self, store: Store) -> None:
        # More than one page on S3-like stores (1000 keys per page).
        with ThreadPoolExecutor(16) as ex:
            list(ex.map(lambda i: store.put(f"many/{i:05d}", b"x"), range(1100)))
        got = [i.name for i in store.list("many/")]
        assert len(got) == 1100
        assert len(set(got)) == 1100

    # -- hostile names -------------------------------------------------------------------

    @pytest.mark.parametrize("name", HOSTILE_NAMES)
    def test_hostile_names_are_refused_before_io(self, store: Store, raw: RawAccess, name: str) -> None:
        before = raw.names()
        for op in (
            lambda: store.put(name, b"x"),
            lambda: store.get(name),
            lambda: store.stat(name),
            lambda: store.delete(name),
        ):
            with pytest.raises(InvalidName):
                op()
        assert raw.names() == before

    # -- hostile states planted underneath ------------------------------------------------

    def test_object_planted_raw_is_readable(self, store: Store, raw: RawAccess) -> None:
        raw.put("planted/obj", b"from outside")
        assert store.get("planted/obj") == b"from outside"
        assert "planted/obj" in {i.name for i in store.list("planted/")}
