"""Hostile and malformed input: stored documents, pack trailers, codec specs,
names and blocks. Every refusal is a GpuckptError that names what was wrong;
nothing else ever escapes, and no name escapes the store."""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import os
import re
import struct
from datetime import timedelta
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ckpt import (
    Block,
    CheckpointNotFound,
    ConfigError,
    FormatError,
    GpuckptError,
    IntegrityError,
    Keyring,
    Manifest,
    ManifestError,
    MemoryStore,
    Repository,
    UnsupportedVersion,
    document,
)
from ckpt import checksum as cks
from ckpt.codecs import REGISTRY, Codec, CodecContext, Pipeline, codec_from_dict
from ckpt.index import decode_index
from ckpt.manifest import KIND, manifest_name
from ckpt.pack import END_MAGIC, HEADER, read_trailer
from ckpt.testing import FaultyStore
from tests.harness.repo import NS, key, make_block, sample_pins

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- a valid manifest to start from -----------------------------------------------------------


class Base:
    """One saved checkpoint in a MemoryStore, and its stored manifest."""

    def __init__(self) -> None:
        self.store = MemoryStore()
        self.repo = Repository.open(self.store, create=True)
        blocks = [make_block(i, "bfloat16", (2, 8, 16), seed=i) for i in range(3)]
        blocks.append(make_block(3, "float8_e4m3fn", (4, 32), seed=3))
        self.m = self.repo.save(
            blocks,
            worker_id="w0",
            namespace=NS,
            pins=sample_pins(),
            ledger={"schema": "test-ledger", "version": 1, "data": {"requests": [1, 2]}},
        )
        self.name = self.m.name
        self.raw = self.store.get(self.name)
        self.env: dict[str, Any] = json.loads(self.raw)
        self.body: dict[str, Any] = self.env["body"]

    def seal(self, body: dict[str, Any], name: str | None = None) -> bytes:
        """A plain manifest envelope with a correct checksum for ``body``."""
        return document.seal(KIND, 1, name or self.name, body, None)

    def env_bytes(self, **changes: Any) -> bytes:
        env = copy.deepcopy(self.env)
        for k, v in changes.items():
            if v is _DROP:
                env.pop(k)
            else:
                env[k] = v
        return json.dumps(env).encode()

    def decode(self, data: bytes, **kw: Any) -> Manifest:
        return Manifest.decode(self.name, data, None, **kw)


_DROP = object()
BASE = Base()


# -- the envelope ---------------------------------------------------------------------------


def test_base_manifest_decodes() -> None:
    assert BASE.decode(BASE.raw) == BASE.m
    assert BASE.decode(BASE.seal(BASE.body)) == BASE.m


@pytest.mark.parametrize("version", [3, 0, -1, "1", 1.0, None, True, [1]])
def test_unknown_manifest_version(version: Any) -> None:
    with pytest.raises(UnsupportedVersion) as ei:
        BASE.decode(BASE.env_bytes(version=version))
    assert BASE.name in str(ei.value)
    assert repr(version) in str(ei.value)
    assert ei.value.version == version
    assert ei.value.what == BASE.name


def test_unknown_manifest_version_through_the_repository() -> None:
    base = Base()
    base.store.put(base.name, base.env_bytes(version=7))
    with pytest.raises(UnsupportedVersion, match=r"version 7 .*supported: 1") as ei:
        list(base.repo.load(base.m.id))
    assert base.name in str(ei.value)
    # A newer body version inside a known envelope version is a schema error.
    body = {**base.body, "version": 2}
    with pytest.raises(ManifestError, match="version"):
        base.decode(base.seal(body))


@pytest.mark.parametrize("fmt", ["gpuckpt-index", "gpuckpt-repository", "", None, 1, "GPUCKPT-MANIFEST"])
def test_unknown_format(fmt: Any) -> None:
    with pytest.raises(ManifestError, match="format") as ei:
        BASE.decode(BASE.env_bytes(format=fmt))
    assert BASE.name in str(ei.value)


