"""Repository locks.

A lock is an object ``locks/<id>`` holding who took it and when it was last
refreshed. Saves and ``forget`` take *shared* locks; ``gc`` takes the one
*exclusive* lock. Acquiring is optimistic, as in restic: write our lock, then
list the others; on a conflict, remove ours and report the holder. Two racing
acquirers may both back off; neither can both succeed. A lock not refreshed
for ``stale_after`` seconds belongs to a dead process and is ignored (and
removed by ``gc``); long operations refresh theirs in the background.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ckpt import document
from ckpt.errors import GpuckptError, ObjectNotFound, RepositoryLocked
from ckpt.store.base import Store

KIND = "gpuckpt-lock"
VERSION = 1
PREFIX = "locks/"
DEFAULT_STALE_AFTER = 30 * 60.0
log = logging.getLogger("gpuckpt.lock")


@dataclass(frozen=True)
class LockInfo:
    name: str
    exclusive: bool
    operation: str
    hostname: str
    pid: int
    created: float
    refreshed: float

    def describe(self) -> str:
        kind = "exclusive" if self.exclusive else "shared"
        age = time.time() - self.created
        return (
            f"{kind} lock {self.name} held by {self.operation!r} on {self.hostname} "
            f"pid {self.pid}, taken {age:.0f}s ago"
        )


def _body(exclusive: bool, operation: str, created: float) -> dict[str, Any]:
    return {
        "exclusive": exclusive,
        "operation": operation,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "created": created,
        "refreshed": time.time(),
    }


def read_lock(store: Store, name: str) -> LockInfo | None:
    """Read one lock; None if it vanished or cannot be parsed (debris)."""
    try:
        _, b = document.open_envelope(store.get(name), kind=KIND, supported=(VERSION,), name=name, keyring=None)
        return LockInfo(
            name,
            bool(b["exclusive"]),
            str(b["operation"]),
            str(b["hostname"]),
            int(b["pid"]),
            float(b["created"]),
            float(b["refreshed"]),
        )
    except ObjectNotFound:
        return None
    except (GpuckptError, KeyError, TypeError, ValueError):
        log.warning("unreadable lock object", extra={"object": name})
        return None


def list_locks(store: Store) -> list[LockInfo]:
    out = []
    for o in store.list(PREFIX):
        info = read_lock(store, o.name)
        if info is not None:
            out.append(info)
    return out


class Lock:
    """A held lock; a context manager. Refreshes itself until released."""

    def __init__(
        self,
        store: Store,
        *,
        exclusive: bool,
        operation: str,
        stale_after: float = DEFAULT_STALE_AFTER,
        wait: float = 0.0,
    ) -> None:
        self.store = store
        self.exclusive = exclusive
        self.operation = operation
        self.stale_after = stale_after
        self.name = PREFIX + secrets.token_hex(16)
        self._created = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        deadline = time.monotonic() + wait
        while True:
            try:
                self._try_acquire()
                break
            except RepositoryLocked:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(1.0, max(0.05, deadline - time.monotonic())) * (0.5 + secrets.randbelow(100) / 100))
        self._thread = threading.Thread(target=self._refresher, name="gpuckpt-lock-refresh", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        data = document.seal(KIND, VERSION, self.name, _body(self.exclusive, self.operation, self._created), None)
        self.store.put(self.name, data)

    def _try_acquire(self) -> None:
        self._write()
        now = time.time()
        for other in list_locks(self.store):
            if other.name == self.name or now - other.refreshed > self.stale_after:
                continue
            if self.exclusive or other.exclusive:
                self.store.delete(self.name)
                raise RepositoryLocked(f"repository is locked: {other.describe()}")

    def _refresher(self) -> None:
        interval = max(1.0, self.stale_after / 3)
        while not self._stop.wait(interval):
            try:
                self._write()
            except GpuckptError as exc:
                log.warning("could not refresh lock", extra={"object": self.name, "error": str(exc)})

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.store.delete(self.name)
        except GpuckptError as exc:
            # A lock we cannot remove goes stale and is ignored after stale_after.
            log.warning("could not remove lock", extra={"object": self.name, "error": str(exc)})

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
