"""Encryption keys: where they come from and what is derived from them.

A repository key is 32 random bytes kept *outside* the repository, in a file
or an environment variable (:class:`KeySource`, which says what it accepts).
Keys are derived from it with HKDF-SHA256, so that no single derived value
reveals another:

* the AES-256-GCM key of format-v1 sealed messages (read only, and the
  repository's key check): today every message is sealed under a key of its
  own, derived from the repository key and a random salt stored with it
  (:meth:`Keyring.seal`, FORMAT.md §10.1);
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
import errno
import hashlib
import hmac
import os
import secrets
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ckpt.errors import ConfigError, IntegrityError, KeyMismatch, UnsupportedVersion

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
ALG = "aes-256-gcm"

#: Sealed-message formats (FORMAT.md §10.1). 1: ``nonce(12) | ct | tag(16)``
#: under the one repository AES key. 2: ``0x02 | salt(32) | ct | tag(16)``
#: under a key and nonce derived for that message alone.
SEAL_V1 = 1
SEAL_V2 = 2
#: what writers use
SEAL_VERSION = SEAL_V2
SEAL_VERSIONS = (SEAL_V1, SEAL_V2)
SALT_BYTES = 32
#: bytes a sealed message adds to its plaintext, per seal version
SEAL_OVERHEAD = {SEAL_V1: NONCE_BYTES + TAG_BYTES, SEAL_V2: 1 + SALT_BYTES + TAG_BYTES}
AEAD_OVERHEAD = SEAL_OVERHEAD[SEAL_V1]

#: What a sealed message is for; part of its key derivation (v2), so bytes
#: sealed as one kind never open as another even under equal additional data.
Purpose = Literal["blob", "document", "pack-trailer"]

#: a key file larger than this is not read: it cannot be a key
_KEY_FILE_MAX = 4096

Buffer = bytes | bytearray | memoryview


def _derive(master: bytes, info: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info.encode()).derive(master)


def _is_text(raw: bytes) -> bool:
    return all(0x20 <= c < 0x7F or c in b"\t\r\n" for c in raw)


def _parse_key_bytes(raw: bytes, where: str, *, allow_raw: bool) -> bytes:
    """The key in ``raw``; ConfigError naming ``where`` and the cause if it holds none.

    Accepted, and nothing else (FORMAT.md §10):

    * text: 64 hex digits, or standard padded base64 of 32 bytes (44
      characters), followed by at most one line end (``\\n`` or ``\\r\\n``);
    * binary (files only, ``allow_raw``): exactly 32 bytes that are not all
      printable text. 32 bytes of text are refused rather than guessed at: they
      are a passphrase (or a short key and a newline), not 32 random bytes,
      and a random key is all text with probability (98/256)^32 < 2^-44.

    A passphrase is never a key: nothing here stretches one.
    """
    if len(raw) == KEY_BYTES and not _is_text(raw):
        if allow_raw:
            return raw
        raise ConfigError(
            f"{where} holds {KEY_BYTES} binary bytes; a key in the environment must be 64 hex digits or base64"
        )
    if not _is_text(raw):
        raise ConfigError(
            f"{where} holds {len(raw)} bytes that are not text: a binary key is exactly "
            f"{KEY_BYTES} bytes; a text key is 64 hex digits or base64 of {KEY_BYTES} bytes"
        )
    text = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw
    if len(text) == 64:
        try:
            return binascii.unhexlify(text)
        except (binascii.Error, ValueError):
            pass
    elif len(text) == 44:
        try:
            key = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            pass
        else:
            if len(key) == KEY_BYTES:
                return key
    # Never echo the text: it is key material, or a passphrase.
    if len(raw) == KEY_BYTES:
        cause = (
            f"holds {KEY_BYTES} bytes of text, which is ambiguous: a binary key is {KEY_BYTES} random bytes, "
            "a text key is 64 hex digits or base64 of 32 bytes (a passphrase is not accepted)"
        )
    elif text != text.strip() or b"\n" in text or b"\r" in text:
        cause = "holds whitespace or lines besides the key (only one trailing newline is allowed)"
    else:
        cause = (
            f"holds {len(text)} characters of text that are neither 64 hex digits nor base64 of 32 bytes "
            "(a passphrase is not accepted)"
        )
    raise ConfigError(f"{where} {cause}; make a key with 'gpuckpt key generate PATH'")


def _read_key_file(path: Path) -> bytes:
    """The bytes of a key file, refused unless only its owner (this user, or root) can use it.

    The file is opened without following a final symlink and checked through
    the open descriptor (no window between the check and the read): it must be
    a regular file owned by the effective user or root, with no group or other
    permission bits. The one exception is a Kubernetes Secret volume's entry
    (:func:`_secret_volume_entry`): its link is followed, and its file may be
    readable by a group this process is in (the pod's fsGroup), never written.
    """
    group_read = False
    try:
        # O_NONBLOCK: a FIFO planted at the path must not hang the open; it is refused below.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise ConfigError(f"key file {path}: {exc.strerror}") from None
        target = _secret_volume_entry(path)
        if target is None:
            raise ConfigError(f"key file {path} is a symbolic link; name the file itself") from None
        try:
            fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc2:
            raise ConfigError(f"key file {path} ({target}): {exc2.strerror}") from None
        group_read = True
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"key file {path} is not a regular file")
        uid = os.geteuid()
        if st.st_uid not in (uid, 0):
            raise ConfigError(f"key file {path} is owned by uid {st.st_uid}, not by this user (uid {uid}) or root")
        mode = stat.S_IMODE(st.st_mode)
        # A Secret volume's file is root's: a non-root agent reads it through the pod's fsGroup
        # (mode 0440 / 0040), a group only the pods' containers that mount the volume can use.
        allowed = 0o040 if group_read and st.st_gid in {os.getegid(), *os.getgroups()} else 0
        if mode & 0o077 & ~allowed:
            raise ConfigError(f"key file {path} is open to group or others (mode {mode:04o}); chmod 600 {path}")
        if st.st_size > _KEY_FILE_MAX:
            raise ConfigError(f"key file {path} is {st.st_size} bytes, too large to be a key")
        chunks = []
        total = 0
        while total <= _KEY_FILE_MAX:
            chunk = os.read(fd, _KEY_FILE_MAX + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > _KEY_FILE_MAX:
            raise ConfigError(f"key file {path} is too large to be a key")
        return b"".join(chunks)
    except OSError as exc:
        raise ConfigError(f"key file {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def _secret_volume_entry(path: Path) -> Path | None:
    """The file a Kubernetes Secret (or ConfigMap / projected) volume entry names, or ``None``.

    The kubelet writes such volumes atomically: ``<dir>/<name>`` is a symlink to
    ``..data/<name>``, ``..data`` a symlink to ``..<timestamp>``, a directory beside it that holds
    the files. Only exactly that shape is followed — every link relative and inside ``<dir>``, the
    versioned directory a real directory owned by this user or root and writable by nobody
    else — so a link elsewhere is still refused.
    """
    try:
        if os.readlink(path) != f"..data/{path.name}":
            return None
        version = os.readlink(path.parent / "..data")
        if "/" in version or not version.startswith("..") or version in ("..", "..data"):
            return None
        st = os.lstat(path.parent / version)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o022:
        return None
    return path.parent / version / path.name


def generate_key() -> str:
    """A new random key, as 64 hex digits (write it to a 0600 file)."""
    return secrets.token_hex(KEY_BYTES)


@dataclass(frozen=True)
class KeySource:
    """Where the key comes from: ``file:/path`` or ``env:NAME``.

    A key file holds 64 hex digits or base64 of 32 bytes (one trailing
    newline allowed), or exactly 32 bytes that are not all text; it must be a
    regular file (not a symlink) owned by this user or root, without group or
    other permissions (FORMAT.md §10). A variable holds the text forms only.
    Anything else is a ConfigError naming the source and the cause (never
    the value).
    """

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
            value = os.environb.get(arg.encode())
            if not value:
                raise ConfigError(f"key source env:{arg}: the variable is not set")
            return Keyring(_parse_key_bytes(value, f"env:{arg}", allow_raw=False))
        path = Path(arg)
        return Keyring(_parse_key_bytes(_read_key_file(path), f"key file {path}", allow_raw=True))


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

    def _message_key(self, salt: bytes, purpose: Purpose) -> tuple[bytes, bytes]:
        """Seal v2: the AES-256 key and GCM nonce of the one message sealed with ``salt``."""
        okm = HKDF(
            algorithm=hashes.SHA256(),
            length=KEY_BYTES + NONCE_BYTES,
            salt=salt,
            info=f"gpuckpt seal v2 {purpose}".encode(),
        ).derive(self.master)
        return okm[:KEY_BYTES], okm[KEY_BYTES:]

    def seal(self, data: Buffer, aad: bytes, *, purpose: Purpose = "blob", version: int = SEAL_VERSION) -> bytearray:
        """Encrypt ``data`` and authenticate it with ``aad``; returns the sealed message.

        Version 2, what writers use: ``0x02 | salt(32) | ciphertext | tag(16)``.
        The AES-256-GCM key and nonce are HKDF-SHA256 of the repository key
        with a fresh random salt and the context ``"gpuckpt seal v2 <purpose>"``:
        each message has a key of its own, so GCM's limit of 2^32 random nonces
        per key does not apply, and two messages share a key only if their
        salts collide (probability below n^2 / 2^257 for n messages; FORMAT.md
        §10.1). Nothing outside the message (its pack, its object name) enters
        the derivation, so sealed bytes copied verbatim elsewhere still open.

        Version 1: ``nonce(12) | ciphertext | tag(16)`` with a random nonce
        under the repository AES key; written only for the key check (one
        message per repository).

        Uses the streaming encryptor with ``update_into`` (the one-shot API
        copies more).
        """
        if version == SEAL_V2:
            salt = secrets.token_bytes(SALT_BYTES)
            key, nonce = self._message_key(salt, purpose)
            head = bytes([SEAL_V2]) + salt
        elif version == SEAL_V1:
            key, nonce = self.enc_key, secrets.token_bytes(NONCE_BYTES)
            head = nonce
        else:
            raise ValueError(f"no seal version {version!r} (known: {SEAL_VERSIONS})")
        h = len(head)
        n = memoryview(data).nbytes
        # update_into needs room for a block more than the input.
        out = bytearray(h + n + 15 + TAG_BYTES)
        out[:h] = head
        enc = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(aad)
        mv = memoryview(out)
        written = enc.update_into(data, mv[h:])
        enc.finalize()
        end = h + written
        mv[end : end + TAG_BYTES] = enc.tag
        mv.release()
        del out[end + TAG_BYTES :]
        return out

    def open(
        self,
        sealed: Buffer,
        aad: bytes,
        *,
        obj: str,
        blob: str | None = None,
        purpose: Purpose = "blob",
        version: int = SEAL_VERSION,
    ) -> bytearray:
        """Decrypt and verify a message sealed by :meth:`seal` with this ``purpose`` and ``version``.

        The version comes from the metadata that describes the message (the
        codec configuration, the envelope, the pack header), never from the
        message: a version-1 message starts with random bytes. Raises
        UnsupportedVersion for an unknown version and IntegrityError naming
        ``obj`` (and ``blob``) for a truncated message, a missing version-2
        marker or failed authentication (a modified salt, nonce, ciphertext
        or tag, other additional data, or another key).
        """
        mv = memoryview(sealed).cast("B")
        where = f"blob {blob} in {obj}" if blob else obj
        if version not in SEAL_VERSIONS:
            raise UnsupportedVersion(f"sealed data of {where}", version, SEAL_VERSIONS)
        overhead = SEAL_OVERHEAD[version]
        if len(mv) < overhead:
            raise IntegrityError(
                f"encrypted data of {where} is truncated ({len(mv)} bytes; a version-{version} sealed message "
                f"has at least {overhead})",
                obj=obj,
                blob=blob,
            )
        if version == SEAL_V2:
            if mv[0] != SEAL_V2:
                raise IntegrityError(
                    f"encrypted data of {where} is not a version-2 sealed message "
                    f"(first byte {mv[0]:#04x}, expected {SEAL_V2:#04x})",
                    obj=obj,
                    blob=blob,
                )
            start = 1 + SALT_BYTES
            key, nonce = self._message_key(bytes(mv[1:start]), purpose)
        else:
            start = NONCE_BYTES
            key, nonce = self.enc_key, bytes(mv[:NONCE_BYTES])
        body, tag = mv[start:-TAG_BYTES], bytes(mv[-TAG_BYTES:])
        dec = Cipher(algorithms.AES(key), modes.GCM(nonce, tag)).decryptor()
        dec.authenticate_additional_data(aad)
        out = bytearray(len(body) + 15)
        written = dec.update_into(body, out)
        try:
            dec.finalize()
        except InvalidTag:
            raise IntegrityError(
                f"authentication failed for {where}: the data was modified or was not written with this key",
                obj=obj,
                blob=blob,
            ) from None
        del out[written:]
        return out

    # The repository config stores a sealed known string: opening it proves
    # the key is the repository's key (KeyMismatch) before any data is read.
    # It stays a version-1 message: one per repository is far from any nonce
    # limit, and configs keep opening in every gpuckpt that reads this format.
    _CHECK = b"gpuckpt key check v1"

    def make_check(self) -> str:
        return base64.b64encode(bytes(self.seal(self._CHECK, b"key-check", version=SEAL_V1))).decode()

    def verify_check(self, check: str, expected_key_id: str) -> None:
        if not hmac.compare_digest(self.key_id, expected_key_id):
            raise KeyMismatch(f"the key given (id {self.key_id}) is not this repository's key (id {expected_key_id})")
        try:
            ok = self.open(base64.b64decode(check), b"key-check", obj="config", version=SEAL_V1) == self._CHECK
        except (IntegrityError, binascii.Error, ValueError):
            ok = False
        if not ok:
            raise KeyMismatch("the key given does not open this repository's key check")
