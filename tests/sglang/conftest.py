"""Fixtures for the SGLang adapter's tests: the SGLang interpreter and servers with gpuckpt's linker.

SGLang runs in a virtual environment of its own (it cannot share the vLLM one): ``.venv-sglang``
at the repository root, or the interpreter ``GPUCKPT_SGLANG_PYTHON`` names. Without it the tests
are skipped, saying so, unless ``GPUCKPT_REQUIRE_SGLANG=1`` (then they fail naming what is
missing). The servers get ``standin/`` on their ``PYTHONPATH`` (see its modules: this CPU has no
``sgl-kernel`` wheel) and the repository root (the linker is imported from the working tree).
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.engines.sglang.serve import CPU_ARGS, SglangProcess

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "standin"
#: The flags every test server shares (the reference runs use the same).
BASE_ARGS = CPU_ARGS


def _sglang_python() -> str:
    py = os.environ.get("GPUCKPT_SGLANG_PYTHON") or str(ROOT / ".venv-sglang" / "bin" / "python")
    why = None
    if not os.access(py, os.X_OK):
        why = f"no SGLang interpreter at {py} (set GPUCKPT_SGLANG_PYTHON or create .venv-sglang)"
    else:
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": os.pathsep.join([str(STANDIN), str(ROOT)])}
        probe = "import sglang.srt.mem_cache.unified_cache.unified_cache_linker, agent.engines.control"
        r = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
        if r.returncode != 0:
            why = f"{py} cannot import sglang and gpuckpt: {r.stderr.strip()[-300:]}"
    if why is None:
        return py
    if os.environ.get("GPUCKPT_REQUIRE_SGLANG") == "1":
        pytest.fail(f"GPUCKPT_REQUIRE_SGLANG=1: {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def sglang_python() -> str:
    return _sglang_python()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm.conftest import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("sglang-model") / "llama", dtype="float32", seed=7)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Start = Callable[..., SglangProcess]


@pytest.fixture(scope="module")
def start_server(sglang_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Start]:
    """``start(name, page_size=16)``: an SGLang server with the linker, ready; all killed at the end."""
    procs: list[SglangProcess] = []
    base = tmp_path_factory.mktemp("sglang-run")

    def start(name: str, page_size: int = 16) -> SglangProcess:
        p = SglangProcess(
            str(tiny_model),
            str(base / f"{name}.sock"),
            port=free_port(),
            log_path=str(base / f"{name}.log"),
            python=sglang_python,
            staging_dir=str(base / f"{name}-staging"),
            extra_args=[*BASE_ARGS, "--page-size", str(page_size)],
            pythonpath=[str(STANDIN), str(ROOT)],
        )
        procs.append(p)
        p.wait_ready(600)
        return p

    yield start
    for p in procs:
        p.kill()
