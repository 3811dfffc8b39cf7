"""The checkout's root, and short directories for Unix sockets."""

from __future__ import annotations

import tempfile
from pathlib import Path

#: the checkout (the directory holding ``tests/``)
ROOT = Path(__file__).resolve().parents[2]


def short_dir(prefix: str = "gpt-") -> Path:
    """A new directory directly under /tmp: Unix socket paths are limited to ~107 bytes, and
    pytest's ``tmp_path`` can exceed that. The caller removes it (or keeps it for its logs)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