@pytest.mark.parametrize("field", ["checksum", "body", "format", "version"])
def test_missing_envelope_field(field: str) -> None:
    with pytest.raises((ManifestError, UnsupportedVersion)) as ei:
        BASE.decode(BASE.env_bytes(**{field: _DROP}))
    assert BASE.name in str(ei.value)


@pytest.mark.parametrize("field", ["blocks", "pins", "id", "codecs", "namespace", "created"])
def test_missing_body_field(field: str) -> None:
    body = {k: v for k, v in BASE.body.items() if k != field}
    with pytest.raises(ManifestError) as ei:
        BASE.decode(BASE.seal(body))
    assert BASE.name in str(ei.value)
    assert field in str(ei.value)


def test_extra_fields() -> None:
    with pytest.raises(ManifestError, match="unexpected"):
        BASE.decode(BASE.env_bytes(extra=1))
    with pytest.raises(ManifestError, match="malformed encryption header"):
        BASE.decode(BASE.env_bytes(ciphertext="AAAA", encryption=None))
    with pytest.raises(ManifestError, match="surprise"):
        BASE.decode(BASE.seal({**BASE.body, "surprise": 1}))


@pytest.mark.parametrize("doc", [b"[]", b"[1, 2]", b'"manifest"', b"1", b"null", b"true", b"1.5"])
def test_non_object_json(doc: bytes) -> None:
    with pytest.raises(ManifestError, match="JSON object") as ei:
        BASE.decode(doc)
    assert BASE.name in str(ei.value)


def test_non_object_body() -> None:
    for body in ([], "x", 1, None):
        env = {**BASE.env, "body": body, "checksum": "xxh3-128:" + xxhash.xxh3_128_hexdigest(document.canonical(body))}
        with pytest.raises(ManifestError, match="body must be a JSON object"):
            BASE.decode(json.dumps(env).encode())


@pytest.mark.parametrize(
    "doc",
    [
        b"\xff\xfe\x00",
        b'{"format": "gpuckpt-manifest\xff"}',
        BASE.raw[:-40] + b"\xc3\x28" + BASE.raw[-38:],
        b"",
        b"   ",
        b"{",
        b"\x00" * 16,
    ],
)
def test_invalid_utf8_or_json(doc: bytes) -> None:
    with pytest.raises(ManifestError, match="not valid JSON") as ei:
        BASE.decode(doc)
    assert BASE.name in str(ei.value)


def test_deeply_nested_json() -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(ManifestError, match="not valid JSON"):
        BASE.decode(deep)
    inside = (
        b'{"format":"gpuckpt-manifest","version":1,"checksum":"xxh3-128:00","body":{"layout":'
        + b'{"a":' * 100_000
        + b"1"
        + b"}" * 100_000
        + b"}}"
    )
    with pytest.raises(ManifestError, match="not valid JSON"):
        BASE.decode(inside)
    # Nesting that parses, with a correct checksum: accepted where the schema allows any JSON.
    body = copy.deepcopy(BASE.body)
    nested: Any = 1
    for _ in range(300):
        nested = [nested]
    body["layout"] = {"deep": nested}
    assert BASE.decode(BASE.seal(body)).layout == {"deep": nested}


def test_huge_numbers_are_refused_cleanly() -> None:
    """Python refuses to parse integers over 4300 digits (ValueError): still a ManifestError."""
    data = BASE.raw.replace(b'"offset":16', b'"offset":' + b"9" * 5000, 1)
    assert data != BASE.raw
    with pytest.raises(ManifestError) as ei:
        BASE.decode(data)
    assert BASE.name in str(ei.value)


