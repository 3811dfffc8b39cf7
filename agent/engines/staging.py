"""Page files: host staging that another process can read (no vLLM import).

A page file is a pair in one staging directory (mode 0700, files 0600; on
Linux under ``/dev/shm``, so the bytes stay in memory):

``<name>.bin``
    ``len(keys)`` pages back to back, each ``page_bytes`` long: one block's
    pages of every layer, layer-major in the order ``layers`` names.
``<name>.json``
    ``{"schema": "gpuckpt-vllm-pages", "version": 1, "dtype", "page_shape",
    "page_bytes", "layers", "keys": [hex, …]}``; key ``i`` is at offset
    ``i * page_bytes``. Written after the data, by rename, so a reader that
    sees the index sees complete data.

The capture side (the worker half of the connector) writes a page file; the
agent reads it and deletes it. The restore side works the other way round.
Nothing here is pickled.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from agent import fs
from agent.fs import Trust
from ckpt.blocks import DTYPES
from ckpt.errors import EngineError

SCHEMA = "gpuckpt-vllm-pages"
VERSION = 1
#: a page file's index names its keys: 64 MiB covers a million pages
MAX_INDEX_BYTES = 64 << 20
#: the largest page a page file may declare (one block's pages of every layer; a 61-layer model's
#: bf16 pages of 16 tokens and 8 KV heads are about 4 MiB): what a reader allocates for one page
MAX_PAGE_BYTES = 256 << 20


class PageFileError(EngineError, ValueError):
    """A page file that cannot be read as its index declares (a worker truncated it, declared a
    page larger than the bound or inconsistent with its shape): that capture's error, nothing more."""


def save_queue_bound(max_staging: int) -> int:
    """Raw bytes the agent's save may hold queued from read (deleted, still mapped) chunks: half
    of a capture's staging bound (the worker half sizes its chunks to the other half)."""
    return max(1, max_staging // 2)


def default_dir(tag: str) -> Path:
    # A shared, world-writable place: ensure_dir refuses anything there that is
    # not a real directory owned by us (no symlink or squatting games).
    shm = Path("/dev/shm")  # noqa: S108
    base = shm if shm.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))  # noqa: S108
    return base / f"gpuckpt-{os.getuid()}-{tag}"


def sweep_dead(tag: str) -> list[str]:
    """Delete this user's staging directories ``default_dir(f"{tag}<pid>")`` whose process is gone
    (killed: nothing else deletes what it staged). A directory that is not a real directory owned by
    this user is left alone; so is one whose pid runs (perhaps reused: kept, never guessed)."""
    probe = default_dir(f"{tag}0")
    prefix = probe.name[: -len("0")]
    removed: list[str] = []
    try:
        entries = list(probe.parent.iterdir())
    except OSError:
        return removed
    for d in entries:
        rest = d.name[len(prefix) :] if d.name.startswith(prefix) else ""
        if not rest.isdigit():
            continue
        try:
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            os.kill(int(rest), 0)
            continue  # its process runs
        except ProcessLookupError:
            pass
        except OSError:
            continue  # not ours to judge (EPERM: another user's pid)
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    return removed


def ensure_dir(path: str | os.PathLike[str], trust: Trust | None = None) -> Path:
    """Create (or adopt) a staging directory: private (0700, this user's) or, with a shared group in
    ``trust``, 2770 and that group's; never a symlink, never one another account made or could
    write to (:func:`agent.fs.ensure_dir`). Pages are users' KV."""
    return fs.ensure_dir(path, trust)


@dataclass(frozen=True)
class PageIndex:
    dtype: str
    page_shape: tuple[int, ...]
    page_bytes: int
    layers: tuple[str, ...]
    keys: tuple[bytes, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "dtype": self.dtype,
            "page_shape": list(self.page_shape),
            "page_bytes": self.page_bytes,
            "layers": list(self.layers),
            "keys": [k.hex() for k in self.keys],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PageIndex:
        if d.get("schema") != SCHEMA or d.get("version") != VERSION:
            raise PageFileError(f"not a version-{VERSION} {SCHEMA} index: {d.get('schema')!r} v{d.get('version')!r}")
        return cls(
            d["dtype"],
            tuple(d["page_shape"]),
            int(d["page_bytes"]),
            tuple(d["layers"]),
            tuple(bytes.fromhex(k) for k in d["keys"]),
        )


def _open_private(path: Path, shared: bool = False) -> BinaryIO:
    """A new file only this user (``shared``: and the group, read-only) can read. It is always a
    file this call created (``O_EXCL``, never blocking): whatever stood under its name — a file a
    killed process left, a symlink, a FIFO another account planted in a shared staging directory,
    which an ordinary open would block on forever — is removed first, never opened or followed;
    if it cannot be, the error names the path."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        try:
            os.unlink(path)
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise OSError(exc.errno, f"a staging file's name is taken and cannot be freed: {exc}", str(path)) from exc
    try:
        os.fchmod(fd, 0o640 if shared else 0o600)  # whatever the umask, whatever was there
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "wb")


class PageWriter:
    """Append pages to ``<dir>/<name>.bin``; ``commit`` publishes the index."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        name: str,
        *,
        dtype: str,
        page_shape: Iterable[int],
        layers: Iterable[str],
        trust: Trust | None = None,
    ) -> None:
        self.trust = trust or Trust.of()
        self.dir = ensure_dir(directory, self.trust)
        self.name = name
        self.dtype = dtype
        self.page_shape = tuple(page_shape)
        self.layers = tuple(layers)
        self.keys: list[bytes] = []
        self.page_bytes: int | None = None
        self._f = _open_private(self.data_path, self.trust.gid is not None)

    @property
    def data_path(self) -> Path:
        return self.dir / f"{self.name}.bin"

    @property
    def index_path(self) -> Path:
        return self.dir / f"{self.name}.json"

    def write(self, key: bytes, page: bytes | bytearray | memoryview) -> None:
        n = memoryview(page).nbytes
        if self.page_bytes is None:
            self.page_bytes = n
        elif n != self.page_bytes:
            raise PageFileError(f"page of {n} bytes in a file of {self.page_bytes}-byte pages")
        self._f.write(page)
        self.keys.append(key)

    def commit(self) -> PageIndex:
        self._f.close()
        idx = PageIndex(self.dtype, self.page_shape, self.page_bytes or 0, self.layers, tuple(self.keys))
        tmp = self.dir / f".{self.name}.json.tmp"
        with _open_private(tmp, self.trust.gid is not None) as f:
            f.write(json.dumps(idx.to_json()).encode())
        os.replace(tmp, self.index_path)
        return idx

    def abort(self) -> None:
        self._f.close()
        self.data_path.unlink(missing_ok=True)


