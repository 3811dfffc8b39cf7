"""Today's reader reads every supported format version, from committed fixtures.

tests/fixtures/format-v1 was written by tests/fixtures/make_format_v1.py when
v1 was current and is never regenerated.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from ckpt import Keyring, Repository
from ckpt.errors import UnsupportedVersion
from tests.fixtures.make_format_v1 import KEY_HEX

FIXTURES = Path(__file__).parent / "fixtures" / "format-v1"


@pytest.fixture
def expected() -> dict[str, str]:
    data: dict[str, str] = json.loads((FIXTURES / "expected.json").read_text())
    return data


@pytest.mark.parametrize("variant", ["plain", "encrypted"])
def test_v1_fixture_loads_bit_exact(variant: str, expected: dict[str, str], tmp_path: Path) -> None:
    # Work on a copy: the reader must never need to write, but be safe.
    root = tmp_path / variant
    shutil.copytree(FIXTURES / variant, root)
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
    report = repo.verify()
    assert report.ok, report.problems
    assert report.checked_packs >= 1


def test_a_future_version_is_refused_by_name(tmp_path: Path) -> None:
    root = tmp_path / "plain"
    shutil.copytree(FIXTURES / "plain", root)
    m = next((root / "manifests" / "fixture-worker").iterdir())
    doc = json.loads(m.read_text())
    doc["version"] = 2
    m.write_text(json.dumps(doc))
    repo = Repository.open(str(root))
    with pytest.raises(UnsupportedVersion) as ei:
        repo.manifest(m.name)
    assert "version 2" in str(ei.value)
    assert m.name in str(ei.value)
    assert ei.value.supported == (1,)
