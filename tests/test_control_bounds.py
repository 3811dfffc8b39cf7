"""The connector's control channel (:class:`ControlServer`) against floods, huge lines and stalled clients.

The server runs in a subprocess (this module run as a script, through
:mod:`tests.harness.bounds`), so the threads it starts (``/proc/PID/task``)
and its peak memory (``VmHWM``) are its own. Its handler knows ``ping`` and
``block``: a long-running call (as ``capture`` or ``wait`` are) that returns
when the test creates a release file. Nothing here waits on a clock: every
wait is for a condition, with a generous deadline.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from agent.engines import control
from tests.harness.bounds import (
    FLOOD,
    PATIENCE,
    Served,
    connect,
    enough_fds,
    in_thread,
    read_until_eof,
    served_by,
    wait_for,
)


@contextmanager
def served(
    tmp: Path, *, max_connections: int = control.MAX_CONNECTIONS, request_timeout: float = control.REQUEST_TIMEOUT
) -> Iterator[Served]:
    """This module's control server (``_serve``), in a subprocess."""
    args = (str(max_connections), str(request_timeout))
    with served_by("tests.test_control_bounds", tmp / "c.sock", tmp / "state", *args, what="the control server") as s:
        yield s


# -- the tests --------------------------------------------------------------------------------


def test_an_idle_flood_costs_bounded_threads_and_the_channel_keeps_answering(short_tmp: Path) -> None:
    enough_fds(FLOOD)
    with served(short_tmp) as srv:
        base_threads, base_rss = srv.threads(), srv.kib("VmRSS")
        conns: list[socket.socket] = []
        try:
            # One thread per served connection, however many connect and say nothing.
            peak = srv.idle_flood(conns, base_threads + control.MAX_CONNECTIONS)
            # With every idle connection still open, a real call is answered.
            assert control.call(srv.sock, "ping", io_timeout=PATIENCE)["ok"] is True
            rss = srv.kib("VmRSS")
        finally:
            for s in conns:
                s.close()
    print(f"threads {base_threads} -> peak {peak}; RSS {base_rss} -> {rss} KiB after {FLOOD} connections")
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


def test_the_socket_is_owner_only_replaces_a_stale_one_and_leaves_the_umask_alone(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bound in a private directory and moved into place: 0600 from its first moment, a killed
    worker's socket file replaced, and no process-wide umask — the server runs inside the engine's
    process, whose other threads create files and directories meanwhile."""
    import os
    import stat

    path = short_tmp / "ctl.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # a killed worker's: nobody listens
    stale.close()
    umask_calls: list[int] = []
    real_umask = os.umask
    monkeypatch.setattr(os, "umask", lambda m: umask_calls.append(m) or real_umask(m))
    srv = control.ControlServer(path, lambda msg: {"ok": True})
    monkeypatch.undo()
    try:
        assert umask_calls == [], "the server changed the process's umask"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert not [p for p in short_tmp.iterdir() if p.name.startswith(".g")], "its private directory is left"
        with contextlib.closing(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)) as c:
            c.connect(str(path))
            c.sendall(b'{"cmd": "ping"}\n')
            assert json.loads(c.makefile().readline())["ok"] is True
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
