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


@dataclass
class Served:
    """The server's process, its socket and the directory its handlers leave marks in."""

    pid: int
    sock: Path
    state: Path

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/task"))

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
