"""A vLLM worker under ``gpuckpt launch``, as the retries and crash-loop tests run it: the flags
(with the tokenizer, a chat template, room for every request at once), the launch itself, and the
waits and kills around it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from agent.engines.channel import WorkerChannel
from tests.harness.cli import CLI
from tests.harness.models import CHAT_TEMPLATE
from tests.harness.vllm import ARGS as SERVE_ARGS
from tests.harness.vllm import ENV

# the test workers' flags (tests.harness.vllm), with the tokenizer (text, chat) and room for every request at once
ARGS = [
    *(a for a in SERVE_ARGS if a != "--skip-tokenizer-init"),
    "--max-num-seqs",
    "16",
    "--structured-outputs-config",
    json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
    "--enable-prompt-embeds",
    # a tool parser, as a server taking tool calls has (the generated tokenizer has none of a
    # model family's special tokens; the pythonic parser needs none)
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "pythonic",
]


def chat_model(tiny_llama_text: Path, tmp: Path) -> Path:
    path = tmp / "chat-model"
    shutil.copytree(tiny_llama_text, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def launch(
    model: Path, rdir: Path, repo: Path, port: int, log: Path, extra: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    argv = [*CLI, "launch", "--worker-id", "w1", "--runtime-dir", str(rdir)]
    argv += ["--repo", str(repo), "--", sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    argv += ["--model", str(model), "--port", str(port), *ARGS, *extra, "--served-model-name", "m"]
    # as fleets run their workers: vLLM refuses any KV connector beside expandable segments, and
    # gpuckpt's plugin exempts its own (tests/test_vllm_plugin.py); the launched worker must start
    env = {**os.environ, **ENV, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def until(pred: Any, timeout: float, what: str, proc: subprocess.Popen[bytes], log: Path) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"launch exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        if v := pred():
            return v
        time.sleep(0.25)
    raise TimeoutError(f"{what}:\n{log.read_text()[-3000:]}")


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def kill_all(launch: subprocess.Popen[bytes], sock: Path) -> None:
    """SIGKILL the launch process group and the worker's (launch starts it in a session of its own)."""
    with contextlib.suppress(Exception):
        os.killpg(os.getpgid(WorkerChannel(str(sock)).ping().pid), signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(launch.pid, signal.SIGKILL)
    launch.wait()


def agent_status(api: Path) -> dict[str, Any] | None:
    st = subprocess.run([*CLI, "status", "--agent", str(api), "--json"], capture_output=True, text=True, timeout=120)
    return json.loads(st.stdout) if st.returncode == 0 else None
