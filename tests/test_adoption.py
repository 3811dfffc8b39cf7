"""Replacement pods adopting the checkpoints of the pods they replace, with the agent daemon and
the stand-in worker (tests/fake_connector.py): a StatefulSet's pod by its stable name on another
"node" (another worker, staging directory and socket), a Deployment's pod of another name by
claiming its pool's orphaned final checkpoint (ckpt/claims.py), and two replacements racing for
one final checkpoint: one restores it, the other starts cold. The real-vLLM lifecycle is
tests/k8s/test_lifecycle.py."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.daemon.agent import Agent
from agent.daemon.notify import Notifier
from ckpt import Repository, claims
from tests.fake_connector import FakeConnector
from tests.harness.agent import make_cfg
from tests.harness.waiting import wait_for

RESTORE = {"on_start": True, "adopt": "claim", "require_canary": False, "wait_for_worker": "30s"}


class Pods:
    """Pods on "nodes" of their own: each its worker (socket, staging) and agent, one repository."""

    def __init__(self, tmp: Path, repository: str) -> None:
        self.tmp, self.repository = tmp, repository
        self.fakes: list[FakeConnector] = []
        self.agents: list[Agent] = []

    def agent(self, name: str, *, node_name: str | None = None, **over: Any) -> Agent:
        """Pod ``name`` (its worker id) on node ``node_name`` (default: a node of its own)."""
        node = self.tmp / (node_name or name)
        node.mkdir()
        node.chmod(0o700)  # whatever umask another thread holds at this moment (an API socket's bind)
        self.fakes.append(FakeConnector(node / "conn.sock", node / "stage"))
        cfg = make_cfg(
            node,
            worker_id=name,
            repository=self.repository,
            connector_socket=str(node / "conn.sock"),
            **over,
        )
        a = Agent(cfg, notifier=Notifier(address=""))
        self.agents.append(a)
        return a

    def close(self) -> None:
        for a in self.agents:
            if a.state not in ("stopping", "starting"):
                a.shutdown(final=False)
        for f in self.fakes:
            f.close()


@pytest.fixture(params=["local", "s3"])
def pods(request: pytest.FixtureRequest, short_tmp: Path) -> Iterator[Pods]:
    url = str(short_tmp / "repo") if request.param == "local" else request.getfixturevalue("s3_url")
    p = Pods(short_tmp, url)
    yield p
    p.close()


def final_checkpoint(pods: Pods, name: str, **over: Any) -> str:
    """Pod ``name`` starts, serves, and takes its final checkpoint at stop (its preStop)."""
    a = pods.agent(name, **over)
    a.start()
    a.shutdown(final=True)
    assert a.last_checkpoint is not None, a.last_error
    return str(a.last_checkpoint["id"])


def settled(a: Agent) -> Callable[[], dict[str, Any]]:
    """The adopted checkpoint's record once its claim is no longer held ({} until then)."""

    def done() -> dict[str, Any]:
        r = a.restore_report
        adopted = r.adopted if r is not None else None
        return dict(adopted) if adopted is not None and adopted["state"] != "held" else {}

    return done


def test_a_statefulset_pod_restores_its_own_checkpoint_on_another_node(pods: Pods) -> None:
    """The chart sets worker_id from the pod's stable name: a web-0 on another node (another
    worker, socket and staging) restores web-0's newest checkpoint, warm — nothing host-local in
    the lookup (the worker id in the repository) or the plan (the compatibility rules)."""
    first = final_checkpoint(pods, "web-0")
    again = pods.agent("web-0", node_name="node-2", restore={"on_start": True, "require_canary": False})
    again.start()
    r = again.restore_report
    assert r is not None
    assert (r.checkpoint, r.outcome) == (first, "warm"), r.to_json()
    assert r.adopted is None  # by name, no claim


