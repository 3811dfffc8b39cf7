"""Bit-exact round trips: every KV dtype, odd and huge shapes, every codec
combination, with and without encryption, on a local directory and on S3."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ckpt import Block, Keyring, Manifest, Repository, SaveOptions
from ckpt.blocks import DTYPES
from ckpt.keys import SEAL_OVERHEAD, SEAL_VERSION
from ckpt.pack import HEADER_SIZE, read_trailer
from ckpt.store import LocalStore
from ckpt.store.base import Store
from ckpt.testing import FaultyStore
from tests.harness.repo import (
    KV_DTYPES,
    NS,
    block_bytes,
    block_tensor,
    key,
    make_block,
    repo_factory,
    sample_pins,
)

MiB = 1 << 20

#: name -> SaveOptions keywords; every combination the writer supports
CODECS: dict[str, dict[str, Any]] = {
    "raw": {"compression": "none"},
    "zstd": {"compression": "zstd", "byteplane": False},
    "zstd+byteplane": {"compression": "zstd", "byteplane": True},
}

#: small, odd, single-element and empty shapes, plus a KV page
SMALL_SHAPES: list[tuple[int, ...]] = [(3, 5, 7), (1,), (0,), (4, 0, 8), (2, 16, 64), (7, 129)]


def big_shape(dtype: str) -> tuple[int, ...]:
    """A multi-MiB block (2 MiB for 1- and 2-byte dtypes, 4 MiB for fp32)."""
    return (2048, 1024) if DTYPES[dtype] == 1 else (1024, 1024)


def expected_names(dtype: str, codec: str, encrypted: bool) -> list[str]:
    """The pipeline the writer prefers for this dtype (stage names)."""
    names: list[str] = []
    if CODECS[codec]["compression"] == "zstd":
        if CODECS[codec]["byteplane"] and DTYPES[dtype] > 1:
            names.append("byteplane")
        names.append("zstd")
    if encrypted:
        names.append("aes-256-gcm")
    return names


def raw_names(encrypted: bool) -> list[str]:
    return ["aes-256-gcm"] if encrypted else []


def pipeline_names(m: Manifest, codec_index: int) -> list[str]:
    return [c.name for c in m.codecs[codec_index]]


def save(repo: Repository, blocks: list[Block], **opts: Any) -> Manifest:
    return repo.save(blocks, worker_id="w0", namespace=NS, pins=sample_pins(), options=SaveOptions(**opts))


def assert_roundtrip(repo: Repository, m: Manifest | str, blocks: list[Block]) -> None:
    """Load everything back and compare bytes and tensors with what was saved."""
    want = {b.key: b for b in blocks}
    seen: dict[bytes, int] = {}
    for lb in repo.load(m):
        b = want[lb.key]
        assert lb.dtype == b.dtype
        assert lb.shape == b.shape
        assert bytes(lb.data) == block_bytes(b), f"block {lb.key.hex()} ({b.dtype}{b.shape}) differs"
        t = lb.tensor()
        assert t.dtype == getattr(torch, b.dtype)
        assert tuple(t.shape) == b.shape
        assert torch.equal(t, block_tensor(b))
        seen[lb.key] = seen.get(lb.key, 0) + 1
    assert seen == {k: 1 for k in want}


def assert_pipelines(m: Manifest, blocks: list[Block], codec: str, encrypted: bool) -> None:
    """Every block used its dtype's preferred pipeline or, when that did not
    shrink it, the raw fallback; multi-MiB KV-like blocks always compress."""
    dtypes = {b.key.hex(): b for b in blocks}
    for ref in m.blocks:
        names = pipeline_names(m, ref.codec)
        assert names in (expected_names(ref.dtype, codec, encrypted), raw_names(encrypted)), names
        if ref.raw_length >= MiB:
            assert names == expected_names(ref.dtype, codec, encrypted)
            if CODECS[codec]["compression"] == "zstd":
                assert ref.length < ref.raw_length
        if names == raw_names(encrypted):
            assert ref.length == ref.raw_length + (SEAL_OVERHEAD[SEAL_VERSION] if encrypted else 0)
        assert ref.raw_length == dtypes[ref.key].nbytes


def matrix_blocks(dtypes: tuple[str, ...], shapes: list[tuple[int, ...]], big: bool) -> list[Block]:
    blocks = []
    i = 0
    for dtype in dtypes:
        for shape in [*shapes, *([big_shape(dtype)] if big else [])]:
            blocks.append(make_block(i, dtype, shape, seed=1000 + i))
            i += 1
    return blocks


# -- the matrix on a local directory ------------------------------------------------------


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_roundtrip_local(tmp_path: Any, dtype: str, codec: str, encrypted: bool) -> None:
    k = Keyring(os.urandom(32)) if encrypted else None
    repo = repo_factory(str(tmp_path / "repo"), k)
    blocks = matrix_blocks((dtype,), SMALL_SHAPES, big=True)
    m = save(repo, blocks, **CODECS[codec])
    assert m.sizes.blocks == len(blocks)
    assert m.sizes.raw_bytes == sum(b.nbytes for b in blocks)
    assert (m.encryption is not None) == encrypted
    assert_pipelines(m, blocks, codec, encrypted)
    # A fresh process: nothing cached, everything from the store.
    again = repo_factory(str(tmp_path / "repo"), k, create=False)
    assert_roundtrip(again, m.id, blocks)
    report = again.verify()
    assert report.ok, report.problems


# -- the matrix on SeaweedFS: every dtype and codec combination at least once -------------


@pytest.mark.s3
@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
@pytest.mark.parametrize("codec", list(CODECS))
def test_roundtrip_s3(s3_url: str, codec: str, encrypted: bool) -> None:
    k = Keyring(os.urandom(32)) if encrypted else None
    repo = repo_factory(s3_url, k)
    blocks = [make_block(999, "bfloat16", big_shape("bfloat16"), seed=7)]
    blocks += matrix_blocks(KV_DTYPES, [(3, 5, 7), (1,), (0,), (2, 16, 64), (32, 1024)], big=False)
    # Small packs: several objects, coalesced ranged reads over S3.
    m = save(repo, blocks, pack_size=64 * 1024, **CODECS[codec])
    assert m.sizes.packs_written >= 2
    assert_pipelines(m, blocks, codec, encrypted)
    again = repo_factory(s3_url, k, create=False)
    assert_roundtrip(again, m.id, blocks)
    assert again.verify().ok


# -- loading a subset, packing, coalescing, dedup within a save ----------------------------


class RangeLog(FaultyStore):
    """Records every ranged get as (name, offset, length)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.gets: list[tuple[str, int, int | None]] = []

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        with self._lock:
            self.gets.append((name, offset, length))
        return super().get(name, offset, length)

    def pack_gets(self) -> list[tuple[str, int, int | None]]:
        with self._lock:
            return [g for g in self.gets if g[0].startswith("packs/")]

    def reset(self) -> None:
        with self._lock:
            self.gets.clear()


