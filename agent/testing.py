"""A testing kit for serving workers, shipped like :mod:`ckpt.testing`: a worker started in its own
process group, so that ``kill`` does to it what a crash or a preemption would.

:class:`WorkerProcess` is engine-neutral; :class:`ServeProcess` runs ``vllm serve`` with gpuckpt's
connector (and middleware), :class:`SglangProcess` an SGLang server with gpuckpt's linker. The
tests, the demos and the benchmarks start these; nothing of the product imports this module (the
agent attaches to a worker something else runs, and ``gpuckpt launch`` starts its own).

No engine is imported here: the workers are subprocesses, and the engines' ``serve`` modules this
takes the commands and the clients from import neither vLLM nor SGLang.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agent.engines.retries import token_path
from agent.engines.serving import ServeError
from agent.engines.sglang import serve as sglang_serve
from agent.engines.vllm import serve as vllm_serve

__all__ = ["ServeProcess", "SglangProcess", "WorkerProcess"]


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
        self.killed = False

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
        """SIGKILL to the whole group, once: the group's id is the leader's pid, which the system
        may give to another process once the leader is reaped."""
        if self.killed:
            return
        self.killed = True
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


class ServeProcess(WorkerProcess):
    """A ``vllm serve`` worker with the connector, run in its own process group.

    ``stop()`` (and leaving the ``with`` block) kills the whole group: vLLM's
    EngineCore and worker processes are children that can outlive the API
    server. ``kill()`` is SIGKILL to the group, as a crash or a preemption
    would; the worker gets no chance to clean up.
    """

    def __init__(
        self,
        model: str,
        control_socket: str,
        *,
        port: int,
        log_path: str,
        staging_dir: str | None = None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        kv_config: dict[str, Any] | None = None,
        prefix: Sequence[str] = (),
        inherit_env: bool = True,
    ) -> None:
        """``prefix``: argv run before the worker's (e.g. ``setpriv`` to run it as its own account);
        ``inherit_env=False``: the worker gets ``env`` alone, nothing of this process's environment."""
        self.staging_dir = staging_dir
        cmd = vllm_serve.serve_command(
            model, control_socket, host=host, port=port, staging_dir=staging_dir, args=args, kv_config=kv_config
        )
        url = f"http://{host}:{port}"
        super().__init__(
            [*prefix, *cmd],
            url=url,
            control_socket=control_socket,
            log_path=log_path,
            client=vllm_serve.ServeClient(url, token_file=token_path(control_socket)),
            env={**(os.environ if inherit_env else {}), **(env or {})},
            needs_socket=kv_config is None
            or bool((kv_config.get("kv_connector_extra_config") or {}).get("control_socket")),
        )

    def __enter__(self) -> ServeProcess:
        return self


class SglangProcess(WorkerProcess):
    """An SGLang server with the linker, in its own process group (``kill`` is SIGKILL to the
    group: SGLang's scheduler and detokenizer are child processes)."""

    def __init__(
        self,
        model: str,
        control_socket: str,
        *,
        port: int,
        log_path: str,
        python: str = sys.executable,
        staging_dir: str | None = None,
        extra_args: Sequence[str] = (),
        pythonpath: Sequence[str] = (),
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        middleware: bool = False,
    ) -> None:
        """``pythonpath``: directories put in front of the server's ``PYTHONPATH``; ``env`` is added
        to this process's environment, with ``SGLANG_USE_CPU_ENGINE=1`` unless it says otherwise;
        ``middleware``: gpuckpt's SGLang server (retries attach), as ``gpuckpt launch`` runs it."""
        cmd = sglang_serve.serve_command(
            model,
            port=port,
            control_socket=control_socket,
            host=host,
            staging_dir=staging_dir,
            python=python,
            extra_args=extra_args,
            middleware=middleware,
        )
        full_env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", **(env or {})}
        paths = [*pythonpath, *([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else [])]
        if paths:
            full_env["PYTHONPATH"] = os.pathsep.join(paths)
        url = f"http://{host}:{port}"
        super().__init__(
            cmd,
            url=url,
            control_socket=control_socket,
            log_path=log_path,
            client=sglang_serve.SglangClient(url, token_file=token_path(control_socket)),
            env=full_env,
        )

    def __enter__(self) -> SglangProcess:
        return self
