"""An in-memory store, for unit tests and as the reference behaviour."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from ckpt.errors import IntegrityError, ObjectExists, ObjectNotFound
from ckpt.store.base import Buffer, Capabilities, ObjectInfo, Store, check_name, check_prefix


class MemoryStore(Store):
    """Objects in a dict, guarded by a lock. Passes the conformance suite."""

    capabilities = Capabilities(conditional_create=True, ranged_read=True)

    def __init__(self) -> None:
        self._objects: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"memory://{id(self):x}"

    def put(self, name: str, data: Buffer, *, if_absent: bool = False) -> None:
        check_name(name)
        blob = bytes(data)
        with self._lock:
            if if_absent and name in self._objects:
                raise ObjectExists(f"object exists: {name!r}", key=name)
            self._objects[name] = (blob, time.time())

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        check_name(name)
        with self._lock:
            try:
                blob, _ = self._objects[name]
            except KeyError:
                raise ObjectNotFound(f"not found: {name!r}", key=name) from None
        if length is None:
            return blob[offset:]
        out = blob[offset : offset + length]
        if len(out) != length:
            raise IntegrityError(
                f"object {name!r} is truncated: asked for {length} bytes at offset {offset}, got {len(out)}",
                obj=name,
            )
        return out

    def stat(self, name: str) -> ObjectInfo:
        check_name(name)
        with self._lock:
            try:
                blob, mtime = self._objects[name]
            except KeyError:
                raise ObjectNotFound(f"not found: {name!r}", key=name) from None
        return ObjectInfo(name, len(blob), mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        with self._lock:
            items = [(k, len(b), m) for k, (b, m) in self._objects.items() if k.startswith(prefix)]
        for k, size, mtime in items:
            yield ObjectInfo(k, size, mtime)

    def delete(self, name: str) -> None:
        check_name(name)
        with self._lock:
            self._objects.pop(name, None)

    # Test helpers that bypass the interface (the conformance suite's "raw" access).
    def raw_set(self, name: str, data: bytes, mtime: float | None = None) -> None:
        with self._lock:
            self._objects[name] = (data, time.time() if mtime is None else mtime)
