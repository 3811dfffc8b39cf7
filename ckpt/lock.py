"""Repository locks.

A lock is an object ``locks/<id>`` holding who took it. Saves, ``delete``
and ``forget`` take *shared* locks. ``gc`` takes an exclusive lock of one
of two modes: by default a *gc-only* lock, which keeps other gcs out but not
saves (gc then deletes in two phases, FORMAT.md §9); with ``gc --now`` a
*full* exclusive lock, which waits for every save and keeps them out.
Shared locks carry ``protocol: 2`` — their holders do not deduplicate against
condemned packs; a shared lock without it (an older gpuckpt's save) keeps
every gc out, and older saves take a gc-only lock for a full one.
Acquiring is optimistic, as in restic: write our lock, then list the others;
on a conflict, remove ours and report the holder. Two racing acquirers may
both back off; neither can both succeed.

Judging another lock (FORMAT.md §8):

* **Age is the store's.** A lock's age is the store's time now (the
  modification time the store gave the lock we just wrote) minus the
  modification time it gave that lock when its holder last refreshed it —
  never the holder's clock against ours. A lock older than ``stale_after``
  belongs to a dead, suspended or cut-off process and is ignored (and
  removed by ``gc`` and ``gpuckpt unlock``).
* **A dead holder on this host is stale at once** (restic's rule): the lock
  names the holder's boot id, pid and process start time; when the boot id
  is this host's and no such process runs, nobody holds it.
* **Fail closed.** A lock that cannot be fetched (after the store's retries)
  stops the acquisition. A lock of a format version this code does not know
  counts as a live exclusive lock (a newer gc). A lock that does not parse
  (torn, planted) counts as a live exclusive lock for gc — so gc never runs
  beside a save it cannot see — and is ignored by saves; once it is stale by
  the store's clock it is ignored by both.
* **Released** locks are deleted; a holder that may not delete (a
  least-privilege role without ``DeleteObject``) overwrites its lock with a
  released marker instead, which everyone ignores.

A held lock refreshes itself in the background; :meth:`Lock.confirm` tells
a long operation, before it commits, whether its lock is still sure to be
seen as live (no failed refresh, last refresh well within ``stale_after``
on a clock that counts suspended time). ``release`` cannot be undone by a
refresh in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from ckpt import document
from ckpt.errors import (
    AccessDenied,
    ConfigError,
    GpuckptError,
    ObjectNotFound,
    OperationAborted,
    RepositoryLocked,
    StoreError,
    UnsupportedVersion,
)
from ckpt.store.base import Store

KIND = "gpuckpt-lock"
VERSION = 1
PREFIX = "locks/"
DEFAULT_STALE_AFTER = 30 * 60.0
log = logging.getLogger("gpuckpt.lock")


def _boottime() -> float:
    """Seconds on a clock that keeps counting while the host is suspended."""
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):  # not Linux
        return time.monotonic()


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str:
    """The kernel's start time of ``pid`` (clock ticks since boot), "" when unknown or not running."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # the command name may hold spaces and parentheses: fields follow the last ")"
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else ""


BOOT_ID = _boot_id()


