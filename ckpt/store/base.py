"""The storage interface every backend implements.

A store maps object names to immutable byte strings. The repository layer
(:mod:`ckpt.blobstore` and all above it) is written against this interface only; retry,
fault injection and logging are wrappers implementing the same interface.

Semantics every store guarantees (the conformance suite in
``tests/store_suite.py`` checks each one):

* **Names** are ``/``-separated segments of ``[A-Za-z0-9._-]``, no segment
  empty, ``.`` or ``..``, at most 1024 bytes in all. Any other name raises
  :class:`~ckpt.errors.InvalidName` before any I/O: a name can never escape
  the store's root.
* **Atomic puts.** A reader sees either no object or the whole object, never
  a prefix. A failed or interrupted put leaves no object under the name
  (an unfinished upload may leave invisible debris that :meth:`Store.cleanup`
  removes).
* **Read-after-write.** Once ``put`` returns, ``get``, ``stat`` and ``list``
  see the object.
* **Conditional create.** ``put(name, data, if_absent=True)`` succeeds for
  exactly one of any number of racing writers; the others get
  :class:`~ckpt.errors.ObjectExists` and the object holds the winner's bytes.
* **Overwrite.** ``put`` without ``if_absent`` replaces the object atomically.
* **Errors.** A missing object raises :class:`~ckpt.errors.ObjectNotFound`
  (never returns ``None``); ``delete`` of a missing object is not an error.
  Transient failures raise :class:`~ckpt.errors.StoreUnavailable`; a full
  store :class:`~ckpt.errors.StorageFull`; refused credentials
  :class:`~ckpt.errors.AccessDenied`.
* **Ranged reads.** ``get(name, offset, length)`` returns exactly the bytes
  asked for; a range that runs past the end raises
  :class:`~ckpt.errors.IntegrityError` (the caller asked for bytes an index
  says exist: the object is truncated).
* **Listing** yields every object under a prefix exactly once, in no
  particular order, and never yields unfinished writes.
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from ckpt.errors import InvalidName, ObjectNotFound

_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")
MAX_NAME_BYTES = 1024

Buffer = bytes | bytearray | memoryview


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid object name, else raise InvalidName."""
    if not isinstance(name, str) or not name:
        raise InvalidName(f"invalid object name {name!r}: empty or not a string", key=None)
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise InvalidName(f"invalid object name: longer than {MAX_NAME_BYTES} bytes", key=None)
    for seg in name.split("/"):
        if seg in ("", ".", "..") or not _SEGMENT.match(seg):
            raise InvalidName(
                f"invalid object name {name!r}: segment {seg!r} is not [A-Za-z0-9._-]+ or is empty, '.' or '..'",
                key=None,
            )
    return name


def check_prefix(prefix: str) -> str:
    """Validate a listing prefix: empty, or a valid name optionally ending in '/'."""
    if prefix == "":
        return prefix
    check_name(prefix.rstrip("/"))
    return prefix


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What ``stat`` and ``list`` report about one object."""

    name: str
    size: int
    mtime: float  # seconds since the epoch, as the store records it


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store can do natively (the repository adapts to what is missing)."""

    conditional_create: bool = True
    ranged_read: bool = True
    #: the store verifies a checksum we send with each put (S3 CRC32C)
    server_checksums: bool = False
    #: large puts are split and sent in parallel parts
    parallel_upload: bool = False


class Store(ABC):
    """An object store. Implementations must be safe to call from many threads."""

    capabilities: Capabilities = Capabilities()

    @property
    @abstractmethod
    def url(self) -> str:
        """A URL naming this store, without credentials (safe to log)."""

    @abstractmethod
    def put(self, name: str, data: Buffer, *, if_absent: bool = False) -> None:
        """Store ``data`` under ``name`` atomically and durably.

        With ``if_absent`` the put is a conditional create: it raises
        ObjectExists if the name is taken, and exactly one of several racing
        creators wins.
        """

    @abstractmethod
    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        """Return the object's bytes, or ``length`` bytes from ``offset``."""

    @abstractmethod
    def stat(self, name: str) -> ObjectInfo:
        """Return the object's size and modification time."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Yield every object whose name starts with ``prefix``."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove the object. Removing a missing object is not an error."""

    def exists(self, name: str) -> bool:
        try:
            self.stat(name)
        except ObjectNotFound:
            return False
        return True

    def cleanup(self, older_than: float) -> int:
        """Remove invisible debris of interrupted writes older than ``older_than``
        (epoch seconds): temp files, unfinished multipart uploads. Returns how
        many were removed. Stores with no such debris return 0."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and threads. The store is unusable afterwards."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- per-operation deadlines ---------------------------------------------------------------------

#: The ``time.monotonic()`` past which store calls made on behalf of the current
#: operation (a save with a deadline) stop retrying: set with :func:`deadline_scope`;
#: threads the operation starts carry it (``contextvars.copy_context``).
CALL_DEADLINE: ContextVar[float | None] = ContextVar("gpuckpt_call_deadline", default=None)


@contextmanager
def deadline_scope(deadline: float | None) -> Iterator[None]:
    """Store calls in this context (and in tasks submitted with its context) spend no retry
    past ``deadline``: a retry that would start after it is not made, and the error stands."""
    token = CALL_DEADLINE.set(deadline)
    try:
        yield
    finally:
        CALL_DEADLINE.reset(token)


def retry_budget_left(delay: float = 0.0) -> bool:
    """Whether a retry after ``delay`` seconds would still start before the current deadline."""
    deadline = CALL_DEADLINE.get()
    return deadline is None or time.monotonic() + delay < deadline
