"""The agent's control API: HTTP/1.1 with JSON bodies over a Unix socket.

=======  ==========================  ===========================================
method   path                        answer
=======  ==========================  ===========================================
GET      /health                     ``{"ok", "state", "worker_attached"}``
GET      /status                     :meth:`Agent.status`
POST     /checkpoint                 body ``{"trigger": "request"|"drain"}`` (optional);
                                     ``202`` with the ticket (joined or new)
GET      /checkpoint/<ticket>        the ticket: state, progress, checkpoint id or error
GET      /checkpoints                this worker's checkpoints, newest last
GET      /restore                    the restore-at-start report, with results
GET      /restore/plan?checkpoint=R  compatibility of R with this host and worker
=======  ==========================  ===========================================

Errors are ``{"error": {"type", "message"}}`` with 400 (malformed), 404,
405, 413 (body over 64 KiB), 409 (agent stopping) or 500. A thread per
connection, so status keeps answering while a checkpoint runs. The socket
is created with the configured mode (0660 by default) under a umask, never
world-accessible; its group can be set so operators in it may use the CLI.
"""

from __future__ import annotations

import contextlib
import grp
import json
import logging
import os
import socket
import socketserver
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import httpx

if TYPE_CHECKING:
    from agent.daemon.agent import Agent

log = logging.getLogger("gpuckpt.agent.api")
MAX_BODY = 64 << 10


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = False
    agent: Agent