def test_load_subset_by_keys(tmp_path: Any) -> None:
    repo = repo_factory(str(tmp_path))
    blocks = [make_block(i, "bfloat16", (2, 16, 64), seed=i) for i in range(20)]
    m = save(repo, blocks)
    wanted = [key(i) for i in (0, 3, 7, 19)]
    got = {lb.key: lb for lb in repo.load(m.id, keys=wanted)}
    assert set(got) == set(wanted)
    for b in blocks:
        if b.key in got:
            assert bytes(got[b.key].data) == block_bytes(b)
    assert list(repo.load(m.id, keys=[])) == []
    assert list(repo.load(m.id, keys=[b"not-a-key"])) == []


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_small_packs_span_many_objects_and_reads_coalesce(tmp_path: Any, encrypted: bool) -> None:
    k = Keyring(os.urandom(32)) if encrypted else None
    store = RangeLog(LocalStore(tmp_path))
    repo = repo_factory(store, k)
    blocks = [make_block(i, "bfloat16", (2, 16, 64), seed=i) for i in range(200)]  # 4 KiB each
    m = save(repo, blocks, pack_size=64 * 1024)
    packs = {r.pack for r in m.blocks}
    assert len(packs) >= 4
    assert m.sizes.packs_written == len(packs)
    for p in packs:
        data = repo.store.get(f"packs/{p[:2]}/{p}")
        entries = read_trailer(data, p, k)
        assert {e.id for e in entries} == {r.blob for r in m.blocks if r.pack == p}

    store.reset()
    assert_roundtrip(repo, m, blocks)
    gets = store.pack_gets()
    # One ranged read per pack, covering exactly its blob area (no trailer).
    assert len(gets) == len(packs) < len(blocks)
    for name, offset, length in gets:
        pid = name.rsplit("/", 1)[-1]
        refs = [r for r in m.blocks if r.pack == pid]
        assert offset == HEADER_SIZE == min(r.offset for r in refs)
        assert length == max(r.offset + r.length for r in refs) - offset