def test_oversized_manifest() -> None:
    base = Base()
    size = len(base.raw)
    # The limit applies before the object is read.
    store = FaultyStore(base.store)
    repo = Repository.open(store)
    with pytest.raises(ManifestError, match=rf"{size} bytes exceeds the manifest size limit 1000") as ei:
        repo.manifest(base.m.id, max_bytes=1000)
    assert base.name in str(ei.value)
    assert ("get", base.name) not in store.log
    with pytest.raises(ManifestError, match="exceeds the manifest size limit"):
        Manifest.decode(base.name, base.raw, None, max_bytes=size - 1)
    assert Manifest.decode(base.name, base.raw, None, max_bytes=size) == base.m

    # A stored object inflated past the limit (whitespace: the body and its
    # checksum are unchanged, so nothing else would catch it) is refused.
    padded = base.raw[:-1] + b" " * (4 * size) + b"}"
    assert Manifest.decode(base.name, padded, None) == base.m
    base.store.put(base.name, padded)
    with pytest.raises(ManifestError, match=f"{len(padded)} bytes exceeds"):
        repo.manifest(base.m.id, max_bytes=2 * size)
    assert repo.manifest(base.m.id, max_bytes=len(padded)) == base.m


def test_manifest_under_a_name_that_differs_from_its_id() -> None:
    base = Base()
    other_id = base.m.id[:-8] + "deadbeef"
    for other in (manifest_name("w0", other_id), manifest_name("w1", base.m.id)):
        base.store.put(other, base.raw)
        ref = other.removeprefix("manifests/")
        with pytest.raises(ManifestError, match="says it is") as ei:
            base.repo.manifest(ref)
        assert other in str(ei.value)
        assert base.name in str(ei.value)
        report = base.repo.verify()
        assert any(p.obj == other for p in report.problems)
        base.store.delete(other)


# -- config and index envelopes -----------------------------------------------------------------


def _config_env(store: MemoryStore) -> dict[str, Any]:
    return json.loads(store.get("config"))


def test_config_envelope_errors() -> None:
    store = MemoryStore()
    Repository.open(store, create=True)
    env = _config_env(store)

    store.put("config", json.dumps({**env, "version": 99}).encode())
    with pytest.raises(UnsupportedVersion) as ei:
        Repository.open(store)
    assert "config" in str(ei.value)
    assert ei.value.version == 99

    store.put("config", json.dumps({**env, "format": "gpuckpt-manifest"}).encode())
    with pytest.raises(FormatError, match="config: format"):
        Repository.open(store)

    for doc in (b"[]", b"\xff", b"{", b'"config"'):
        store.put("config", doc)
        with pytest.raises(FormatError, match="config"):
            Repository.open(store)

    for drop in ("id", "pack_size", "encryption", "created"):
        body = {k: v for k, v in env["body"].items() if k != drop}
        store.put("config", document.seal("gpuckpt-repository", 1, "config", body, None))
        with pytest.raises(FormatError, match="config: malformed"):
            Repository.open(store)

    for enc in ({"alg": "rot13", "key_id": "x", "check": "x"}, "aes", [1]):
        body = {**env["body"], "encryption": enc}
        store.put("config", document.seal("gpuckpt-repository", 1, "config", body, None))
        with pytest.raises(FormatError, match="config"):
            Repository.open(store)

    store.put("config", json.dumps({**env, "extra": 1}).encode())
    with pytest.raises(FormatError, match="unexpected"):
        Repository.open(store)


def test_index_envelope_errors() -> None:
    base = Base()
    (name,) = [o.name for o in base.store.list("index/")]
    env = json.loads(base.store.get(name))
    with pytest.raises(UnsupportedVersion) as ei:
        decode_index(name, json.dumps({**env, "version": 4}).encode(), None)
    assert name in str(ei.value)
    assert ei.value.version == 4
    for body in ({"packs": {}}, {"packs": [1]}, {"packs": [{"id": 1, "size": 1}]}, {}):
        with pytest.raises(FormatError, match=name):
            decode_index(name, document.seal("gpuckpt-index", 1, name, body, None), None)
    # An index document of an unknown version (a newer writer's) does not stop a save, which
    # only cannot deduplicate against it; gc refuses, deleting nothing: its packs are not garbage.
    base.store.put(name, json.dumps({**env, "version": 4}).encode())
    fresh = Repository.open(base.store)
    m = fresh.save([make_block(9, "bfloat16", (4,), 9)], worker_id="w0", namespace=NS, pins=sample_pins())
    assert len(list(fresh.load(m.id))) == 1
    before = {o.name for o in base.store.list("") if not o.name.startswith("locks/")}
    with pytest.raises(UnsupportedVersion, match=name):
        fresh.gc(now=True, grace=timedelta(0))
    assert {o.name for o in base.store.list("") if not o.name.startswith("locks/")} == before


