"""Repository URLs: a path, ``file:///path``, or ``s3://bucket/prefix[?endpoint=…&region=…]``."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

import platformdirs

from ckpt.errors import ConfigError
from ckpt.store.base import Store
from ckpt.store.local import LocalStore
from ckpt.store.retry import RetryStore

ENV_REPO = "GPUCKPT_REPO"


def default_repo_url() -> str:
    """``$GPUCKPT_REPO``, else a per-user data directory."""
    env = os.environ.get(ENV_REPO)
    if env:
        return env
    return str(Path(platformdirs.user_data_dir("gpuckpt")) / "repo")


def open_store(url: str, *, create: bool = True) -> Store:
    """Open the store a URL names. Credentials never come from the URL."""
    if not url:
        raise ConfigError("empty repository URL")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and url[1:3] == ":\\"):
        if scheme == "file":
            if parts.netloc not in ("", "localhost"):
                raise ConfigError(f"file URL {url!r} names a host; use file:///absolute/path")
            path = unquote(parts.path)
        else:
            path = url
        return LocalStore(Path(path).expanduser(), create=create)
    if scheme == "s3":
        # late on purpose: boto3 and botocore (~0.3 s to import) load only when an s3:// repository
        # is opened; a local one, and every process that imports ckpt without opening one, never pay
        from ckpt.store.s3 import S3Store

        return RetryStore(S3Store.from_url(url), attempts=3)
    raise ConfigError(f"unsupported repository URL scheme {scheme!r} in {url!r} (use a path, file://, s3://)")
