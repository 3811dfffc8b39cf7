"""``gpuckpt agent``: configurations for the tests' agents and ``agent run`` started beside a worker."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tests.harness.cli import CLI, cli

if TYPE_CHECKING:
    from agent.daemon.config import AgentConfig
    from agent.testing import WorkerProcess


def make_cfg(tmp: Path, **over: object) -> AgentConfig:
    """An agent's configuration under ``tmp`` (repository, connector socket, API socket), no
    restore at start, keep the last two; ``over`` replaces any top-level key."""
    base: dict[str, object] = {
        "worker_id": "w0",
        "repository": str(tmp / "repo"),
        "connector_socket": str(tmp / "conn.sock"),
        "api": {"socket": str(tmp / "agent.sock")},
        "restore": {"on_start": False},
        "retention": {"keep_last": 2, "gc_interval": None},
    }
    base.update(over)
    from agent.daemon import config

    return config.load(None, **base)


def write_config(
    path: Path,
    *,
    url: str,
    worker: WorkerProcess,
    api: Path,
    restore: bool,
    interval: str = "3s",
    offer_ttl: str = "10m",
    engine: str = "vllm",
) -> None:
    """The TOML of an agent for ``worker`` (worker id ``w0``, JSON logs), checkpointing every
    ``interval``, restoring at start when ``restore``."""
    path.write_text(
        f"""
worker_id = "w0"
repository = "{url}"
engine = "{engine}"
connector_socket = "{worker.control_socket}"
worker_url = "{worker.url}"
log_format = "json"

[api]
socket = "{api}"
mode = "0600"

[checkpoint]
interval = "{interval}"
stop_deadline = "60s"

[restore]
on_start = {"true" if restore else "false"}
wait_for_worker = "2m"
offer_ttl = "{offer_ttl}"

[retention]
keep_last = 10
gc_interval = "1h"
"""
    )


def start_agent(config: Path, log: Path, api: Path) -> subprocess.Popen[bytes]:
    """``gpuckpt agent run --config CONFIG``, returned once its status says ready."""
    p = subprocess.Popen(
        [*CLI, "agent", "run", "--config", str(config)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"agent exited {p.returncode}:\n{log.read_text()[-3000:]}")
        if api.exists():
            r = cli("status", "--agent", str(api), "--json")
            if r.returncode == 0 and json.loads(r.stdout)["state"] == "ready":
                return p
        time.sleep(0.3)
    p.kill()
    raise TimeoutError(f"agent not ready:\n{log.read_text()[-3000:]}")
