"""Today's reader reads every supported format version, from committed fixtures.

tests/fixtures/format-v1 and format-v2 were written by
tests/fixtures/make_format_v1.py and make_format_v2.py when each was current
and are never regenerated. Both hold the same blocks under the same key.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from ckpt import Keyring, Repository
from ckpt.errors import UnsupportedVersion
from tests.fixtures.make_format_v1 import KEY_HEX

ROOT = Path(__file__).parent / "fixtures"
FIXTURES = ROOT / "format-v1"
FORMATS = {"v1": ROOT / "format-v1", "v2": ROOT / "format-v2", "v3": ROOT / "format-v3"}
#: what each format writes: pack header version, index document version, manifest version, seal version
WRITES = {"v1": (1, 1, 1, 1), "v2": (2, 2, 2, 2), "v3": (2, 3, 2, 2)}


@pytest.fixture
def expected() -> dict[str, str]:
    data: dict[str, str] = json.loads((FIXTURES / "expected.json").read_text())
    for fmt in ("v2", "v3"):
        assert json.loads((FORMATS[fmt] / "expected.json").read_text()) == data
    return data


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("variant", ["plain", "encrypted"])
def test_fixture_loads_bit_exact(fmt: str, variant: str, expected: dict[str, str], tmp_path: Path) -> None:
    # Work on a copy: the reader must never need to write, but be safe.
    root = tmp_path / variant
    shutil.copytree(FORMATS[fmt] / variant, root)
    key = Keyring(bytes.fromhex(KEY_HEX)) if variant == "encrypted" else None
    repo = Repository.open(str(root), key=key)
    cps = repo.list("fixture-worker")
    assert len(cps) == 2
    codecs_seen = set()
    for cp in cps:
        m = repo.manifest(cp.id)
        assert m.ledger is not None
        assert m.ledger.data == {"requests": [{"id": "r1", "tokens": [1, 2]}]}
        codecs_seen |= {c.name for pipeline in m.codecs for c in pipeline}
        got = {b.key.hex(): hashlib.sha256(bytes(b.data)).hexdigest() for b in repo.load(m)}
        assert got == expected
    assert {"byteplane", "zstd"} <= codecs_seen
    if variant == "encrypted":
        assert "aes-256-gcm" in codecs_seen
    report = repo.verify(read_data=True)
    assert report.ok, report.problems
    assert report.checked_packs >= 1


def _stored(root: Path, kinds: tuple[str, ...] = ("index", "manifests")) -> tuple[list[bytes], list[dict[str, Any]]]:
    packs = [p.read_bytes() for p in sorted((root / "packs").rglob("*")) if p.is_file()]
    docs = [json.loads(p.read_bytes()) for d in kinds for p in sorted((root / d).rglob("*")) if p.is_file()]
    return packs, docs


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fixture_bytes_are_of_their_format(fmt: str) -> None:
    """Each committed fixture holds what its format writes, so the loads above
    exercise that format's reader: v1 with random-nonce seals under the one
    key, v2 with a marker and salt per message."""
    pack_version, index_version, manifest_version, seal = WRITES[fmt]
    for variant in ("plain", "encrypted"):
        packs, docs = _stored(FORMATS[fmt] / variant)
        assert packs
        assert docs
        assert {struct.unpack_from("<I", p, 8)[0] for p in packs} == {pack_version}
        assert {d["version"] for d in _stored(FORMATS[fmt] / variant, ("index",))[1]} == {index_version}
        assert {d["version"] for d in _stored(FORMATS[fmt] / variant, ("manifests",))[1]} == {manifest_version}
    _, docs = _stored(FORMATS[fmt] / "encrypted")
    for d in docs:
        assert d["encryption"].get("seal", 1) == seal
        if seal == 2:
            assert base64.b64decode(d["ciphertext"])[0] == 2


def test_a_future_version_is_refused_by_name(tmp_path: Path) -> None:
    root = tmp_path / "plain"
    shutil.copytree(FORMATS["v2"] / "plain", root)
    m = next((root / "manifests" / "fixture-worker").iterdir())
    doc = json.loads(m.read_text())
    doc["version"] = 3
    m.write_text(json.dumps(doc))
    repo = Repository.open(str(root))
    with pytest.raises(UnsupportedVersion) as ei:
        repo.manifest(m.name)
    assert "version 3" in str(ei.value)
    assert m.name in str(ei.value)
    assert ei.value.supported == (1, 2)


def test_a_future_seal_is_refused_by_name(tmp_path: Path) -> None:
    root = tmp_path / "encrypted"
    shutil.copytree(FORMATS["v2"] / "encrypted", root)
    m = next((root / "manifests" / "fixture-worker").iterdir())
    doc = json.loads(m.read_text())
    doc["encryption"]["seal"] = 3
    m.write_text(json.dumps(doc))
    repo = Repository.open(str(root), key=Keyring(bytes.fromhex(KEY_HEX)))
    with pytest.raises(UnsupportedVersion) as ei:
        repo.manifest(m.name)
    assert "version 3" in str(ei.value)
    assert m.name in str(ei.value)
    assert ei.value.supported == (1, 2)
