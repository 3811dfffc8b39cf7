"""Tensor-parallel SGLang servers: every rank's shard is captured, and a checkpoint restores into any TP size.

Real SGLang 0.5.23 servers (CPU, the tiny random-weight Llama: 2 KV heads, so each of two ranks
holds one). SGLang's CPU path runs ``--tp-size 2`` here with torch.distributed (gloo) for its
all-reduce — its shared-memory all-reduce needs AMX — once ``SGLANG_CPU_OMP_THREADS_BIND`` gives
each rank its cores (without it SGLang asks for one NUMA node per rank).

Three servers, one at a time (an idle SGLang scheduler spins on a core of this two-core host):
A (TP=2) answers every request uninterrupted, then checkpoints greedy requests mid-decode and is
SIGKILLed; C (TP=1) answers A's requests uninterrupted, restores A's checkpoint (TP=2 → TP=1),
checkpoints other requests mid-decode and is SIGKILLed; B (TP=2) restores A's checkpoint (TP=2 →
TP=2) and C's (TP=1 → TP=2), then streams its whole tree a page per chunk. Each restored
continuation is compared with the restoring TP size's uninterrupted run of the same tokens (on
this model TP=1 and TP=2 happen to decode alike; the test does not count on it). A
pipeline-parallel linker and one whose heads cannot be split as its TP size asks are refused by
name (linkers hosted on bare pools).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent import session
from agent.engines.channel import WorkerChannel
from agent.engines.control import ControlError
from agent.engines.sglang.notes import NOTE, Relay, decode_note, encode_note
from agent.engines.sglang.serve import Completion
from agent.engines.types import TRUST_DOMAIN, Checkpointed, RestorePlan
from agent.testing import SglangProcess
from ckpt import Manifest, Repository
from tests.harness.paths import ROOT, short_dir
from tests.harness.sglang import GREEDY, STANDIN, Start, checkpoint_in_flight
from tests.harness.waiting import wait_for

PAGE = 16
TP2 = ("--tp-size", "2")
#: checkpointed on A (TP=2), restored into B (TP=2) and C (TP=1): rid → (prompt, budget)
FROM_TP2 = {
    "a-short": ([5 + i % 400 for i in range(23)], 64),
    "a-mid": ([7 + (3 * i) % 450 for i in range(61)], 72),
    "a-long": ([11 + (7 * i) % 480 for i in range(100)], 60),
}
#: checkpointed on C (TP=1), restored into B (TP=2)
FROM_TP1 = {
    "c-short": ([9 + (5 * i) % 430 for i in range(29)], 64),
    "c-long": ([13 + (11 * i) % 470 for i in range(75)], 72),
}
WHEN = {"min_outputs": 12}


@pytest.fixture(scope="module")
def tp_env() -> Iterator[None]:
    """SGLang's CPU path wants a NUMA node per rank unless the ranks' cores are named (this host has
    one node); the binding itself is applied only with AMX, so "0|1" only lets TP=2 start."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")
        yield


