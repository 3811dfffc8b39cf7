"""An SGLang server checkpointed mid-decode through gpuckpt's linker, SIGKILLed, and restored.

Real SGLang 0.5.23 (CPU) with a tiny random-weight Llama, driven by :mod:`agent.session`
exactly as a vLLM worker is. Three servers in all: A (checkpointed, then SIGKILLed), B (the warm
restore, then the restore of a corrupted copy) and C (``--page-size 32``: refused, replayed cold).
Every comparison is against the uninterrupted run of the same requests on A.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent import session
from agent.engines.sglang.serve import Completion
from agent.testing import SglangProcess
from ckpt import Repository
from tests.harness.repo import corrupt_blocks
from tests.harness.sglang import GREEDY, Start, checkpoint_in_flight

PAGE = 16
#: in-flight requests: rid → (prompt, budget); different lengths, whole and partial pages
REQUESTS = {
    "g-short": ([5 + i % 400 for i in range(23)], 90),
    "g-mid": ([7 + (3 * i) % 450 for i in range(61)], 100),
    "g-long": ([11 + (7 * i) % 480 for i in range(130)], 80),
}
TURN1 = [13 + (5 * i) % 470 for i in range(70)]  # a finished turn: its next turn comes after the restore
TURN1_OUT = 20
WHEN = {"live": 3, "min_outputs": 12}


def _reference(server: SglangProcess) -> dict[str, list[int]]:
    out = {}
    for rid, (prompt, n) in REQUESTS.items():
        out[rid] = server.client.complete(prompt, {**GREEDY, "max_new_tokens": n}).token_ids
    return out


@pytest.fixture(scope="module")
def checkpointed(start_server: Start, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Server A: reference runs, a finished turn, the in-flight requests checkpointed mid-decode;
    then A is SIGKILLed."""
    a = start_server("a")
    reference = _reference(a)
    turn1 = a.client.complete(TURN1, {**GREEDY, "max_new_tokens": TURN1_OUT}, rid="turn-1").token_ids
    # the next turn as an uninterrupted server answers it (the reference for after the restore)
    turn2_prompt = TURN1 + turn1 + [17, 19, 23]
    turn2_ref = a.client.complete(turn2_prompt, {**GREEDY, "max_new_tokens": 10}).token_ids
    httpx.post(a.url + "/flush_cache", timeout=30).raise_for_status()  # nothing of the references is cached
    a.client.complete(TURN1, {**GREEDY, "max_new_tokens": TURN1_OUT}, rid="turn-1b")  # the turn, cached again
    repo_path = tmp_path_factory.mktemp("sglang-repo") / "repo"
    repo = Repository.open(str(repo_path), create=True)
    taken = checkpoint_in_flight(a, REQUESTS, repo, "sglang-a", WHEN)
    m, stats = taken.manifest, taken.stats
    a.kill()
    return {
        "repo_path": repo_path,
        "manifest": m,
        "stats": stats,
        "reference": reference,
        "turn1": turn1,
        "turn2_prompt": turn2_prompt,
        "turn2_ref": turn2_ref,
    }


@pytest.fixture(scope="module")
def server_b(start_server: Start, checkpointed: dict[str, Any]) -> SglangProcess:
    return start_server("b")


def _check_exact(ck: dict[str, Any], plan: Any, results: dict[str, Completion]) -> None:
    assert {r.request_id for r in plan.requests} == set(REQUESTS)
    for r in plan.requests:
        got = list(r.output_token_ids) + results[r.request_id].token_ids
        assert got == ck["reference"][r.request_id], r.request_id