def test_a_replacement_of_another_name_adopts_its_pools_final_checkpoint(
    pods: Pods, caplog: pytest.LogCaptureFixture
) -> None:
    final = final_checkpoint(pods, "a-xyz", pool="p", trust_domain="p")
    m = Repository.open(pods.repository).manifest(f"a-xyz/{final}")
    assert (m.labels["trigger"], m.labels["pool"], m.namespace["trust_domain"]) == ("stop", "p", "p")
    b = pods.agent("b-qrs", pool="p", trust_domain="p", restore=RESTORE)
    with caplog.at_level(logging.INFO, logger="gpuckpt.agent"):
        b.start()
    r = b.restore_report
    assert r is not None
    assert (r.checkpoint, r.outcome) == (final, "warm"), r.to_json()
    adopted = wait_for(settled(b), 30, "the claim to be marked done")
    assert adopted == {
        "worker_id": "a-xyz",
        "checkpoint": final,
        "claim": claims.generation_name("a-xyz", final, 1),
        "state": "done",
        "outcome": "warm",
    }
    assert b.status()["restore"]["adopted"]["worker_id"] == "a-xyz"
    logged = [rec for rec in caplog.records if rec.getMessage() == "adopting a checkpoint"]
    assert [(x.checkpoint, x.original_worker) for x in logged] == [(final, "a-xyz")]  # type: ignore[attr-defined]
    # adopted once: the next replacement finds nothing to claim, and says why
    c = pods.agent("c-def", pool="p", trust_domain="p", restore=RESTORE)
    c.start()
    rc = c.restore_report
    assert rc is not None
    assert rc.outcome == "none", rc.to_json()
    assert rc.adopted is None


def test_two_replacements_racing_for_one_final_checkpoint_one_restores_one_starts_cold(pods: Pods) -> None:
    final = final_checkpoint(pods, "a-xyz", pool="p", trust_domain="p")
    racers = [pods.agent(n, pool="p", trust_domain="p", restore=RESTORE) for n in ("c-111", "d-222")]
    barrier = threading.Barrier(len(racers))
    errors: list[BaseException] = []

    def start(a: Agent) -> None:
        barrier.wait()
        try:
            a.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(a,)) for a in racers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    reports = {a.cfg.worker_id: a.restore_report for a in racers}
    outcomes = sorted((r.outcome if r is not None else None) or "" for r in reports.values())
    assert outcomes == ["none", "warm"], {k: v.to_json() if v else None for k, v in reports.items()}
    (winner,) = [a for a in racers if a.restore_report is not None and a.restore_report.outcome == "warm"]
    (loser,) = [a for a in racers if a is not winner]
    assert winner.restore_report is not None
    assert winner.restore_report.checkpoint == final
    assert wait_for(settled(winner), 30, "the winner's claim done")["worker_id"] == "a-xyz"
    lr = loser.restore_report
    assert lr is not None
    assert lr.checkpoint is None, lr.to_json()
    state = claims.read_state(Repository.open(pods.repository).store, "a-xyz", final)
    assert state.generations == 1
    assert state.done is not None
    assert state.done.claimant == winner.cfg.worker_id


def test_an_incompatible_claimed_checkpoint_starts_cold_and_is_done_with_the_reason(pods: Pods) -> None:
    """The compatibility rules still decide on the new node: a claimed checkpoint this worker
    cannot restore warm is replayed cold (its ledger resubmitted), so it is marked done with the
    reason — releasing it would have the next pod replay the same requests again."""
    final = final_checkpoint(pods, "a-xyz", pool="p", trust_domain="p")
    b = pods.agent("b-qrs", pool="p", trust_domain="p", restore=RESTORE)
    node2 = pods.fakes[-1]
    facts = node2.facts()
    node2.facts = lambda: {**facts, "engine_version": "0.33.0"}  # type: ignore[method-assign]
    b.start()
    r = b.restore_report
    assert r is not None
    assert (r.checkpoint, r.outcome) == (final, "cold"), r.to_json()
    adopted = wait_for(settled(b), 30, "the claim to be marked done")
    assert adopted["outcome"] == "cold"
    done = claims.read_state(Repository.open(pods.repository).store, "a-xyz", final).done
    assert done is not None
    assert "engine_version" in done.reason
    assert "0.32.0" in done.reason


def test_a_pool_adopts_only_its_own_final_checkpoints(pods: Pods) -> None:
    final_checkpoint(pods, "x-1", pool="other", trust_domain="other")
    final_checkpoint(pods, "y-1", pool="p", trust_domain="y-1")  # the pool's label, another domain
    live = pods.agent("z-1", pool="p", trust_domain="p")
    live.start()
    live.request_checkpoint("request")
    wait_for(lambda: live.last_checkpoint, 30, "a periodic-like checkpoint of a live pod")
    b = pods.agent("b-qrs", pool="p", trust_domain="p", restore=RESTORE)
    b.start()
    r = b.restore_report
    assert r is not None
    assert r.outcome == "none", r.to_json()
    passed = "\n".join(r.passed_over)
    assert "y-1/" in passed
    assert "trust domain 'y-1'" in passed
    assert "z-1/" in passed
    assert "not final" in passed
    assert "x-1" not in passed  # another pool's: not even looked at