def test_duplicate_keys_within_one_save_store_one_blob(tmp_path: Any) -> None:
    repo = repo_factory(str(tmp_path))
    a, b, c = (make_block(i, "float16", (4, 16, 64), seed=i) for i in range(3))
    m = save(repo, [a, b, a, c, a])
    assert m.sizes.blocks == 5
    assert m.sizes.new_blocks == 3
    assert m.sizes.new_raw_bytes == 3 * a.nbytes
    refs_a = [r for r in m.blocks if r.key == a.key.hex()]
    assert len(refs_a) == 3
    assert len({(r.blob, r.pack, r.offset, r.length) for r in refs_a}) == 1
    (pack,) = {r.pack for r in m.blocks}
    entries = read_trailer(repo.store.get(f"packs/{pack[:2]}/{pack}"), pack, None)
    assert len(entries) == 3
    loaded = list(repo.load(m.id))
    assert len(loaded) == 5
    for lb in loaded:
        want = {a.key: a, b.key: b, c.key: c}[lb.key]
        assert bytes(lb.data) == block_bytes(want)


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_incompressible_data_falls_back_to_raw_pipeline(tmp_path: Any, encrypted: bool) -> None:
    k = Keyring(os.urandom(32)) if encrypted else None
    repo = repo_factory(str(tmp_path), k)
    noise = [
        Block(key(100), os.urandom(64 * 1024), "uint8", (64 * 1024,)),
        Block(key(101), os.urandom(32 * 1024), "bfloat16", (16, 1024)),
        Block(key(102), os.urandom(1 << 20), "float32", (256, 1024)),
    ]
    kv = make_block(1, "bfloat16", (1024, 256), seed=1)
    m = save(repo, [*noise, kv])
    refs = {r.key: r for r in m.blocks}
    for n in noise:
        ref = refs[n.key.hex()]
        assert pipeline_names(m, ref.codec) == raw_names(encrypted)
        assert ref.length == ref.raw_length + (SEAL_OVERHEAD[SEAL_VERSION] if encrypted else 0)
    assert pipeline_names(m, refs[kv.key.hex()].codec) == expected_names("bfloat16", "zstd+byteplane", encrypted)
    for lb in repo.load(m.id):
        want = next(b for b in [*noise, kv] if b.key == lb.key)
        assert bytes(lb.data) == block_bytes(want)


def test_load_streams_before_all_ranges_are_fetched(tmp_path: Any) -> None:
    store = RangeLog(LocalStore(tmp_path))
    repo = repo_factory(store)
    # ~48 KiB blocks into 64 KiB packs: two blocks a pack, one range a pack.
    blocks = [make_block(i, "bfloat16", (24, 1024), seed=i) for i in range(32)]
    m = save(repo, blocks, pack_size=64 * 1024, compression="none")
    n_ranges = len({r.pack for r in m.blocks})
    assert n_ranges >= 10
    store.reset()
    it: Iterator[Any] = repo.load(m, workers=1)
    first = next(it)
    at_first = len(store.pack_gets())
    assert bytes(first.data) == block_bytes(next(b for b in blocks if b.key == first.key))
    # With one fetch thread the loader keeps at most a window of two ranges
    # (plus the one it just scheduled) ahead of the caller.
    assert 1 <= at_first <= 3 < n_ranges
    rest = list(it)
    assert len(rest) == len(blocks) - 1
    assert len(store.pack_gets()) == n_ranges
