"""SGLang as a gpuckpt engine: the worker half is a cache linker (:mod:`.linker`) that SGLang
loads by its own ``--enable-unified-cache-external-linker`` flags (no patch to SGLang); requests
go back in through its native ``/generate`` API (:mod:`.serve`). No ``sglang`` import here: the
agent runs without SGLang installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from agent.engines.base import Engine, script_python
from agent.engines.retries import token_path
from agent.engines.sglang.serve import SERVER_MODULE, SglangClient, linker_config

#: the module ``python -m`` runs for a server (what ``sglang serve`` runs for a language model)
LAUNCH_MODULE = "sglang.launch_server"
_LINKER_FLAGS = (
    "--enable-unified-cache-external-linker",
    "--unified-cache-external-linker-backend",
    "--unified-cache-external-linker-config",
)


class SglangEngine(Engine):
    name: ClassVar[str] = "sglang"
    default_port: ClassVar[int] = 30000

    def client(self, url: str) -> SglangClient:
        return SglangClient(url, token_file=token_path(str(self.socket)), trust=self.staging.trust)

    @classmethod
    def runs(cls, command: list[str]) -> bool:
        argv = _launch_argv(command)
        return len(argv) >= 3 and argv[1] == "-m" and argv[2] == LAUNCH_MODULE

    @classmethod
    def worker_command(
        cls,
        command: list[str],
        *,
        control_socket: str,
        staging_dir: str | None,
        shared_group: str | None,
        hold_retries_s: float = 0.0,
    ) -> list[str]:
        """``python -m sglang.launch_server ARGS`` (or ``sglang serve ARGS``) as gpuckpt's SGLang
        server (:mod:`.server`: SGLang's own with gpuckpt's middleware, the same arguments: the
        clients' retries attach) with gpuckpt's linker; ``hold_retries_s``: possible retries
        wait that long for the restore to say what it resubmits."""
        argv = _launch_argv(command)
        if any(a == f or a.startswith(f + "=") for a in argv for f in _LINKER_FLAGS):
            raise ValueError("the command already configures an external cache linker; launch sets it")
        cfg = linker_config(control_socket, staging_dir, shared_group)
        if hold_retries_s > 0:
            cfg["linker_extra_config"]["retry_hold_s"] = hold_retries_s
        if len(argv) >= 3 and argv[1] == "-m" and argv[2] == LAUNCH_MODULE:
            argv = [argv[0], "-m", SERVER_MODULE, *argv[3:]]
        return [
            *argv,
            "--enable-unified-cache-external-linker",
            "--unified-cache-external-linker-backend",
            "dynamic",
            "--unified-cache-external-linker-config",
            json.dumps(cfg),
        ]


def _launch_argv(cmd: list[str]) -> list[str]:
    """``sglang serve ARGS`` as ``PYTHON -m sglang.launch_server ARGS`` with the script's own Python
    (a text model's server; the same arguments)."""
    if len(cmd) >= 2 and Path(cmd[0]).name == "sglang" and cmd[1] == "serve":
        return [script_python(cmd[0]), "-m", LAUNCH_MODULE, *cmd[2:]]
    return list(cmd)
