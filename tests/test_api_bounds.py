"""The agent's control API (the real :class:`ApiServer`) against floods, huge requests and stalled clients,
and ``/restore/plan`` kept to the agent's own worker.

The bounds tests run the server in a subprocess (this module run as a
script) with a minimal agent, so the threads it starts (``/proc/PID/task``)
and its peak memory (``VmHWM``) are its own. Its ``GET /status`` is a
long-running request: it returns when the test creates a release file.
Nothing here waits on a clock: every wait is for a condition, with a
generous deadline.
"""

from __future__ import annotations

import itertools
import json
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import ckpt
from agent.daemon import api
from agent.daemon.api import AgentApiError, AgentClient, ApiServer
from ckpt.pins import Pins, WorkerFacts
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
from tests.harness.repo import WORKER_FACTS


@contextmanager
def served(
    tmp: Path, *, max_threads: int = api.MAX_THREADS, request_timeout: float = api.REQUEST_TIMEOUT
) -> Iterator[Served]:
    """This module's agent API (``_serve``), in a subprocess."""
    args = (str(max_threads), str(request_timeout))
    with served_by("tests.test_api_bounds", tmp / "a.sock", tmp / "state", *args, what="the agent API") as s:
        yield s


def health(sock: Path) -> Any:
    with AgentClient(sock, timeout=PATIENCE) as c:
        return c.request("GET", "/health")


def running(srv: Served) -> int:
    return len(list(srv.state.glob("running-*")))


def slow_status(srv: Served) -> tuple[Any, list[Any]]:
    def get() -> Any:
        with AgentClient(srv.sock, timeout=PATIENCE) as c:
            return c.request("GET", "/status")

    return in_thread(get)


# -- bounds --------------------------------------------------------------------------------------


def test_an_idle_flood_costs_bounded_threads_and_the_api_keeps_answering(short_tmp: Path) -> None:
    enough_fds(FLOOD)
    with served(short_tmp) as srv:
        base_threads, base_rss = srv.threads(), srv.kib("VmRSS")
        conns: list[socket.socket] = []
        try:
            # One thread per served connection, however many connect and say nothing.
            peak = srv.idle_flood(conns, base_threads + api.MAX_THREADS)
            assert health(srv.sock) == {"ok": True, "state": "ready", "worker_attached": False}
            rss = srv.kib("VmRSS")
        finally:
            for s in conns:
                s.close()
    print(f"threads {base_threads} -> peak {peak}; RSS {base_rss} -> {rss} KiB after {FLOOD} connections")
    assert rss - base_rss < 64 << 10, (base_rss, rss)


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /", b"414"),  # the request line
        (b"GET /health HTTP/1.1\r\nHost: agent\r\nX-Pad: ", b"431"),  # a header line
        (b"POST /checkpoint HTTP/1.1\r\nHost: agent\r\nContent-Length: 1073741824\r\n\r\n", b"413"),  # the body
    ],
    ids=["request-line", "header", "body"],
)
def test_a_gigabyte_request_is_refused_at_once(short_tmp: Path, head: bytes, status: bytes) -> None:
    with served(short_tmp) as srv:
        hwm0 = srv.kib("VmHWM")
        chunk = b"a" * (1 << 20)
        sent = 0
        with connect(srv.sock) as s:
            s.sendall(head)
            try:
                while sent < 1 << 30:  # streamed: refused long before its end
                    s.sendall(chunk)
                    sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            answer = read_until_eof(s)
        growth = (srv.kib("VmHWM") - hwm0) << 10
        assert health(srv.sock)["ok"] is True
    print(f"refused within {sent + len(chunk)} bytes sent; peak RSS grew {growth >> 10} KiB")
    assert sent < 1 << 30
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
    assert growth < 16 << 20  # limits of 64 KiB: never the gigabyte


def test_a_stalled_request_is_dropped_and_a_long_request_is_not(short_tmp: Path) -> None:
    with served(short_tmp, request_timeout=1.0) as srv:
        t, out = slow_status(srv)
        wait_for(lambda: running(srv) == 1, "the long request to start")
        with connect(srv.sock) as half, connect(srv.sock) as idle:
            half.sendall(b"GET /health HTTP/1.1\r\nHost: agent\r\n")  # and never the blank line
            answer = read_until_eof(half)
            silence = read_until_eof(idle)  # an idle keep-alive connection is closed without a word
        # Both were dropped after their 1 s; the request handled all that while was not.
        assert t.is_alive()
        (srv.state / "release").touch()
        t.join(PATIENCE)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"the request did not arrive whole within 1 s" in answer
    assert silence == b""
    assert out == [{"released": True}]


