"""The connector's control channel (:class:`ControlServer`) against floods, huge lines and stalled clients.

The server runs in a subprocess (this module run as a script), so the
threads it starts (``/proc/PID/task``) and its peak memory (``VmHWM``) are
its own. Its handler knows ``ping`` and ``block``: a long-running call (as
``capture`` or ``wait`` are) that returns when the test creates a release
file. Nothing here waits on a clock: every wait is for a condition, with a
generous deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.engines import control

ROOT = Path(__file__).resolve().parent.parent
FLOOD = 2000
PATIENCE = 120.0  # seconds: a deadline only a broken server reaches


@dataclass
class Served:
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


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can exceed that.
    import shutil

    d = Path(tempfile.mkdtemp(prefix="gpc-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@contextmanager
def served(
    tmp: Path, *, max_connections: int = control.MAX_CONNECTIONS, request_timeout: float = control.REQUEST_TIMEOUT
) -> Iterator[Served]:
    sock, state = tmp / "c.sock", tmp / "state"
    state.mkdir()
    args = [str(sock), str(state), str(max_connections), str(request_timeout)]
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.test_control_bounds", *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline() == "ready\n", "the control server did not start"
        yield Served(p.pid, sock, state)
    finally:
        assert p.stdin is not None
        p.stdin.close()  # the server closes and exits
        try:
            p.wait(PATIENCE)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


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
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# -- the tests --------------------------------------------------------------------------------


def test_an_idle_flood_costs_bounded_threads_and_the_channel_keeps_answering(short_tmp: Path) -> None:
    enough_fds(FLOOD)
    with served(short_tmp) as srv:
        base_threads, base_rss = srv.threads(), srv.kib("VmRSS")
        conns: list[socket.socket] = []
        peak = base_threads
        try:
            for i in range(FLOOD):  # connect and say nothing; all stay open on this side
                conns.append(connect(srv.sock))
                if i % 50 == 0:
                    peak = max(peak, srv.threads())
            peak = max(peak, srv.threads())
            # With every idle connection still open, a real call is answered.
            assert control.call(srv.sock, "ping", io_timeout=PATIENCE)["ok"] is True
            rss = srv.kib("VmRSS")
        finally:
            for s in conns:
                s.close()
    print(f"threads {base_threads} -> peak {peak}; RSS {base_rss} -> {rss} KiB after {FLOOD} connections")
    # One thread per served connection and the accept loop's; a thread joined just now may
    # linger in /proc for a moment, hence the small allowance.
    assert peak <= base_threads + control.MAX_CONNECTIONS + 2, (base_threads, peak)
    assert rss - base_rss < 64 << 10, (base_rss, rss)


def test_an_overlong_line_is_refused_at_the_limit(short_tmp: Path) -> None:
    with served(short_tmp) as srv:
        hwm0 = srv.kib("VmHWM")
        chunk = b"x" * (1 << 20)
        sent = 0
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(PATIENCE)
            s.connect(str(srv.sock))
            s.sendall(b'{"cmd": "ping", "pad": "')
            try:
                while sent < 1 << 30:  # a 1 GiB line, streamed: refused long before its end
                    s.sendall(chunk)
                    sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            answer = read_until_eof(s)
        growth = (srv.kib("VmHWM") - hwm0) << 10
        assert control.call(srv.sock, "ping", io_timeout=PATIENCE)["ok"] is True
    print(f"sent {sent >> 20} MiB before the refusal; peak RSS grew {growth >> 20} MiB")
    assert sent < 1 << 30
    reply = json.loads(answer)
    assert reply["ok"] is False
    assert f"longer than {control.MAX_LINE} bytes (64 MiB)" in reply["error"], reply
    assert growth < 256 << 20  # the limit and some change, never the gigabyte


def test_a_stalled_request_is_dropped_and_a_long_call_is_not(short_tmp: Path) -> None:
    with served(short_tmp, request_timeout=1.0) as srv:
        t, out = in_thread(lambda: control.call(srv.sock, "block", name="a", io_timeout=PATIENCE))
        wait_for((srv.state / "running-a").exists, "the long call to start")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(srv.sock))
            s.sendall(b'{"cmd": "pi')  # half a request, then nothing
            answer = read_until_eof(s)
        # The stalled client was dropped after its 1 s; the call running all that while was not.
        assert t.is_alive()
        (srv.state / "release-a").touch()
        t.join(PATIENCE)
    reply = json.loads(answer)
    assert reply["ok"] is False
    assert "did not arrive whole within 1 s (11 bytes came)" in reply["error"], reply
    assert out == [{"ok": True, "released": "a"}]


def test_a_stalled_client_gives_way_to_a_new_one(short_tmp: Path) -> None:
    with served(short_tmp, max_connections=1) as srv, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(srv.sock))
        s.sendall(b'{"cmd": "pi')  # takes the only slot, and would keep it for 30 s
        assert control.call(srv.sock, "ping", io_timeout=PATIENCE)["ok"] is True
        answer = read_until_eof(s)
    reply = json.loads(answer)
    assert reply["ok"] is False
    assert "connection dropped for a new one: 1 were open" in reply["error"], reply


def test_busy_when_every_connection_runs_a_call(short_tmp: Path) -> None:
    with served(short_tmp, max_connections=2) as srv:
        calls = [
            in_thread(lambda n=n: control.call(srv.sock, "block", name=n, io_timeout=PATIENCE))  # type: ignore[misc]
            for n in ("a", "b")
        ]
        for n in ("a", "b"):
            wait_for((srv.state / f"running-{n}").exists, f"call {n} to start")
        with pytest.raises(control.ControlError, match="busy: all 2 connections are running requests"):
            control.call(srv.sock, "ping", io_timeout=PATIENCE)
        for n in ("a", "b"):
            (srv.state / f"release-{n}").touch()
        for t, _ in calls:
            t.join(PATIENCE)
        assert [out for _, out in calls] == [[{"ok": True, "released": "a"}], [{"ok": True, "released": "b"}]]
        assert control.call(srv.sock, "ping", io_timeout=PATIENCE)["ok"] is True


def test_pipelined_requests_on_one_connection_each_get_their_reply(short_tmp: Path) -> None:
    with served(short_tmp) as srv, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(srv.sock))
        s.sendall(b'{"cmd": "ping"}\n[1]\n{"cmd": "nope"}\n')
        s.shutdown(socket.SHUT_WR)
        lines = read_until_eof(s).splitlines()
    replies = [json.loads(x) for x in lines]
    assert replies[0]["ok"] is True
    assert replies[1] == {"ok": False, "error": "malformed request: a request is a JSON object"}
    assert replies[2] == {"ok": False, "error": "unknown command 'nope'"}


# -- the server, run as ``python -m tests.test_control_bounds SOCK STATE MAX TIMEOUT`` ----------


def test_unfinished_requests_are_bounded_across_connections(short_tmp: Path) -> None:
    """Each connection may send up to max_line; together they may not hold more than max_buffered."""
    mib = 1 << 20
    srv = control.ControlServer(
        short_tmp / "b.sock", lambda req: {"ok": True}, max_line=mib, max_buffered=mib + mib // 2
    )
    try:
        part = b'{"cmd": "ping", "pad": "' + b"x" * (mib - 100)  # under max_line, no newline yet
        a = connect(short_tmp / "b.sock")
        a.sendall(part)
        wait_for(lambda: srv._slots.buffered() >= len(part), "the first partial request to be held")
        b = connect(short_tmp / "b.sock")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            b.sendall(part)
        reply = json.loads(read_until_eof(b))
        assert reply["ok"] is False
        assert "bytes of unfinished requests are held" in reply["error"], reply
        a.sendall(b'"}\n')  # the first still completes
        got = b""
        while not got.endswith(b"\n"):
            got += a.recv(1 << 16)
        assert json.loads(got) == {"ok": True}
        a.close()
        b.close()
        assert control.call(short_tmp / "b.sock", "ping", io_timeout=PATIENCE)["ok"] is True
    finally:
        srv.close()


def _serve(argv: list[str]) -> None:
    sock, state = Path(argv[0]), Path(argv[1])

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        if req.get("cmd") == "ping":
            return {"ok": True}
        if req.get("cmd") == "block":
            name = str(req["name"])
            (state / f"running-{name}").touch()
            while not (state / f"release-{name}").exists():
                time.sleep(0.01)
            return {"ok": True, "released": name}
        return {"ok": False, "error": f"unknown command {req.get('cmd')!r}"}

    server = control.ControlServer(sock, handle, max_connections=int(argv[2]), request_timeout=float(argv[3]))
    print("ready", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    server.close()


if __name__ == "__main__":
    _serve(sys.argv[1:])
