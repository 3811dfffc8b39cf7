"""The blobs of a repository, as save, load, gc and verify see them.

A :class:`BlobStore` is what those operations share, below the public
:class:`~ckpt.repository.Repository`: the store, the keyring, the config, the
master index (the union of the index documents, FORMAT.md §4.4), and how a
block's blob id and content id are computed and a stored blob is verified and
decoded. It reads and writes no checkpoint: manifests are
:mod:`ckpt.manifest`'s, and which operation runs under which lock is the
repository's.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable
from typing import Any

from ckpt import checksum as cks
from ckpt.blocks import Namespace
from ckpt.codecs import CodecContext, Pipeline
from ckpt.config import RepoConfig
from ckpt.errors import IntegrityError
from ckpt.index import MasterIndex
from ckpt.keys import Keyring
from ckpt.pack import BlobEntry
from ckpt.store.base import Store


def decode_blob(
    keyring: Keyring | None,
    pipeline: Pipeline,
    stored: memoryview,
    *,
    obj: str,
    blob: str,
    checksum: str,
    raw_checksum: str,
    raw_length: int,
) -> bytearray:
    """Verify and decode one stored blob; the one place every reader does it.

    Encrypted blobs: the AEAD tag, checked by the first decode stage before
    anything else runs, authenticates the stored bytes and binds them to the
    blob id, so a modified or moved blob fails "authentication" (FORMAT.md
    §10) rather than a checksum; the stored checksum is still checked after.
    Plain blobs: the stored checksum is checked before decoding. In both, the
    decoded length and checksum are checked last. Returns writable bytes.
    """
    aead_first = pipeline.encrypted
    if not aead_first:
        cks.verify(stored, checksum, obj=obj, blob=blob, what="stored bytes")
    ctx = CodecContext(keyring, blob.encode(), obj, blob)
    raw = pipeline.decode(stored, ctx, raw_length)
    if aead_first:
        cks.verify(stored, checksum, obj=obj, blob=blob, what="stored bytes")
    mv = memoryview(raw).cast("B")
    if mv.nbytes != raw_length:
        raise IntegrityError(
            f"blob {blob} in {obj} decoded to {mv.nbytes} bytes, expected {raw_length}", obj=obj, blob=blob
        )
    cks.verify(mv, raw_checksum, obj=obj, blob=blob, what="decoded bytes")
    # Callers view the bytes as tensors, which need a writable buffer.
    return raw if isinstance(raw, bytearray) else bytearray(mv)


class BlobStore:
    """A repository's store, keyring, config and master index. Thread-safe for concurrent
    loads; the index is refreshed by whoever needs it fresh (a save after taking its lock,
    gc, verify, a reader that finds a pack gone)."""

    def __init__(self, store: Store, config: RepoConfig, keyring: Keyring | None) -> None:
        self.store = store
        self.config = config
        self.keyring = keyring
        self.index = MasterIndex()
        self._relocate_lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def encrypted(self) -> bool:
        return self.keyring is not None

    def refresh_index(self) -> None:
        """Read the index documents not seen yet (and drop those gone)."""
        self.index.refresh(self.store, self.keyring)

    def blob_id(self, ns: Namespace, key: bytes) -> str:
        """The blob id of a block: SHA-256 (HMAC-SHA-256 when encrypted) over
        namespace id and content key."""
        msg = b"gpuckpt-blob\x00" + ns.id.encode() + b"\x00" + key
        if self.keyring is not None:
            return self.keyring.blob_mac(msg)
        return hashlib.sha256(msg).hexdigest()

    def content_id(self, raw: Any) -> str | None:
        """The content id of a block's raw bytes: HMAC-SHA-256 (the blob-id key) over their SHA-256,
        in an encrypted repository only — there no one without the key can claim one in an index
        document, so a save may reference another trust domain's blob of exactly these bytes
        (FORMAT.md §10, trust domains). ``None`` in a plain repository: no sharing by content."""
        if self.keyring is None:
            return None
        return self.keyring.blob_mac(b"gpuckpt-content\x00" + hashlib.sha256(raw).digest())

    def decode(
        self,
        pipeline: Pipeline,
        stored: memoryview,
        *,
        obj: str,
        blob: str,
        checksum: str,
        raw_checksum: str,
        raw_length: int,
    ) -> bytearray:
        """:func:`decode_blob` under this repository's key."""
        return decode_blob(
            self.keyring,
            pipeline,
            stored,
            obj=obj,
            blob=blob,
            checksum=checksum,
            raw_checksum=raw_checksum,
            raw_length=raw_length,
        )

    def relocate(self, missing_pack: str, blob_ids: Iterable[str]) -> dict[str, list[BlobEntry]]:
        """Where blobs that a manifest places in ``missing_pack`` live now
        (moved by a gc repack), from a freshly read index: every copy of each
        outside that pack. Blobs not found elsewhere are absent from the result."""
        with self._relocate_lock:
            self.refresh_index()
        out = {}
        for b in blob_ids:
            copies = [e for e in self.index.copies(b) if e.pack != missing_pack]
            if copies:
                out[b] = copies
        return out

    def close(self) -> None:
        self.store.close()