def _uninterrupted(server: SglangProcess, requests: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
    """Every request run to its end, side by side (as the checkpointed ones run), then the cache
    flushed so that nothing of them is cached."""
    out: dict[str, list[int]] = {}

    def run(rid: str, prompt: list[int], n: int) -> None:
        out[rid] = server.client.complete(prompt, {**GREEDY, "max_new_tokens": n}).token_ids

    threads = [threading.Thread(target=run, args=(rid, p, n)) for rid, (p, n) in requests.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert set(out) == set(requests)
    httpx.post(server.url + "/flush_cache", timeout=30).raise_for_status()
    return out


def _checkpoint_and_kill(
    server: SglangProcess, requests: dict[str, tuple[list[int], int]], repo: Repository, worker: str
) -> Checkpointed:
    """``requests`` started, checkpointed once each has ``WHEN`` outputs, and the server SIGKILLed."""
    return checkpoint_in_flight(server, requests, repo, worker, {**WHEN, "live": len(requests)}, kill=True)


@dataclass
class Restored:
    """A restore into a server and what came of it: the plan, the resubmissions' results and the
    tokens each request got from the checkpoint's pages."""

    plan: RestorePlan
    results: dict[str, Completion]
    loaded: dict[str, int]


def _restore(server: SglangProcess, repo_path: Path, m: Manifest) -> Restored:
    """Restore ``m`` into ``server`` and resubmit its requests (the offer withdrawn after)."""
    before = dict(session.stats(server.control_socket)["restored_tokens"])
    repo = Repository.open(str(repo_path))
    plan = session.restore(repo, m.id, server.control_socket, generate=server.client.generate, wait=True)
    results = server.client.submit(plan.requests) if plan.warm else {}
    after = session.stats(server.control_socket)["restored_tokens"]
    session.withdraw(server.control_socket)
    return Restored(plan, results, {rid: after.get(rid, 0) - before.get(rid, 0) for rid in after})


def _exact(restored: Restored, reference: dict[str, list[int]]) -> None:
    """Warm, every continuation equal to ``reference``, and each request's pages (all but its last
    one at most) from the checkpoint."""
    plan = restored.plan
    assert plan.warm, plan.reasons
    assert plan.stats["canary"]["match"]
    assert plan.totals()["failed_blocks"] == 0
    assert {r.request_id for r in plan.requests} == set(reference)
    for r in plan.requests:
        got = list(r.output_token_ids) + restored.results[r.request_id].token_ids
        assert got == reference[r.request_id], r.request_id
        cached = restored.results[r.request_id].cached_tokens
        assert cached is not None, r.request_id
        assert cached >= len(r.token_ids) - PAGE, (r.request_id, cached)
        full_pages = (len(r.token_ids) - 1) // PAGE * PAGE
        assert restored.loaded.get(r.request_id, 0) >= full_pages - PAGE, (r.request_id, restored.loaded)


@pytest.fixture(scope="module")
def runs(tp_env: None, start_server: Start, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A (TP=2) and C (TP=1), one after the other."""
    repo_path = tmp_path_factory.mktemp("sglang-tp") / "repo"
    repo = Repository.open(str(repo_path), create=True)
    a = start_server("tp2-a", args=TP2)
    ref_tp2 = _uninterrupted(a, {**FROM_TP2, **FROM_TP1})
    from_a = _checkpoint_and_kill(a, FROM_TP2, repo, "sglang-tp2")
    c = start_server("tp1-c")
    ref_tp1 = _uninterrupted(c, FROM_TP2)
    tp2_to_tp1 = _restore(c, repo_path, from_a.manifest)
    from_c = _checkpoint_and_kill(c, FROM_TP1, repo, "sglang-tp1")
    return {
        "repo_path": repo_path,
        "ref_tp2": ref_tp2,
        "ref_tp1": ref_tp1,
        "from_a": from_a,
        "from_c": from_c,
        "tp2_to_tp1": tp2_to_tp1,
    }


@pytest.fixture(scope="module")
def server_b(runs: dict[str, Any], start_server: Start) -> SglangProcess:
    return start_server("tp2-b", args=TP2)


def _mid_decode(
    taken: Checkpointed, requests: dict[str, tuple[list[int], int]], reference: dict[str, list[int]]
) -> None:
    from agent.engines.sglang import ledger

    assert taken.manifest.ledger is not None
    entries = {e["rid"]: e for e in ledger.read(taken.manifest.ledger)}
    assert set(entries) == set(requests)
    for rid, e in entries.items():
        outs = e["output_token_ids"]
        assert WHEN["min_outputs"] <= len(outs) < requests[rid][1], rid
        assert outs == reference[rid][: len(outs)], rid


def test_a_tp2_checkpoint_holds_every_ranks_heads(runs: dict[str, Any]) -> None:
    m = runs["from_a"].manifest
    stats = runs["from_a"].stats
    assert m.layout["tensor_parallel_size"] == 2
    assert [(s["rank"], s["kv_heads"]) for s in m.layout["shards"]] == [(0, [0, 1]), (1, [1, 1])]
    assert m.layout["page_shape"][1 + m.layout["head_axis"]] == 2  # stored pages hold both KV heads
    assert m.pins.worker.num_kv_heads == 2
    assert stats["lost_pages"] == 0
    _mid_decode(runs["from_a"], FROM_TP2, runs["ref_tp2"])
    # the same pages at either TP size: one namespace, the same keys
    mc = runs["from_c"].manifest
    assert {k: v for k, v in mc.namespace.items() if k != TRUST_DOMAIN} == {
        k: v for k, v in m.namespace.items() if k != TRUST_DOMAIN
    }
    assert mc.layout["tensor_parallel_size"] == 1
    assert [(s["rank"], s["kv_heads"]) for s in mc.layout["shards"]] == [(0, [0, 2])]
    _mid_decode(runs["from_c"], FROM_TP1, runs["ref_tp1"] | runs["ref_tp2"])


def test_tp2_to_tp1(runs: dict[str, Any]) -> None:
    _exact(runs["tp2_to_tp1"], {k: runs["ref_tp1"][k] for k in FROM_TP2})


def test_tp2_to_tp2(runs: dict[str, Any], server_b: SglangProcess) -> None:
    restored = _restore(server_b, runs["repo_path"], runs["from_a"].manifest)
    _exact(restored, {k: runs["ref_tp2"][k] for k in FROM_TP2})


def test_tp1_to_tp2(runs: dict[str, Any], server_b: SglangProcess) -> None:
    restored = _restore(server_b, runs["repo_path"], runs["from_c"].manifest)
    _exact(restored, {k: runs["ref_tp2"][k] for k in FROM_TP1})


def test_a_tp2_server_streams_its_tree_on_every_rank(
    runs: dict[str, Any], server_b: SglangProcess, tmp_path: Path
) -> None:
    """A checkpoint of B's whole tree a page per chunk: every rank's file of every chunk, every lock
    released on every rank at the end (SGLang's count of locked tokens is rank 0's; the ranks took
    the same locks at the same steps, or the server would not answer any more)."""
    repo = Repository.open(str(tmp_path / "repo"), create=True)
    taken = session.checkpoint(server_b.control_socket, repo, "sg-tp-tree", copy_per_step=1)
    stats: dict[str, Any] = dict(taken.stats)
    assert stats["prefix_pages"] > 4, stats
    assert stats["chunks"] > 4, stats
    assert [s["rank"] for s in stats["shards"]] == [0, 1]
    assert len(taken.manifest.blocks) >= stats["prefix_pages"]
    wait_for(
        lambda: session.wait_until(server_b.control_socket, live=0, timeout=60)["tree_protected_tokens"] == 0,
        60,
        "every lock released",
    )
    # and the server still serves, both ranks in step
    assert server_b.client.generate([3, 4, 5, 6], 4)


class _Receiver:
    """SGLang's request receiver as the relay sees it: ``recv_requests`` returns what the broadcast
    would (rank 0's pulled requests and its ``local_reqs``; on another rank, rank 0's list)."""

    def __init__(self, pulled: list[Any], *, skip: bool = False, broadcast: list[Any] | None = None) -> None:
        self.pulled, self.skip, self.broadcast = pulled, skip, broadcast
        self.recv_limit = 7

    def recv_requests(self, local_reqs: list[Any] | None = None) -> list[Any]:
        if self.skip:  # --scheduler-recv-interval: this iteration receives nothing
            return []
        if self.broadcast is not None:
            return list(self.broadcast)
        return [*self.pulled, *(local_reqs or [])]


def _relay(inner: _Receiver, *, leader: bool, note: list[dict[str, Any]] | None) -> tuple[Relay, dict[str, Any]]:
    seen: dict[str, Any] = {"in": [], "sent": []}
    relay = Relay(
        inner,
        leader=leader,
        outgoing=lambda: encode_note(note) if note else None,
        sent=lambda n, out: seen["sent"].append((decode_note(n), out)),
        incoming=lambda ops: seen["in"].append(ops),
    )
    return relay, seen


def test_rank_0s_note_rides_the_broadcast_and_no_rank_dispatches_it() -> None:
    ops = [{"op": "pump", "seq": 3}]
    req = object()
    relay, seen = _relay(_Receiver([req]), leader=True, note=ops)
    assert relay.recv_requests(local_reqs=[]) == [req]  # SGLang dispatches its own requests only
    assert seen == {"in": [ops], "sent": [(ops, True)]}
    assert relay.recv_limit == 7  # the rest of the receiver is SGLang's
    other, seen1 = _relay(_Receiver([], broadcast=[encode_note(ops), req]), leader=False, note=None)
    assert other.recv_requests() == [req]
    assert seen1 == {"in": [ops], "sent": []}


def test_a_note_of_a_skipped_receive_is_told_unsent_and_a_broken_note_is_dropped() -> None:
    ops = [{"op": "release"}]
    relay, seen = _relay(_Receiver([object()], skip=True), leader=True, note=ops)
    assert relay.recv_requests() == []
    assert seen["sent"] == [(ops, False)]  # rank 0 sends it again with the next one
    req = object()
    other, seen1 = _relay(_Receiver([], broadcast=[NOTE + "{not json", req]), leader=False, note=None)
    assert other.recv_requests() == [req]
    assert seen1["in"] == []


#: Linkers hosted on bare CPU pools (no server) in one process, each built from inside a
#: ``Scheduler`` as SGLang builds it, with the parallel sizes and heads its argument names:
#: ``SOCKET:TP:PP:TOTAL_HEADS:HEADS`` (staging beside the socket)
HOST = textwrap.dedent(
    """
    import signal, sys, threading
    from types import SimpleNamespace
    import torch
    from agent.engines.sglang.linker import GpuckptLinker

    class Scheduler:  # what the linker finds in its caller's frame: the model's total KV heads
        def __init__(self, sock, tp, pp, total, heads):
            self.model_config = SimpleNamespace(get_total_num_kv_heads=lambda: total)
            pool = SimpleNamespace(
                k_buffer=[torch.zeros(256, heads, 64) for _ in range(2)],
                v_buffer=[torch.zeros(256, heads, 64) for _ in range(2)],
            )
            params = SimpleNamespace(
                page_size=16,
                token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
                req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(4, 256, dtype=torch.int32)),
            )
            args = SimpleNamespace(
                tp_size=tp, pp_size=pp, model_path="", tokenizer_path=None, attention_backend="torch_native",
                device="cpu", revision=None, disable_overlap_schedule=True,
            )
            extra = {"control_socket": sock, "staging_dir": sock + "-staging"}
            self.linker = GpuckptLinker(args, params, extra_config=extra)

    linkers = []
    for spec in sys.argv[1:]:
        sock, *sizes = spec.split(":")
        linkers.append(Scheduler(sock, *map(int, sizes)).linker)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.005):
        for linker in linkers:
            linker.num_completed_offloads()  # the scheduler loop's step boundary
    for linker in linkers:
        linker.close()
    """
)


@pytest.fixture(scope="module")
def refused_linkers(sglang_python: str, server_b: SglangProcess) -> Iterator[dict[str, str]]:
    """Two bare-pool linkers: a pipeline-parallel one and a TP=3 one of a model with 2 KV heads
    (B is done with: it would spin on a core while they start)."""
    server_b.kill()
    base = short_dir()
    socks = {"pp2": str(base / "pp2.sock"), "tp3": str(base / "tp3.sock")}
    specs = [f"{socks['pp2']}:1:2:2:2", f"{socks['tp3']}:3:1:2:1"]
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": f"{STANDIN}:{ROOT}"}
    with open(base / "host.log", "w") as log:
        proc = subprocess.Popen([sglang_python, "-c", HOST, *specs], env=env, stdout=log, stderr=log)
    try:
        for sock in socks.values():
            wait_for(lambda s=sock: Path(s).exists() or proc.poll() is not None, 180, f"the linker host's {sock}")  # type: ignore[misc]
        assert proc.poll() is None, (base / "host.log").read_text()[-2000:]
        yield socks
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(base, ignore_errors=True)


def test_a_pipeline_parallel_server_is_refused_by_name(refused_linkers: dict[str, str]) -> None:
    sock = refused_linkers["pp2"]
    with pytest.raises(ControlError, match="pipeline-parallel"):
        WorkerChannel(sock).capture(timeout=30)
    assert "pipeline-parallel" in session.describe(sock).layout["kv_not_carried"]


def test_heads_that_cannot_be_split_for_the_tp_size_restore_cold_by_name(
    refused_linkers: dict[str, str], runs: dict[str, Any]
) -> None:
    sock = refused_linkers["tp3"]
    with pytest.raises(ControlError, match="3 ranks cannot replicate 2 KV heads"):
        WorkerChannel(sock).capture(timeout=30)
    decision = session.plan(sock, runs["from_a"].manifest)
    assert not decision.warm
    assert any("KV not carried (worker)" in r and "cannot be split" in r for r in decision.reasons), decision.reasons
