"""``bench/gpu_check.py``'s worker launcher, which a GPU host runs once per check in one process:
each check's launcher runs the test worker script, never an earlier check's launcher (which,
in the same directory, would run itself; in a deleted one, nothing)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def gpu_check() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_check_launches_the_worker_script_with_its_own_engine_arguments(tmp_path: Path) -> None:
    gc = gpu_check()
    script = tmp_path / "vllm_worker.py"
    seen: list[tuple[str, str, dict[str, Any]]] = []

    def run_worker(args: dict[str, Any], tmp: Path, **kw: Any) -> dict[str, Any]:
        launcher = Path(harness.WORKER)
        seen.append((launcher.name, launcher.read_text(), json.loads(os.environ[gc._LLM_EXTRA])))
        return {"ok": args["n"]}

    harness = SimpleNamespace(WORKER=script, run_worker=run_worker)
    for n, d in enumerate(["a", "a", "b"]):  # two checks in one directory, a third in another
        (tmp_path / d).mkdir(exist_ok=True)
        run = gc._worker(harness, tmp_path / d)
        assert run({"n": n}, {"kv_cache_dtype": f"x{n}"}) == {"ok": n}
        assert str(harness.WORKER) == str(script)  # restored after the call
    for n, (name, text, llm) in enumerate(seen):
        assert name == "launch_worker.py"
        assert repr(str(script)) in text, text  # the worker script itself, not a launcher
        assert "launch_worker" not in text.split("sys.argv[0] = ", 1)[1]
        assert llm == {"kv_cache_dtype": f"x{n}"}
    assert gc._LLM_EXTRA not in os.environ