# -- property: arbitrary input never raises anything but GpuckptError --------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@FAST
@given(data=st.binary(max_size=2048))
@example(data=b'{"format":"gpuckpt-manifest","version":1,"checksum":"xxh3-128:' + b"9" * 5000 + b'"}')
@example(data=b'{"format":"gpuckpt-manifest","version":1,"checksum":1,"body":{}}')
@example(data=b'{"format":"gpuckpt-manifest","version":1,"ciphertext":"!!","encryption":{}}')
@example(data=b'{"format":"gpuckpt-manifest","version":1,"body":{},"x":' + b"1" * 5000 + b"}")
def test_arbitrary_bytes_as_a_manifest(data: bytes) -> None:
    for keyring in (None, KEYRING):
        with contextlib.suppress(ManifestError, FormatError, IntegrityError, UnsupportedVersion, GpuckptError):
            Manifest.decode(BASE.name, data, keyring)


KEYRING = Keyring(os.urandom(32))


@FAST
@given(body=json_values, version=st.sampled_from([1, 2]), encrypted=st.booleans())
def test_arbitrary_json_in_a_valid_envelope(body: Any, version: int, encrypted: bool) -> None:
    try:
        canon = document.canonical(body)
    except (TypeError, ValueError):
        return
    if encrypted:
        env: dict[str, Any] = {
            "format": KIND,
            "version": version,
            "encryption": {"alg": "aes-256-gcm", "key_id": KEYRING.key_id},
            "ciphertext": base64.b64encode(
                bytes(KEYRING.seal(canon, f"{KIND}/{version}/{BASE.name}".encode()))
            ).decode(),
        }
    else:
        env = {
            "format": KIND,
            "version": version,
            "body": body,
            "checksum": "xxh3-128:" + xxhash.xxh3_128_hexdigest(canon),
        }
    with pytest.raises(GpuckptError):
        Manifest.decode(BASE.name, json.dumps(env).encode(), KEYRING if encrypted else None)
    with pytest.raises(GpuckptError):
        decode_index("index/x", json.dumps({**env, "format": "gpuckpt-index"}).encode(), None)


# -- property: schema mutations with the checksum recomputed ----------------------------------

BLOCK_FIELDS = [
    "key",
    "blob",
    "pack",
    "offset",
    "length",
    "raw_length",
    "checksum",
    "raw_checksum",
    "codec",
    "dtype",
    "shape",
]
INT_BLOCK_FIELDS = ["offset", "length", "raw_length", "codec"]
SIZES_FIELDS = [
    "blocks",
    "raw_bytes",
    "stored_bytes",
    "new_blocks",
    "new_raw_bytes",
    "new_stored_bytes",
    "packs_written",
]
REQUIRED_TOP = ["id", "worker_id", "created", "namespace", "pins", "codecs", "blocks"]
N_BLOCKS = len(BASE.body["blocks"])

Path = tuple[Any, ...]


def _droppable() -> list[Path]:
    paths: list[Path] = [(k,) for k in REQUIRED_TOP]
    paths += [("blocks", i, f) for i in range(N_BLOCKS) for f in BLOCK_FIELDS]
    paths += [
        ("codecs", 0, 0, "name"),
        ("codecs", 0, 0, "configuration"),
        ("pins", "host"),
        ("pins", "worker"),
        ("ledger", "schema"),
        ("ledger", "version"),
    ]
    return paths


def _retypeable() -> list[Path]:
    paths = [*_droppable(), ("version",), ("sizes",), ("labels",), ("timings",)]
    paths += [("sizes", f) for f in SIZES_FIELDS]
    paths += [("pins", "host", "gpu_count"), ("pins", "worker", "rank"), ("pins", "worker", "engine")]
    return [p for p in paths if p not in {("ledger", "data")}]


