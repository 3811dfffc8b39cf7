"""The agent's control API: HTTP/1.1 with JSON bodies over a Unix socket.

=======  ==========================  ===========================================
method   path                        answer
=======  ==========================  ===========================================
GET      /health                     ``{"ok", "state", "worker_attached"}``
GET      /ready                      ``{"ready", "awaiting", "state", "restore", "worker"}``: the
                                     restore at start has finished (warm, cold or failed) and
                                     the worker answers (:func:`readiness`; a readiness probe)
GET      /status                     the agent's status (:meth:`agent.daemon.agent.Agent.status`)
POST     /checkpoint                 body ``{"trigger": "request"|"drain"}`` (optional);
                                     ``202`` with the ticket (joined or new)
GET      /checkpoint/<ticket>        the ticket: state, progress, checkpoint id or error
GET      /checkpoints                this worker's checkpoints, newest last
GET      /restore                    the restore-at-start report, with results
GET      /restore/plan?checkpoint=R  compatibility of R (one of this worker's own
                                     checkpoints; default latest) with this host and worker
=======  ==========================  ===========================================

Errors are ``{"error": {"type", "message"}}`` with 400 (malformed), 404,
405, 408 (request not received in time), 409 (agent stopping), 413 (body
over 64 KiB), 414/431 (request line or a header over 64 KiB), 500 or 503
(at the connection limit). The socket is created with the configured mode
(0660 by default) in a private directory and linked into place, never
world-accessible; its group can be
set so operators in it may use the CLI.

Bounds (any member of the socket's group can connect, so a slow or hostile
client costs a bounded amount and the API keeps answering the others):

- Threads: each connection is served by its own thread, at most
  ``max_threads`` (32) at once, so status keeps answering while a checkpoint
  runs. When all are taken, a new connection takes the place of one that is
  waiting for a request (one that has sent nothing of it first, then the one
  that made progress least recently), which is closed (503 if part of a
  request had come); a request being handled is never dropped. When every
  thread is handling a request, the new connection is answered 503 and
  closed. The kernel's accept backlog (64) holds connections not yet accepted.
- Time: a request's line, headers and body must arrive whole within
  ``request_timeout`` (10 s) of the connection being ready for it (accepted,
  or the previous response sent); then 408, or a silent close for an idle
  keep-alive connection. Handling is not limited here (no endpoint
  long-polls; ``/restore/plan`` asks the connector, ``/checkpoints`` lists
  the repository); a response must be taken within 30 s.
- Size: request line and each header 64 KiB (``http.server``'s limits, at
  most 100 headers), body 64 KiB.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import io
import json
import logging
import os
import socket
import socketserver
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

import httpx

from agent import fs, session
from agent.daemon.client import AgentApiError, AgentClient
from agent.daemon.config import AgentConfig
from agent.engines.base import Engine
from agent.slots import Conn, Slots
from ckpt import CheckpointNotFound, EngineError, GpuckptError, Manifest, Policy, Repository

__all__ = [
    # the CLI's client, for importers written before agent.daemon.client
    "AgentApiError",
    "AgentClient",
    "AgentPort",
    "ApiError",
    "JsonView",
    "ApiServer",
    "route",
]

log = logging.getLogger("gpuckpt.agent.api")
MAX_BODY = 64 << 10
MAX_THREADS = 32
REQUEST_TIMEOUT = 10.0
WRITE_TIMEOUT = 30.0


class JsonView(Protocol):
    """Something the API serves as JSON: a checkpoint ticket, the restore report."""

    def to_json(self) -> dict[str, Any]: ...


class AgentPort(Protocol):
    """What the API reads and asks of the agent (:class:`agent.daemon.agent.Agent` is one); each
    route uses only its own part, so a stand-in need have only what its routes read."""

    @property
    def state(self) -> str: ...

    @property
    def worker(self) -> Mapping[str, Any]: ...

    @property
    def cfg(self) -> AgentConfig: ...

    @property
    def repo(self) -> Repository | None: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def restore_report(self) -> JsonView | None: ...

    def healthy(self) -> bool: ...

    def status(self) -> dict[str, Any]: ...

    def request_checkpoint(self, trigger: str) -> JsonView: ...

    def ticket(self, ticket_id: int) -> JsonView | None: ...


class _Slot(Conn):
    """One served connection, with its current request's deadline (see :meth:`_Server.reading`)."""

    __slots__ = ("deadline",)

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.deadline = 0.0


class _Dropped(Exception):
    """The current request will not arrive (deadline passed, or dropped for a new connection)."""

    def __init__(self, status: HTTPStatus, message: str, *, started: bool) -> None:
        super().__init__(message)
        self.status = status
        self.started = started  # part of the request came: the client is told why


