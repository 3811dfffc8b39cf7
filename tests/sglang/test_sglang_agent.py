"""The agent daemon driving a real SGLang server end to end, as it drives vLLM
(tests/vllm/test_agent_e2e.py): ``gpuckpt agent run`` with ``engine = "sglang"``.

Periodic checkpoints land while the server serves; SIGTERM to the agent takes a
final checkpoint with requests in flight; a new server and a new agent restore
it at start (warm, canary checked), resubmit the in-flight requests under their
rids, and they finish with the tokens an uninterrupted run produces.
"""

from __future__ import annotations

import json
import random
import signal
import threading
from datetime import UTC, datetime
from functools import partial
from typing import Any

import pytest

from agent import session
from agent.engines.base import token_digest
from ckpt import Repository
from tests.harness.agent import start_agent, write_config
from tests.harness.cli import cli
from tests.harness.paths import short_dir
from tests.harness.sglang import Start
from tests.harness.waiting import concurrently, quiet, wait_for

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0.0, "ignore_eos": True}
LONG = {**GREEDY, "max_new_tokens": 1500}  # still decoding when the final checkpoint captures


@pytest.fixture(scope="module")
def e2e(start_server: Start) -> dict[str, Any]:
    tmp = short_dir("gpsg-")
    url = str(tmp / "repo")
    repo = Repository.open(url, create=True)
    out: dict[str, Any] = {"tmp": tmp, "url": url}
    rng = random.Random(11)
    system = [rng.randrange(3, 480) for _ in range(48)]
    # -- server A with its agent: periodic checkpoints, then SIGTERM with requests in flight
    a = start_server("agent-a")
    api = tmp / "agent-a.sock"
    write_config(tmp / "a.toml", url=url, worker=a, api=api, restore=False, engine="sglang")
    agent = start_agent(tmp / "a.toml", tmp / "agent-a.log", api)
    try:
        wait_for(lambda: repo.list("w0"), 60, "a first periodic checkpoint")
        convs = [system + [rng.randrange(3, 480) for _ in range(40 + 10 * i)] for i in range(2)]
        for i, p in enumerate(convs):
            a.client.complete(p, {**GREEDY, "max_new_tokens": 16}, rid=f"turn1-{i}")
        done_at = datetime.now(UTC)
        after = wait_for(
            lambda: [i for i in repo.list("w0") if i.created > done_at] or None, 60, "a checkpoint after the traffic"
        )
        out["periodic"] = repo.manifest(after[0].id)
        prompts = {f"req{i}": system + [rng.randrange(3, 480) for _ in range(30 + 25 * i)] for i in range(2)}
        threads = [
            threading.Thread(target=lambda k=k: quiet(lambda: a.client.complete(prompts[k], LONG, rid=k)))
            for k in prompts
        ]

        def start() -> None:
            for t in threads:
                t.start()

        # registered before the requests exist: a busy host cannot let them pass unseen
        session.wait_around(a.control_socket, start, live=len(prompts), min_outputs=10)
        agent.send_signal(signal.SIGTERM)
        out["agent_a_exit"] = agent.wait(120)
    finally:
        if agent.poll() is None:
            agent.kill()
        a.kill()
    out["prompts"] = prompts
    out["final"] = repo.manifest(repo.list("w0")[-1].id)
    # -- server B with a fresh agent: restore at start
    b = start_server("agent-b")
    api = tmp / "agent-b.sock"
    write_config(tmp / "b.toml", url=url, worker=b, api=api, restore=True, interval="1h", engine="sglang")
    agent = start_agent(tmp / "b.toml", tmp / "agent-b.log", api)
    try:

        def restored() -> dict[str, Any] | None:
            st = json.loads(cli("status", "--agent", str(api), "--json").stdout)
            state = (st.get("restore") or {}).get("resubmission", {}).get("state")
            return st if state in ("done", "failed") else None

        out["status_b"] = wait_for(restored, 300, "the restored requests to finish")
        from agent.daemon.api import AgentClient

        with AgentClient(api) as c:
            out["restore_b"] = c.request("GET", "/restore")
            out["plan_b"] = c.request("GET", f"/restore/plan?checkpoint={out['final'].id}")
        # the uninterrupted reference, on the same fresh server
        # together: the server decodes them in one step each, as it did the restored continuations
        refs = concurrently({k: partial(b.client.complete, p, LONG, rid=f"ref-{k}") for k, p in out["prompts"].items()})
        out["reference"] = {k: c.token_ids for k, c in refs.items()}
        agent.send_signal(signal.SIGTERM)
        out["agent_b_exit"] = agent.wait(120)
    finally:
        if agent.poll() is None:
            agent.kill()
        b.kill()
    return out


def test_periodic_checkpoints_of_an_sglang_server_hold_its_prefix_cache(e2e: dict[str, Any]) -> None:
    m = e2e["periodic"]
    assert m.labels.get("trigger") == "periodic"
    assert m.pins.worker.engine == "sglang"
    assert m.ledger is not None
    assert m.ledger.schema_ == "gpuckpt-sglang-ledger"
    assert m.sizes.blocks >= 2 * 48 // 16, m.sizes  # both conversations' full pages at least


def test_sigterm_takes_a_final_checkpoint_with_the_sglang_requests_in_flight(e2e: dict[str, Any]) -> None:
    assert e2e["agent_a_exit"] == 0
    m = e2e["final"]
    assert "stop" in m.labels["trigger"].split(",")
    assert m.ledger is not None
    entries = {e["rid"]: e for e in m.ledger.data["requests"]}
    assert set(entries) == set(e2e["prompts"])
    assert all(len(e["output_token_ids"]) >= 10 for e in entries.values())


def test_a_new_agent_restores_the_sglang_server_warm_and_the_requests_finish_exactly(e2e: dict[str, Any]) -> None:
    rep = e2e["restore_b"]
    assert rep["outcome"] == "warm", rep
    assert rep["checkpoint"] == e2e["final"].id
    assert rep["canary"]["checked"], rep["canary"]
    assert rep["canary"]["match"], rep["canary"]
    assert rep["resubmission"]["state"] == "done", rep["resubmission"]
    results = rep["results"]
    assert set(results) == set(e2e["prompts"])
    for k, ref in e2e["reference"].items():
        r = results[k]
        assert (r["output_tokens"], r["output_digest"]) == (len(ref), token_digest(ref)), f"{k} diverged"
        # restored up to the last whole page: at most one page recomputed
        assert r["cached_tokens"] >= r["prompt_tokens"] - 16, r
    assert e2e["status_b"]["restore"]["outcome"] == "warm"
    plan = e2e["plan_b"]
    assert plan["warm"] is True, plan
    assert {x["rule"] for x in plan["results"]} >= {"block_size", "model_digest", "engine"}
    assert e2e["agent_b_exit"] == 0
