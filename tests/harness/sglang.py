"""SGLang servers as the tests run them: the interpreter of SGLang's own virtual environment and
servers with gpuckpt's linker.

SGLang runs in a virtual environment of its own (it cannot share the vLLM one): ``.venv-sglang``
at the repository root, or the interpreter ``GPUCKPT_SGLANG_PYTHON`` names. The servers get
``tests/sglang/standin/`` on their ``PYTHONPATH`` (see its modules: this CPU has no ``sgl-kernel``
wheel) and the repository root (the linker is imported from the working tree).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from agent import session
from agent.engines.sglang.serve import CPU_ARGS, linker_config
from agent.engines.types import Checkpointed
from agent.testing import SglangProcess
from ckpt import Repository
from tests.harness.net import free_port
from tests.harness.paths import ROOT
from tests.harness.waiting import wait_for

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

    def __init__(self, python: str, model: Path, base: Path, *, tokenizer: bool = False) -> None:
        """``tokenizer``: the servers load the model's tokenizer (text, chat) — a server as users
        run it — instead of taking token ids alone (``--skip-tokenizer-init``)."""
        self.python, self.model, self.base = python, model, base
        self.args = tuple(a for a in BASE_ARGS if not (tokenizer and a == "--skip-tokenizer-init"))
        self.procs: list[SglangProcess] = []

    def start(
        self,
        name: str,
        page_size: int = 16,
        linker: dict[str, Any] | None = None,
        args: Sequence[str] = (),
        middleware: bool = False,
    ) -> SglangProcess:
        """A server named ``name``, ready (API and control socket); ``linker`` adds to the linker's
        extra config (``copy_bytes_per_step`` and the like), ``args`` to the server's flags."""
        extra = [*self.args, "--page-size", str(page_size), *args]
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
            middleware=middleware,
        )
        self.procs.append(p)
        p.wait_ready(600)
        return p

    def close(self) -> None:
        for p in self.procs:
            p.kill()


#: greedy, with the budget always spent (the reference runs and the checkpointed ones match)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@contextlib.contextmanager
def arriving_together(server: SglangProcess, rids: Sequence[str]) -> Iterator[None]:
    """The calls ``rids``, sent inside the block, reach ``server``'s scheduler together.

    A checkpoint taken once several calls decode at once must not race them: started one by one
    on a busy host, the first could spend its whole budget before the last arrived, and the
    condition would never hold. So the server holds new calls (SGLang's ``/pause_generation``,
    in place), each call is seen received (its rid in the server's request log, JSON), and
    ``/continue_generation`` lets them all go."""
    post = partial(_post, server.url)
    post("/configure_logging", {"log_requests": True, "log_requests_format": "json"})
    post("/pause_generation", {"mode": "in_place"})
    try:
        yield
        wait_for(lambda: all(received(server.log_path, r) for r in rids), 120, f"calls {list(rids)} reach the server")
    finally:
        post("/continue_generation", {})


def _post(url: str, path: str, body: dict[str, Any]) -> None:
    httpx.post(url + path, json=body, timeout=60).raise_for_status()


def received(log_path: str, rid: str) -> bool:
    """Whether the server's request log (JSON) has received the call ``rid``."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        return any('"request.received"' in line and f'"rid": "{rid}"' in line for line in f)


def checkpoint_in_flight(
    server: SglangProcess,
    requests: dict[str, tuple[list[int], int]],
    repo: Repository,
    worker: str,
    when: dict[str, int],
    *,
    kill: bool = False,
) -> Checkpointed:
    """``requests`` (rid → greedy prompt and budget) started on ``server``, each on a thread of its
    own, and checkpointed once ``when`` holds (``session.checkpoint_around``: the capture waits
    for the condition at a step boundary, not for a sleep). Then the requests run to their end —
    or, with ``kill``, the server is SIGKILLed under them (their clients see the connection drop)."""
    threads: list[threading.Thread] = []

    def run(rid: str, prompt: list[int], n: int) -> None:
        with contextlib.suppress(httpx.HTTPError):  # the server may be killed under it
            server.client.complete(prompt, {**GREEDY, "max_new_tokens": n}, rid=rid)

    def start() -> None:
        with arriving_together(server, list(requests)):
            for rid, (prompt, n) in requests.items():
                t = threading.Thread(target=run, args=(rid, prompt, n), name=f"client-{rid}")
                t.start()
                threads.append(t)

    taken = session.checkpoint_around(
        server.control_socket, start, repo, worker, when=when, timeout=300, generate=server.client.generate
    )
    if kill:
        server.kill()
    for t in threads:
        t.join(300)
    return taken
