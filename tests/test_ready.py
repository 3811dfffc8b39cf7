"""Readiness (``GET /ready``, ``gpuckpt agent ready``) and the bounded wait of ``gpuckpt checkpoint
--wait --timeout``: what the Kubernetes chart's readiness probe and the worker's ``preStop`` run.

The real :class:`~agent.daemon.api.ApiServer` and the real CLI serve a stand-in agent (only what
the routes read) and a stand-in worker API (an HTTP server on loopback answering ``/health`` with
the status a test sets); no engine is needed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agent import engines
from agent.daemon.api import ApiServer, route
from agent.daemon.restore_at_start import RestoreReport
from agent.engines.types import Staging
from tests.harness.agent import make_cfg
from tests.harness.cli import invoke


class _Worker:
    """A worker's API on loopback: ``/health`` answers ``status``; ``hits`` counts the asks."""

    def __init__(self) -> None:
        self.status = 200
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits += 1
                self.send_response(outer.status if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Ticket:
    def __init__(self, state: str) -> None:
        self.state = state

    def to_json(self) -> dict[str, Any]:
        done = self.state == "done"
        return {
            "id": 1,
            "state": self.state,
            "triggers": ["drain"],
            "checkpoint": "c1" if done else None,
            "error": None,
            "progress": None,
        }


class _Agent:
    """What the readiness and checkpoint routes read of :class:`agent.daemon.agent.Agent`."""

    def __init__(self, tmp: Path, worker_url: str | None, state: str = "ready") -> None:
        self.cfg = make_cfg(tmp, worker_url=worker_url)
        self.state = state
        self.worker = {"attached": True}
        self.restore_report: RestoreReport | None = None
        self.ticket_states: list[str] = []  # what GET /checkpoint/1 answers, in turn (the last one stays)
        self.triggers: list[str] = []

    def healthy(self) -> bool:
        return True

    def request_checkpoint(self, trigger: str) -> _Ticket:
        self.triggers.append(trigger)
        return _Ticket("pending")

    def ticket(self, ticket_id: int) -> _Ticket | None:
        state = self.ticket_states.pop(0) if len(self.ticket_states) > 1 else self.ticket_states[0]
        return _Ticket(state) if ticket_id == 1 else None


@pytest.fixture
def worker() -> Iterator[_Worker]:
    w = _Worker()
    yield w
    w.close()


@pytest.fixture
def served(short_tmp: Path, worker: _Worker) -> Iterator[tuple[_Agent, str]]:
    """The stand-in agent behind the real API server; its socket path."""
    agent = _Agent(short_tmp, worker.url)
    sock = short_tmp / "a.sock"
    server = ApiServer(agent, sock)  # type: ignore[arg-type]
    server.start()
    yield agent, str(sock)
    server.stop()


def _ready(agent: _Agent) -> dict[str, Any]:
    status, body = route(agent, "GET", "/ready", {}, dict)  # type: ignore[arg-type]
    assert status == 200
    return body  # type: ignore[no-any-return]


def test_not_ready_while_the_restore_at_start_runs_and_the_worker_is_not_asked(
    short_tmp: Path, worker: _Worker
) -> None:
    agent = _Agent(short_tmp, worker.url, state="restoring")
    agent.restore_report = RestoreReport(started_at="t0", checkpoint="ckpt-7")
    r = _ready(agent)
    assert r["ready"] is False
    assert r["awaiting"] == ["the restore at start of checkpoint ckpt-7"]
    assert worker.hits == 0  # nothing else is awaited before the worker is asked

    agent.state = "starting"
    assert _ready(agent)["awaiting"] == ["the agent's start (state starting)"]


@pytest.mark.parametrize("outcome", ["warm", "cold", "failed", None])
def test_ready_once_the_restore_finished_whatever_its_outcome_and_the_worker_answers(
    short_tmp: Path, worker: _Worker, outcome: str | None
) -> None:
    agent = _Agent(short_tmp, worker.url)
    if outcome is not None:
        agent.restore_report = RestoreReport(started_at="t0", checkpoint="ckpt-7", outcome=outcome)
    r = _ready(agent)
    assert r == {
        "ready": True,
        "awaiting": [],
        "state": "ready",
        "restore": None if outcome is None else agent.restore_report.to_json(results=False),  # type: ignore[union-attr]
        "worker": {"answers": True, "error": None},
    }
    assert worker.hits == 1


def test_not_ready_while_the_worker_does_not_answer(short_tmp: Path, worker: _Worker) -> None:
    agent = _Agent(short_tmp, worker.url)
    worker.status = 503  # loading its model, or draining
    r = _ready(agent)
    assert r["ready"] is False
    assert r["awaiting"] == [f"the worker ({worker.url}/health answered 503)"]
    worker.close()  # gone
    r = _ready(agent)
    assert r["ready"] is False
    assert r["awaiting"][0].startswith(f"the worker ({worker.url} does not answer: ")


def test_without_a_worker_url_the_control_socket_must_answer(short_tmp: Path) -> None:
    agent = _Agent(short_tmp, None)
    # the real engine, its connector socket absent: no worker there
    agent.engine = engines.get("vllm", agent.cfg.connector_socket, Staging())  # type: ignore[attr-defined]
    r = _ready(agent)
    assert r["ready"] is False
    assert r["awaiting"][0].startswith("the worker (its control socket does not answer: ")
    assert str(agent.cfg.connector_socket) in r["awaiting"][0]


def test_never_ready_while_stopping(short_tmp: Path, worker: _Worker) -> None:
    agent = _Agent(short_tmp, worker.url, state="stopping")
    r = _ready(agent)
    assert (r["ready"], r["awaiting"]) == (False, ["a new start: the agent is stopping"])


def test_agent_ready_exits_0_only_when_ready_and_names_what_is_awaited(
    served: tuple[_Agent, str], worker: _Worker
) -> None:
    agent, sock = served
    agent.state = "restoring"
    res = invoke("agent", "ready", "--agent", sock)
    assert res.exit_code == 7
    assert "not ready: awaiting the restore at start" in res.stderr

    agent.state = "ready"
    agent.restore_report = RestoreReport(started_at="t0", checkpoint="ckpt-7", outcome="warm")
    res = invoke("agent", "ready", "--agent", sock)
    assert (res.exit_code, res.stdout.strip()) == (0, "ready (restore at start: warm)")

    worker.status = 500
    res = invoke("agent", "ready", "--agent", sock, "--json")
    assert res.exit_code == 7
    doc = json.loads(res.stdout)
    assert doc["ready"] is False
    assert doc["awaiting"] == [f"the worker ({worker.url}/health answered 500)"]
    assert doc["restore"]["outcome"] == "warm"


def test_agent_ready_without_an_agent_is_not_ready(short_tmp: Path) -> None:
    res = invoke("agent", "ready", "--agent", str(short_tmp / "none.sock"))
    assert res.exit_code == 7
    assert "no agent answering" in res.stderr


def test_checkpoint_wait_with_a_timeout_gives_up_and_says_so(served: tuple[_Agent, str]) -> None:
    agent, sock = served
    agent.ticket_states = ["capturing"]  # never done
    res = invoke("checkpoint", "--agent", sock, "--drain", "--wait", "--timeout", "1s")
    assert res.exit_code == 1
    assert "checkpoint ticket 1 not done within 1 s (state capturing); the agent goes on with it" in res.stderr
    assert agent.triggers == ["drain"]


def test_checkpoint_wait_with_a_timeout_returns_when_done(served: tuple[_Agent, str]) -> None:
    agent, sock = served
    agent.ticket_states = ["capturing", "saving", "done"]
    res = invoke("checkpoint", "--agent", sock, "--drain", "--wait", "--timeout", "10m")
    assert res.exit_code == 0, res.output
    assert "checkpoint c1 saved" in res.stdout


def test_timeout_needs_wait(served: tuple[_Agent, str]) -> None:
    _agent, sock = served
    res = invoke("checkpoint", "--agent", sock, "--timeout", "1s")
    assert res.exit_code == 2
    assert "--timeout bounds --wait" in res.output
