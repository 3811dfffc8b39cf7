"""Packs: many blobs in one object, so a checkpoint is not one PUT per block.

Byte layout (all integers little-endian)::

    header   16 bytes   b"GPCKPACK" | u32 version (2) | u32 reserved (0)
    blobs    ...        stored blobs back to back, no framing
    trailer  T bytes    the pack's own index: JSON, or in an encrypted
                        repository the JSON sealed (seal 2 in a version-2
                        pack, seal 1 in a version-1 pack; FORMAT.md §10.1)
    footer   32 bytes   u64 T | XXH3-128 of the trailer (16 bytes) | b"GPCKEND1"

Versions 1 and 2 differ only in how an encrypted trailer is sealed. Blobs
carry their own seal version in their codec configuration, so a version-2
pack (a gc repack) may hold blobs sealed either way.

The trailer lets a reader (``verify``, an index rebuild) learn a pack's
blobs from the pack alone; normal reads never touch it, since indexes and
manifests record each blob's offset and length.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from ckpt.errors import FormatError, IntegrityError, UnsupportedVersion
from ckpt.keys import SEAL_V1, SEAL_V2, Keyring

MAGIC = b"GPCKPACK"
END_MAGIC = b"GPCKEND1"
VERSION = 2
SUPPORTED = (1, 2)
#: how a pack of each version seals its trailer
_TRAILER_SEAL = {1: SEAL_V1, 2: SEAL_V2}
HEADER = MAGIC + struct.pack("<II", VERSION, 0)
HEADER_SIZE = len(HEADER)
FOOTER_SIZE = 32
PREFIX = "packs/"

Buffer = bytes | bytearray | memoryview


def pack_name(pack_id: str) -> str:
    return f"{PREFIX}{pack_id[:2]}/{pack_id}"


@dataclass(frozen=True, slots=True)
class BlobEntry:
    """Where a blob lives and how to check and decode it."""

    id: str
    pack: str
    offset: int
    length: int
    raw_length: int
    checksum: str  # XXH3-128 of the stored bytes, checked before decoding
    raw_checksum: str  # XXH3-128 of the decoded bytes, checked after decoding
    codec: str  # canonical JSON of the codec pipeline specs
    #: the content id of the raw bytes (a keyed SHA-256, :meth:`ckpt.Repository.content_id`), in
    #: index documents of version 3 only: what other trust domains may deduplicate against
    content: str = ""

    def to_row(self, codec_index: int) -> list[Any]:
        return [self.id, self.offset, self.length, self.raw_length, self.checksum, self.raw_checksum, codec_index]


def rows_to_entries(pack: str, rows: Any, codecs: Any, where: str) -> list[BlobEntry]:
    """Parse the compact row form used by trailers and index documents."""
    if not isinstance(rows, list) or not isinstance(codecs, list):
        raise FormatError(f"{where}: blobs and codecs must be lists")
    canon = [json.dumps(c, sort_keys=True, separators=(",", ":")) for c in codecs]
    out = []
    for r in rows:
        if (
            not isinstance(r, list)
            or len(r) != 7
            or not all(isinstance(r[i], str) for i in (0, 4, 5))
            or not all(type(r[i]) is int and r[i] >= 0 for i in (1, 2, 3, 6))
            or r[6] >= len(canon)
        ):
            raise FormatError(f"{where}: malformed blob row {r!r}")
        out.append(BlobEntry(r[0], pack, r[1], r[2], r[3], r[4], r[5], canon[r[6]]))
    return out


def entries_to_rows(entries: list[BlobEntry]) -> tuple[list[list[Any]], list[Any]]:
    table: dict[str, int] = {}
    rows = []
    for e in entries:
        idx = table.setdefault(e.codec, len(table))
        rows.append(e.to_row(idx))
    return rows, [json.loads(c) for c in table]


class PackWriter:
    """Accumulates blobs into one pack. Not thread-safe: callers serialize ``add``."""

    def __init__(self, pack_id: str, capacity: int = 0, buffer: bytearray | None = None) -> None:
        self.id = pack_id
        self.name = pack_name(pack_id)
        # Preallocated to the target size (appending into a growing bytearray
        # costs repeated reallocations of tens of MiB), and reusable: a fresh
        # buffer costs a page fault per 4 KiB on first touch.
        if buffer is None or len(buffer) < max(capacity, HEADER_SIZE):
            buffer = bytearray(max(capacity, HEADER_SIZE))
        self.buf = buffer
        self.buf[:HEADER_SIZE] = HEADER
        self._len = HEADER_SIZE
        self.entries: list[BlobEntry] = []

    @property
    def size(self) -> int:
        return self._len

    def add(
        self,
        blob_id: str,
        stored: Buffer,
        raw_length: int,
        checksum: str,
        raw_checksum: str,
        codec: str,
        content: str = "",
    ) -> BlobEntry:
        offset = self._len
        n = memoryview(stored).nbytes
        end = offset + n
        if end > len(self.buf):
            self.buf.extend(bytes(max(end - len(self.buf), len(self.buf) // 4)))
        self.buf[offset:end] = stored
        self._len = end
        e = BlobEntry(blob_id, self.id, offset, n, raw_length, checksum, raw_checksum, codec, content)
        self.entries.append(e)
        return e

    def finish(self, keyring: Keyring | None) -> memoryview:
        """Append trailer and footer; returns the complete pack, a view of the
        writer's buffer (valid until the buffer is reused)."""
        rows, codecs = entries_to_rows(self.entries)
        trailer = json.dumps({"pack": self.id, "codecs": codecs, "blobs": rows}, separators=(",", ":")).encode()
        if keyring is not None:
            trailer = bytes(
                keyring.seal(
                    trailer, trailer_aad(self.id, VERSION), purpose="pack-trailer", version=_TRAILER_SEAL[VERSION]
                )
            )
        tail = trailer + struct.pack("<Q", len(trailer)) + xxhash.xxh3_128_digest(trailer) + END_MAGIC
        end = self._len + len(tail)
        if end > len(self.buf):
            self.buf.extend(bytes(end - len(self.buf)))
        self.buf[self._len : end] = tail
        self._len = end
        return memoryview(self.buf)[:end]


