"""The repository's ``config`` object: its identity and settings (FORMAT.md §4.3).

Written once, with a conditional create, when a repository is created; read
first whenever one is opened. Always plain (it holds no secret); in an
encrypted repository it carries a key check and a MAC under the key, so a
wrong key is refused before any data is read and an edit by someone without
the key fails authentication.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ckpt import document
from ckpt.errors import ConfigError, FormatError, IntegrityError, KeyMissing, ObjectExists, RepositoryExists
from ckpt.keys import ALG, Keyring, KeySource
from ckpt.store.base import Store

log = logging.getLogger("gpuckpt.repository")

CONFIG_NAME = "config"
CONFIG_KIND = "gpuckpt-repository"
CONFIG_VERSION = 1
CONFIG_SUPPORTED = (1,)
#: bounds a reader enforces on ``config.pack_size``
PACK_SIZE_RANGE = (64 << 10, 1 << 30)
#: a new repository's pack size, and the one used where a config's cannot be trusted
DEFAULT_PACK_SIZE = 32 << 20


@dataclass(frozen=True)
class RepoConfig:
    id: str
    created: str
    pack_size: int
    encryption: dict[str, str] | None

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "pack_size": self.pack_size, "encryption": self.encryption}

    def mac_message(self) -> bytes:
        enc = {k: v for k, v in (self.encryption or {}).items() if k != "mac"}
        return document.canonical({**self.body(), "encryption": enc})

    @classmethod
    def parse(cls, body: dict[str, Any]) -> RepoConfig:
        try:
            enc = body["encryption"]
            if enc is not None and (not isinstance(enc, dict) or enc.get("alg") != ALG):
                raise FormatError(f"config: unsupported encryption {enc!r}")
            if type(body["pack_size"]) is not int:
                raise TypeError("pack_size is not an integer")
            cfg = cls(str(body["id"]), str(body["created"]), body["pack_size"], enc)
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"config: malformed ({exc})") from None
        lo, hi = PACK_SIZE_RANGE
        if not lo <= cfg.pack_size <= hi:
            raise FormatError(f"config: pack_size {cfg.pack_size} outside [{lo}, {hi}]")
        return cfg

    def authenticate(self, keyring: Keyring) -> RepoConfig:
        """An encrypted repository's config carries a MAC under the key: an edit
        (say of ``pack_size``) by someone without the key is refused. A config
        without one (written before configs were authenticated, or one whose MAC
        someone removed) is read, but nothing in it that a writer without the
        key could have chosen is used: the config returned has the default
        ``pack_size`` (a planted 64 KiB would make every save write thousands of
        packs, 1 GiB would make every save hold a gigabyte)."""
        assert self.encryption is not None
        mac = self.encryption.get("mac")
        if mac is None:
            log.warning(
                "the repository config is not authenticated (no MAC: an older gpuckpt, or removed): "
                "its pack_size is ignored",
                extra={"pack_size": self.pack_size, "used": DEFAULT_PACK_SIZE},
            )
            return dataclasses.replace(self, pack_size=DEFAULT_PACK_SIZE)
        if not hmac.compare_digest(str(mac), keyring.config_mac(self.mac_message())):
            raise IntegrityError("config: authentication failed: the repository config was modified", obj="config")
        return self


def as_keyring(key: KeySource | Keyring | str | None) -> Keyring | None:
    if key is None or isinstance(key, Keyring):
        return key
    if isinstance(key, str):
        key = KeySource.parse(key)
    return key.load()


def create_config(store: Store, keyring: Keyring | None, pack_size: int) -> RepoConfig:
    """Write a new repository's config with a conditional create: of two racing creations one
    wins, the other gets :class:`~ckpt.errors.RepositoryExists`."""
    lo, hi = PACK_SIZE_RANGE
    if not lo <= pack_size <= hi:
        raise ConfigError(f"pack_size {pack_size} outside [{lo}, {hi}]")
    enc = None
    if keyring is not None:
        enc = {"alg": ALG, "key_id": keyring.key_id, "check": keyring.make_check()}
    cfg = RepoConfig(secrets.token_hex(16), datetime.now(UTC).isoformat(), pack_size, enc)
    if keyring is not None:
        assert cfg.encryption is not None
        cfg.encryption["mac"] = keyring.config_mac(cfg.mac_message())
    data = document.seal(CONFIG_KIND, CONFIG_VERSION, CONFIG_NAME, cfg.body(), None)
    try:
        store.put(CONFIG_NAME, data, if_absent=True)
    except ObjectExists:
        raise RepositoryExists(f"a repository already exists at {store.url}") from None
    return cfg


def read_config(store: Store, data: bytes, key: KeySource | Keyring | str | None) -> tuple[RepoConfig, Keyring | None]:
    """Check a config object's bytes and the key given against it: an unknown version is
    UnsupportedVersion, an encrypted repository without a key KeyMissing, a wrong key
    KeyMismatch, a key for a plain repository ConfigError. Returns the config and the keyring."""
    _, body = document.open_envelope(data, kind=CONFIG_KIND, supported=CONFIG_SUPPORTED, name=CONFIG_NAME, keyring=None)
    cfg = RepoConfig.parse(body)
    keyring = as_keyring(key)
    if cfg.encryption is not None:
        if keyring is None:
            raise KeyMissing(
                f"the repository at {store.url} is encrypted (key {cfg.encryption.get('key_id')}); "
                "give its key (--key file:/path or env:NAME)"
            )
        keyring.verify_check(cfg.encryption["check"], cfg.encryption["key_id"])
        cfg = cfg.authenticate(keyring)
    elif keyring is not None:
        raise ConfigError(f"the repository at {store.url} is not encrypted; do not give a key")
    return cfg, keyring
