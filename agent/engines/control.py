"""The control channel: JSON lines over a Unix socket (no vLLM import, no pickle).

The connector's scheduler half serves it from daemon threads in the
EngineCore process; the agent (or a test) is the client. One request line,
one reply line, per call; a connection may carry several calls.

Requests are ``{"cmd": NAME, ...}``. Replies are ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``. The socket file is created mode 0600.

Bounds: the server runs inside the serving process, so whatever a client
does, slowly, wrongly or on purpose, costs a bounded number of threads and
bytes, and the channel keeps answering the others.

- Connections: at most ``max_connections`` (16) are served at once, each by
  its own thread. The agent holds a few at a time (``capture``, ``next`` and
  ``wait`` block up to their own timeout), so 16 leaves room. When all are
  taken, a new connection takes the place of one that is waiting for a
  request (one that has sent nothing of its request first, then the one
  that made progress least recently), which is closed; a connection whose
  handler is running is never dropped. When every connection is running a
  handler, the new one is answered ``{"ok": false, "error": "gpuckpt control
  busy: ..."}`` and closed. The kernel's accept backlog (64) holds
  connections not yet accepted.
- Request size: a request line is at most ``max_line`` (64 MiB; ``keys``
  and ``durable`` requests legitimately carry several MiB). It is read in
  chunks of at most 1 MiB and never buffered past the limit: a longer line
  is answered with an error naming the limit and the connection is closed.
  Across all connections at most ``max_buffered`` (128 MiB) of unfinished
  requests is held; the connection whose chunk passes it is refused so.
- Time: each request must arrive whole within ``request_timeout`` (30 s) of
  the connection being ready for it (accepted, or its previous reply sent),
  and its reply must be taken within as long; otherwise the connection is
  closed (with an error reply, if part of a request had come). A handler's
  own run time is not limited here.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.slots import Conn, Slots
from ckpt.errors import EngineRefused, WorkerUnreachable

log = logging.getLogger(__name__)


class ControlError(EngineRefused):
    """The worker's adapter refused or failed a control call, or the channel broke; the message says which.

    A :class:`ckpt.errors.EngineRefused` (exit code of an unavailable worker).
    A socket nobody answers on is :class:`ckpt.errors.WorkerUnreachable` (also
    an ``OSError``).
    """


Handler = Callable[[dict[str, Any]], dict[str, Any]]
MAX_LINE = 64 << 20
#: JSON values a reply may hold (counted on its bytes before parsing): Python holds each parsed
#: value in ~30-110 bytes whatever its text's size, so a reply of small values (a list of digits)
#: costs ~15x its bytes to parse; this bounds a parse near 200 MB (the largest legitimate replies,
#: page-key lists, hold a few hundred thousand)
MAX_VALUES = 2_000_000
MAX_CONNECTIONS = 16
#: unfinished request bytes held across all connections at once (two whole lines)
MAX_BUFFERED = 2 * MAX_LINE
REQUEST_TIMEOUT = 30.0
_CHUNK = 1 << 20
# accept() errors that pass (a full descriptor table frees up as connections close).
_TRANSIENT_ACCEPT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EINTR}


class _Conn(Conn):
    """One served connection, with what it has received of its next request."""

    __slots__ = ("buf",)

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.buf = bytearray()  # received, not yet handled


class ControlServer:
    """Serves ``handler`` on the Unix socket ``path`` (bounds: see the module docstring).

    ``handler`` runs in the connection's thread, several at once, so it must
    be thread-safe; it returns the reply, and an exception it raises becomes
    an ``ok: false`` reply naming it. :meth:`close` stops accepting and drops
    connections waiting for a request; running handlers finish and reply.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        handler: Handler,
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_line: int = MAX_LINE,
        request_timeout: float = REQUEST_TIMEOUT,
        max_buffered: int = MAX_BUFFERED,
    ) -> None:
        self.path = Path(path)
        self.handler = handler
        self.max_connections = max_connections
        self.max_line = max_line
        self.request_timeout = request_timeout
        self.max_buffered = max_buffered
        self._slots = Slots(max_connections)
        self._lock = self._slots.lock
        self._conns = self._slots.conns
        self._closed = False
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound in a private (0700) directory beside it, made 0600 there, then moved into place: no
        # window in which the socket is wider open, and no process-wide umask — this runs inside
        # the engine's process, whose own threads would create their files and directories under it.
        with tempfile.TemporaryDirectory(prefix=".g", dir=self.path.parent) as private:
            tmp = os.path.join(private, "s")
            try:
                self._sock.bind(tmp)
                os.chmod(tmp, 0o600)
                os.replace(tmp, self.path)  # a stale socket of a killed worker is replaced
            except BaseException:
                self._sock.close()
                raise
        self._sock.listen(64)
        self._thread = threading.Thread(target=self._serve, name="gpuckpt-control", daemon=True)
        self._thread.start()

    # -- accepting -------------------------------------------------------------------------

    def _serve(self) -> None:
        failing = 0  # errno of the accept failure last logged
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                if exc.errno not in _TRANSIENT_ACCEPT:
                    log.exception("gpuckpt control: accept failed; the control channel stops")
                    return
                if exc.errno != failing:
                    log.warning("gpuckpt control: accept failed (%s); retrying", exc)
                    failing = exc.errno or 0
                time.sleep(0.1)  # a full descriptor table does not free up at once
                continue
            failing = 0
            try:
                self._admit(sock)
            except Exception:  # never let one connection end the accept loop
                log.exception("gpuckpt control: could not serve a connection")
                sock.close()

    def _admit(self, sock: socket.socket) -> None:
        conn = _Conn(sock)
        if not self._slots.admit(conn):
            _say(
                sock,
                f"gpuckpt control busy: all {self.max_connections} connections are running requests; try again",
            )
            sock.close()
            return
        conn.thread = threading.Thread(target=self._run, args=(conn,), name="gpuckpt-control-conn", daemon=True)
        try:
            conn.thread.start()
        except BaseException:
            self._forget(conn)
            raise

    def _forget(self, conn: _Conn) -> None:
        self._slots.release(conn)
        conn.sock.close()

    # -- one connection --------------------------------------------------------------------

    def _run(self, conn: _Conn) -> None:
        try:
            while (line := self._read_line(conn)) is not None:
                with self._lock:
                    if conn.evicted:
                        return
                    conn.reading = False
                reply = self._reply(line)
                del line
                conn.sock.settimeout(self.request_timeout)
                conn.sock.sendall(reply)  # a client that does not take its reply times out here
                with self._lock:
                    conn.reading = True
                    conn.got = len(conn.buf)  # part of a next request may have come already
                    conn.since = time.monotonic()
        except OSError as exc:  # the client went away or stopped reading
            log.debug("gpuckpt control: connection dropped: %s", exc)
        except Exception:
            log.exception("gpuckpt control: connection failed")
        finally:
            self._forget(conn)

    def _read_line(self, conn: _Conn) -> bytes | bytearray | None:
        """The next request line (no newline), or ``None`` when the connection is to close
        (after an error reply, when the client had sent part of a request)."""
        deadline = time.monotonic() + self.request_timeout
        buf, scanned = conn.buf, 0
        while True:
            nl = buf.find(b"\n", scanned)
            if nl >= 0:
                if nl == len(buf) - 1:  # the usual case: the whole buffer is one line
                    conn.buf = bytearray()
                    del buf[nl:]
                    return buf
                line = bytes(buf[:nl])
                del buf[: nl + 1]
                return line
            if len(buf) > self.max_line:
                _say(
                    conn.sock,
                    f"gpuckpt control: request line longer than {self.max_line} bytes "
                    f"({self.max_line / 2**20:g} MiB), the limit; closing the connection",
                )
                return None
            scanned = len(buf)
            left = deadline - time.monotonic()
            if left <= 0:
                if buf:
                    _say(
                        conn.sock,
                        f"gpuckpt control: the request did not arrive whole within {self.request_timeout:g} s "
                        f"({len(buf)} bytes came); closing the connection",
                    )
                return None
            conn.sock.settimeout(left)
            try:
                # Never more than the limit plus one byte, so an over-long line is refused
                # with at most that much buffered.
                chunk = conn.sock.recv(min(_CHUNK, self.max_line + 1 - len(buf)))
            except TimeoutError:
                continue
            if not chunk:
                if conn.evicted and buf:
                    _say(
                        conn.sock,
                        f"gpuckpt control: connection dropped for a new one: {self.max_connections} were open "
                        "and this one had waited longest for its request",
                    )
                return None  # the client closed (a partial line is discarded), or was dropped
            buf += chunk
            self._slots.progress(conn, len(buf))
            held = self._slots.buffered()
            if held > self.max_buffered:
                # every connection may send up to max_line: together they could hold max_connections
                # times as much in the serving process; past this, the one that sent last goes
                _say(
                    conn.sock,
                    f"gpuckpt control: {held} bytes of unfinished requests are held, more than "
                    f"{self.max_buffered} ({self.max_buffered / 2**20:g} MiB); closing the connection",
                )
                return None

    def _reply(self, line: bytes | bytearray) -> bytes:
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise ValueError("a request is a JSON object")
        except (ValueError, RecursionError) as exc:  # a client's mistake: one log line, no traceback
            log.warning("gpuckpt control: malformed request: %s", exc)
            return _line({"ok": False, "error": f"malformed request: {exc}"})
        try:
            return _line(self.handler(req))
        except Exception as exc:  # the channel reports errors, it does not die of them
            log.exception("gpuckpt control request failed")
            return _line({"ok": False, "error": f"{type(exc).__name__}: {exc}"})

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (close alone does not)
        self._sock.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RD)
        self.path.unlink(missing_ok=True)


