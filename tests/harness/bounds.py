"""A server under load from the test: run in a subprocess (so the threads it starts, in
``/proc/PID/task``, and its peak memory, ``VmHWM``, are its own), driven over a Unix socket with
floods, huge lines and stalled clients. Nothing here waits on a clock: every wait is for a
condition, with a deadline only a broken server reaches."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness import waiting
from tests.harness.paths import ROOT

FLOOD = 2000
PATIENCE = 120.0  # seconds: a deadline only a broken server reaches
_PF_EXITING = 0x4  # linux/sched.h: the task has entered do_exit


@dataclass
class Served:
    """The server's process, its socket and the directory its handlers leave marks in."""

    pid: int
    sock: Path
    state: Path

    def threads(self) -> int:
        """The server's threads that have not begun to exit.

        A thread the server has joined is still listed in ``/proc/PID/task`` while the kernel
        tears it down, and on a busy host several can sit there at once (CI counted 4): those
        have ``PF_EXITING`` in their flags, or their entry is already unreadable. They are not
        the server's to bound, so they are not counted; a thread counted here is one that
        runs or can run."""
        live = 0
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            try:
                stat = Path(f"/proc/{self.pid}/task/{tid}/stat").read_text()
            except OSError:  # gone between the listing and the read
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
            state, flags = fields[0], int(fields[6])  # stat fields 3 and 9
            if state not in ("Z", "X") and not flags & _PF_EXITING:
                live += 1
        return live

    def threads_within(self, bound: int) -> int:
        """The most live threads seen while waiting for the server to be within ``bound``.

        A thread joined by the server an instant ago is still in its C library's exit, where
        ``/proc`` cannot tell it from one that runs; on a busy host a few sit there at once. So
        a count above the bound is looked at again until it comes down: threads held, one per
        connection, never do, and fail here naming the count."""
        seen: list[int] = []

        def within() -> bool:
            seen.append(self.threads())
            return seen[-1] <= bound

        try:
            waiting.wait_for(within, PATIENCE, "", interval=0.01)
        except TimeoutError:
            kept = f"the server kept {seen[-1]} threads for {PATIENCE:g} s"
            raise AssertionError(f"{kept}, over its bound of {bound}") from None
        return max(seen)

    def idle_flood(self, conns: list[socket.socket], bound: int) -> int:
        """Open :data:`FLOOD` connections that say nothing (into ``conns``, which the caller
        closes), checking the server's threads stay within ``bound`` as they come; the most
        seen."""
        peak = self.threads_within(bound)
        for i in range(FLOOD):
            conns.append(connect(self.sock))
            if i % 50 == 0:
                peak = max(peak, self.threads_within(bound))
        return max(peak, self.threads_within(bound))

    def kib(self, field: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise AssertionError(f"no {field} in /proc/{self.pid}/status")


@contextmanager
def served_by(module: str, sock: Path, state: Path, *args: str, what: str) -> Iterator[Served]:
    """``python -m MODULE SOCK STATE ARGS``, which prints ``ready`` once it serves and stops when
    its stdin closes (at the end of the block)."""
    state.mkdir()
    p = subprocess.Popen(
        [sys.executable, "-m", module, str(sock), str(state), *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline() == "ready\n", f"{what} did not start"
        yield Served(p.pid, sock, state)
    finally:
        assert p.stdin is not None
        p.stdin.close()  # the server stops and exits
        try:
            p.wait(PATIENCE)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_for(cond: Callable[[], object], what: str) -> None:
    """Until ``cond()`` holds, checked often (the tests wait for a server's threads to move)."""
    waiting.wait_for(cond, PATIENCE, f"gave up waiting for {what}", interval=0.01)


def enough_fds(n: int) -> None:
    """Raise the soft descriptor limit to hold ``n`` connections (and spares), or skip saying why."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = n + 256
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below the {need} descriptors {n} connections need")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def connect(path: Path) -> socket.socket:
    """A connection, waiting (not failing) while the server's accept backlog is full."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(PATIENCE)
    deadline = time.monotonic() + PATIENCE
    while True:
        try:
            s.connect(str(path))
            return s
        except BlockingIOError:  # a full backlog: EAGAIN, for a socket with a timeout
            if time.monotonic() > deadline:
                s.close()
                raise
            time.sleep(0.001)


def read_until_eof(s: socket.socket) -> bytes:
    s.settimeout(PATIENCE)
    got = b""
    try:
        while chunk := s.recv(1 << 16):
            got += chunk
    except ConnectionResetError:
        pass  # what came before the reset is the answer
    return got


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``fn`` in a daemon thread; its result or exception lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out