def _negatable() -> list[Path]:
    paths: list[Path] = [("blocks", i, f) for i in range(N_BLOCKS) for f in INT_BLOCK_FIELDS]
    paths += [("blocks", i, "shape", 0) for i in range(N_BLOCKS)]
    paths += [("sizes", f) for f in SIZES_FIELDS]
    paths += [
        ("pins", "host", "gpu_count"),
        ("pins", "worker", "rank"),
        ("pins", "worker", "block_size"),
        ("ledger", "version"),
    ]
    return paths


def _objects() -> list[Path]:
    """Dicts whose model forbids unknown keys (not namespace/layout/labels: free-form)."""
    return [
        (),
        *[("blocks", i) for i in range(N_BLOCKS)],
        ("sizes",),
        ("codecs", 0, 0),
        ("pins",),
        ("pins", "host"),
        ("pins", "worker"),
        ("ledger",),
    ]


def _wrong_type(v: Any) -> Any:
    if isinstance(v, bool) or v is None:
        return "x"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return []  # not int either: "created" accepts an int as a timestamp
    if isinstance(v, list):
        return {"0": v}
    if isinstance(v, dict):
        return [v]
    return None


def _node(body: Any, path: Path) -> Any:
    for p in path:
        body = body[p]
    return body


@st.composite
def mutations(draw: st.DrawFn) -> tuple[str, Path, Any]:
    op = draw(st.sampled_from(["drop", "type", "add", "negative"]))
    if op == "drop":
        return op, draw(st.sampled_from(_droppable())), None
    if op == "type":
        return op, draw(st.sampled_from(_retypeable())), None
    if op == "negative":
        return op, draw(st.sampled_from(_negatable())), draw(st.integers(max_value=-1, min_value=-(2**70)))
    path = draw(st.sampled_from(_objects()))
    existing = set(_node(BASE.body, path))
    name = draw(st.from_regex(r"[a-z][a-z_]{0,11}", fullmatch=True).filter(lambda n: n not in existing))
    return op, path, (name, draw(json_values))


@FAST
@given(mutation=mutations())
@example(mutation=("drop", ("blocks", 0, "checksum"), None))
@example(mutation=("negative", ("sizes", "packs_written"), -1))
@example(mutation=("type", ("blocks", 1, "shape"), None))
def test_schema_mutations_name_the_field(mutation: tuple[str, Path, Any]) -> None:
    op, path, arg = mutation
    body = copy.deepcopy(BASE.body)
    if op == "add":
        field, value = arg
        _node(body, path)[field] = value
    else:
        parent, field = _node(body, path[:-1]), path[-1]
        if op == "drop":
            del parent[field]
        elif op == "type":
            parent[field] = _wrong_type(parent[field])
        else:
            parent[field] = arg
    with pytest.raises(ManifestError) as ei:
        BASE.decode(BASE.seal(body))
    msg = str(ei.value)
    assert BASE.name in msg
    assert str(field) in msg, f"{op} {path}: {msg}"
    assert "does not match the manifest schema" in msg


def test_block_naming_a_codec_that_does_not_exist() -> None:
    body = copy.deepcopy(BASE.body)
    body["blocks"][2]["codec"] = len(body["codecs"])
    with pytest.raises(ManifestError, match="names codec"):
        BASE.decode(BASE.seal(body))


# -- pack trailers -----------------------------------------------------------------------------

PACK_ID = "ab" * 16


def _pack(trailer: bytes, blob_area: bytes = b"") -> bytes:
    return HEADER + blob_area + trailer + struct.pack("<Q", len(trailer)) + xxhash.xxh3_128_digest(trailer) + END_MAGIC


def _read(data: bytes) -> None:
    for keyring in (None, KEYRING):
        with contextlib.suppress(GpuckptError):
            read_trailer(data, PACK_ID, keyring)


