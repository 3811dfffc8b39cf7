"""The same checkpoint → kill → restore cycle with ``vllm serve`` workers (the
OpenAI-compatible server), driven over HTTP and the connector's socket.

One checkpointing server and one restoring server serve the module (an
engine start costs ~20-40 s here). The requests stream from threads; the
checkpoint is taken once each has at least 40 tokens, the same server then
finishes them (the uninterrupted reference), and its process group is
SIGKILLed. The fresh server restores the checkpoint and gets the ledger's
requests back through :meth:`ServeClient.submit`.
"""

from __future__ import annotations

import random
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import pytest

from agent import session
from agent.engines import canary
from agent.testing import ServeProcess
from ckpt import Repository
from tests.harness.clients import checkpoint_during
from tests.harness.vllm import GREEDY, SEEDED, serve_worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, module_cleanup: ExitStack) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-serve")
    repo = Repository.open(str(tmp / "repo"), create=True)
    rng = random.Random(11)
    system = [rng.randrange(3, 512) for _ in range(64)]
    prompts = {f"req{i}": system + [rng.randrange(3, 512) for _ in range(100 + 37 * i)] for i in range(3)}
    prompts["seeded"] = system + [rng.randrange(3, 512) for _ in range(90)]
    sampling = {k: (SEEDED if k == "seeded" else GREEDY) for k in prompts}

    def worker(name: str, cpu: int = 0) -> ServeProcess:
        return serve_worker(tiny_llama, tmp, name, cpu=cpu)

    out: dict = {"prompts": prompts}
    with worker("a") as a:
        a.wait_ready()
        # B starts once A is up, while A works, on another CPU: an engine start costs ~20 s here,
        # and B is still fresh when its turn comes
        b_early = module_cleanup.enter_context(worker("b", cpu=1))
        # The canary is probed before the traffic: between the moment the requests are
        # far enough and the capture, nothing may run that lets them finish first.
        probe = canary.record(a.client.generate)
        # Paced by the engine, not by the streams (see checkpoint_during)
        calls = {k: partial(a.client.complete, prompts[k], sampling[k], request_id=k, stream=False) for k in prompts}
        m, results = checkpoint_during(a, calls, repo, live=len(prompts), canary=probe, timeout=240)
        out["checkpoint"] = m
        out["reference"] = {k: prompts[k] + results[k].token_ids for k in prompts}
        a.kill()  # SIGKILL to the whole group, as a preemption would
    with b_early as b:
        b.wait_ready()
        plan = session.restore(
            repo, m.id, b.control_socket, staging_dir=str(tmp / "stage-b"), generate=b.client.generate
        )
        out["plan"] = plan
        out["resumed"] = b.client.submit(plan.requests)
        out["rest_arrived"] = plan.wait_offered(120)  # every part offered: the files to withdraw are known
        out["connector"] = session.stats(b.control_socket)

        def restore_files() -> list[str]:  # the restore's page files (the worker's report file is not KV)
            return sorted(p.name for p in (tmp / "stage-b").glob("restore-*"))

        out["stage_b_offered"] = restore_files()
        out["withdrawn_files"] = session.withdraw(b.control_socket)
        # deleted at the next step boundary, which the withdraw makes the idle engine take
        end = time.monotonic() + 60
        while restore_files() and time.monotonic() < end:
            time.sleep(0.05)
        out["stage_b_after"] = restore_files()
        out["connector_after"] = session.stats(b.control_socket)
    return out


def test_ledger_holds_the_in_flight_requests_under_their_client_ids(served: dict) -> None:
    entries = {e["client_request_id"]: e for e in served["checkpoint"].ledger.data["requests"]}
    assert set(entries) == {f"cmpl-{k}-0" for k in served["prompts"]}
    for k, p in served["prompts"].items():
        e = entries[f"cmpl-{k}-0"]
        assert e["prompt_token_ids"] == p
        assert 40 <= len(e["output_token_ids"]) < 700, "checkpointed mid-decode"
    assert entries["cmpl-seeded-0"]["generator_state"], "the seeded request's sampler state travels"


def test_restored_requests_continue_token_identically(served: dict) -> None:
    plan = served["plan"]
    assert plan.warm, plan.reasons
    assert plan.stats["canary"]["match"] is True
    assert {r.request_id for r in plan.requests} == {f"cmpl-{k}-0" for k in served["prompts"]}
    for r in plan.requests:
        k = r.request_id.removeprefix("cmpl-").removesuffix("-0")
        c = served["resumed"][r.request_id]
        assert c.finish_reason == "length"
        assert r.token_ids + c.token_ids == served["reference"][k], f"{k} diverged after the restore"


def test_the_restore_page_file_is_deleted_when_the_offer_ends(served: dict) -> None:
    """The verified pages (users' KV) stay in /dev/shm only while offered: the withdraw deletes them."""
    assert served["stage_b_offered"], "the restore staged no page file"
    assert served["connector"]["offer_files"], "the connector does not own the offered page file"
    assert served["rest_arrived"]
    # the canary's pages, the in-flight requests' and any later part: each one page file, each withdrawn
    assert served["withdrawn_files"] == len(served["connector"]["offer_files"]) >= 1
    assert len(served["stage_b_offered"]) == 2 * served["withdrawn_files"]  # index and data of each
    assert served["stage_b_after"] == []
    assert served["connector_after"]["offer_files"] == []
    assert served["connector_after"]["offered"] == 0


def test_each_restored_request_recomputes_at_most_one_token(served: dict) -> None:
    for r in served["plan"].requests:
        c = served["resumed"][r.request_id]
        # The server's own count of prompt tokens served from the cache.
        assert c.cached_tokens == len(r.token_ids) - 1, (r.request_id, c.cached_tokens, len(r.token_ids))
        # ...and the connector's: what it loaded on top of the new worker's own prefix hits.
        assert served["connector"]["restored_tokens"][r.request_id] > 0
