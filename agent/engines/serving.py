"""What the engines' HTTP clients share (no engine import): a finished completion as the agent
sees it, and the error a worker's API answers with."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from ckpt.errors import EngineRefused

__all__ = ["Completion", "ServeError", "WorkerProcess", "check_response"]


class ServeError(EngineRefused):
    """The worker's API refused or failed a request; the message carries its answer."""


@dataclass
class Completion:
    """One finished completion: token ids, timings and the server's accounting."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    first_token_s: float | None = None  # from sending to the first token
    total_s: float = 0.0
    #: not resubmitted, and why: its client's retry is served as a new request (computed once, there)
    left_to_client: str | None = None


def check_response(r: httpx.Response) -> None:
    """Nothing for a 200; else :class:`ServeError` with the server's own message."""
    if r.status_code == 200:
        return
    try:
        msg = r.json().get("message") or r.json().get("error", {}).get("message") or r.text
    except (ValueError, AttributeError):
        msg = r.text
    raise ServeError(f"{r.request.method} {r.request.url.path}: HTTP {r.status_code}: {str(msg)[:300]}")


class WorkerProcess:
    """A serving worker in its own process group, logging to ``log_path`` (0600): what tests,
    demos and benchmarks start. ``kill`` is SIGKILL to the whole group (the engines run child
    processes: vLLM's EngineCore, SGLang's scheduler and detokenizer), as a crash would be.

    ``client`` is the engine's request client for ``url``; ``wait_ready`` waits for its API and,
    when ``needs_socket``, for the adapter's control socket.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        url: str,
        control_socket: str,
        log_path: str,
        client: Any,
        env: Mapping[str, str],
        needs_socket: bool = True,
    ) -> None:
        self.control_socket = control_socket
        self.url = url
        self.log_path = log_path
        self._needs_socket = needs_socket
        # The log is the worker's stdout/stderr; it names no secret (an API key, if any, is in env).
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            self.proc = subprocess.Popen(
                list(argv), stdout=fd, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
            )
        finally:
            os.close(fd)
        self.client = client
        self.started = time.monotonic()

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Wait for the API and the control socket; returns seconds since start."""
        alive: Callable[[], bool] = lambda: self.proc.poll() is None  # noqa: E731
        try:
            self.client.wait_ready(timeout, alive=alive)
            while self._needs_socket and not os.path.exists(self.control_socket):
                if time.monotonic() - self.started > timeout:
                    raise ServeError(f"no control socket at {self.control_socket}")
                time.sleep(0.1)
        except ServeError as exc:
            raise ServeError(f"{exc}; last lines of {self.log_path}:\n{self.log_tail()}") from None
        return time.monotonic() - self.started

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.client.close()

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the worker (a graceful shutdown), then SIGKILL the group."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(grace)
        self.kill()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