def _check_geometry(path: Path, index: PageIndex, max_page_bytes: int) -> None:
    """The declared page size is within the bound and is what the declared shape, dtype and layers
    make (when the dtype is one this code knows), before a byte is allocated for it."""
    n = index.page_bytes
    if n < 0 or n > max_page_bytes:
        raise PageFileError(f"{path}: declares {n}-byte pages; the bound is {max_page_bytes} bytes")
    item = DTYPES.get(index.dtype)
    if item is not None and index.keys:
        made = item
        for d in index.page_shape:
            made *= int(d)
        # the page shape holds the layers' axis (vLLM) or is per layer
        if n not in (made, made * max(1, len(index.layers))):
            raise PageFileError(
                f"{path}: declares {n}-byte pages, but pages of {list(index.page_shape)} {index.dtype} "
                f"({len(index.layers)} layers) make {made}"
            )


def unlink_pair(index_path: str | os.PathLike[str]) -> None:
    """Delete a page file (index and data); missing parts are fine."""
    p = Path(index_path)
    p.with_suffix(".bin").unlink(missing_ok=True)
    p.unlink(missing_ok=True)


class PageFile:
    """A committed page file, read-only: memory-mapped, or read with ``pread`` (``mapped=False``).

    Another process named it, so both halves are opened with
    :func:`agent.fs.open_checked` before a byte is read: directly in
    ``directory`` (``None``: in a directory :func:`agent.fs.check_dir`
    accepts), no symlink, no FIFO, a regular single-link file owned by a
    trusted account and closed to others. :class:`agent.fs.UnsafePath`
    names the file and why otherwise. The declared page size is checked
    against ``max_page_bytes`` and against the declared shape, dtype and
    layers before anything is allocated (:class:`PageFileError`).

    The agent reads the worker's files with ``mapped=False``: a file the
    worker truncates under a mapping kills the reader with SIGBUS, while a
    short ``pread`` is that page's :class:`PageFileError`. The worker maps
    the agent's files (the agent does not attack its worker).
    """

    def __init__(
        self,
        index_path: str | os.PathLike[str],
        *,
        directory: str | os.PathLike[str] | None = None,
        trust: Trust | None = None,
        mapped: bool = True,
        max_page_bytes: int = MAX_PAGE_BYTES,
    ) -> None:
        trust = trust or Trust.of()
        self.index_path = Path(index_path)
        if self.index_path.suffix != ".json":
            raise fs.UnsafePath(f"{self.index_path} is not a page file index (*.json)")
        ifd = fs.open_checked(self.index_path, directory=directory, trust=trust)
        with os.fdopen(ifd, "rb") as f:
            # by the file's size: read(n) allocates n bytes up front, whatever the file holds
            raw = f.read(min(os.fstat(f.fileno()).st_size, MAX_INDEX_BYTES) + 1)
        if len(raw) > MAX_INDEX_BYTES:
            raise PageFileError(f"{self.index_path}: index larger than {MAX_INDEX_BYTES} bytes")
        try:
            self.index = PageIndex.from_json(json.loads(raw))
        except (KeyError, TypeError, ValueError) as exc:
            raise PageFileError(f"{self.index_path}: not a page file index ({exc})") from None
        _check_geometry(self.index_path, self.index, max_page_bytes)
        self.data_path = self.index_path.with_suffix(".bin")
        self._fd = fs.open_checked(self.data_path, directory=self.index_path.parent, trust=trust)
        size = os.fstat(self._fd).st_size
        if size != self.index.page_bytes * len(self.index.keys):
            os.close(self._fd)
            raise PageFileError(f"{self.data_path}: {size} bytes, index says {len(self.index.keys)} pages")
        self._mm = mmap.mmap(self._fd, size, prot=mmap.PROT_READ) if size and mapped else None
        self.offsets = {k: i * self.index.page_bytes for i, k in enumerate(self.index.keys)}

    def page(self, key: bytes) -> memoryview:
        off = self.offsets[key]
        n = self.index.page_bytes
        if self._mm is not None:
            return memoryview(self._mm)[off : off + n]
        data = os.pread(self._fd, n, off)
        if len(data) != n:
            raise PageFileError(
                f"{self.data_path}: page at {off} is {len(data)} of {n} bytes: the file was truncated while read"
            )
        return memoryview(data)

    def items(self) -> Iterator[tuple[bytes, memoryview]]:
        for k in self.index.keys:
            yield k, self.page(k)

    def close(self) -> None:
        if self._mm is not None:
            # A view still alive keeps the mapping; it goes with the view.
            with contextlib.suppress(BufferError):
                self._mm.close()
        os.close(self._fd)

    def unlink(self) -> None:
        self.data_path.unlink(missing_ok=True)
        self.index_path.unlink(missing_ok=True)
