"""The worker never outlives ``gpuckpt launch`` by more than :data:`GRACE_S`: the launcher's watchdog.

``launch`` starts its worker in a session of its own, with Linux's parent-death signal (SIGTERM)
armed on the worker's first process. That alone is not enough: vLLM's API server takes SIGTERM as
a graceful shutdown, and with its engine gone it can wait for its clients' streams to close —
uvicorn's "Waiting for connections to close" — while the streams stay open and silent, their
clients waiting out a read timeout (the ``openai`` client's is ten minutes), the worker's processes
still there.

So ``launch`` also starts this watchdog (:func:`start`), in a session of its own, its parent-death
signal armed too. When ``launch`` dies — by any signal, SIGKILL and the OOM killer included — the
watchdog sends SIGTERM to the worker's process group (the engine's own shutdown: vLLM ends the
requests in flight, which gpuckpt's middleware turns into errors their clients retry), waits up to
``grace`` seconds for the worker's first process to end (followed by its pidfd), then SIGKILLs the
whole group whatever remains: no process of the worker is left, and every client connection it
held is closed, so the clients retry at once. A ``launch`` that stops the worker itself (SIGTERM to
``launch``: final checkpoint, then the worker) ends the watchdog after it; a watchdog whose
worker's first process ended exits by itself (``launch`` sees to the rest).

Runs as ``python -m agent.daemon.watchdog LAUNCH_PID WORKER_PGID GRACE_S`` and imports nothing of
gpuckpt's: it starts in milliseconds and holds no secret.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable

#: how long the worker's graceful shutdown may take once ``launch`` is dead, before SIGKILL
GRACE_S = 5.0
#: how often the watchdog looks at its parent and the worker's group
POLL_S = 0.2

_PR_SET_PDEATHSIG = 1


def start(worker_pgid: int, grace: float = GRACE_S) -> subprocess.Popen[bytes] | None:
    """Start the watchdog of the worker whose process group is ``worker_pgid`` (from ``launch``,
    right after starting the worker). ``None`` off Linux (no parent-death signal)."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    return subprocess.Popen(
        [sys.executable, "-m", "agent.daemon.watchdog", str(parent), str(worker_pgid), str(grace)],
        start_new_session=True,  # out of the worker's group, and of a terminal's
        stdin=subprocess.DEVNULL,
        preexec_fn=_arm(parent),
    )


def _parent_death_signal() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def die_with(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for the worker: it gets SIGTERM when ``launch`` (``parent``) dies, by any
    signal, SIGKILL included (Linux's parent-death signal; the engine then shuts its own children
    down, and :func:`start`'s watchdog makes sure it does), so a supervisor that dies never leaves
    a worker serving, holding the GPU and the port, with no agent beside it."""

    def arm() -> None:
        _parent_death_signal()
        if os.getppid() != parent:  # launch died before the signal was armed: do not start
            os._exit(1)

    return arm if sys.platform.startswith("linux") else None


def _arm(parent: int) -> Callable[[], None]:
    def arm() -> None:
        # held until main() handles it (the mask outlives exec): launch may die while this
        # interpreter still starts, and SIGTERM's default action would end the watchdog silently
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        _parent_death_signal()
        if os.getppid() != parent:  # launch died before the signal was armed: the worker runs, end it
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def _ended(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has ended (its pidfd reads as ready then)."""
    return bool(select.select([pidfd], [], [], 0)[0])


def end_group(pgid: int, grace: float, leader: int | None = None) -> bool:
    """SIGTERM the group, wait up to ``grace`` seconds for its first process (``leader``, a pidfd)
    to end, then SIGKILL the whole group whatever remains. Returns whether the leader was still
    there at the end of the grace."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not (leader is not None and _ended(leader)):
        time.sleep(POLL_S)
    lingered = leader is None or not _ended(leader)
    # unconditionally: a group's liveness as kill(-pgid, 0) sees it is no proof of its end, and a
    # process the leader left behind (an engine core) must not outlive the grace either
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    return lingered


def main(argv: list[str]) -> int:
    parent, pgid, grace = int(argv[0]), int(argv[1]), float(argv[2])
    orphaned = False

    def on_term(*_: object) -> None:
        nonlocal orphaned
        orphaned = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is launch's to handle
    try:
        leader: int | None = os.pidfd_open(pgid)  # the worker's first process: it leads its group
    except ProcessLookupError:
        leader = None  # already ended (and reaped): launch sees to it
    except OSError:
        leader = None  # no pidfd here: the grace is waited out whole
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one that came meanwhile lands now
    while not orphaned:
        if os.getppid() != parent:  # the parent-death signal's fallback
            break
        if leader is not None and _ended(leader):
            return 0  # the worker ended: launch reaps it and stops
        time.sleep(POLL_S)
    if os.getppid() == parent:
        return 0  # launch is alive: it stops the worker itself (SIGTERM came from someone else)
    if end_group(pgid, grace, leader):
        print(
            f"gpuckpt watchdog: launch ({parent}) died; the worker (group {pgid}) did not stop within "
            f"{grace:g} s of SIGTERM and was killed",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
