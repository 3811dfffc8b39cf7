"""Seal v2 (FORMAT.md §10.1): every encrypted message under a key of its own.

The stored bytes are checked against an independent reading of the spec
(HKDF and AES-GCM from ``cryptography`` directly, not ckpt's code), so the
tests pin the byte format, not just a round trip.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ckpt import Keyring, Namespace, Repository, SaveOptions
from ckpt.codecs import AesGcm, CodecContext, codec_from_dict
from ckpt.errors import IntegrityError, UnsupportedVersion
from ckpt.manifest import Manifest
from ckpt.pack import FOOTER_SIZE, pack_name, read_trailer
from ckpt.store.local import LocalStore
from tests.fixtures.make_format_v1 import KEY_HEX, blocks
from tests.harness.repo import NS, make_block, sample_pins

V1_ENCRYPTED = Path(__file__).parent / "fixtures" / "format-v1" / "encrypted"
MASTER = os.urandom(32)
KEY = Keyring(MASTER)


def spec_key(master: bytes, salt: bytes, purpose: str) -> tuple[bytes, bytes]:
    """key, nonce as FORMAT.md §10.1 defines them."""
    okm = HKDF(hashes.SHA256(), 44, salt, b"gpuckpt seal v2 " + purpose.encode()).derive(master)
    return okm[:32], okm[32:]


def spec_open(master: bytes, sealed: bytes, aad: bytes, purpose: str) -> bytes:
    """Open a seal-2 message from the spec alone: 0x02 | salt(32) | ciphertext | tag(16)."""
    assert sealed[0] == 2
    key, nonce = spec_key(master, sealed[1:33], purpose)
    return AESGCM(key).decrypt(nonce, sealed[33:], aad)


def trailer_of(pack: bytes) -> bytes:
    (tlen,) = struct.unpack_from("<Q", pack, len(pack) - FOOTER_SIZE)
    return pack[len(pack) - FOOTER_SIZE - tlen : len(pack) - FOOTER_SIZE]


def with_trailer(pack: bytes, trailer: bytes) -> bytes:
    """``pack`` with its trailer replaced (same length) and the footer checksum fixed."""
    start = len(pack) - FOOTER_SIZE - len(trailer)
    footer = struct.pack("<Q", len(trailer)) + xxhash.xxh3_128_digest(trailer) + pack[-8:]
    return pack[:start] + trailer + footer


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Repository, Manifest, Path]:
    """An encrypted repository with one checkpoint of raw (uncompressed) blocks."""
    root = tmp_path / "repo"
    repo = Repository.init(LocalStore(root), key=KEY, pack_size=1 << 20)
    bs = [make_block(i, "bfloat16", (4, 16, 8), i) for i in range(4)]
    m = repo.save(
        bs, worker_id="w0", namespace=NS, pins=sample_pins(), options=SaveOptions(pack_size=1 << 20, compression="none")
    )
    return repo, m, root


def test_new_writes_seal_every_message_under_its_own_key(saved: tuple[Repository, Manifest, Path]) -> None:
    repo, m, root = saved
    # Blobs: the codec spec says seal 2, the bytes open by the spec with the blob id as additional data.
    specs = [c.model_dump() for c in m.codecs[0]]
    assert specs == [{"name": "aes-256-gcm", "configuration": {"key_id": KEY.key_id, "seal": 2}}]
    originals = {
        b.key.hex(): bytes(memoryview(b.data).cast("B"))
        for b in (make_block(i, "bfloat16", (4, 16, 8), i) for i in range(4))
    }
    salts = set()
    for ref in m.blocks:
        pack = (root / pack_name(ref.pack)).read_bytes()
        assert struct.unpack_from("<I", pack, 8)[0] == 2
        stored = pack[ref.offset : ref.offset + ref.length]
        assert ref.length == ref.raw_length + 49  # marker 1, salt 32, tag 16
        assert spec_open(MASTER, stored, ref.blob.encode(), "blob") == originals[ref.key]
        salts.add(stored[1:33])
    assert len(salts) == len(m.blocks)
    # The pack trailer: seal 2, bound to the pack version and id.
    pack_id = m.blocks[0].pack
    trailer = spec_open(
        MASTER,
        trailer_of((root / pack_name(pack_id)).read_bytes()),
        f"gpuckpt-pack-trailer/2/{pack_id}".encode(),
        "pack-trailer",
    )
    assert json.loads(trailer)["pack"] == pack_id
    # Documents: envelope version 2 (index documents 3: content ids), seal 2 in the header, bound to
    # their names and versions.
    for name in [m.name] + [o.name for o in repo.store.list("index/")]:
        env = json.loads((root / name).read_bytes())
        v = 3 if name.startswith("index/") else 2
        assert env["version"] == v
        assert env["encryption"] == {"alg": "aes-256-gcm", "key_id": KEY.key_id, "seal": 2}
        aad = f"{env['format']}/{v}/{name}".encode()
        body = spec_open(MASTER, base64.b64decode(env["ciphertext"]), aad, "document")
        assert isinstance(json.loads(body), dict)


def test_two_seals_of_one_plaintext_use_different_keys() -> None:
    data, aad = b"the same KV page" * 64, b"blob-id"
    a, b = bytes(KEY.seal(data, aad)), bytes(KEY.seal(data, aad))
    assert a[0] == b[0] == 2
    assert a[1:33] != b[1:33]
    (ka, na), (kb, nb) = spec_key(MASTER, a[1:33], "blob"), spec_key(MASTER, b[1:33], "blob")
    assert ka != kb
    assert na != nb
    assert a[33:] != b[33:]
    assert KEY.open(a, aad, obj="x") == KEY.open(b, aad, obj="x") == data
    # The salt alone chooses the key: another message's salt does not open this one.
    with pytest.raises(IntegrityError, match="authentication failed for x"):
        KEY.open(a[:1] + b[1:33] + a[33:], aad, obj="x")


def test_purpose_and_version_separate_messages() -> None:
    sealed = bytes(KEY.seal(b"body", b"aad", purpose="blob"))
    with pytest.raises(IntegrityError, match="authentication failed"):
        KEY.open(sealed, b"aad", obj="x", purpose="document")
    # Read under the wrong seal version, in either direction, it does not open.
    with pytest.raises(IntegrityError, match="authentication failed"):
        KEY.open(sealed, b"aad", obj="x", version=1)
    old = bytes(KEY.seal(b"body", b"aad", version=1))
    assert KEY.open(old, b"aad", obj="x", version=1) == b"body"
    with pytest.raises(IntegrityError):
        KEY.open(old, b"aad", obj="x", version=2)
    with pytest.raises(UnsupportedVersion, match="version 3"):
        KEY.open(sealed, b"aad", obj="x", version=3)


@pytest.mark.parametrize(
    ("mangle", "why"),
    [
        (lambda s: s[:5] + bytes([s[5] ^ 1]) + s[6:], "authentication failed for blob b1 in packs/ab/x"),
        (lambda s: s[:-1], "authentication failed for blob b1 in packs/ab/x"),
        (lambda s: s[:48], "encrypted data of blob b1 in packs/ab/x is truncated"),
        (lambda s: b"\x01" + s[1:], "blob b1 in packs/ab/x is not a version-2 sealed message"),
    ],
    ids=["salt", "short", "truncated", "marker"],
)
def test_a_damaged_blob_names_itself(mangle: Any, why: str) -> None:
    codec = AesGcm.for_writing(KEY.key_id)
    ctx = CodecContext(KEY, b"b1", "packs/ab/x", "b1")
    sealed = bytes(codec.encode(b"x" * 100, ctx))
    assert bytes(codec.decode(sealed, ctx, 100)) == b"x" * 100
    with pytest.raises(IntegrityError, match=why) as ei:
        codec.decode(mangle(sealed), ctx, 100)
    assert (ei.value.obj, ei.value.blob) == ("packs/ab/x", "b1")


def test_a_tampered_blob_salt_fails_the_load_naming_blob_and_pack(saved: tuple[Repository, Manifest, Path]) -> None:
    _repo, m, root = saved
    ref = m.blocks[1]
    path = root / pack_name(ref.pack)
    pack = bytearray(path.read_bytes())
    pack[ref.offset + 1] ^= 0x80  # the first salt byte
    path.write_bytes(bytes(pack))
    with pytest.raises(IntegrityError) as ei:
        list(Repository.open(LocalStore(root), key=KEY).load(m.id))
    assert f"authentication failed for blob {ref.blob} in {pack_name(ref.pack)}" in str(ei.value)


def _rewrite_ciphertext(path: Path, mangle: Any, **header: Any) -> None:
    env = json.loads(path.read_bytes())
    env["ciphertext"] = base64.b64encode(mangle(base64.b64decode(env["ciphertext"]))).decode()
    env["encryption"].update(header)
    path.write_text(json.dumps(env))


@pytest.mark.parametrize(
    ("mangle", "header", "why"),
    [
        (lambda s: s[:10] + bytes([s[10] ^ 1]) + s[11:], {}, "authentication failed for {name}"),
        (lambda s: s[:40], {}, "encrypted data of {name} is truncated"),
        (lambda s: b"\x07" + s[1:], {}, "{name} is not a version-2 sealed message"),
        # Relabelled as a format-1 seal (a downgrade): read as nonce | ct | tag under the old key, it fails.
        (lambda s: s, {"seal": 1}, "authentication failed for {name}"),
    ],
    ids=["salt", "truncated", "marker", "downgrade"],
)
def test_a_damaged_manifest_names_itself(
    saved: tuple[Repository, Manifest, Path], mangle: Any, header: dict[str, Any], why: str
) -> None:
    _repo, m, root = saved
    _rewrite_ciphertext(root / m.name, mangle, **header)
    with pytest.raises(IntegrityError, match=why.format(name=m.name)) as ei:
        Repository.open(LocalStore(root), key=KEY).manifest(m.id)
    assert ei.value.obj == m.name


def test_a_tampered_trailer_salt_names_the_pack(saved: tuple[Repository, Manifest, Path]) -> None:
    _repo, m, root = saved
    pack_id = m.blocks[0].pack
    pack = (root / pack_name(pack_id)).read_bytes()
    trailer = bytearray(trailer_of(pack))
    trailer[3] ^= 1
    with pytest.raises(IntegrityError, match=f"authentication failed for {pack_name(pack_id)}"):
        read_trailer(with_trailer(pack, bytes(trailer)), pack_id, KEY)
    assert read_trailer(pack, pack_id, KEY)


def test_codec_seal_versions() -> None:
    # Format 1's spec has no seal field and means seal 1; it serializes back unchanged.
    v1 = codec_from_dict({"name": "aes-256-gcm", "configuration": {"key_id": "k"}})
    assert isinstance(v1, AesGcm)
    assert v1.seal == 1
    assert v1.to_dict() == {"name": "aes-256-gcm", "configuration": {"key_id": "k"}}
    assert AesGcm.for_writing("k").to_dict() == {"name": "aes-256-gcm", "configuration": {"key_id": "k", "seal": 2}}
    with pytest.raises(UnsupportedVersion, match="seal: format version 3"):
        codec_from_dict({"name": "aes-256-gcm", "configuration": {"key_id": "k", "seal": 3}})


def test_v1_blobs_copied_verbatim_by_a_repack_still_open(tmp_path: Path) -> None:
    """A gc repack copies seal-1 blobs of a format-1 pack into a new (version-2) pack: they open
    there, since neither their key nor their additional data depends on the pack."""
    key = Keyring(bytes.fromhex(KEY_HEX))
    root = tmp_path / "repo"
    shutil.copytree(V1_ENCRYPTED, root)
    repo = Repository.open(LocalStore(root), key=key)
    old = repo.list("fixture-worker")
    # A new checkpoint of two of the fixture's blocks, deduplicated against its seal-1 blobs.
    ns = Namespace({"engine": "fixture", "model": "none", "codec": "zstd"})
    keep = blocks()[:2]
    m = repo.save(keep, worker_id="w-new", namespace=ns, pins=sample_pins(), options=SaveOptions(pack_size=1 << 20))
    assert m.sizes.new_blocks == 0
    v1_packs = {b.pack for b in m.blocks}
    assert all(struct.unpack_from("<I", (root / pack_name(p)).read_bytes(), 8)[0] == 1 for p in v1_packs)
    # Forgetting the fixture's checkpoints leaves that pack half live: gc repacks it.
    for info in old:
        repo.delete(info.id)
    report = repo.gc(now=True, grace=timedelta(0), repack_below=1.0)
    assert sorted(report.repacked_packs) == sorted(pack_name(p) for p in v1_packs)
    assert not any((root / pack_name(p)).exists() for p in v1_packs)

    fresh = Repository.open(LocalStore(root), key=key)
    for ref in m.blocks:
        (entry,) = fresh.relocate(ref.pack, [ref.blob])[ref.blob]
        new_pack = (root / pack_name(entry.pack)).read_bytes()
        assert struct.unpack_from("<I", new_pack, 8)[0] == 2
        assert trailer_of(new_pack)[0] == 2  # the new pack's own trailer is seal 2
        assert json.loads(entry.codec)[-1] == {"name": "aes-256-gcm", "configuration": {"key_id": key.key_id}}
        assert (entry.checksum, entry.length) == (ref.checksum, ref.length)  # the very bytes
    got = {b.key: bytes(b.data) for b in fresh.load(m.id)}
    assert got == {b.key: bytes(memoryview(b.data).cast("B")) for b in keep}
    v = fresh.verify(read_data=True)
    assert v.ok, v.problems


def test_the_sealed_spec_rejects_a_wrong_tag_independently() -> None:
    """The spec reader above is a real check: it refuses what ckpt refuses."""
    sealed = bytes(KEY.seal(b"abc", b"aad", purpose="document"))
    assert spec_open(MASTER, sealed, b"aad", "document") == b"abc"
    with pytest.raises(InvalidTag):
        spec_open(MASTER, sealed, b"aad", "blob")