class _Server(socketserver.UnixStreamServer):
    """A thread per connection, at most ``max_threads`` (see the module docstring)."""

    allow_reuse_address = False
    request_queue_size = 64  # the kernel's accept backlog
    agent: AgentPort

    def __init__(self, path: str, *, max_threads: int, request_timeout: float) -> None:
        self.max_threads = max_threads
        self.request_timeout = request_timeout
        self.pool = Slots(max_threads)
        self._lock = self.pool.lock
        self.slots: dict[socket.socket, _Slot] = {}  # by socket, for the handler to find its own
        super().__init__(path, _Handler)

    def get_request(self) -> tuple[Any, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # let connections close before trying again
                log.warning("api: accept failed: %s", exc)
                time.sleep(0.1)
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        slot = self._admit(request)
        if slot is None:
            _refuse(request, self.max_threads)
            return
        slot.thread = threading.Thread(
            target=self._serve_one, args=(request, client_address, slot), name="gpuckpt-api-conn", daemon=True
        )
        try:
            slot.thread.start()
        except BaseException:
            self._release(slot)
            raise

    def _admit(self, sock: socket.socket) -> _Slot | None:
        slot = _Slot(sock)
        if not self.pool.admit(slot):
            return None
        with self._lock:
            self.slots[sock] = slot
        return slot

    def _release(self, slot: _Slot) -> None:
        self.pool.release(slot)
        with self._lock:
            self.slots.pop(slot.sock, None)

    def _serve_one(self, request: Any, client_address: Any, slot: _Slot) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._release(slot)
            self.shutdown_request(request)

    def reading(self, slot: _Slot) -> None:
        """The connection waits for a new request: a fresh deadline, and it may be dropped."""
        with self._lock:
            slot.reading = True
            slot.got = 0
            slot.since = time.monotonic()
            slot.deadline = slot.since + self.request_timeout

    def handling(self, slot: _Slot) -> bool:
        """The request has come whole; False if the connection was dropped meanwhile."""
        with self._lock:
            slot.reading = False
            return not slot.evicted

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # the client went away or stopped reading
            log.debug("api: connection dropped: %s", exc)
        else:
            log.exception("api: connection failed")

    def server_close(self) -> None:
        super().server_close()
        with self._lock:
            slots = [s for s in self.slots.values() if s.reading]
        for s in slots:  # threads waiting for a request end now; running requests finish
            with contextlib.suppress(OSError):
                s.sock.shutdown(socket.SHUT_RD)


def _refuse(sock: socket.socket, limit: int) -> None:
    """Answer 503 without waiting (it fits the socket buffer) and close."""
    body = json.dumps(
        {
            "error": {
                "type": HTTPStatus.SERVICE_UNAVAILABLE.phrase,
                "message": f"the agent is handling {limit} requests, its limit; try again",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(head.encode() + body)
    sock.close()


class _DeadlineReader(io.RawIOBase):
    """The request socket, read under the current request's deadline (see :meth:`_Server.reading`)."""

    def __init__(self, server: _Server, slot: _Slot) -> None:
        self._server = server
        self._slot = slot

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        slot = self._slot
        left = slot.deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            slot.sock.settimeout(left)
            n = slot.sock.recv_into(b)
        except TimeoutError:
            raise _Dropped(
                HTTPStatus.REQUEST_TIMEOUT,
                f"the request did not arrive whole within {self._server.request_timeout:g} s",
                started=slot.got > 0,
            ) from None
        if n == 0 and slot.evicted:
            raise _Dropped(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"connection dropped for a new one: {self._server.max_threads} were open "
                "and this one had waited longest for its request",
                started=slot.got > 0,
            )
        # Read without the lock when a connection is picked to drop: a stale value
        # only changes which waiting connection goes.
        slot.got += n
        slot.since = time.monotonic()
        return n


#: C0 controls and DEL as escapes, for what a client sends that reaches a log line
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(32), 127)}


class ApiError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "gpuckpt-agent"

    def setup(self) -> None:
        super().setup()
        self.slot = self.server.slots[self.request]
        self.rfile.close()
        self.rfile = io.BufferedReader(_DeadlineReader(self.server, self.slot))

    def handle_one_request(self) -> None:
        self.server.reading(self.slot)
        self.requestline = self.request_version = ""  # until parse_request: what an early error response needs
        try:
            super().handle_one_request()
        except _Dropped as exc:
            self.close_connection = True
            log.debug("api: %s", exc)
            if exc.started:  # an idle keep-alive connection is closed without a word
                with contextlib.suppress(OSError):
                    self._error(exc.status, str(exc))

    def address_string(self) -> str:  # Unix sockets have no client address
        return "unix"

    def log_message(self, format: str, *args: Any) -> None:
        # a request line is the client's: control characters go to the logs escaped
        log.debug("api: %s", (format % args).encode("ascii", "backslashreplace").decode().translate(_CONTROLS))

    def _send(self, status: HTTPStatus, body: Any) -> None:
        self.connection.settimeout(WRITE_TIMEOUT)  # a client that does not take its response is dropped
        data = json.dumps(body, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._send(status, {"error": {"type": status.phrase, "message": message}})

    def _read_body(self) -> bytes:
        """The whole body, read before handling (under the request's deadline)."""
        n = self.headers.get("Content-Length")
        if not n:
            return b""
        try:
            size = int(n)
        except ValueError:
            raise ApiError(HTTPStatus.BAD_REQUEST, "Content-Length is not a number") from None
        if size < 0 or size > MAX_BODY:
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {size} bytes; at most {MAX_BODY}")
        raw = self.rfile.read(size)
        if len(raw) < size:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"body ended after {len(raw)} of {size} bytes")
        return raw

    def _dispatch(self, method: str) -> None:
        try:
            raw = self._read_body()
        except ApiError as exc:
            self.close_connection = True  # the body was not read: the connection cannot carry another request
            self._error(exc.status, str(exc))
            return
        if not self.server.handling(self.slot):
            self.close_connection = True  # dropped for a new connection as the request completed
            return
        try:
            url = urlsplit(self.path)
            status, body = route(self.server.agent, method, url.path, parse_qs(url.query), lambda: _parse_body(raw))
            self._send(status, body)
        except ApiError as exc:
            self._error(exc.status, str(exc))
        except Exception as exc:  # the API never dies with a request
            log.exception("api: %s %s failed", method, ascii(self.path))
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self.close_connection = True  # its body, if any, is not read
        self._error(HTTPStatus.METHOD_NOT_ALLOWED, "use GET or POST")

    do_DELETE = do_PATCH = do_PUT


def _parse_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
    return body


def route(agent: AgentPort, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[HTTPStatus, Any]:
    """The API's routing table (pure: testable without a socket)."""
    path = path.rstrip("/") or "/"
    if method == "GET" and path == "/health":
        return HTTPStatus.OK, {"ok": agent.healthy(), "state": agent.state, "worker_attached": agent.worker["attached"]}
    if method == "GET" and path == "/ready":
        return HTTPStatus.OK, readiness(agent)
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
        return HTTPStatus.ACCEPTED, t.to_json()
    if method == "GET" and path.startswith("/checkpoint/"):
        tid = path.rsplit("/", 1)[1]
        if not (tid.isascii() and tid.isdigit()):  # "²".isdigit() is true, int("²") is not
            raise ApiError(HTTPStatus.BAD_REQUEST, f"ticket id must be a number, not {tid!r}")
        found = agent.ticket(int(tid))
        if found is None:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no checkpoint ticket {tid}")
        return HTTPStatus.OK, found.to_json()
    if method == "GET" and path == "/checkpoints":
        assert agent.repo is not None
        infos = agent.repo.list(agent.cfg.worker_id)
        return HTTPStatus.OK, [{"id": i.id, "worker_id": i.worker_id} for i in infos]
    if method == "GET" and path == "/restore":
        report = agent.restore_report
        return HTTPStatus.OK, report.to_json() if report is not None else {"outcome": None}
    if method == "GET" and path == "/restore/plan":
        return HTTPStatus.OK, restore_plan(agent, (query.get("checkpoint") or ["latest"])[0])
    raise ApiError(HTTPStatus.NOT_FOUND, f"no such endpoint: {method} {path}")


#: how long ``/ready`` waits for the worker's answer: a probe's period is seconds
READY_WORKER_TIMEOUT = 2.0


def readiness(agent: AgentPort) -> dict[str, Any]:
    """Whether the worker may take traffic, as far as the agent can tell (``GET /ready``; the
    Kubernetes chart's readiness probe, ``gpuckpt agent ready``).

    Ready once the agent has started and its restore at start has finished —
    warm, cold or failed (a failed one is reported, not waited on forever: the
    worker serves cold) — and the worker answers now: its API's ``/health``
    (``worker_url``), or without one its adapter's control socket. Never ready
    while the agent stops. ``awaiting`` names each thing not yet there; the
    document is always a 200 (the caller decides what not-ready means).
    """
    awaiting: list[str] = []
    state = agent.state
    report = agent.restore_report
    # without the per-request results (large; GET /restore has them), as the status has it
    rr = {k: v for k, v in report.to_json().items() if k != "results"} if report is not None else None
    if state == "stopping":
        awaiting.append("a new start: the agent is stopping")
    elif state == "restoring":
        what = f" of checkpoint {rr['checkpoint']}" if rr is not None and rr.get("checkpoint") else ""
        awaiting.append(f"the restore at start{what}")
    elif state != "ready":
        awaiting.append(f"the agent's start (state {state})")
    worker: dict[str, Any] = {"answers": False, "error": None}
    if state == "ready":  # the worker is asked only once nothing else is awaited: a probe costs it little
        worker["error"] = _worker_error(agent)
        worker["answers"] = worker["error"] is None
        if worker["error"] is not None:
            awaiting.append(f"the worker ({worker['error']})")
    return {
        "ready": not awaiting,
        "awaiting": awaiting,
        "state": state,
        "restore": rr,
        "worker": worker,
    }


def _worker_error(agent: AgentPort) -> str | None:
    """None when the worker answers: its API's ``/health`` with 200, or (no ``worker_url``) its
    adapter's description over the control socket; else why not, in a few words."""
    url = agent.cfg.worker_url
    if url:
        try:
            r = httpx.get(url.rstrip("/") + "/health", timeout=READY_WORKER_TIMEOUT)
        except httpx.HTTPError as exc:
            return f"{url} does not answer: {type(exc).__name__}"
        return None if r.status_code == HTTPStatus.OK else f"{url}/health answered {r.status_code}"
    try:
        session.describe(agent.engine)
    except (OSError, GpuckptError) as exc:
        return f"its control socket does not answer: {exc}"
    return None


def restore_plan(agent: AgentPort, ref: str) -> dict[str, Any]:
    """The restore decision for checkpoint ``ref`` against this host and the attached worker
    (:func:`agent.session.plan`, serialized as the CLI's ``restore --dry-run`` does)."""
    m = _own_manifest(agent, ref)
    try:
        return session.plan(agent.engine, m, Policy.from_strings(ignore=agent.cfg.restore.ignore_rules)).to_json()
    except (OSError, EngineError) as exc:
        return {"checkpoint": m.id, "warm": False, "reasons": [f"worker not reachable: {exc}"], "results": []}


def _own_manifest(agent: AgentPort, ref: str) -> Manifest:
    """Checkpoint ``ref`` (``latest``, an id or unique id prefix, ``W:latest`` or ``W/ID``)
    among this agent's worker's checkpoints only: whoever may use the socket must not
    read other workers' pins through it."""
    assert agent.repo is not None
    wid = agent.cfg.worker_id
    try:
        if ref in ("latest", f"{wid}:latest"):
            return agent.repo.latest(wid)[1]
        if ref.startswith(f"{wid}/"):  # WORKER/ID: exactly that id
            found = [c for c in agent.repo.list(wid) if c.id == ref.removeprefix(f"{wid}/")]
        else:  # an id or a unique prefix of one (another worker's W/ID or W:latest matches nothing)
            found = [c for c in agent.repo.list(wid) if c.id.startswith(ref)] if ref else []
        if not found:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no checkpoint of worker {wid} matches {ref!r}")
        if len(found) > 1:
            shown = ", ".join(c.id for c in found[:5])
            raise ApiError(HTTPStatus.BAD_REQUEST, f"checkpoint reference {ref!r} is ambiguous: {shown}")
        return agent.repo.manifest(found[0])
    except CheckpointNotFound as exc:
        raise ApiError(HTTPStatus.NOT_FOUND, f"checkpoint {ref!r} of worker {wid}: {exc}") from None


class ApiServer:
    """Serves :func:`route` on a Unix socket in a background thread."""

    def __init__(
        self,
        agent: AgentPort,
        path: Path,
        *,
        mode: int = 0o660,
        group: str | None = None,
        max_threads: int = MAX_THREADS,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self.agent = agent
        self.path = Path(path)
        self.mode = mode
        self.group = group
        self.max_threads = max_threads
        self.request_timeout = request_timeout
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        # made, or adopted only when no untrusted account could write to it (as every other directory)
        fs.ensure_socket_dir(self.path.parent)
        if self.path.exists() or self.path.is_symlink():
            if not _is_stale_socket(self.path):
                raise OSError(f"{self.path} is in use by another agent (or is not a socket)")
            self.path.unlink()
        # Bound in a private (0700) directory beside it, given its mode and group there, then linked
        # into place: no window in which the socket is wider open — and no process-wide umask,
        # which would change the mode of whatever another thread creates meanwhile.
        with tempfile.TemporaryDirectory(prefix=".g", dir=self.path.parent) as private:
            tmp = Path(private) / "s"
            srv = _Server(str(tmp), max_threads=self.max_threads, request_timeout=self.request_timeout)
            try:
                os.chmod(tmp, self.mode)
                if self.group:
                    os.chown(tmp, -1, grp.getgrnam(self.group).gr_gid)
                os.link(tmp, self.path)  # refuses (EEXIST) if another agent took the path meanwhile
            except BaseException:
                srv.server_close()
                raise
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