def _line(reply: dict[str, Any]) -> bytes:
    return json.dumps(reply).encode() + b"\n"


def _say(sock: socket.socket, error: str) -> None:
    """Best effort: an ``ok: false`` line that fits the socket buffer, sent without waiting."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(_line({"ok": False, "error": error}))


def call(path: str | os.PathLike[str], cmd: str, *, io_timeout: float = 60.0, **args: Any) -> dict[str, Any]:
    """One request; raises :class:`ControlError` on an ``ok: false`` reply or a broken channel
    (:class:`ckpt.errors.WorkerUnreachable`, an ``OSError``, when the socket cannot be reached at all)."""
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            # connect(2) follows a symlink: whoever could plant it would answer for the worker
            raise ControlError(f"gpuckpt control {cmd!r}: {path} is a symlink; refusing to follow it")
    except FileNotFoundError as exc:
        raise WorkerUnreachable(f"no worker adapter answering on {path}: {exc.strerror or exc}") from exc
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(io_timeout)
        _connect(s, path, cmd, io_timeout)
        try:
            s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            # The connector may have refused the request (busy, over a limit) and said why first.
            buf = _recv_line(s, cmd, io_timeout)
            if not buf.endswith(b"\n"):
                raise
        else:
            buf = _recv_line(s, cmd, io_timeout)
    if not buf.endswith(b"\n"):
        raise ControlError(
            f"gpuckpt control {cmd!r}: the connector closed the connection without a reply "
            f"(did the engine die? {len(buf)} bytes received)"
        )
    values = buf.count(b",") + buf.count(b":") + 1
    if values > MAX_VALUES:
        raise ControlError(
            f"gpuckpt control {cmd!r}: the reply holds about {values} JSON values, more than the {MAX_VALUES} "
            f"this agent parses (a broken or hostile worker?); not parsed"
        )
    try:
        reply = json.loads(buf)
    except ValueError:
        raise ControlError(f"gpuckpt control {cmd!r}: the reply is not JSON") from None
    if not isinstance(reply, dict):
        raise ControlError(f"gpuckpt control {cmd!r}: malformed reply")
    if not reply.get("ok"):
        raise ControlError(f"gpuckpt control {cmd!r} failed: {reply.get('error')}")
    return reply


def _connect(s: socket.socket, path: str | os.PathLike[str], cmd: str, io_timeout: float) -> None:
    deadline = time.monotonic() + io_timeout
    while True:
        try:
            s.connect(str(path))
            return
        except BlockingIOError:  # the accept backlog is full (a flood of connections): wait for room
            if time.monotonic() >= deadline:
                raise ControlError(
                    f"gpuckpt control {cmd!r}: the connector's accept backlog stayed full for {io_timeout:.0f} s"
                ) from None
            time.sleep(0.005)
        except OSError as exc:  # nothing listening (no worker yet, or it died), or no socket at all
            raise WorkerUnreachable(f"no worker adapter answering on {path}: {exc.strerror or exc}") from exc


def _recv_line(s: socket.socket, cmd: str, io_timeout: float) -> bytes:
    """Up to and including the first newline, or what came before the connector closed."""
    buf = bytearray()  # appended in place: no copy of the whole line per chunk
    try:
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
            if len(buf) > MAX_LINE:
                raise ControlError(f"gpuckpt control {cmd!r}: reply larger than {MAX_LINE} bytes")
    except TimeoutError:
        raise ControlError(f"gpuckpt control {cmd!r}: no reply within {io_timeout:.0f} s") from None
    except ConnectionResetError:
        pass  # what came before the reset is still the reply, if it is whole
    return bytes(buf)
