"""The control channel: JSON lines over a Unix socket (no vLLM import, no pickle).

The connector's scheduler half serves it from a daemon thread in the
EngineCore process; the agent (or a test) is the client. One request line,
one reply line, per call; a connection may carry several calls.

Requests are ``{"cmd": NAME, ...}``. Replies are ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``. The socket file is created mode 0600.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt.errors import ServiceUnavailable

log = logging.getLogger(__name__)


class ControlError(ServiceUnavailable, RuntimeError):
    """The connector refused or failed a control call, or the channel broke; the message says which.

    A :class:`ckpt.errors.ServiceUnavailable` (exit code of an unreachable
    worker) and, for callers written against the first slice, a ``RuntimeError``.
    """


Handler = Callable[[dict[str, Any]], dict[str, Any]]
MAX_LINE = 64 << 20


class ControlServer:
    def __init__(self, path: str | os.PathLike[str], handler: Handler) -> None:
        self.path = Path(path)
        self.handler = handler
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(str(self.path))
        finally:
            os.umask(old)
        self._sock.listen(8)
        self._thread = threading.Thread(target=self._serve, name="gpuckpt-control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._conn, args=(conn,), name="gpuckpt-control-conn", daemon=True).start()

    def _conn(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as rf:
            for line in rf:
                try:
                    req = json.loads(line)
                    if not isinstance(req, dict):
                        raise ValueError("a request is a JSON object")
                    reply = self.handler(req)
                except Exception as exc:  # the channel reports errors, it does not die of them
                    log.exception("gpuckpt control request failed")
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                conn.sendall(json.dumps(reply).encode() + b"\n")

    def close(self) -> None:
        self._sock.close()
        self.path.unlink(missing_ok=True)


def call(path: str | os.PathLike[str], cmd: str, *, io_timeout: float = 60.0, **args: Any) -> dict[str, Any]:
    """One request; raises :class:`ControlError` on an ``ok: false`` reply or a broken channel
    (``OSError`` when the socket cannot be reached at all)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(io_timeout)
        s.connect(str(path))
        s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        buf = b""
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
    if not buf.endswith(b"\n"):
        raise ControlError(
            f"gpuckpt control {cmd!r}: the connector closed the connection without a reply "
            f"(did the engine die? {len(buf)} bytes received)"
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
