"""Tensor-parallel workers: every rank's shard is captured, and a checkpoint restores into any TP size.

Workers (vLLM's CPU build runs TP=2 on two cores with
``VLLM_CPU_OMP_THREADS_BIND="0|1"``): a TP=2 worker checkpoints greedy and
seeded requests mid-decode (plus finished turns' tails) and is SIGKILLed;
a TP=2 and a TP=1 worker restore it. A TP=1 worker checkpoints and a TP=2
worker restores that. Each restored continuation is compared with the same
engine's uninterrupted run. A copy of the TP=2 checkpoint whose layout lacks
rank 1's part is restored cold, with a reason naming rank 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.vllm import run_worker, run_workers

pytestmark = pytest.mark.slow


def drop_rank(repo_path: str, ref: str, rank: int) -> str:
    """Save a copy of checkpoint ``ref`` whose layout says rank ``rank``'s part is missing; returns its id."""
    from ckpt import Block, Namespace, Repository

    repo = Repository.open(repo_path)
    m = repo.manifest(ref)
    layout = {**m.layout, "shards": [s for s in m.layout["shards"] if s["rank"] != rank]}
    blocks = (Block(b.key, bytes(b.data), b.dtype, b.shape) for b in repo.load(m))
    return repo.save(
        blocks, worker_id="w0-bad", namespace=Namespace(m.namespace), pins=m.pins, layout=layout, ledger=m.ledger
    ).id


@pytest.fixture(scope="module")
def runs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-tp")
    # 240 tokens (the worker script's default): a request must still be decoding when the checkpoint,
    # taken once all have 40 outputs, reaches its step boundary on a busy host (160 left it too little)
    base = {"model": str(tiny_llama), "repo": str(tmp / "repo"), "max_tokens": 240}

    def worker(name: str, **args: object) -> dict:
        sock, stage = str(tmp / f"{name}.sock"), str(tmp / f"stage-{name}")
        return run_worker({**base, "socket": sock, "staging": stage, **args}, tmp, kill_after_result=True)

    a = worker("a", mode="checkpoint", tp=2)
    bad = drop_rank(base["repo"], a["checkpoint"], 1)
    b = worker("b", mode="restore", tp=2, checkpoint=a["checkpoint"], turn1=a["turn1"], extra_restores=[bad])
    # c and d (one rank each, independent of each other) side by side, on CPUs of their own
    one_rank = {
        "c": {"mode": "restore", "tp": 1, "checkpoint": a["checkpoint"], "turn1": a["turn1"]},
        "d": {"mode": "checkpoint", "tp": 1},
    }
    done = run_workers(
        {
            n: {**base, "socket": str(tmp / f"{n}.sock"), "staging": str(tmp / f"stage-{n}"), **j}
            for n, j in one_rank.items()
        },
        tmp,
        kill_after_result=True,
    )
    c, d = done["c"], done["d"]
    e = worker("e", mode="restore", tp=2, checkpoint=d["checkpoint"], turn1=d["turn1"])
    return {"a": a, "b": b, "c": c, "d": d, "e": e, "bad": bad, "repo": base["repo"]}


def _same(checkpointed: dict, restored: dict) -> None:
    assert restored["warm"], restored["reasons"]
    assert restored["restore_stats"]["canary"]["match"], restored["restore_stats"]["canary"]
    assert restored["restore_stats"]["failed_blocks"] == 0
    assert set(restored["restored"]) == set(checkpointed["reference"])
    for rid, ref in checkpointed["reference"].items():
        got = restored["restored"][rid]
        assert got["full"] == ref, rid
        assert got["num_cached_tokens"] == got["prompt_len"] - 1, rid  # one token recomputed
    for rid, t in restored["turn2"].items():  # finished turns' history, tails included
        assert t["num_cached_tokens"] == t["prompt_len"] - 5, rid


def test_a_tp2_checkpoint_holds_every_ranks_shard(runs: dict) -> None:
    from ckpt import Repository

    m = Repository.open(runs["repo"]).manifest(runs["a"]["checkpoint"])
    assert m.layout["tensor_parallel_size"] == 2
    assert [(s["rank"], s["kv_heads"]) for s in m.layout["shards"]] == [(0, [0, 1]), (1, [1, 1])]
    assert m.layout["page_shape"][1] == 2  # stored pages hold both KV heads
    assert m.pins.worker.num_kv_heads == 2
    assert [r["rank"] for r in m.layout["ranks"]] == [0, 1]
    assert {r["backend"] for r in m.layout["ranks"]} == {"CPU_ATTN"}


def test_tp2_to_tp2(runs: dict) -> None:
    _same(runs["a"], runs["b"])


def test_tp2_to_tp1(runs: dict) -> None:
    _same(runs["a"], runs["c"])


def test_tp1_to_tp2(runs: dict) -> None:
    _same(runs["d"], runs["e"])


def test_a_checkpoint_missing_a_ranks_part_restores_cold_naming_the_rank(runs: dict) -> None:
    r = runs["b"]["extra_restores"][runs["bad"]]
    assert not r["warm"]
    assert any("rank 1's part is missing" in why for why in r["reasons"]), r["reasons"]
