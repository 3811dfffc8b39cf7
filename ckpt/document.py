"""The envelope every stored JSON document (config, index, manifest) is wrapped in.

Plain::

    {"format": KIND, "version": V, "checksum": "xxh3-128:<hex>", "body": {...}}

Encrypted (repository with a key)::

    {"format": KIND, "version": V, "encryption": {"alg": "aes-256-gcm", "key_id": ID, "seal": 2},
     "ciphertext": "<base64 of the sealed canonical body>"}

``seal`` names the sealed-message format (FORMAT.md §10.1): 2, what writers
use, is ``0x02 | salt | AES-GCM(canonical body) | tag`` under a key derived
for this document alone; absent means 1 (format v1 documents), ``nonce |
AES-GCM(canonical body) | tag`` under the repository AES key.

The checksum and the AEAD both cover the *canonical* JSON of the body (keys
sorted, no whitespace, UTF-8). A plain document stores the body as that
text, last, so a reader checks the checksum over the stored bytes; one
stored otherwise (written before, or by another writer) is parsed and
serialized canonically again. The
AEAD's additional data is ``KIND/VERSION/NAME``, binding a document to its
object name: a manifest copied under another name fails authentication.
Readers check ``format`` and refuse a ``version`` they do not know before
looking at anything else, and refuse documents over a size limit before
parsing them.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from ckpt.checksum import ALGORITHM, checksum
from ckpt.errors import FormatError, IntegrityError, KeyMismatch, KeyMissing, UnsupportedVersion
from ckpt.keys import ALG, SEAL_V1, SEAL_VERSION, SEAL_VERSIONS, Keyring

#: Kinds that are always plain: they hold no user data.
_PLAIN_KINDS = frozenset({"gpuckpt-repository", "gpuckpt-lock"})


def canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


#: where a plain envelope's body starts, as writers lay it out (last; see :func:`seal`)
_BODY = b',"body":'


def _aad(kind: str, version: int, name: str) -> bytes:
    return f"{kind}/{version}/{name}".encode()


def seal(kind: str, version: int, name: str, body: dict[str, Any], keyring: Keyring | None) -> bytes:
    """Serialize ``body`` into an envelope for object ``name``."""
    canon = canonical(body)
    env: dict[str, Any] = {"format": kind, "version": version}
    if keyring is None:
        env["checksum"] = f"{ALGORITHM}:{checksum(canon)}"
        # The body is embedded as its canonical text itself, last: the file is readable JSON, and
        # a reader can check the checksum over those very bytes and parse them once
        # (open_canonical), instead of parsing the envelope and serializing the body again.
        head = json.dumps(env, separators=(",", ":"), ensure_ascii=False).encode()
        return head[:-1] + _BODY + canon + b"}"
    sealed = keyring.seal(canon, _aad(kind, version, name), purpose="document", version=SEAL_VERSION)
    env["encryption"] = {"alg": ALG, "key_id": keyring.key_id, "seal": SEAL_VERSION}
    env["ciphertext"] = base64.b64encode(bytes(sealed)).decode()
    return json.dumps(env, separators=(",", ":")).encode()


def _plain_text(
    data: bytes, *, kind: str, supported: tuple[int, ...], keyring: Keyring | None
) -> tuple[int, bytes] | None:
    """A plain envelope laid out as :func:`seal` writes it, whose checksum holds over its body's
    bytes as stored: (version, those bytes). None for anything else (another layout, a body
    stored in another order, any fault), which :func:`open_envelope`'s full reading judges."""
    i = data.find(_BODY)
    if i <= 0 or not data.endswith(b"}") or (keyring is not None and kind not in _PLAIN_KINDS):
        return None
    try:
        head = json.loads(data[:i] + b"}")
    except (ValueError, RecursionError):
        return None
    if not isinstance(head, dict) or set(head) != {"format", "version", "checksum"}:
        return None
    version, expected = head["version"], head["checksum"]
    if head["format"] != kind or type(version) is not int or version not in supported:
        return None
    if not isinstance(expected, str) or not expected.startswith(ALGORITHM + ":"):
        return None
    text = data[i + len(_BODY) : -1]
    if checksum(text) != expected.split(":", 1)[1]:
        return None
    return version, text


def open_canonical(
    data: bytes,
    *,
    kind: str,
    supported: tuple[int, ...],
    name: str,
    keyring: Keyring | None,
    error: type[FormatError] = FormatError,
) -> tuple[int, bytes]:
    """Check and (if needed) decrypt an envelope; returns (version, the body's canonical JSON
    text), verified — its checksum or AEAD tag checked — but not parsed: a caller with a schema
    parses it once (a 9,000-block manifest: one pass instead of three). Raises as
    :func:`open_envelope` does."""
    fast = _plain_text(data, kind=kind, supported=supported, keyring=keyring)
    if fast is not None:
        return fast
    version, body, canon = _open(data, kind=kind, supported=supported, name=name, keyring=keyring, error=error)
    return version, canon if canon is not None else canonical(body)


