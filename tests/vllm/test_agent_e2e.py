"""The agent end to end with real processes: SeaweedFS, a ``vllm serve`` CPU worker
with the connector, and ``gpuckpt agent run`` beside it.

Periodic checkpoints land in the bucket and are incremental; SIGTERM to the
agent takes a final checkpoint with requests in flight and exits 0; a new
worker and a new agent restore it at start (warm), resubmit the in-flight
requests, and they complete with the tokens an uninterrupted run produces.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import ExitStack
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import pytest

from agent import session
from agent.engines import staging
from agent.engines.base import token_digest
from agent.testing import ServeProcess
from ckpt import Repository
from tests.harness.agent import start_agent, write_config
from tests.harness.cli import CLI, cli
from tests.harness.net import free_port
from tests.harness.paths import short_dir
from tests.harness.vllm import ARGS, ENV, GREEDY, serve_worker
from tests.harness.waiting import concurrently, quiet, wait_for

pytestmark = pytest.mark.slow
LONG = {**GREEDY, "max_tokens": 3000}


@pytest.fixture(scope="module")
def e2e(tiny_llama: Path, seaweed, module_cleanup: ExitStack) -> dict:  # type: ignore[no-untyped-def]
    tmp = short_dir("gpe2e-")
    bucket = seaweed.make_bucket(f"e2e-{uuid.uuid4().hex[:10]}")
    url = f"s3://{bucket}/repo?endpoint={seaweed.endpoint}"
    out: dict = {"tmp": tmp, "url": url}
    rng = random.Random(3)
    system = [rng.randrange(3, 512) for _ in range(64)]

    def worker(name: str) -> ServeProcess:
        # The requests in flight at SIGTERM must still be decoding when the final checkpoint
        # captures, however busy the host: worker A's steps are paced (20 ms each, so 3,000
        # tokens take a minute or more); it is killed after the final checkpoint, and the
        # reference and the continuations run on worker B at full speed.
        extra = {"step_delay_s": 0.02} if name == "a" else None
        w = serve_worker(tiny_llama, tmp, name, [*ARGS, "--max-model-len", "4096"], extra)
        w.wait_ready()
        return w

    repo = Repository.open(url, create=True)
    # -- worker A with its agent: periodic checkpoints, then SIGTERM with requests in flight.
    with worker("a") as a:
        # B starts once A is up, while A works, on another CPU: an engine start costs ~20 s here,
        # and B is still fresh when its turn comes
        b_early = serve_worker(tiny_llama, tmp, "b", [*ARGS, "--max-model-len", "4096"], cpu=1)
        module_cleanup.enter_context(b_early)
        api = tmp / "agent-a.sock"
        write_config(tmp / "a.toml", url=url, worker=a, api=api, restore=False)
        agent = start_agent(tmp / "a.toml", tmp / "agent-a.log", api)
        try:
            idle = wait_for(lambda: repo.list("w0"), 30, "a first periodic checkpoint")
            # Traffic: three conversations' first turns; the next periodic checkpoint holds them.
            convs = [system + [rng.randrange(3, 512) for _ in range(150 + 20 * i)] for i in range(3)]
            for i, p in enumerate(convs):
                a.client.complete(p, {**GREEDY, "max_tokens": 32}, request_id=f"turn1-{i}", stream=False)
            done_at = datetime.now(UTC)

            def two_after():  # type: ignore[no-untyped-def]
                infos = [i for i in repo.list("w0") if i.created > done_at]
                return infos if len(infos) >= 3 else None

            out["idle"] = repo.manifest(idle[0].id)
            # The first may still catch the last turn's tail being stored: judge the next two.
            after = wait_for(two_after, 60, "three checkpoints after the traffic")[1:]
            out["periodic"] = [repo.manifest(i.id) for i in after]
            # In flight at SIGTERM.
            prompts = {f"req{i}": system + [rng.randrange(3, 512) for _ in range(100 + 30 * i)] for i in range(3)}
            threads = [
                threading.Thread(
                    target=lambda k=k: quiet(lambda: a.client.complete(prompts[k], LONG, request_id=k, stream=False))
                )
                for k in prompts
            ]

            def start() -> None:
                for t in threads:
                    t.start()

            # registered before the requests exist: a busy host cannot let them pass unseen
            session.wait_around(a.control_socket, start, live=3, min_outputs=30)
            agent.send_signal(signal.SIGTERM)
            out["agent_a_exit"] = agent.wait(90)
        finally:
            if agent.poll() is None:
                agent.kill()
        out["prompts"] = prompts
        final = repo.list("w0")[-1]
        out["final"] = repo.manifest(final.id)
        a.kill()
    # -- worker B with a fresh agent: restore at start.
    with b_early as b:
        b.wait_ready()
        api = tmp / "agent-b.sock"
        # No periodic checkpoints on B: with retention they would forget A's
        # final checkpoint, which the CLI is asked about below.
        # The restored blocks stay offered 20 s: then their page file (users' KV) must be gone.
        write_config(tmp / "b.toml", url=url, worker=b, api=api, restore=True, interval="1h", offer_ttl="20s")
        agent = start_agent(tmp / "b.toml", tmp / "agent-b.log", api)
        try:

            def restored():  # type: ignore[no-untyped-def]
                r = cli("status", "--agent", str(api), "--json")
                st = json.loads(r.stdout)
                state = (st.get("restore") or {}).get("resubmission", {}).get("state")
                return st if state in ("done", "failed") else None

            out["status_b"] = wait_for(restored, 120, "the restored requests to finish")
            from agent.daemon.api import AgentClient

            with AgentClient(api) as c:
                out["restore_b"] = c.request("GET", "/restore")
            stage = staging.default_dir(f"{session.RESTORE_TAG}{agent.pid}")
            out["restore_stage_exists"] = stage.is_dir()  # its page file may be gone already: 20 s is short
            end = time.monotonic() + 120  # the offer's 20 s, then the next step boundary
            while stage.is_dir() and any(stage.iterdir()) and time.monotonic() < end:
                time.sleep(0.2)
            out["restore_stage_after"] = sorted(p.name for p in stage.iterdir()) if stage.is_dir() else []
            # The uninterrupted reference, on the same fresh worker: the same requests from their prompts.
            # together: the engine decodes them in one step each, as it did the restored continuations
            refs = concurrently(
                {
                    k: partial(b.client.complete, p, LONG, request_id=f"ref-{k}", stream=False)
                    for k, p in prompts.items()
                }
            )
            out["reference"] = {k: c.token_ids for k, c in refs.items()}
            out["cli_restore_dry_run"] = cli(
                "restore", final.id, "--repo", url, "--connector-socket", b.control_socket, "--dry-run", "--json"
            )
            # The worker dies under its agent: checkpoints fail and say why, the agent stays up.
            b.kill()
            out["killed_at"] = datetime.now(UTC)
            out["checkpoint_dead_worker"] = cli("checkpoint", "--agent", str(api), "--wait", "--json")
            out["status_dead_worker"] = json.loads(cli("status", "--agent", str(api), "--json").stdout)
            agent.send_signal(signal.SIGTERM)
            out["agent_b_exit"] = agent.wait(90)
        finally:
            if agent.poll() is None:
                agent.kill()
    return out


def test_periodic_checkpoints_land_and_are_incremental(e2e: dict) -> None:
    first, second = e2e["periodic"][:2]
    assert all(m.labels.get("trigger") == "periodic" for m in (e2e["idle"], first, second))
    # Both hold the three conversations' KV (far more than the idle worker's canary block)...
    assert first.sizes.blocks >= e2e["idle"].sizes.blocks + 12, (e2e["idle"].sizes, first.sizes)
    assert second.sizes.blocks >= first.sizes.blocks
    # ...and the second references what is already stored: it writes far fewer bytes.
    assert second.sizes.new_stored_bytes < 0.2 * second.sizes.stored_bytes, second.sizes
    assert second.parent == first.id


def test_sigterm_takes_a_final_checkpoint_with_the_requests_in_flight(e2e: dict) -> None:
    assert e2e["agent_a_exit"] == 0
    m = e2e["final"]
    assert "stop" in m.labels["trigger"].split(",")
    ids = {e["client_request_id"] for e in m.ledger.data["requests"]}
    assert ids == {f"cmpl-{k}-0" for k in e2e["prompts"]}
    log = (e2e["tmp"] / "agent-a.log").read_text().splitlines()
    records = [json.loads(line) for line in log if line.startswith("{")]
    assert any(r.get("message") == "final checkpoint saved" for r in records), "structured JSON logs"


def test_a_new_agent_restores_warm_and_the_requests_finish_with_the_expected_tokens(e2e: dict) -> None:
    rep = e2e["restore_b"]
    assert rep["outcome"] == "warm", rep
    assert rep["checkpoint"] == e2e["final"].id
    assert rep["resubmission"]["state"] == "done"
    results = rep["results"]
    assert set(results) == {f"cmpl-{k}-0" for k in e2e["prompts"]}
    for k, ref in e2e["reference"].items():
        r = results[f"cmpl-{k}-0"]
        assert (r["output_tokens"], r["output_digest"]) == (len(ref), token_digest(ref)), f"{k} diverged"
        assert r["cached_tokens"] == r["prompt_tokens"] - 1, r
    assert e2e["status_b"]["restore"]["outcome"] == "warm"
    assert e2e["agent_b_exit"] == 0


def test_a_dead_worker_fails_checkpoints_cleanly_and_the_agent_stays_up(e2e: dict) -> None:
    r = e2e["checkpoint_dead_worker"]
    assert r.returncode == 1, r.stdout + r.stderr
    err = json.loads(r.stdout)["error"]["message"]
    assert "checkpoint failed" in err
    st = e2e["status_dead_worker"]
    assert st["state"] == "ready"
    assert st["worker"]["attached"] is False
    assert st["last_error"]["operation"] == "checkpoint"
    # Nothing half-written became visible; the earlier checkpoints are intact and the newest loads.
    repo = Repository.open(e2e["url"])
    infos = repo.list("w0")
    assert all(i.created <= e2e["killed_at"] for i in infos), "no checkpoint landed after the worker died"
    m = repo.manifest(infos[-1].id)
    assert sum(1 for _ in repo.load(m)) == len(m.blocks)
    assert e2e["agent_b_exit"] == 0, "SIGTERM with the worker gone: the final checkpoint fails, the agent still exits"


def test_cli_restore_dry_run_prints_the_plan_as_json(e2e: dict) -> None:
    r = e2e["cli_restore_dry_run"]
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["warm"] is True
    assert plan["requests"] == 3
    assert {x["rule"] for x in plan["results"]} >= {"block_size", "model_digest"}


def test_launch_starts_a_worker_with_the_connector_and_an_agent_beside_it(tiny_llama: Path) -> None:
    import httpx

    tmp = short_dir("gpl-")
    port = free_port()
    repo_path = tmp / "repo"
    log = tmp / "launch.log"
    p = subprocess.Popen(
        [
            *CLI,
            "launch",
            "--worker-id",
            "w1",
            "--runtime-dir",
            str(tmp),
            "--repo",
            str(repo_path),
            "--",
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(tiny_llama),
            "--port",
            str(port),
            *ARGS,
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **ENV},
        start_new_session=True,
    )
    try:

        def worker_ready() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                assert p.poll() is None, log.read_text()[-3000:]
                return False

        wait_for(worker_ready, 180, "the launched worker's API")
        api = tmp / "w1.sock"
        r = cli("checkpoint", "--agent", str(api), "--wait", "--json")
        assert r.returncode == 0, r.stdout + r.stderr + log.read_text()[-3000:]
        t = json.loads(r.stdout)
        assert t["state"] == "done"
        st = json.loads(cli("status", "--agent", str(api), "--json").stdout)
        assert st["worker"]["attached"] is True
        assert st["restore"]["outcome"] == "none"  # nothing to restore on a first start
        p.send_signal(signal.SIGTERM)
        assert p.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        else:
            import contextlib

            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # the worker, if it outlived launch
    repo = Repository.open(str(repo_path))
    ms = [repo.manifest(i.id) for i in repo.list("w1")]
    assert ms[0].id == t["checkpoint"]
    assert "stop" in ms[-1].labels["trigger"].split(",")
    assert ms[-1].canary is not None, "the launched agent knows the worker's API: canary recorded"


def test_the_restored_pages_leave_host_memory_when_the_offer_expires(e2e: dict) -> None:
    assert e2e["restore_b"]["blocks_offered"] > 0, "the restore offered no page file"
    assert e2e["restore_stage_exists"], "the restore staged nowhere the test looks"
    assert e2e["restore_stage_after"] == [], "the restore's page file outlived its offer"
