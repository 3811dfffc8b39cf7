"""Index documents: which blob lives in which pack, at what offset.

Each save writes one index document (``index/<id>``) for the packs it wrote,
after those packs are durable and before its manifest. The repository index
is the union of all index documents; ``gc`` replaces them with one rewritten
document *before* deleting any pack, so an index never points at a pack that
was deleted on purpose.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckpt import document
from ckpt.errors import FormatError, IntegrityError, ObjectNotFound, UnsupportedVersion
from ckpt.keys import Keyring
from ckpt.pack import BlobEntry, entries_to_rows, rows_to_entries
from ckpt.store.base import Store

KIND = "gpuckpt-index"
#: 2: encrypted bodies are sealed per document (FORMAT.md §10.1); 3: a pack record may map its
#: blobs to content ids (``"content"``, FORMAT.md §4.4); 1 and 2 are still read
VERSION = 3
SUPPORTED = (1, 2, 3)
PREFIX = "index/"
log = logging.getLogger("gpuckpt.index")
#: index documents larger than this are not read (a gc rewrite of a large
#: repository stays far below: ~100 bytes per blob)
MAX_INDEX_BYTES = 512 << 20


def index_name(index_id: str) -> str:
    return PREFIX + index_id


@dataclass(frozen=True)
class PackRecord:
    id: str
    size: int
    entries: tuple[BlobEntry, ...]


def encode_index(
    name: str,
    packs: Iterable[PackRecord],
    keyring: Keyring | None,
    superseded: Iterable[str] = (),
    condemned: dict[str, float] | None = None,
) -> bytes:
    """``superseded``: packs a gc is deleting now (FORMAT.md §9: a gc that dies before deleting
    them leaves the next gc the answer). ``condemned``: packs a gc will delete once no save can
    still be referencing them, each with the store time it was condemned at (0: at this
    document's own store time); saves do not deduplicate against either."""
    body: dict[str, Any] = {"packs": []}
    if superseded:
        body["superseded"] = sorted(set(superseded))
    if condemned:
        body["condemned"] = {p: float(t) for p, t in sorted(condemned.items())}
    for p in packs:
        rows, codecs = entries_to_rows(list(p.entries))
        rec: dict[str, Any] = {"id": p.id, "size": p.size, "codecs": codecs, "blobs": rows}
        content = {e.id: e.content for e in p.entries if e.content}
        if content:
            rec["content"] = content
        body["packs"].append(rec)
    return document.seal(KIND, VERSION, name, body, keyring)


def decode_index(name: str, data: bytes, keyring: Keyring | None) -> list[PackRecord]:
    return decode_index_doc(name, data, keyring).packs


@dataclass(frozen=True)
class IndexDoc:
    packs: list[PackRecord]
    superseded: frozenset[str]
    condemned: dict[str, float]  # pack id -> store time (0: the document's own)


def decode_index_doc(name: str, data: bytes, keyring: Keyring | None) -> IndexDoc:
    """An index document's packs, the packs it supersedes and the packs it condemns."""
    _, body = document.open_envelope(data, kind=KIND, supported=SUPPORTED, name=name, keyring=keyring)
    sup = body.get("superseded", [])
    if not isinstance(sup, list) or not all(isinstance(x, str) and len(x) == 32 for x in sup):
        raise FormatError(f"{name}: 'superseded' must be a list of pack ids")
    con = body.get("condemned", {})
    if not isinstance(con, dict) or not all(
        isinstance(k, str) and len(k) == 32 and type(v) in (int, float) and v >= 0 for k, v in con.items()
    ):
        raise FormatError(f"{name}: 'condemned' must map pack ids to store times")
    packs = body.get("packs")
    if not isinstance(packs, list):
        raise FormatError(f"{name}: 'packs' must be a list")
    out = []
    for p in packs:
        if not isinstance(p, dict) or not isinstance(p.get("id"), str) or type(p.get("size")) is not int:
            raise FormatError(f"{name}: malformed pack record")
        entries = rows_to_entries(p["id"], p.get("blobs"), p.get("codecs"), name)
        content = p.get("content", {})
        if not isinstance(content, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in content.items()
        ):
            raise FormatError(f"{name}: 'content' must map blob ids to content ids")
        if content:
            entries = [dataclasses.replace(e, content=content.get(e.id, "")) for e in entries]
        out.append(PackRecord(p["id"], p["size"], tuple(entries)))
    return IndexDoc(out, frozenset(sup), {k: float(v) for k, v in con.items()})


class MasterIndex:
    """The union of the repository's index documents, loaded incrementally.

    Index documents are immutable, so each is read once per process; a
    refresh reads only names not seen before and forgets deleted ones. A
    document that cannot be read for what it holds (malformed, planted,
    rotten, oversized, a version this reader does not know) is skipped and
    listed in :attr:`unreadable`: it is never a reason to stop a save or a
    gc, and nothing is deleted on its account. A store failure still raises.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.unreadable: dict[str, str] = {}
        #: the unreadable ones of a format version this reader does not know: a
        #: newer writer's packs, which gc must not take for garbage
        self.unsupported: dict[str, UnsupportedVersion] = {}
        self._docs: dict[str, list[PackRecord]] = {}
        self._superseded: dict[str, frozenset[str]] = {}
        self._condemned: dict[str, dict[str, float]] = {}  # per document, times resolved
        # packs saves must not deduplicate against: condemned or superseded by a gc
        self._excluded: frozenset[str] = frozenset()
        # every copy of a blob id: two saves of one block in an encrypted
        # repository store two ciphertexts (different checksums), both valid
        self._blobs: dict[str, list[BlobEntry]] = {}
        self._packs: dict[str, PackRecord] = {}
        # content id -> blobs holding those bytes (what saves of other trust domains may share)
        self._content: dict[str, list[BlobEntry]] = {}

    def refresh(self, store: Store, keyring: Keyring | None, workers: int = 8) -> None:
        listing = {o.name: o for o in store.list(PREFIX)}
        sizes = {n: o.size for n, o in listing.items()}
        names = set(sizes)
        with self._lock:
            new = [n for n in names if n not in self._docs and n not in self.unreadable]
            gone = [n for n in self._docs if n not in names]
            for n in [n for n in self.unreadable if n not in names]:
                del self.unreadable[n]
                self.unsupported.pop(n, None)

        def read(n: str) -> tuple[str, list[PackRecord] | None]:
            try:
                if sizes[n] > MAX_INDEX_BYTES:
                    raise FormatError(f"{n}: {sizes[n]} bytes exceeds the index size limit {MAX_INDEX_BYTES}")
                doc = decode_index_doc(n, store.get(n), keyring)
                with self._lock:
                    self._superseded[n] = doc.superseded
                    # 0 = "when this document was written", on the store's clock
                    self._condemned[n] = {p: t or listing[n].mtime for p, t in doc.condemned.items()}
                return n, doc.packs
            except ObjectNotFound:  # deleted by a gc since the listing
                return n, None
            except (FormatError, IntegrityError) as exc:
                log.warning("skipping an unreadable index document", extra={"object": n, "error": str(exc)})
                with self._lock:
                    self.unreadable[n] = str(exc)
                    if isinstance(exc, UnsupportedVersion):
                        self.unsupported[n] = exc
                return n, None

        results = []
        if new:
            with ThreadPoolExecutor(min(workers, len(new))) as ex:
                results = list(ex.map(read, new))
        with self._lock:
            for n in gone:
                self._docs.pop(n, None)
                self._superseded.pop(n, None)
                self._condemned.pop(n, None)
            for n, recs in results:
                if recs is not None:
                    self._docs[n] = recs
            self._rebuild()

    def _rebuild(self) -> None:
        self._blobs = {}
        self._packs = {}
        self._content = {}
        for recs in self._docs.values():
            self._add_packs(recs)
        excluded: set[str] = set()
        for sup in self._superseded.values():
            excluded |= sup
        for con in self._condemned.values():
            excluded |= con.keys()
        self._excluded = frozenset(excluded)

    def _add_packs(self, packs: Iterable[PackRecord]) -> None:
        for p in packs:
            if p.id in self._packs:
                continue  # the same pack listed by two documents (a gc rewrite in progress)
            self._packs[p.id] = p
            for e in p.entries:
                self._blobs.setdefault(e.id, []).append(e)
                if e.content:
                    self._content.setdefault(e.content, []).append(e)

    def add(self, name: str, packs: list[PackRecord]) -> None:
        with self._lock:
            self._docs[name] = packs
            self._add_packs(packs)

    def lookup(self, blob_id: str) -> BlobEntry | None:
        """A copy of ``blob_id`` a save may deduplicate against, or None.

        Copies in packs a gc has condemned or superseded do not count: gc
        deletes those once every save that could have seen them as live has
        committed or aborted (FORMAT.md §9), so a new reference to one could
        outlive its data.
        """
        excluded = self._excluded
        for e in self._blobs.get(blob_id, ()):
            if e.pack not in excluded:
                return e
        return None

    def lookup_content(self, content_id: str, raw_length: int) -> BlobEntry | None:
        """A blob holding exactly these bytes (by their content id and length) a save may reference
        instead of storing them again, whatever its key or trust domain; condemned and superseded
        packs do not count (see :meth:`lookup`)."""
        excluded = self._excluded
        for e in self._content.get(content_id, ()):
            if e.pack not in excluded and e.raw_length == raw_length:
                return e
        return None

    def copies(self, blob_id: str) -> list[BlobEntry]:
        """Every indexed copy of ``blob_id``; a reader picks the one whose checksum its reference names."""
        return list(self._blobs.get(blob_id, ()))

    def __contains__(self, blob_id: str) -> bool:
        return blob_id in self._blobs

    @property
    def documents(self) -> dict[str, list[PackRecord]]:
        with self._lock:
            return dict(self._docs)

    @property
    def superseded(self) -> frozenset[str]:
        """Packs some index document says a gc replaced: to be deleted, whatever manifests name them."""
        with self._lock:
            return frozenset().union(*self._superseded.values()) if self._superseded else frozenset()

    @property
    def condemned(self) -> dict[str, float]:
        """Packs some index document condemns, each with the earliest store time it was condemned at."""
        with self._lock:
            out: dict[str, float] = {}
            for con in self._condemned.values():
                for p, t in con.items():
                    out[p] = min(t, out.get(p, t))
            return out

    def condemned_by(self, name: str) -> dict[str, float]:
        with self._lock:
            return dict(self._condemned.get(name, {}))

    def superseded_by(self, name: str) -> frozenset[str]:
        with self._lock:
            return self._superseded.get(name, frozenset())

    @property
    def packs(self) -> dict[str, PackRecord]:
        with self._lock:
            return dict(self._packs)

    def __len__(self) -> int:
        return len(self._blobs)
