"""Encryption keys: where they come from and what is derived from them.

A repository key is 32 random bytes kept *outside* the repository, in a file
(mode 0600 or stricter, or it is refused) or an environment variable. Three
keys are derived from it with HKDF-SHA256, so that no single derived value
reveals another:

* the AES-256-GCM key that encrypts blobs, pack trailers, indexes and manifests;
* the blob-id key: with encryption on, blob ids are HMAC-SHA256 over the
  block's namespace and content key, so someone who can read the bucket
  cannot confirm a guessed conversation by recomputing its prefix hash;
* the key id, a short public fingerprint recorded in the repository config
  and in manifests, which tells a wrong key from a corrupt object.

Key material is never logged, never written to a manifest and never put in an
exception message.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ckpt.errors import ConfigError, IntegrityError, KeyMismatch

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
AEAD_OVERHEAD = NONCE_BYTES + TAG_BYTES
ALG = "aes-256-gcm"

Buffer = bytes | bytearray | memoryview


def _derive(master: bytes, info: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info.encode()).derive(master)


def _parse_key_text(raw: bytes, where: str) -> bytes:
    """Accept 32 raw bytes, 64 hex digits or base64 of 32 bytes."""
    if len(raw) == KEY_BYTES:
        return raw
    text = raw.strip()
    for decode in (binascii.unhexlify, base64.b64decode):
        try:
            key = decode(text)
        except (binascii.Error, ValueError):
            continue
        if len(key) == KEY_BYTES:
            return key
    raise ConfigError(f"key from {where} is not 32 bytes (raw), 64 hex digits or base64 of 32 bytes")


def generate_key() -> str:
    """A new random key, as 64 hex digits (write it to a 0600 file)."""
    return secrets.token_hex(KEY_BYTES)


@dataclass(frozen=True)
class KeySource:
    """Where the key comes from: ``file:/path``, ``env:NAME``, or literal bytes (tests)."""

    spec: str

    @classmethod
    def parse(cls, spec: str) -> KeySource:
        if not (spec.startswith("file:") or spec.startswith("env:")):
            # Never echo the value: a user may have pasted the key itself here.
            raise ConfigError("a key source must be 'file:/path' or 'env:NAME' (key material is not accepted inline)")
        return cls(spec)

    def load(self) -> Keyring:
        kind, _, arg = self.spec.partition(":")
        if kind == "env":
            value = os.environ.get(arg)
            if not value:
                raise ConfigError(f"key source env:{arg}: the variable is not set")
            return Keyring(_parse_key_text(value.encode(), f"env:{arg}"))
        path = Path(arg)
        try:
            st = path.stat()
        except OSError as exc:
            raise ConfigError(f"key file {path}: {exc.strerror}") from exc
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError(
                f"key file {path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it"
            )
        return Keyring(_parse_key_text(path.read_bytes(), f"file {path}"))


@dataclass(frozen=True)
class Keyring:
    """The derived keys of one master key. Thread-safe."""

    master: bytes = field(repr=False)
    enc_key: bytes = field(init=False, repr=False)
    id_key: bytes = field(init=False, repr=False)
    key_id: str = field(init=False)
    _local: threading.local = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.master) != KEY_BYTES:
            raise ConfigError("a repository key must be 32 bytes")
        object.__setattr__(self, "enc_key", _derive(self.master, "gpuckpt aes-256-gcm v1"))
        object.__setattr__(self, "id_key", _derive(self.master, "gpuckpt blob-id v1"))
        object.__setattr__(self, "key_id", _derive(self.master, "gpuckpt key-id v1").hex()[:16])
        object.__setattr__(self, "_local", threading.local())

    def blob_mac(self, message: bytes) -> str:
        return hmac.new(self.id_key, message, hashlib.sha256).hexdigest()

    def config_mac(self, message: bytes) -> str:
        """Authenticates the repository's plain ``config`` (its pack size and the rest)."""
        return hmac.new(_derive(self.master, "gpuckpt config-mac v1"), message, hashlib.sha256).hexdigest()

    def seal(self, data: Buffer, aad: bytes) -> bytearray:
        """Encrypt and authenticate: returns nonce | ciphertext | tag.

        Uses the streaming encryptor with ``update_into`` (the one-shot API
        copies more). A fresh random 96-bit nonce per call: with at most 2^32
        messages per key the collision risk stays below 2^-32.
        """
        nonce = secrets.token_bytes(NONCE_BYTES)
        n = len(memoryview(data).cast("B"))
        # update_into needs room for a block more than the input.
        out = bytearray(NONCE_BYTES + n + 15 + TAG_BYTES)
        out[:NONCE_BYTES] = nonce
        enc = Cipher(algorithms.AES(self.enc_key), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(aad)
        mv = memoryview(out)
        written = enc.update_into(data, mv[NONCE_BYTES:])
        enc.finalize()
        end = NONCE_BYTES + written
        mv[end : end + TAG_BYTES] = enc.tag
        mv.release()
        del out[end + TAG_BYTES :]
        return out

    def open(self, sealed: Buffer, aad: bytes, *, obj: str, blob: str | None = None) -> bytearray:
        """Decrypt and verify; IntegrityError names the object if authentication fails."""
        mv = memoryview(sealed).cast("B")
        if len(mv) < AEAD_OVERHEAD:
            raise IntegrityError(f"encrypted data in {obj} is truncated ({len(mv)} bytes)", obj=obj, blob=blob)
        nonce, body, tag = mv[:NONCE_BYTES], mv[NONCE_BYTES:-TAG_BYTES], mv[-TAG_BYTES:]
        dec = Cipher(algorithms.AES(self.enc_key), modes.GCM(bytes(nonce), bytes(tag))).decryptor()
        dec.authenticate_additional_data(aad)
        out = bytearray(len(body) + 15)
        written = dec.update_into(body, out)
        try:
            dec.finalize()
        except InvalidTag:
            where = f"blob {blob} in {obj}" if blob else obj
            raise IntegrityError(
                f"authentication failed for {where}: the data was modified or was not written with this key",
                obj=obj,
                blob=blob,
            ) from None
        del out[written:]
        return out

    # The repository config stores a sealed known string: opening it proves
    # the key is the repository's key (KeyMismatch) before any data is read.
    _CHECK = b"gpuckpt key check v1"

    def make_check(self) -> str:
        return base64.b64encode(bytes(self.seal(self._CHECK, b"key-check"))).decode()

    def verify_check(self, check: str, expected_key_id: str) -> None:
        if not hmac.compare_digest(self.key_id, expected_key_id):
            raise KeyMismatch(f"the key given (id {self.key_id}) is not this repository's key (id {expected_key_id})")
        try:
            ok = self.open(base64.b64decode(check), b"key-check", obj="config") == self._CHECK
        except (IntegrityError, binascii.Error, ValueError):
            ok = False
        if not ok:
            raise KeyMismatch("the key given does not open this repository's key check")