def trailer_aad(pack_id: str, version: int) -> bytes:
    """The trailer's additional data: binds it to its pack id and to the header's version."""
    return f"gpuckpt-pack-trailer/{version}/{pack_id}".encode()


def read_trailer(data: Buffer, pack_id: str, keyring: Keyring | None) -> list[BlobEntry]:
    """Parse a whole pack's header, footer and trailer; returns its blob entries.

    Raises IntegrityError (truncated, corrupt) or UnsupportedVersion.
    """
    name = pack_name(pack_id)
    mv = memoryview(data)
    if len(mv) < HEADER_SIZE + FOOTER_SIZE:
        raise IntegrityError(f"pack {name} is truncated ({len(mv)} bytes)", obj=name)
    if bytes(mv[:8]) != MAGIC:
        raise IntegrityError(f"pack {name} has a bad header magic", obj=name)
    (version,) = struct.unpack_from("<I", mv, 8)
    if version not in SUPPORTED:
        raise UnsupportedVersion(f"pack {name}", version, SUPPORTED)
    if bytes(mv[-8:]) != END_MAGIC:
        raise IntegrityError(f"pack {name} is truncated or has a bad footer", obj=name)
    (tlen,) = struct.unpack_from("<Q", mv, len(mv) - FOOTER_SIZE)
    digest = bytes(mv[len(mv) - 24 : len(mv) - 8])
    start = len(mv) - FOOTER_SIZE - tlen
    if start < HEADER_SIZE:
        raise IntegrityError(f"pack {name}: trailer length {tlen} exceeds the pack", obj=name)
    trailer = mv[start : len(mv) - FOOTER_SIZE]
    if xxhash.xxh3_128_digest(trailer) != digest:
        raise IntegrityError(f"pack {name}: trailer checksum mismatch", obj=name)
    raw = bytes(trailer)
    if keyring is not None:
        raw = bytes(
            keyring.open(
                raw, trailer_aad(pack_id, version), obj=name, purpose="pack-trailer", version=_TRAILER_SEAL[version]
            )
        )
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also too deep, or ints over 4300 digits
        raise IntegrityError(f"pack {name}: trailer is not JSON ({exc})", obj=name) from None
    if not isinstance(doc, dict) or doc.get("pack") != pack_id:
        raise IntegrityError(f"pack {name}: trailer names another pack", obj=name)
    entries = rows_to_entries(pack_id, doc.get("blobs"), doc.get("codecs"), name)
    for e in entries:
        if e.offset < HEADER_SIZE or e.offset + e.length > start:
            raise IntegrityError(f"pack {name}: blob {e.id} lies outside the blob area", obj=name)
    return entries