@FAST
@given(data=st.binary(max_size=1024))
@example(data=HEADER + b"\x00" * 8 + END_MAGIC)
@example(data=_pack(b"[" * 100_000 + b"]" * 100_000))
@example(data=_pack(b'{"pack":"' + PACK_ID.encode() + b'","x":' + b"1" * 5000 + b"}"))
@example(data=_pack(b'{"pack":"%s","blobs":[],"codecs":[%s%s]}' % (PACK_ID.encode(), b"[" * 50_000, b"]" * 50_000)))
@example(data=HEADER + struct.pack("<Q", 2**64 - 1) + b"\x00" * 16 + END_MAGIC)
def test_pack_trailer_fuzz_raw(data: bytes) -> None:
    _read(data)
    _read(data[:16] + HEADER[:16] + data[16:])


@FAST
@given(
    blobs=st.lists(json_values | st.lists(st.integers(min_value=-5, max_value=300), max_size=8), max_size=4),
    codecs=json_values,
    area=st.binary(max_size=64),
    pack=st.sampled_from([PACK_ID, "cd" * 16, 7, None]),
)
def test_pack_trailer_fuzz_structured(blobs: Any, codecs: Any, area: bytes, pack: Any) -> None:
    trailer = json.dumps({"pack": pack, "codecs": codecs, "blobs": blobs}).encode()
    _read(_pack(trailer, area))
    _read(_pack(bytes(KEYRING.seal(trailer, f"gpuckpt-pack-trailer/1/{PACK_ID}".encode())), area))


def test_valid_trailer_still_reads() -> None:
    row = ["ef" * 32, 16, 4, 4, "0" * 32, "0" * 32, 0]
    trailer = json.dumps({"pack": PACK_ID, "codecs": [[]], "blobs": [row]}).encode()
    (e,) = read_trailer(_pack(trailer, b"abcd"), PACK_ID, None)
    assert (e.offset, e.length, e.codec) == (16, 4, "[]")


# -- codec specs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "lz4", "configuration": {}},
        {"name": "", "configuration": {}},
        {"name": None, "configuration": {}},
        {"name": "zstd"},
        {"configuration": {}},
        {
            "name": "zstd",
            "configuration": [],
        },
        {"name": "zstd", "configuration": {"level": 1}, "extra": 1},
        {"name": "zstd", "configuration": {"lvl": 1}},
        {"name": "zstd", "configuration": {"level": "fast"}},
        {"name": "zstd", "configuration": {"level": 99}},
        {"name": "zstd", "configuration": {"level": 1.5}},
        {"name": "zstd", "configuration": {"_local": 5}},
        {"name": "byteplane", "configuration": {"width": 3}},
        {"name": "byteplane", "configuration": {"width": 2.0}},
        {"name": "byteplane", "configuration": {}},
        {"name": "aes-256-gcm", "configuration": {"key_id": 5}},
        ["zstd", {}],
        "zstd",
        None,
    ],
)
def test_bad_codec_specs(spec: Any) -> None:
    with pytest.raises(FormatError):
        codec_from_dict(spec)
    with pytest.raises(FormatError):
        Pipeline.from_specs([{"name": "zstd", "configuration": {"level": 1}}, spec])


def test_unknown_codec_in_a_manifest_refuses_the_load() -> None:
    base = Base()
    body = copy.deepcopy(base.body)
    body["codecs"][0] = [{"name": "lz4", "configuration": {}}]
    base.store.put(base.name, base.seal(body))
    with pytest.raises(FormatError, match="unknown codec 'lz4'"):
        list(base.repo.load(base.m.id))


def _frame_claiming(size: int) -> bytes:
    """A zstd frame header declaring ``size`` content bytes, then an empty last block."""
    return struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", size) + bytes([1, 0, 0])


@pytest.mark.parametrize(
    "specs",
    [
        [{"name": "zstd", "configuration": {"level": 1}}],
        [{"name": "byteplane", "configuration": {"width": 2}}, {"name": "zstd", "configuration": {"level": 1}}],
        [{"name": "byteplane", "configuration": {"width": 4}}, {"name": "zstd", "configuration": {"level": 3}}],
    ],
    ids=["zstd", "byteplane2+zstd", "byteplane4+zstd"],
)
def test_zstd_frame_claiming_another_size_is_refused_before_allocating(specs: list[Any]) -> None:
    pl = Pipeline.from_specs(specs)
    ctx = CodecContext(None, b"blob", "packs/ab/x", "blob")
    for claimed in (1 << 40, 16):
        with pytest.raises(IntegrityError, match=f"claims {claimed} bytes, expected 8"):
            pl.decode(_frame_claiming(claimed), ctx, 8)


