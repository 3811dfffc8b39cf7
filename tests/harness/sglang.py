"""SGLang servers as the tests run them: the interpreter of SGLang's own virtual environment and
servers with gpuckpt's linker.

SGLang runs in a virtual environment of its own (it cannot share the vLLM one): ``.venv-sglang``
at the repository root, or the interpreter ``GPUCKPT_SGLANG_PYTHON`` names. The servers get
``tests/sglang/standin/`` on their ``PYTHONPATH`` (see its modules: this CPU has no ``sgl-kernel``
wheel) and the repository root (the linker is imported from the working tree).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agent.engines.sglang.serve import CPU_ARGS, linker_config
from agent.testing import SglangProcess
from tests.harness.net import free_port
from tests.harness.paths import ROOT

STANDIN = ROOT / "tests" / "sglang" / "standin"
#: The flags every test server shares (the reference runs use the same).
BASE_ARGS = CPU_ARGS

#: ``start(name, page_size=16)``: a ready server (the ``start_server`` fixture)
Start = Callable[..., SglangProcess]


def find_sglang_python() -> tuple[str, str | None]:
    """SGLang's interpreter, and why it cannot serve (``None`` when it can import sglang and gpuckpt)."""
    py = os.environ.get("GPUCKPT_SGLANG_PYTHON") or str(ROOT / ".venv-sglang" / "bin" / "python")
    if not os.access(py, os.X_OK):
        return py, f"no SGLang interpreter at {py} (set GPUCKPT_SGLANG_PYTHON or create .venv-sglang)"
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": os.pathsep.join([str(STANDIN), str(ROOT)])}
    probe = "import sglang.srt.mem_cache.unified_cache.unified_cache_linker, agent.engines.control"
    r = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    if r.returncode != 0:
        return py, f"{py} cannot import sglang and gpuckpt: {r.stderr.strip()[-300:]}"
    return py, None


class Servers:
    """SGLang servers with the linker, their sockets, logs and staging under ``base``;
    :meth:`close` kills every one still running."""

    def __init__(self, python: str, model: Path, base: Path) -> None:
        self.python, self.model, self.base = python, model, base
        self.procs: list[SglangProcess] = []

    def start(
        self, name: str, page_size: int = 16, linker: dict[str, Any] | None = None, args: Sequence[str] = ()
    ) -> SglangProcess:
        """A server named ``name``, ready (API and control socket); ``linker`` adds to the linker's
        extra config (``copy_bytes_per_step`` and the like), ``args`` to the server's flags."""
        extra = [*BASE_ARGS, "--page-size", str(page_size), *args]
        if linker:
            staging_dir = str(self.base / f"{name}-staging")
            cfg = linker_config(str(self.base / f"{name}.sock"), staging_dir)
            cfg["linker_extra_config"].update(linker)
            extra += ["--unified-cache-external-linker-config", json.dumps(cfg)]  # the last one counts
        p = SglangProcess(
            str(self.model),
            str(self.base / f"{name}.sock"),
            port=free_port(),
            log_path=str(self.base / f"{name}.log"),
            python=self.python,
            staging_dir=str(self.base / f"{name}-staging"),
            extra_args=extra,
            pythonpath=[str(STANDIN), str(ROOT)],
        )
        self.procs.append(p)
        p.wait_ready(600)
        return p

    def close(self) -> None:
        for p in self.procs:
            p.kill()
