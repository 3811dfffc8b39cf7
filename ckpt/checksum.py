"""Blob checksums: XXH3-128, fast enough for the hot path (>10 GB/s a core).

Checksums guard against corruption, not against an adversary: an attacker who
can write to the store can recompute them. Encryption (AES-256-GCM) is what
authenticates; see FORMAT.md, "Threat model".
"""

from __future__ import annotations

import hmac

import xxhash

from ckpt.errors import IntegrityError

ALGORITHM = "xxh3-128"
Buffer = bytes | bytearray | memoryview


def checksum(data: Buffer) -> str:
    """The hex XXH3-128 digest of ``data``."""
    return xxhash.xxh3_128_hexdigest(data)


def verify(data: Buffer, expected: str, *, obj: str, blob: str | None = None, what: str = "") -> None:
    """Raise IntegrityError naming ``obj`` (and ``blob``) unless ``data`` has ``expected``."""
    got = checksum(data)
    if not hmac.compare_digest(got, expected):
        where = f"blob {blob} in {obj}" if blob else obj
        raise IntegrityError(
            f"checksum mismatch{(' (' + what + ')') if what else ''} for {where}: "
            f"expected {ALGORITHM} {expected}, got {got}",
            obj=obj,
            blob=blob,
        )