codec_specs = st.fixed_dictionaries(
    {
        "name": st.sampled_from(sorted(REGISTRY)) | st.text(max_size=10),
        "configuration": st.dictionaries(
            st.sampled_from(["level", "width", "key_id", "segments", "_local", "x"]),
            st.integers(-10, 40)
            | st.floats(allow_nan=False, width=16)
            | st.text(max_size=4)
            | st.none()
            | st.booleans(),
            max_size=3,
        ),
    }
)


@FAST
@given(spec=codec_specs, data=st.binary(max_size=256), hint=st.integers(-1, 300))
def test_codec_specs_fuzz(spec: dict[str, Any], data: bytes, hint: int) -> None:
    """Any spec builds a codec or raises FormatError; a codec built from stored
    metadata then decodes any bytes or raises a GpuckptError, nothing else."""
    try:
        codec = codec_from_dict(spec)
    except FormatError:
        return
    assert isinstance(codec, Codec)
    assert codec.to_dict()["name"] == spec["name"]
    for keyring in (None, KEYRING):
        ctx = CodecContext(keyring, b"blob", "packs/ab/x", "blob")
        with contextlib.suppress(GpuckptError):
            codec.decode(data, ctx, hint)


# -- names --------------------------------------------------------------------------------------

HOSTILE = [
    "../x",
    "a/b",
    "",
    "x" * 200,
    "..",
    ".",
    "/",
    "../../config",
    "w0/../../config",
    "../w0:latest",
    ":latest",
    "w0/",
    "/etc/passwd",
    "a\x00b",
    "w0\\..\\config",
    "é",
    "-w",
]


@pytest.fixture
def watched() -> tuple[Repository, FaultyStore, Manifest]:
    store = FaultyStore(MemoryStore())
    repo = Repository.open(store, create=True)
    m = repo.save([make_block(0, "bfloat16", (4, 8), 0)], worker_id="w0", namespace=NS, pins=sample_pins())
    store.log.clear()
    return repo, store, m


def _touched_outside_manifests(store: FaultyStore) -> list[tuple[str, str]]:
    return [
        (meth, n)
        for meth, n in store.log
        if meth in ("get", "stat", "delete", "put") and not n.startswith("manifests/")
    ]


@pytest.mark.parametrize("worker", HOSTILE)
def test_hostile_worker_ids(watched: tuple[Repository, FaultyStore, Manifest], worker: str) -> None:
    repo, store, _ = watched
    before = {o.name for o in store.inner.list("")}
    with pytest.raises(ConfigError, match="worker id"):
        repo.save([make_block(1, "bfloat16", (4,), 1)], worker_id=worker, namespace=NS, pins=sample_pins())
    if worker:
        with pytest.raises(ConfigError):
            repo.list(worker)
    assert {o.name for o in store.inner.list("")} == before
    assert not [e for e in store.log if e[0] == "put"]


@pytest.mark.parametrize("ref", HOSTILE)
def test_hostile_checkpoint_refs(watched: tuple[Repository, FaultyStore, Manifest], ref: str) -> None:
    repo, store, m = watched
    for call in (repo.resolve, repo.manifest, lambda r: list(repo.load(r)), repo.verify, repo.delete):
        with pytest.raises((ConfigError, CheckpointNotFound)):
            call(ref)
    assert _touched_outside_manifests(store) == []
    assert repo.list()
    assert repo.list()[0].id == m.id
    assert repo.resolve(f"w0/{m.id}").id == m.id