@dataclass(frozen=True)
class LockInfo:
    """Another party's lock as read from the store.

    ``problem`` is set for a lock that does not parse (its other fields are
    then placeholders); ``newer`` for one of a format version this code does
    not know; ``mtime`` is the store's time of its last write.
    """

    name: str
    exclusive: bool
    operation: str
    hostname: str
    pid: int
    created: float
    refreshed: float
    mtime: float = 0.0
    boot_id: str = ""
    process_start: str = ""
    released: bool = False
    problem: str | None = None
    newer: bool = False
    mode: str = ""  # "gc": a gc-only exclusive lock (saves may run beside it)
    protocol: int = 1

    def describe(self, now: float | None = None) -> str:
        if self.problem is not None:
            return f"unreadable lock {self.name} ({self.problem})"
        kind = ("gc-only exclusive" if self.mode == "gc" else "exclusive") if self.exclusive else "shared"
        age = (now if now is not None else time.time()) - (self.mtime or self.refreshed)
        return (
            f"{kind} lock {self.name} held by {self.operation!r} on {self.hostname} "
            f"pid {self.pid}, refreshed {age:.0f}s ago"
        )

    def holder_dead(self) -> bool:
        """True only when the holder ran on this host (same boot) and that process is gone."""
        if not self.boot_id or self.boot_id != BOOT_ID or self.pid <= 0:
            return False
        start = _process_start(self.pid)
        return start == "" or (bool(self.process_start) and start != self.process_start)

    def stale(self, store_now: float, stale_after: float) -> bool:
        if self.released:
            return True
        if self.mtime and store_now - self.mtime > stale_after:
            return True
        return self.problem is None and self.holder_dead()

    def blocks(self, exclusive: bool, mode: str = "") -> bool:
        """Whether this (live) lock stops an acquirer of the given kind."""
        if self.newer:
            return True
        if self.problem is not None:
            return exclusive  # gc never runs beside a lock it cannot judge
        if not exclusive:  # a save, delete or forget
            return self.exclusive and self.mode != "gc"
        if mode == "gc":  # a gc-only lock: out of other gcs' way and of saves that ignore condemnation
            return self.exclusive or self.protocol < 2
        return True


def _body(exclusive: bool, operation: str, created: float, released: bool = False, mode: str = "") -> dict[str, Any]:
    return {
        "protocol": 2,
        **({"mode": mode} if mode else {}),
        "exclusive": exclusive,
        "operation": operation,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "boot_id": BOOT_ID,
        "process_start": _process_start(os.getpid()),
        "created": created,
        "refreshed": time.time(),
        "released": released,
    }


def read_lock(store: Store, name: str, mtime: float = 0.0) -> LockInfo | None:
    """Read one lock; None if it vanished. A store failure raises (fail closed)."""
    try:
        data = store.get(name)
    except ObjectNotFound:
        return None
    placeholder = LockInfo(name, True, "?", "?", -1, 0.0, 0.0, mtime)
    try:
        _, b = document.open_envelope(data, kind=KIND, supported=(VERSION,), name=name, keyring=None)
        return LockInfo(
            name,
            bool(b["exclusive"]),
            str(b["operation"]),
            str(b["hostname"]),
            int(b["pid"]),
            float(b["created"]),
            float(b["refreshed"]),
            mtime,
            str(b.get("boot_id", "")),
            str(b.get("process_start", "")),
            bool(b.get("released", False)),
            mode=str(b.get("mode", "")),
            protocol=int(b.get("protocol", 1)),
        )
    except UnsupportedVersion as exc:
        return dataclasses.replace(placeholder, problem=str(exc), newer=True)
    except (GpuckptError, KeyError, TypeError, ValueError) as exc:
        log.warning("unreadable lock object", extra={"object": name, "error": str(exc)})
        return dataclasses.replace(placeholder, problem=f"{type(exc).__name__}: {exc}")


def list_locks(store: Store) -> list[LockInfo]:
    """Every lock object, released markers excluded; raises if one cannot be fetched."""
    out = []
    for o in store.list(PREFIX):
        info = read_lock(store, o.name, o.mtime)
        if info is not None and not info.released:
            out.append(info)
    return out


def store_now(store: Store, name: str) -> float:
    """The store's current time, as the modification time of an object just written."""
    return store.stat(name).mtime


def probe_store_now(store: Store) -> float:
    """The store's current time, by writing (and removing) a probe lock object."""
    name = PREFIX + "probe-" + secrets.token_hex(8)
    store.put(name, document.seal(KIND, VERSION, name, _body(False, "clock probe", time.time(), True), None))
    try:
        return store_now(store, name)
    finally:
        with contextlib.suppress(GpuckptError):
            store.delete(name)


#: set to ``1`` by test suites only: lets ``unlock`` and ``gc`` take locks for stale sooner than
#: :data:`DEFAULT_STALE_AFTER`
SHORT_STALE_ENV = "GPUCKPT_TEST_SHORT_STALE_LIMITS"