def test_a_stalled_client_gives_way_to_a_new_one(short_tmp: Path) -> None:
    with served(short_tmp, max_threads=1) as srv, connect(srv.sock) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")  # takes the only thread, and would keep it for 10 s
        assert health(srv.sock)["ok"] is True
        answer = read_until_eof(s)
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert b"connection dropped for a new one: 1 were open" in answer


def test_503_when_every_thread_handles_a_request(short_tmp: Path) -> None:
    with served(short_tmp, max_threads=2) as srv:
        calls = [slow_status(srv) for _ in range(2)]
        wait_for(lambda: running(srv) == 2, "both long requests to start")
        with connect(srv.sock) as s:
            answer = read_until_eof(s)
        (srv.state / "release").touch()
        for t, _ in calls:
            t.join(PATIENCE)
        assert [out for _, out in calls] == [[{"released": True}]] * 2
        assert health(srv.sock)["ok"] is True
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), answer
    assert json.loads(body)["error"]["message"] == "the agent is handling 2 requests, its limit; try again"


# -- /restore/plan is the agent's own worker's --------------------------------------------------


def test_restore_plan_resolves_only_this_workers_checkpoints(short_tmp: Path) -> None:
    repo = ckpt.Repository.open(str(short_tmp / "repo"), create=True)
    worker = WorkerFacts.model_validate(WORKER_FACTS)
    ids = {}
    for w in ("w0", "w1"):
        block = ckpt.Block.from_array(w.encode(), np.arange(64, dtype=np.float16))
        m = repo.save(
            [block],
            worker_id=w,
            namespace=ckpt.Namespace({"engine": "test"}),
            pins=Pins(host=ckpt.host_facts(), worker=worker),
        )
        ids[w] = m.id
    # Ids start with the time: they share a prefix (the year, at least).
    both = "".join(a for a, _ in itertools.takewhile(lambda p: p[0] == p[1], zip(ids["w0"], ids["w1"], strict=False)))
    assert both
    from agent import engines

    agent = SimpleNamespace(
        repo=repo,
        engine=engines.get("vllm", short_tmp / "none.sock"),
        cfg=SimpleNamespace(
            worker_id="w0", connector_socket=str(short_tmp / "none.sock"), restore=SimpleNamespace(ignore_rules=[])
        ),
    )
    server = ApiServer(agent, short_tmp / "a.sock")  # type: ignore[arg-type]
    server.start()
    try:
        with AgentClient(short_tmp / "a.sock", timeout=PATIENCE) as c:
            for ref in ("latest", "w0:latest", ids["w0"], both, f"w0/{ids['w0']}"):  # both: not ambiguous here
                plan = c.request("GET", f"/restore/plan?checkpoint={ref}")
                assert plan["checkpoint"] == ids["w0"], ref
                assert plan["warm"] is False  # no worker attached: said, not failed
            for ref in (ids["w1"], ids["w1"][:-2], "w1:latest", f"w1/{ids['w1']}", f"w0/{ids['w1']}"):
                with pytest.raises(AgentApiError) as e:
                    c.request("GET", f"/restore/plan?checkpoint={ref}")
                assert e.value.status == 404, ref
                assert "checkpoint of worker w0" in str(e.value), str(e.value)
    finally:
        server.stop()
        repo.close()


# -- the server, run as ``python -m tests.test_api_bounds SOCK STATE MAX_THREADS TIMEOUT`` -------


class _MiniAgent:
    """What :func:`agent.daemon.api.route` reads for ``/health`` and ``/status``."""

    state = "ready"

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.worker = {"attached": False}
        self._n = itertools.count()

    def healthy(self) -> bool:
        return True

    def status(self) -> dict[str, Any]:  # a long-running request, until the test releases it
        (self.dir / f"running-{next(self._n)}").touch()
        while not (self.dir / "release").exists():
            time.sleep(0.01)
        return {"released": True}


def _serve(argv: list[str]) -> None:
    sock, state = Path(argv[0]), Path(argv[1])
    server = ApiServer(
        _MiniAgent(state),  # type: ignore[arg-type]
        sock,
        max_threads=int(argv[2]),
        request_timeout=float(argv[3]),
    )
    server.start()
    print("ready", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    server.stop()


if __name__ == "__main__":
    _serve(sys.argv[1:])