# -- blocks -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Block(key(1), b"\x00" * 3, "bfloat16", (2,)), "do not fit"),
        (lambda: Block(key(1), b"\x00" * 4, "bfloat16", (3,)), "do not fit"),
        (lambda: Block(key(1), b"\x00" * 8, "float32", (2, 2)), "do not fit"),
        (lambda: Block(key(1), b"\x00" * 2, "float8_e4m3fn", (1,)), "do not fit"),
        (lambda: Block(key(1), b"", "bfloat16", (-1,)), "non-negative"),
        (lambda: Block(key(1), b"\x00\x00", "bfloat16", (1.0,)), "non-negative"),  # type: ignore[arg-type]
        (lambda: Block(b"", b"\x00\x00", "bfloat16", (1,)), "key"),
        (lambda: Block(b"k" * 257, b"\x00\x00", "bfloat16", (1,)), "key"),
        (lambda: Block("k", b"\x00\x00", "bfloat16", (1,)), "key"),  # type: ignore[arg-type]
        (lambda: Block(key(1), b"\x00" * 8, "complex64", (1,)), "unsupported dtype"),
        (lambda: Block(key(1), b"\x00" * 2, "bf16", (1,)), "unsupported dtype"),
        (lambda: Block(key(1), b"\x00" * 2, "torch.bfloat16", (1,)), "unsupported dtype"),
        (lambda: Block.from_tensor(key(1), torch.zeros(2, dtype=torch.complex64)), "unsupported dtype"),
        (lambda: Block.from_tensor(key(1), torch.zeros(2, dtype=torch.bool)), "unsupported dtype"),
    ],
)
def test_bad_blocks(make: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()


def test_save_refuses_what_is_not_a_block() -> None:
    repo = Repository.open(MemoryStore(), create=True)
    with pytest.raises(ConfigError, match="Block"):
        repo.save([b"bytes"], worker_id="w0", namespace=NS, pins=sample_pins())  # type: ignore[list-item]
    assert repo.list() == []


# -- stored sizes -------------------------------------------------------------------------------


def _load_collecting(base: Base) -> tuple[list[Any], list[Any]]:
    errors: list[Any] = []
    return list(base.repo.load(base.m.id, errors=errors)), errors


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("raw_length", 2 << 30, r"raw_length 2147483648 is not bfloat16 × \[2, 8, 16\] = 512 bytes"),
        ("shape", [1 << 20, 1 << 12], "exceeds the 4294967296-byte block limit"),
        ("dtype", "complex1024", "unknown dtype 'complex1024'"),
    ],
)
def test_a_stored_size_is_checked_before_anything_is_allocated(field: str, value: Any, why: str) -> None:
    """One block's size lies: that block fails, named, and the others load."""
    base = Base()
    body = copy.deepcopy(base.body)
    body["blocks"][0][field] = value
    if field == "shape":
        body["blocks"][0]["raw_length"] = 2 * (1 << 32)
    base.store.put(base.name, base.seal(body))
    loaded, errors = _load_collecting(base)
    assert len(loaded) == 3
    (failure,) = errors
    assert isinstance(failure.error, IntegrityError)
    assert re.search(why, str(failure.error)), str(failure.error)


def test_a_frame_claiming_100_gb_is_one_blocks_error_not_a_memory_error() -> None:
    """A 17-byte zstd frame declaring 100 GB behind a manifest that claims the same: refused, per block."""
    base = Base()
    body = copy.deepcopy(base.body)
    ref = body["blocks"][0]
    frame = _frame_claiming(100 * 10**9)
    pack = ref["pack"]
    data = bytearray(base.store.get(f"packs/{pack[:2]}/{pack}"))
    data[ref["offset"] : ref["offset"] + len(frame)] = frame
    base.store.put(f"packs/{pack[:2]}/{pack}", bytes(data))
    ref.update(length=len(frame), raw_length=100 * 10**9, shape=[50 * 10**9], dtype="bfloat16")
    ref["checksum"] = cks.checksum(frame)
    base.store.put(base.name, base.seal(body))
    loaded, errors = _load_collecting(base)
    assert len(loaded) == 3
    assert len(errors) == 1
    assert isinstance(errors[0].error, IntegrityError)
    assert "block limit" in str(errors[0].error)
