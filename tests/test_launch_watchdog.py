"""``gpuckpt launch``'s watchdog (:mod:`agent.daemon.watchdog`), with real processes and no engine.

A stand-in launcher starts a worker exactly as ``launch`` does (its own session, the parent-death
signal, the watchdog beside it); the worker listens on a port, holds a client's connection open and
silent, and ignores SIGTERM — as vLLM's API server waiting for connections to close does once its
engine is gone. Whatever kills the launcher, the worker's whole group is gone within the grace and
the client's connection is closed, so it retries at once. ``tests/vllm/test_retries.py`` runs the
same through ``gpuckpt launch`` and ``vllm serve`` with streaming clients.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests.harness.procs import running_in_group
from tests.harness.waiting import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")

WORKER = textwrap.dedent(
    """
    import os, signal, socket, subprocess, sys, time
    if sys.argv[1] == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a server waiting for its streams to close
    # its engine: a child in the same process group
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    print(srv.getsockname()[1], flush=True)
    held = []
    while True:
        conn, _ = srv.accept()
        held.append(conn)  # never answered, never closed
    """
)

LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from agent.daemon import watchdog
    worker = subprocess.Popen(
        [sys.executable, "-c", sys.argv[1], sys.argv[2]],
        start_new_session=True, stdout=subprocess.PIPE, preexec_fn=watchdog.die_with(os.getpid()),
    )
    port = worker.stdout.readline().decode().strip()
    guard = watchdog.start(worker.pid, grace=float(sys.argv[3]))
    print(worker.pid, guard.pid, port, flush=True)
    if sys.argv[4] == "stop":  # launch's own stop: it ends the worker, then the watchdog
        sys.stdin.readline()
        os.killpg(worker.pid, 9)
        worker.wait()
        guard.terminate()
        guard.wait()
        print("stopped", flush=True)
    time.sleep(3600)
    """
)

GRACE_S = 2.0


def _gone(pid: int, group: bool = False) -> bool:
    if group:
        return not running_in_group(pid)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _start(kind: str, mode: str = "die") -> tuple[subprocess.Popen[str], int, int, int]:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, WORKER, kind, str(GRACE_S), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert launcher.stdout is not None
    worker, guard, port = (int(x) for x in launcher.stdout.readline().split())
    return launcher, worker, guard, port


@pytest.mark.parametrize("kind", ["stubborn", "graceful"])
def test_a_killed_launcher_leaves_no_worker_and_no_open_connection(kind: str) -> None:
    launcher, worker, guard, port = _start(kind)
    client = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        launcher.kill()  # SIGKILL: nothing of launch runs after this
        launcher.wait()
        died = time.monotonic()
        # the client's open, silent connection is closed: it sees the end at once and retries
        with contextlib.suppress(ConnectionResetError):  # closed with a reset: the same to a client
            assert client.recv(1) == b""
        wait_for(lambda: _gone(worker, group=True), 60, "the worker's process group to be gone")
        took = time.monotonic() - died
        wait_for(lambda: _gone(guard), 60, "the watchdog to exit")
    finally:
        client.close()
        if not _gone(worker, group=True):
            os.killpg(worker, signal.SIGKILL)
    # the documented bound: SIGKILL follows SIGTERM after the grace (plus the time a busy host takes)
    assert took < GRACE_S + 30, took


def test_a_launcher_that_stops_its_worker_itself_leaves_no_watchdog() -> None:
    launcher, worker, guard, _port = _start("stubborn", "stop")
    assert launcher.stdin is not None
    assert launcher.stdout is not None
    try:
        launcher.stdin.write("\n")
        launcher.stdin.flush()
        assert launcher.stdout.readline().strip() == "stopped"
        assert _gone(guard)
        assert _gone(worker, group=True)
    finally:
        launcher.kill()
        launcher.wait()
