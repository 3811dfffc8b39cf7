"""The document envelope's one-pass reading (``ckpt.document.open_canonical``).

A plain document stores its body as the canonical text, last, so a reader
checks the checksum over the stored bytes and parses them once. Every other
layout — documents written before, by hand, or damaged — goes through the
full reading and gets the same verdict it always had.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from ckpt import Keyring, document
from ckpt.checksum import ALGORITHM, checksum
from ckpt.errors import FormatError, IntegrityError

KIND = "gpuckpt-index"
NAME = "index/ab"
BODY = {"zeta": [1, 2, {"b": "ü", "a": None}], "alpha": {"y": 1.5, "x": "text"}}


def open_both(data: bytes, keyring: Keyring | None = None) -> tuple[bytes, dict[str, Any]]:
    text = document.open_canonical(data, kind=KIND, supported=(1, 2), name=NAME, keyring=keyring)[1]
    body = document.open_envelope(data, kind=KIND, supported=(1, 2), name=NAME, keyring=keyring)[1]
    return text, body


def test_a_plain_document_stores_its_canonical_text_and_is_read_from_it() -> None:
    data = document.seal(KIND, 2, NAME, BODY, None)
    canon = document.canonical(BODY)
    assert data.endswith(b',"body":' + canon + b"}")
    assert json.loads(data)["body"] == BODY  # still one readable JSON object
    text, body = open_both(data)
    assert text == canon
    assert body == BODY


def test_a_document_in_the_earlier_layout_still_reads() -> None:
    # written before: the body in the writer's own key order, so its bytes are not the checksummed text
    env = {"format": KIND, "version": 2, "checksum": f"{ALGORITHM}:{checksum(document.canonical(BODY))}", "body": BODY}
    data = json.dumps(env, separators=(",", ":"), ensure_ascii=False).encode()
    assert document.canonical(BODY) not in data
    text, body = open_both(data)
    assert text == document.canonical(BODY)
    assert body == BODY


def test_a_changed_body_fails_its_checksum_by_either_reading() -> None:
    data = document.seal(KIND, 2, NAME, BODY, None).replace(b'"text"', b'"tent"')
    for read in (document.open_canonical, document.open_envelope):
        with pytest.raises(IntegrityError, match="checksum mismatch"):
            read(data, kind=KIND, supported=(1, 2), name=NAME, keyring=None)


@pytest.mark.parametrize(
    ("mangle", "error", "why"),
    [
        (lambda d: d.replace(KIND.encode(), b"gpuckpt-other", 1), FormatError, "format is"),
        (lambda d: d.replace(b'"version":2', b'"version":9', 1), FormatError, "version"),
        (lambda d: d[:-1], FormatError, "not valid JSON"),
        (lambda d: d.replace(b'"checksum"', b'"checksun"', 1), FormatError, "unexpected or missing fields"),
    ],
)
def test_a_malformed_envelope_gets_the_full_readings_verdict(mangle, error: type, why: str) -> None:  # type: ignore[no-untyped-def]
    data = mangle(document.seal(KIND, 2, NAME, BODY, None))
    with pytest.raises(error, match=why):
        document.open_canonical(data, kind=KIND, supported=(1, 2), name=NAME, keyring=None)


def test_a_plain_document_in_an_encrypted_repository_is_refused_however_well_formed() -> None:
    data = document.seal(KIND, 2, NAME, BODY, None)
    with pytest.raises(IntegrityError, match="plain document in an encrypted repository"):
        document.open_canonical(data, kind=KIND, supported=(1, 2), name=NAME, keyring=Keyring(os.urandom(32)))


def test_an_encrypted_document_hands_back_its_decrypted_canonical_text() -> None:
    k = Keyring(os.urandom(32))
    data = document.seal(KIND, 2, NAME, BODY, k)
    text, body = open_both(data, k)
    assert text == document.canonical(BODY)
    assert body == BODY
    with pytest.raises(IntegrityError):  # moved under another name: the AEAD's additional data differs
        document.open_canonical(data, kind=KIND, supported=(1, 2), name="index/cd", keyring=k)