def open_envelope(
    data: bytes,
    *,
    kind: str,
    supported: tuple[int, ...],
    name: str,
    keyring: Keyring | None,
    error: type[FormatError] = FormatError,
) -> tuple[int, dict[str, Any]]:
    """Parse, check and (if needed) decrypt an envelope; returns (version, body).

    Raises ``error`` (a FormatError) for malformed documents,
    UnsupportedVersion for unknown versions, IntegrityError for checksum or
    authentication failures, KeyMissing/KeyMismatch for key problems.
    """
    version, body, _ = _open(data, kind=kind, supported=supported, name=name, keyring=keyring, error=error)
    return version, body


def _open(
    data: bytes,
    *,
    kind: str,
    supported: tuple[int, ...],
    name: str,
    keyring: Keyring | None,
    error: type[FormatError],
) -> tuple[int, dict[str, Any], bytes | None]:
    """The full reading (FORMAT.md §4.2): (version, body, the decrypted canonical text or None)."""
    canon: bytes | None = None
    try:
        env = json.loads(data)
    except (ValueError, RecursionError) as exc:  # ValueError: also ints over 4300 digits
        raise error(f"{name}: not valid JSON ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(env, dict):
        raise error(f"{name}: expected a JSON object, got {type(env).__name__}")
    if env.get("format") != kind:
        raise error(f"{name}: format is {env.get('format')!r}, expected {kind!r}")
    version = env.get("version")
    if type(version) is not int or version not in supported:
        raise UnsupportedVersion(name, version, supported)
    if "ciphertext" in env:
        enc = env.get("encryption")
        if (
            not isinstance(enc, dict)
            or enc.get("alg") != ALG
            or not isinstance(enc.get("key_id"), str)
            or not set(enc) <= {"alg", "key_id", "seal"}
        ):
            raise error(f"{name}: malformed encryption header {enc!r}")
        seal_version = enc.get("seal", SEAL_V1)
        if type(seal_version) is not int or seal_version not in SEAL_VERSIONS:
            raise UnsupportedVersion(f"{name}: sealed body", seal_version, SEAL_VERSIONS)
        if set(env) != {"format", "version", "encryption", "ciphertext"}:
            raise error(f"{name}: unexpected fields {sorted(set(env))}")
        if keyring is None:
            raise KeyMissing(f"{name} is encrypted (key {enc['key_id']}) and no key was given")
        if keyring.key_id != enc["key_id"]:
            raise KeyMismatch(f"{name} is encrypted with key {enc['key_id']}, the key given is {keyring.key_id}")
        ct = env["ciphertext"]
        if not isinstance(ct, str):
            raise error(f"{name}: ciphertext must be a string")
        try:
            raw = base64.b64decode(ct, validate=True)
        except (binascii.Error, ValueError):
            raise IntegrityError(f"{name}: ciphertext is not valid base64", obj=name) from None
        canon = bytes(keyring.open(raw, _aad(kind, version, name), obj=name, purpose="document", version=seal_version))
        try:
            body = json.loads(canon)
        except (ValueError, RecursionError) as exc:
            raise error(f"{name}: decrypted body is not JSON ({exc})") from None
    else:
        if set(env) != {"format", "version", "checksum", "body"}:
            raise error(f"{name}: unexpected or missing fields {sorted(set(env))}")
        if keyring is not None and kind not in _PLAIN_KINDS:
            # An encrypted repository never writes plain documents: a plain
            # one is a downgrade attempt or debris from elsewhere.
            raise IntegrityError(f"{name}: plain document in an encrypted repository", obj=name)
        body = env["body"]
        expected = env["checksum"]
        if not isinstance(expected, str) or not expected.startswith(ALGORITHM + ":"):
            raise error(f"{name}: malformed checksum field {expected!r}")
        try:
            got = checksum(canonical(body))
        except (TypeError, ValueError, RecursionError) as exc:
            raise error(f"{name}: body cannot be serialized ({exc})") from None
        if got != expected.split(":", 1)[1]:
            raise IntegrityError(
                f"{name}: checksum mismatch: the document was modified or corrupted "
                f"(expected {expected}, got {ALGORITHM}:{got})",
                obj=name,
            )
    if not isinstance(body, dict):
        raise error(f"{name}: body must be a JSON object")
    return version, body, canon
