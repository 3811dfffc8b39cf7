"""Damage is detected, named, and never handed out.

Each case damages one stored object (a pack's blob area, a truncated or
missing pack, a manifest) through the store itself, on a local directory and
on S3, then checks that: ``load()`` raises an IntegrityError whose message and
``.obj`` name the object and the cause; every block yielded before the error
is byte-exact; ``load(..., errors=[])`` reports the damaged blocks and still
yields every good one; ``verify()`` and ``verify(id)`` report a problem naming
the object.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckpt import (
    BlockFailure,
    ConfigError,
    IntegrityError,
    KeyMismatch,
    KeyMissing,
    Keyring,
    LoadedBlock,
    Manifest,
    ManifestError,
    Repository,
    SaveOptions,
)
from ckpt.manifest import manifest_name
from ckpt.pack import pack_name
from tests.harness.repo import NS, block_bytes, make_block, repo_factory, sample_pins


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "s3":
        return str(request.getfixturevalue("s3_url"))
    return str(tmp_path / "repo")


@dataclass
class Setup:
    repo: Repository
    m: Manifest
    want: dict[bytes, bytes]  # key -> the bytes saved

    @property
    def packs(self) -> list[str]:
        return sorted({r.pack for r in self.m.blocks})

    def refs_in(self, pack: str) -> list[str]:
        return [r.key for r in self.m.blocks if r.pack == pack]


def make_setup(target: str, encrypted: bool, compression: str = "zstd") -> Setup:
    key = repo_key(encrypted)
    repo = repo_factory(target, key)
    blocks = [make_block(i, "bfloat16", (8, 1024), seed=i) for i in range(24)]  # 16 KiB each
    m = repo.save(
        blocks,
        worker_id="w0",
        namespace=NS,
        pins=sample_pins(),
        options=SaveOptions(pack_size=64 * 1024, compression=compression),
    )
    assert len({r.pack for r in m.blocks}) >= 3
    return Setup(repo, m, {b.key: block_bytes(b) for b in blocks})


def repo_key(encrypted: bool) -> Keyring | None:
    return Keyring(os.urandom(32)) if encrypted else None


def rewrite(
    repo: Repository, name: str, change: Iterable[tuple[int, int]] | None = None, *, truncate: int | None = None
) -> None:
    """Overwrite stored object ``name`` through the store: XOR bytes, or cut it short."""
    data = bytearray(repo.store.get(name))
    for pos, mask in change or ():
        data[pos] ^= mask
    if truncate is not None:
        del data[truncate:]
    repo.store.put(name, bytes(data))


def checked(it: Iterator[LoadedBlock], want: dict[bytes, bytes], into: list[bytes]) -> Iterator[LoadedBlock]:
    """Pass blocks through, asserting each is byte-exact before anything else sees it."""
    for lb in it:
        assert bytes(lb.data) == want[lb.key], f"a damaged block {lb.key.hex()} was yielded"
        into.append(lb.key)
        yield lb


def load_until_error(s: Setup) -> tuple[IntegrityError, list[bytes]]:
    got: list[bytes] = []
    with pytest.raises(IntegrityError) as ei:
        for _ in checked(s.repo.load(s.m.id), s.want, got):
            pass
    return ei.value, got


def load_collecting(s: Setup) -> tuple[list[BlockFailure], list[bytes]]:
    errors: list[BlockFailure] = []
    got: list[bytes] = []
    for _ in checked(s.repo.load(s.m.id, errors=errors), s.want, got):
        pass
    return errors, got


def assert_reports(s: Setup, obj: str, blob: str | None = None) -> None:
    """verify() and verify(id) both report a problem naming ``obj``."""
    for report in (s.repo.verify(), s.repo.verify(s.m.id)):
        assert not report.ok
        named = [p for p in report.problems if p.obj == obj]
        assert named, report.problems
        assert all(obj in p.message or p.obj == obj for p in named)
        if blob is not None:
            assert any(p.blob == blob for p in named), named


# -- packs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_flipped_byte_in_a_blob(target: str, encrypted: bool) -> None:
    s = make_setup(target, encrypted)
    ref = s.m.blocks[len(s.m.blocks) // 2]
    obj = pack_name(ref.pack)
    rewrite(s.repo, obj, [(ref.offset + ref.length // 2, 0x01)])

    err, got = load_until_error(s)
    assert err.obj == obj
    assert err.blob == ref.blob
    assert obj in str(err)
    assert ref.blob in str(err)
    if encrypted:
        assert "authentication" in str(err)  # the AEAD tag refuses it (FORMAT.md §10)
    else:
        assert "checksum mismatch" in str(err)
    assert ref.key not in {k.hex() for k in got}

    errors, good = load_collecting(s)
    assert [f.key.hex() for f in errors] == [ref.key]
    assert isinstance(errors[0].error, IntegrityError)
    assert errors[0].error.obj == obj
    assert sorted(good) == sorted(k for k in s.want if k.hex() != ref.key)
    assert_reports(s, obj, ref.blob)


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_truncated_pack(target: str, encrypted: bool) -> None:
    s = make_setup(target, encrypted)
    pack = s.packs[0]
    obj = pack_name(pack)
    last = max((r for r in s.m.blocks if r.pack == pack), key=lambda r: r.offset)
    rewrite(s.repo, obj, truncate=last.offset + last.length // 2)

    err, _ = load_until_error(s)
    assert err.obj == obj
    assert obj in str(err)
    assert "truncated" in str(err)

    errors, good = load_collecting(s)
    failed = {f.key.hex() for f in errors}
    assert last.key in failed
    assert failed <= set(s.refs_in(pack))
    assert all(isinstance(f.error, IntegrityError) and f.error.obj == obj for f in errors)
    # Every block of every other pack still loads.
    others = {k for k in s.want if k.hex() not in s.refs_in(pack)}
    assert others <= set(good)
    assert set(good) | {bytes.fromhex(k) for k in failed} == set(s.want)
    assert_reports(s, obj)


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_missing_pack(target: str, encrypted: bool) -> None:
    s = make_setup(target, encrypted)
    pack = s.packs[-1]
    obj = pack_name(pack)
    s.repo.store.delete(obj)

    err, _ = load_until_error(s)
    assert err.obj == obj
    assert obj in str(err)
    assert "missing" in str(err)
    assert s.m.id in str(err)

    errors, good = load_collecting(s)
    assert sorted(f.key.hex() for f in errors) == sorted(s.refs_in(pack))
    assert sorted(good) == sorted(k for k in s.want if k.hex() not in s.refs_in(pack))
    assert_reports(s, obj)


def test_blob_moved_to_another_blobs_place_fails_authentication(target: str) -> None:
    # Without compression every blob of the same shape has the same length,
    # so one can be copied over another without moving anything else.
    s = make_setup(target, True, compression="none")
    a, b = [r for r in s.m.blocks if r.pack == s.packs[0]][:2]
    assert a.length == b.length
    obj = pack_name(a.pack)
    data = bytearray(s.repo.store.get(obj))
    data[a.offset : a.offset + a.length] = data[b.offset : b.offset + b.length]
    s.repo.store.put(obj, bytes(data))

    err, _ = load_until_error(s)
    assert err.obj == obj
    assert err.blob == a.blob
    assert "authentication" in str(err)
    assert a.blob in str(err)
    errors, good = load_collecting(s)
    assert [f.key.hex() for f in errors] == [a.key]
    assert bytes.fromhex(b.key) in good
    assert_reports(s, obj, a.blob)


# -- manifests ------------------------------------------------------------------------------


def test_tampered_plain_manifest(target: str) -> None:
    s = make_setup(target, False)
    name = s.m.name
    original = s.repo.store.get(name)
    env = json.loads(original)

    # A changed value, the checksum left alone: valid JSON, valid schema, refused.
    env["body"]["blocks"][0]["offset"] += 1
    s.repo.store.put(name, json.dumps(env).encode())
    with pytest.raises(IntegrityError) as ei:
        list(s.repo.load(s.m.id))
    assert ei.value.obj == name
    assert name in str(ei.value)
    assert "checksum mismatch" in str(ei.value)
    assert_reports(s, name)

    # A label added: the body stays schema-valid, still refused.
    env = json.loads(original)
    env["body"]["labels"]["evil"] = "1"
    s.repo.store.put(name, json.dumps(env).encode())
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        s.repo.manifest(s.m.id)

    # The same content re-serialized (whitespace, key order) is the same document.
    env = json.loads(original)
    s.repo.store.put(name, json.dumps(env, indent=2, sort_keys=True).encode())
    assert s.repo.manifest(s.m.id) == s.m

    # A flipped byte that breaks the JSON: refused as malformed, naming the object.
    broken = bytearray(original)
    assert broken[-1:] == b"}"
    broken[-1] = ord("x")  # the envelope's closing brace
    s.repo.store.put(name, bytes(broken))
    with pytest.raises(ManifestError) as me:
        list(s.repo.load(s.m.id))
    assert name in str(me.value)
    assert_reports(s, name)


def test_tampered_encrypted_manifest_fails_authentication(target: str) -> None:
    s = make_setup(target, True)
    name = s.m.name
    env = json.loads(s.repo.store.get(name))
    ct = env["ciphertext"]
    i = len(ct) // 2
    # Another valid base64 character: the decoded ciphertext differs by one bit.
    env["ciphertext"] = ct[:i] + ("B" if ct[i] != "B" else "C") + ct[i + 1 :]
    assert base64.b64decode(env["ciphertext"]) != base64.b64decode(ct)
    s.repo.store.put(name, json.dumps(env).encode())
    with pytest.raises(IntegrityError) as ei:
        list(s.repo.load(s.m.id))
    assert ei.value.obj == name
    assert name in str(ei.value)
    assert "authentication" in str(ei.value)
    assert_reports(s, name)


def test_encrypted_manifest_copied_under_another_name_fails_authentication(target: str) -> None:
    s = make_setup(target, True)
    other_id = s.m.id[:-8] + ("0" * 8 if s.m.id[-8:] != "0" * 8 else "1" * 8)
    other = manifest_name("w0", other_id)
    s.repo.store.put(other, s.repo.store.get(s.m.name))
    with pytest.raises(IntegrityError) as ei:
        s.repo.manifest(other_id)
    assert ei.value.obj == other
    assert "authentication" in str(ei.value)
    # The original is untouched and still loads.
    assert sorted(lb.key for lb in s.repo.load(s.m.id)) == sorted(s.want)


def test_plain_manifest_planted_in_an_encrypted_repository_is_refused(tmp_path: Path) -> None:
    enc = make_setup(str(tmp_path / "enc"), True)
    plain = make_setup(str(tmp_path / "plain"), False)
    planted = plain.m.model_copy(update={"encryption": enc.m.encryption})
    enc.repo.store.put(planted.name, planted.encode(None))
    with pytest.raises(IntegrityError, match="plain document"):
        enc.repo.manifest(planted.id)


# -- keys -----------------------------------------------------------------------------------


def test_wrong_missing_and_unexpected_keys(target: str) -> None:
    k = Keyring(os.urandom(32))
    enc_target = target + ("-enc" if "://" not in target else "")
    if "://" in target:  # s3://bucket/repo?endpoint=...: a second prefix in the bucket
        enc_target = target.replace("/repo?", "/repo-enc?")
    repo_factory(enc_target, k)
    repo_factory(target)
    with pytest.raises(KeyMismatch):
        Repository.open(enc_target, key=Keyring(os.urandom(32)))
    with pytest.raises(KeyMissing) as km:
        Repository.open(enc_target)
    assert k.key_id in str(km.value)
    with pytest.raises(ConfigError, match="not encrypted"):
        Repository.open(target, key=k)
    # The right key still opens it.
    assert Repository.open(enc_target, key=k).encrypted
