"""A request that kills the engine never crash-loops its restores, through ``gpuckpt launch``.

Worker A (``gpuckpt launch -- vllm serve``, a test-only logits processor that raises once a request
whose prompt holds a marker reaches a given length: ``tests/harness/poison.py``) serves three
clients: the poisoned request and two short ones; a checkpoint holds all three mid-decode, then
``launch`` is SIGKILLed. The relaunch (B) restores the checkpoint and resubmits them: the short ones
finish, the poisoned one kills the engine — ``launch`` sees its worker die soon after the restore
and records the request it was running. The next relaunch (C, same runtime directory) restores the
same checkpoint warm, resubmits none of the quarantined request, continues the others (their
clients' retries attach and get the uninterrupted answers), and stays up; ``GET /restore`` and
``gpuckpt restore --dry-run`` say which request is quarantined and why.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from agent import session
from agent.engines import canary
from agent.engines.vllm.serve import ServeClient
from ckpt import Repository
from tests.harness.cli import CLI
from tests.harness.clients import call
from tests.harness.launched import agent_status, chat_model, healthy, kill_all, launch, until
from tests.harness.net import free_port
from tests.harness.paths import short_dir
from tests.harness.poison import MARKER

pytestmark = pytest.mark.slow

#: tokens of prompt and output: the poisoned request has 200 outputs by then — 160 steps after the
#: restore, the short ones' 10 long done (a busy host's jitter never makes them its victims)
POISON_AT = 260
BODY = {"temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "stream": True}


def prompts() -> dict[str, list[int]]:
    base = [5 + (i * 7) % 400 for i in range(52)]
    return {
        "poison": base[:20] + MARKER + base[20:52],  # 60 tokens
        "short1": [6 + (i * 13) % 400 for i in range(60)],
        "short2": [7 + (i * 17) % 400 for i in range(60)],
    }


def body(name: str) -> dict[str, Any]:
    return {"prompt": prompts()[name], "max_tokens": 300 if name == "poison" else 50, **BODY}


def test_a_request_that_kills_the_engine_is_quarantined_after_one_crash_and_the_rest_continue(
    tiny_llama_text: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp = short_dir("gpq-")
    model = chat_model(tiny_llama_text, tmp_path_factory.mktemp("poison-model"))
    repo = tmp / "repo"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = ("--logits-processors", "tests.harness.poison:Poison")
    monkeypatch.setenv("POISON_AT", str(POISON_AT))  # the workers inherit it
    # A: the checkpoint holds the three requests mid-decode
    log_a = tmp / "launch-a.log"
    a = launch(model, tmp / "run-a", repo, port, log_a, extra)
    sock_a = tmp / "run-a" / "w1-connector.sock"
    try:
        until(lambda: healthy(url) and sock_a.exists(), 240, "worker A", a, log_a)
        probe = canary.record(ServeClient(url).generate)
        threads = [
            threading.Thread(target=lambda k=k: _quietly(url, k), name=f"client-{k}", daemon=True) for k in prompts()
        ]

        def start() -> None:
            for t in threads:
                t.start()

        session.hold(str(sock_a), 3, timeout=300)
        r = Repository.open(str(repo))
        when = {"live": 3, "min_outputs": 40}
        m = session.checkpoint_around(str(sock_a), start, r, "w1", canary=probe, when=when, timeout=300).manifest
    finally:
        kill_all(a, sock_a)
    assert {e["client_request_id"] for e in m.ledger.data["requests"]} == {f"cmpl-{k}-0" for k in prompts()}
    # B: restores, resubmits; the poisoned request kills the engine; launch records it and exits
    rdir = tmp / "run-bc"
    log_b = tmp / "launch-b.log"
    b = launch(model, rdir, repo, port, log_b, extra)
    try:
        code = b.wait(600)
    finally:
        kill_all(b, rdir / "w1-connector.sock")
    text = log_b.read_text()
    assert code != 0, f"launch exited {code}:\n{text[-3000:]}"
    assert "quarantined for the next restore: cmpl-poison-0" in text, text[-3000:]
    record = json.loads((rdir / "w1.quarantine.json").read_text())
    assert list(record["body"]["requests"]) == ["cmpl-poison-0"]
    assert record["body"]["requests"]["cmpl-poison-0"]["checkpoints"] == [m.id]
    # C: the same checkpoint, warm; the poisoned request not resubmitted, the others continued
    log_c = tmp / "launch-c.log"
    c = launch(model, rdir, repo, port, log_c, extra)
    try:
        until(lambda: healthy(url), 240, "worker C", c, log_c)
        retries = {k: call(url, k, "completions", body(k)) for k in ("short1", "short2")}

        def done() -> dict[str, Any] | None:
            st = agent_status(rdir / "w1.sock")
            rr = (st or {}).get("restore") or {}
            return st if (rr.get("resubmission") or {}).get("state") == "done" else None

        status = until(done, 240, "C's resubmission", c, log_c)
        fresh = {k: call(url, f"{k}-again", "completions", body(k)) for k in ("short1", "short2")}
        sock = str(rdir / "w1-connector.sock")
        dry = subprocess.run(
            [*CLI, "restore", f"w1/{m.id}", "--repo", str(repo), "--connector-socket", sock, "--dry-run", "--json"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        # the worker stayed up through all of it
        assert c.poll() is None, log_c.read_text()[-3000:]
        assert healthy(url)
    finally:
        kill_all(c, rdir / "w1-connector.sock")
    rr = status["restore"]
    assert rr["outcome"] == "warm", rr
    assert list(rr["quarantined"]) == ["cmpl-poison-0"], rr
    assert "the worker died" in rr["quarantined"]["cmpl-poison-0"]
    assert rr["left_to_client"]["cmpl-poison-0"] == rr["quarantined"]["cmpl-poison-0"]
    for k in ("short1", "short2"):
        assert retries[k]["attach"] == "attached", (k, retries[k]["attach"])
        assert retries[k]["choices"][0]["ids"] == fresh[k]["choices"][0]["ids"], k
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert json.loads(dry.stdout)["quarantined"] == rr["quarantined"]


def _quietly(url: str, k: str) -> None:
    with contextlib.suppress(Exception):  # the worker is killed under it
        call(url, k, "completions", body(k))
