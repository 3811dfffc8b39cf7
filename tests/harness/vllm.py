"""vLLM (CPU build) workers as the tests run them: ``vllm serve`` workers with the connector
(:func:`serve_worker`, the flags in :data:`ARGS`) and offline ``vllm.LLM`` workers running
:mod:`tests.harness.scripts.vllm_worker` (:func:`run_worker`, :func:`run_workers`). Nothing here
imports vLLM: workers are processes.

An engine start costs ~15-30 s here, most of a test's time: a test that needs a second worker
starts it while the first works, bound to another CPU (``cpu=1``: :func:`cpu_bind`), and offline
workers that do not depend on each other run side by side (:func:`run_workers`).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agent.engines.vllm.serve import kv_transfer_config
from agent.testing import ServeProcess
from tests.harness.net import free_port
from tests.harness.paths import ROOT
from tests.harness.scripts import vllm_worker

#: A ``vllm serve`` test worker's environment: 1 GiB of KV cache, one core (:func:`cpu_bind`), fixed hash seeds.
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "PYTHONHASHSEED": "0"}
#: A ``vllm serve`` test worker's flags: token ids in and out, float32, 32-token blocks.
ARGS = [
    "--skip-tokenizer-init",
    "--enforce-eager",
    "--dtype",
    "float32",
    "--block-size",
    "32",
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "8",
    "--seed",
    "0",
]
GREEDY = {"temperature": 0.0, "max_tokens": 700, "ignore_eos": True}
SEEDED = {"temperature": 1.0, "seed": 4321, "max_tokens": 700, "ignore_eos": True}

#: the offline worker script :func:`run_worker` runs
WORKER = Path(vllm_worker.__file__)


def cpu_bind(cpu: int = 0, tp: int = 1) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a worker on this process's ``cpu``-th CPU (modulo how
    many it may use), or on the first ``tp`` CPUs, one per rank (``"0|1"``)."""
    cpus = sorted(os.sched_getaffinity(0))
    if tp > 1:
        return "|".join(str(c) for c in cpus[:tp])
    return str(cpus[cpu % len(cpus)])


#: the connector settings of a worker a restore will follow, as ``gpuckpt launch`` gives it: its
#: server holds requests that may be retries until the agent says what it resubmits (its
#: ``expect``), so a client's retry never races the agent's resubmission into a duplicate. Long
#: here, where the restore may be slow on a busy host: the agent's ``expect`` ends the hold.
RESTORE_FOLLOWS: dict[str, Any] = {"retry_hold_s": 600.0}


def serve_worker(
    model: Path, tmp: Path, name: str, args: list[str] = ARGS, extra: dict[str, Any] | None = None, *, cpu: int = 0
) -> ServeProcess:
    """A test worker (not yet ready) whose socket, log and staging are named after ``name`` in ``tmp``;
    ``extra``: more of the connector's ``kv_connector_extra_config``; its engine computes on the
    ``cpu``-th CPU (:func:`cpu_bind`)."""
    sock, stage = str(tmp / f"{name}.sock"), str(tmp / f"stage-{name}")
    return ServeProcess(
        str(model),
        sock,
        port=free_port(),
        log_path=str(tmp / f"{name}.log"),
        staging_dir=stage,
        args=args,
        env={**ENV, "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(cpu)},
        kv_config=kv_transfer_config(sock, stage, **extra) if extra else None,
    )


def run_worker(
    args: dict[str, Any], tmp: Path, *, kill_after_result: bool = False, timeout: float = 300, cpu: int = 0
) -> Any:
    """Run the offline worker script (:mod:`tests.harness.scripts.vllm_worker`) with ``args`` in a new
    process group, computing on the ``cpu``-th CPU (``tp > 1``: on the first ``tp``); return its
    result JSON.

    With ``kill_after_result`` the group is SIGKILLed as soon as the result
    file appears (the worker waits to be killed), as a crash would.
    """
    result = tmp / f"result-{args['mode']}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(cpu, args.get("tp", 1)),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONHASHSEED": "0",
        # the script imports gpuckpt from the checkout these tests are in, whatever is installed
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    log = open(tmp / f"{result.stem}.log", "wb")  # noqa: SIM115
    p = subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps({**args, "result": str(result), "wait_for_kill": kill_after_result})],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if result.exists() and (kill_after_result or p.poll() is not None):
                break
            if p.poll() is not None:
                break
            time.sleep(0.2)
        else:
            raise TimeoutError(f"worker {args['mode']} timed out; log: {log.name}")
    finally:
        # Always kill the whole group: even after a clean exit of the script,
        # vLLM's EngineCore and worker processes (same group) can outlive it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        log.close()
    if not result.exists():
        raise RuntimeError(
            f"worker {args['mode']} exited {p.returncode} without a result:\n" + Path(log.name).read_text()[-4000:]
        )
    return json.loads(result.read_text())


def run_workers(jobs: dict[str, dict[str, Any]], tmp: Path, **kw: Any) -> dict[str, Any]:
    """:func:`run_worker` for each of ``jobs`` (one-rank workers that do not depend on each other),
    as many at once as this process has CPUs, each on a CPU of its own; their results by name."""
    free: queue.SimpleQueue[int] = queue.SimpleQueue()
    n = min(len(os.sched_getaffinity(0)), len(jobs))
    for cpu in range(n):
        free.put(cpu)

    def run(args: dict[str, Any]) -> Any:
        assert args.get("tp", 1) == 1, "a worker of several ranks takes every CPU: run it alone"
        cpu = free.get()
        try:
            return run_worker(args, tmp, cpu=cpu, **kw)
        finally:
            free.put(cpu)

    with ThreadPoolExecutor(max_workers=max(1, n)) as pool:
        futures = {name: pool.submit(run, args) for name, args in jobs.items()}
        return {name: f.result() for name, f in futures.items()}