class ApiError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "gpuckpt-agent"
    timeout = 30  # a client that stops sending is dropped, not kept forever

    def address_string(self) -> str:  # Unix sockets have no client address
        return "unix"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("api: " + format, *args)

    def _send(self, status: HTTPStatus, body: Any) -> None:
        data = json.dumps(body, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._send(status, {"error": {"type": status.phrase, "message": message}})

    def _body(self) -> dict[str, Any]:
        n = self.headers.get("Content-Length")
        if not n:
            return {}
        try:
            size = int(n)
        except ValueError:
            raise ApiError(HTTPStatus.BAD_REQUEST, "Content-Length is not a number") from None
        if size < 0 or size > MAX_BODY:
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {size} bytes; at most {MAX_BODY}")
        raw = self.rfile.read(size)
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
        return body

    def _dispatch(self, method: str) -> None:
        try:
            url = urlsplit(self.path)
            status, body = route(self.server.agent, method, url.path, parse_qs(url.query), self._body)
            self._send(status, body)
        except ApiError as exc:
            self._error(exc.status, str(exc))
        except Exception as exc:  # the API never dies with a request
            log.exception("api: %s %s failed", method, self.path)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._error(HTTPStatus.METHOD_NOT_ALLOWED, "use GET or POST")

    do_DELETE = do_PATCH = do_PUT


def route(agent: Agent, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[HTTPStatus, Any]:
    """The API's routing table (pure: testable without a socket)."""
    path = path.rstrip("/") or "/"
    if method == "GET" and path == "/health":
        return HTTPStatus.OK, {"ok": agent.healthy(), "state": agent.state, "worker_attached": agent.worker["attached"]}
    if method == "GET" and path == "/status":
        return HTTPStatus.OK, agent.status()
    if path == "/checkpoint":
        if method != "POST":
            raise ApiError(HTTPStatus.METHOD_NOT_ALLOWED, "POST /checkpoint to trigger one")
        if agent.state == "stopping":
            raise ApiError(HTTPStatus.CONFLICT, "the agent is stopping; its final checkpoint is under way")
        b = body()
        trigger = b.get("trigger", "request")
        if trigger not in ("request", "drain"):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"trigger must be 'request' or 'drain', not {trigger!r}")
        t = agent.request_checkpoint(trigger)
        return HTTPStatus.ACCEPTED, t.view()
    if method == "GET" and path.startswith("/checkpoint/"):
        tid = path.rsplit("/", 1)[1]
        if not tid.isdigit():
            raise ApiError(HTTPStatus.BAD_REQUEST, f"ticket id must be a number, not {tid!r}")
        found = agent.ticket(int(tid))
        if found is None:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no checkpoint ticket {tid}")
        return HTTPStatus.OK, found.view()
    if method == "GET" and path == "/checkpoints":
        assert agent.repo is not None
        infos = agent.repo.list(agent.cfg.worker_id)
        return HTTPStatus.OK, [{"id": i.id, "worker_id": i.worker_id} for i in infos]
    if method == "GET" and path == "/restore":
        return HTTPStatus.OK, agent.restore_report or {"outcome": None}
    if method == "GET" and path == "/restore/plan":
        return HTTPStatus.OK, restore_plan(agent, (query.get("checkpoint") or ["latest"])[0])
    raise ApiError(HTTPStatus.NOT_FOUND, f"no such endpoint: {method} {path}")


def restore_plan(agent: Agent, ref: str) -> dict[str, Any]:
    """The compatibility table of checkpoint ``ref`` against this host and the attached worker."""
    from agent.engines.vllm import driver
    from ckpt import Pins, Policy, decide, host_facts

    assert agent.repo is not None
    ref = f"{agent.cfg.worker_id}:latest" if ref == "latest" else ref
    try:
        m = agent.repo.manifest(ref)
    except Exception as exc:
        raise ApiError(HTTPStatus.NOT_FOUND, f"checkpoint {ref}: {exc}") from None
    try:
        desc = driver.describe(agent.cfg.connector_socket)
    except (OSError, ValueError, RuntimeError) as exc:
        return {"checkpoint": m.id, "warm": False, "reasons": [f"worker not reachable: {exc}"], "rules": []}
    d = decide(
        m.pins, Pins(host=host_facts(), worker=desc.facts), Policy.from_strings(ignore=agent.cfg.restore.ignore_rules)
    )
    reasons = list(d.reasons)
    if dict(m.namespace) != dict(desc.namespace_fields):
        reasons.append(f"namespace: checkpoint {m.namespace} != worker {dict(desc.namespace_fields)}")
    return {
        "checkpoint": m.id,
        "warm": not reasons,
        "reasons": reasons,
        "rules": [
            {
                "rule": r.rule,
                "verdict": str(r.verdict),
                "recorded": r.recorded,
                "current": r.current,
                "detail": r.detail,
            }
            for r in d.results
        ],
        "requests": len(m.ledger.data.get("requests", [])) if m.ledger is not None else 0,
    }


class ApiServer:
    """Serves :func:`route` on a Unix socket in a background thread."""

    def __init__(self, agent: Agent, path: Path, *, mode: int = 0o660, group: str | None = None) -> None:
        self.agent = agent
        self.path = Path(path)
        self.mode = mode
        self.group = group
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        if self.path.exists() or self.path.is_symlink():
            if not _is_stale_socket(self.path):
                raise OSError(f"{self.path} is in use by another agent (or is not a socket)")
            self.path.unlink()
        # Created with the final mode: no window in which the socket is wider open.
        old = os.umask(0o777 & ~self.mode)
        try:
            srv = _Server(str(self.path), _Handler)
        finally:
            os.umask(old)
        os.chmod(self.path, self.mode)
        if self.group:
            os.chown(self.path, -1, grp.getgrnam(self.group).gr_gid)
        srv.agent = self.agent
        self._server = srv
        self._thread = threading.Thread(target=srv.serve_forever, name="gpuckpt-api", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self._server = None


def _is_stale_socket(path: Path) -> bool:
    """True for a socket nobody listens on (left by a killed agent)."""
    import stat

    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False
    finally:
        s.close()
    return False


class AgentClient:
    """The CLI's side of the API."""

    def __init__(self, path: str | os.PathLike[str], timeout: float = 30.0) -> None:
        self.path = str(path)
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(uds=self.path), base_url="http://agent", timeout=timeout
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            r = self._http.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise ConnectionError(f"no agent answering on {self.path}: {exc}") from None
        data = r.json()
        if r.status_code >= 400:
            err = data.get("error", {}) if isinstance(data, dict) else {}
            raise AgentApiError(r.status_code, str(err.get("message", r.text)))
        return data


class AgentApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"agent answered {status}: {message}")
        self.status = status