def test_checkpoint_is_mid_decode(checkpointed: dict[str, Any]) -> None:
    from agent.engines.sglang import ledger

    entries = {e["rid"]: e for e in ledger.read(checkpointed["manifest"].ledger)}
    assert set(entries) == set(REQUESTS)
    for rid, e in entries.items():
        prompt, n = REQUESTS[rid]
        assert e["prompt_token_ids"] == prompt
        assert WHEN["min_outputs"] <= len(e["output_token_ids"]) < n, rid
        assert e["output_token_ids"] == checkpointed["reference"][rid][: len(e["output_token_ids"])]
        assert e["kv_tokens"] == len(prompt) + len(e["output_token_ids"]) - 1
        assert e["inexact_reasons"] == []
    assert checkpointed["stats"]["prefix_pages"] >= len(TURN1) // PAGE  # the finished turn's pages


def test_warm_restore_continues_exactly(checkpointed: dict[str, Any], server_b: SglangProcess) -> None:
    repo = Repository.open(str(checkpointed["repo_path"]))
    m = checkpointed["manifest"]
    plan = session.restore(repo, m.id, server_b.control_socket, generate=server_b.client.generate, wait=True)
    assert plan.warm, plan.reasons
    assert plan.stats["canary"]["match"]
    results = server_b.client.submit(plan.requests)
    _check_exact(checkpointed, plan, results)
    for r in plan.requests:
        cached = results[r.request_id].cached_tokens
        assert cached is not None, r.request_id
        assert cached >= len(r.token_ids) - PAGE, (r.request_id, cached, len(r.token_ids))
    loaded = session.stats(server_b.control_socket)["restored_tokens"]
    assert all(loaded.get(r.request_id, 0) > 0 for r in plan.requests), loaded
    # the finished turn's next turn: its prefix from the restored cache, the same tokens
    turn2 = server_b.client.complete(checkpointed["turn2_prompt"], {**GREEDY, "max_new_tokens": 10}, rid="turn-2")
    assert turn2.token_ids == checkpointed["turn2_ref"]
    assert session.stats(server_b.control_socket)["restored_tokens"].get("turn-2", 0) >= len(TURN1) // PAGE * PAGE
    assert session.withdraw(server_b.control_socket) >= 1


def test_corrupted_pages_are_not_offered(checkpointed: dict[str, Any], server_b: SglangProcess, tmp_path: Path) -> None:
    bad = tmp_path / "repo"
    shutil.copytree(checkpointed["repo_path"], bad)
    m = checkpointed["manifest"]
    hit = corrupt_blocks(bad, m.id, 2)
    assert hit > 0
    session.withdraw(server_b.control_socket)
    httpx.post(server_b.url + "/flush_cache", timeout=30).raise_for_status()  # the first restore's pages go
    before = dict(session.stats(server_b.control_socket)["restored_tokens"])
    plan = session.restore(Repository.open(str(bad)), m.id, server_b.control_socket, require_canary=False, wait=True)
    assert plan.warm, plan.reasons
    totals = plan.totals()
    assert totals["failed_blocks"] == hit, totals
    assert plan.offered_total == len(m.blocks) - hit
    results = server_b.client.submit(plan.requests)
    _check_exact(checkpointed, plan, results)
    after = session.stats(server_b.control_socket)["restored_tokens"]
    # some request lost a page to the corruption: it got less from the linker than it needed
    short = [
        r
        for r in plan.requests
        if after.get(r.request_id, 0) - before.get(r.request_id, 0) < (len(r.token_ids) - 1) // PAGE * PAGE
    ]
    assert short, after
    session.withdraw(server_b.control_socket)


def test_page_size_mismatch_replays_cold(
    checkpointed: dict[str, Any], server_b: SglangProcess, start_server: Start
) -> None:
    server_b.kill()  # two servers at once would crowd this machine
    c = start_server("c", page_size=32)
    repo = Repository.open(str(checkpointed["repo_path"]))
    plan = session.restore(repo, checkpointed["manifest"].id, c.control_socket, generate=c.client.generate)
    assert not plan.warm
    assert any("block_size" in why or "page" in why for why in plan.reasons), plan.reasons
    results = c.client.submit(plan.requests)
    _check_exact(checkpointed, plan, results)
    assert session.stats(c.control_socket)["restored_tokens"] == {}