def check_stale_limit(stale_after: float) -> None:
    """Refuse (:class:`ConfigError`) a stale limit below the default: a live save refreshes its
    lock every third of the default, so a shorter limit can take it for stale, and a gc then
    deletes what it deduplicated against (its commit re-checks would abort it: a lost save)."""
    if stale_after < DEFAULT_STALE_AFTER and os.environ.get(SHORT_STALE_ENV) != "1":
        raise ConfigError(
            f"a stale limit of {stale_after:.0f}s is below the default of {DEFAULT_STALE_AFTER:.0f}s: live saves "
            f"refresh their locks every {DEFAULT_STALE_AFTER / 3:.0f}s and would be taken for stale; refusing "
            f"(a dead holder on this host is stale at once; --remove-all removes every lock)"
        )


def remove_stale_locks(
    store: Store, stale_after: float = DEFAULT_STALE_AFTER, *, keep: str | None = None, everything: bool = False
) -> list[LockInfo]:
    """Delete the locks that are stale (by the store's clock, or a dead holder on this host), or
    with ``everything`` every lock but ``keep``; returns what was removed. Released markers go too.
    A ``stale_after`` below the default is refused (:func:`check_stale_limit`)."""
    if not everything:
        check_stale_limit(stale_after)
    now = probe_store_now(store) if keep is None else store_now(store, keep)
    removed = []
    for o in store.list(PREFIX):
        if o.name == keep:
            continue
        info = read_lock(store, o.name, o.mtime)
        if info is None:
            continue
        if everything or info.stale(now, stale_after):
            with contextlib.suppress(ObjectNotFound):
                store.delete(o.name)
            removed.append(info)
    return removed


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
        mode: str = "",
    ) -> None:
        if mode not in ("", "gc") or (mode and not exclusive):
            raise ValueError(f"bad lock mode {mode!r}")
        self.store = store
        self.exclusive = exclusive
        self.mode = mode
        self.operation = operation
        self.stale_after = stale_after
        self.name = PREFIX + secrets.token_hex(16)
        self._created = time.time()
        self._stop = threading.Event()
        self._write_lock = threading.Lock()  # a refresh and the release never interleave
        self._released = False
        self._refresh_failed: str | None = None
        self._last_write = 0.0  # _boottime() of the last successful write
        self._acquired = 0.0  # _boottime() when acquiring began
        self._max_gap = 0.0  # the longest time between two successful writes
        #: why the lock is lost (removed from the store), seen by a refresh: never written again
        self._lost: str | None = None
        self._thread: threading.Thread | None = None
        deadline = time.monotonic() + wait
        while True:
            self._acquired = _boottime()
            try:
                self._try_acquire()
                break
            except RepositoryLocked:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(1.0, max(0.05, deadline - time.monotonic())) * (0.5 + secrets.randbelow(100) / 100))
        self._thread = threading.Thread(target=self._refresher, name="gpuckpt-lock-refresh", daemon=True)
        self._thread.start()

    def _write(self, released: bool = False) -> None:
        body = _body(self.exclusive, self.operation, self._created, released, self.mode)
        self.store.put(self.name, document.seal(KIND, VERSION, self.name, body, None))
        now = _boottime()
        if self._last_write:
            self._max_gap = max(self._max_gap, now - self._last_write)
        self._last_write = now

    def _try_acquire(self) -> None:
        self._write()
        try:
            now = store_now(self.store, self.name)
            for other in list_locks(self.store):
                if other.name == self.name or other.stale(now, self.stale_after):
                    continue
                if other.blocks(self.exclusive, self.mode):
                    raise RepositoryLocked(f"repository is locked: {other.describe(now)}")
        except StoreError as exc:
            self._remove()
            if isinstance(exc, ObjectNotFound):
                raise RepositoryLocked(f"our lock {self.name} vanished while acquiring it") from None
            # fail closed: a lock we cannot read may be a gc's or a save's
            raise RepositoryLocked(f"cannot judge the repository's locks ({exc}); not taking the lock") from exc
        except RepositoryLocked:
            self._remove()
            raise

    def _refresher(self) -> None:
        interval = max(1.0, self.stale_after / 3)
        while not self._stop.wait(interval):
            with self._write_lock:
                if self._released:
                    return
                try:
                    # a lock someone removed (as stale) is lost for good: writing it again would
                    # hide that a gc may already have deleted what this holder uses
                    self.store.stat(self.name)
                except ObjectNotFound:
                    self._lost = "was removed from the store while held (by `gpuckpt unlock` or a gc)"
                    log.error("lock removed while held", extra={"object": self.name})
                    return
                except GpuckptError as exc:
                    self._refresh_failed = str(exc)
                    continue
                try:
                    self._write()
                    self._refresh_failed = None
                except GpuckptError as exc:
                    self._refresh_failed = str(exc)
                    log.warning("could not refresh lock", extra={"object": self.name, "error": str(exc)})

    def held_for(self) -> float:
        """Seconds since acquiring began, on a clock that counts suspended time."""
        return _boottime() - self._acquired

    def confirm(self, max_held: float | None = None, *, stale_after: float | None = None) -> None:
        """Raise :class:`OperationAborted` unless the lock is surely still live for everyone.

        Called right before a commit (a save's manifest): if the last refresh
        failed, or the last successful write is older than half of
        ``stale_after`` on a clock that counts suspended time — or two
        successful writes ever were that far apart — another process may
        have taken the lock for stale: the operation must not commit on it.
        With ``max_held``, also if the lock has been held longer than that:
        a save's bound, which a concurrent gc's deletion delay relies on.
        ``stale_after``: the limit others judge this lock by, when it is not
        the one this holder judged theirs by.
        """
        limit = self.stale_after if stale_after is None else stale_after
        if self._lost is not None:
            raise OperationAborted(f"lock {self.name} {self._lost}; not committing")
        # On the store, not in memory: `gpuckpt unlock` or another process's gc may have removed it
        # (taken it for stale) whatever this process's clocks say. First: the time checks below
        # then also cover however long this read took.
        self._check_own(self.store)
        if max_held is not None and self.held_for() > max_held:
            raise OperationAborted(
                f"this save has run {self.held_for():.0f}s, longer than the repository's limit of "
                f"{max_held:.0f}s (a concurrent gc may delete what it deduplicated against); not committing"
            )
        if self._refresh_failed is not None:
            raise OperationAborted(f"lock {self.name} could not be refreshed ({self._refresh_failed}); not committing")
        # Continuity, not just recency: after a gap (a suspended host) a gc may
        # have taken the lock for stale and deleted what this operation uses,
        # even if the lock has been refreshed since.
        age = max(_boottime() - self._last_write, self._max_gap)
        if age > limit / 2:
            raise OperationAborted(
                f"lock {self.name} was last refreshed {age:.0f}s ago (stale after {limit:.0f}s); not committing"
            )

    def _check_own(self, store: Store) -> None:
        """Raise :class:`OperationAborted` unless the lock object on the store is this holder's."""
        try:
            info = read_lock(store, self.name)
        except GpuckptError as exc:
            raise OperationAborted(f"lock {self.name} could not be read back ({exc}); not committing") from None
        if info is None:
            self._lost = "was removed from the store (by `gpuckpt unlock` or a gc that took it for stale)"
            raise OperationAborted(f"lock {self.name} {self._lost}; not committing")
        if info.problem or info.released or info.pid != os.getpid() or info.created != self._created:
            raise OperationAborted(f"lock {self.name} on the store is not this holder's any more; not committing")

    def _remove(self) -> None:
        try:
            self.store.delete(self.name)
        except AccessDenied:
            # A role that may not delete: leave a marker everyone ignores.
            with contextlib.suppress(GpuckptError):
                self._write(released=True)
        except GpuckptError as exc:
            # A lock we cannot remove goes stale and is ignored after stale_after.
            log.warning("could not remove lock", extra={"object": self.name, "error": str(exc)})

    def release(self) -> None:
        self._stop.set()
        with self._write_lock:
            self._released = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._remove()

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
