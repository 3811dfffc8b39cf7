"""Checkpoint a live vLLM worker mid-decode, kill it, restore into a fresh process.

One checkpointing worker and three restoring workers (same flags: warm; a
different block size: refused, cold replay; same flags from a copy of the
repository with corrupted blocks, which then restores once more through a
canary probe that answers wrong) serve every test in this module, because
an engine start costs ~20-30 s here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.harness.repo import corrupt_blocks
from tests.harness.vllm import run_worker, run_workers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-restore")
    base = {"model": str(tiny_llama), "repo": str(tmp / "repo")}
    a = run_worker(
        {**base, "mode": "checkpoint", "socket": str(tmp / "a.sock"), "staging": str(tmp / "stage-a")},
        tmp,
        kill_after_result=True,
    )
    bad = tmp / "repo-bad"
    shutil.copytree(base["repo"], bad)
    flipped = corrupt_blocks(bad, a["checkpoint"], every=4)
    # b, c and d each restore a's checkpoint in a fresh engine: side by side, on CPUs of their own
    done = run_workers(
        {
            "b": {
                **base,
                "mode": "restore",
                "socket": str(tmp / "b.sock"),
                "staging": str(tmp / "stage-b"),
                "checkpoint": a["checkpoint"],
                "turn1": a["turn1"],
                # The warm restore names the connector only: the plugin entry point resolves it.
                "by_name": True,
            },
            "c": {
                **base,
                "mode": "restore",
                "socket": str(tmp / "c.sock"),
                "staging": str(tmp / "stage-c"),
                "checkpoint": a["checkpoint"],
                "block_size": 64,
            },
            "d": {
                **base,
                "repo": str(bad),
                "mode": "restore",
                "socket": str(tmp / "d.sock"),
                "staging": str(tmp / "stage-d"),
                "checkpoint": a["checkpoint"],
                # after the corrupted restore, restore again through a wrong-answering probe
                "canary_fault": True,
            },
        },
        tmp,
    )
    b, c, d = done["b"], done["c"], done["d"]
    return {"a": a, "b": b, "c": c, "d": d, "flipped": flipped}


def test_checkpoint_was_mid_decode(runs: dict) -> None:
    a = runs["a"]
    assert len(a["ledger_outputs"]) == 4  # three greedy, one seeded
    for rid, n in a["ledger_outputs"].items():
        assert 40 <= n < 240, (rid, n)  # in flight: some outputs, budget left
        assert len(a["reference"][rid]) - n >= 200  # ≥ 200 tokens in the request


def test_greedy_warm_restore_is_token_identical(runs: dict) -> None:
    a, b = runs["a"], runs["b"]
    assert b["warm"], b["reasons"]
    assert b["restore_stats"]["failed_blocks"] == 0
    assert set(b["restored"]) == set(a["reference"])
    for rid, r in b["restored"].items():
        assert r["full"] == a["reference"][rid], rid


def test_restored_requests_recompute_at_most_one_token(runs: dict) -> None:
    b = runs["b"]
    loaded = b["connector_after_restore"]["restored_tokens"]
    for rid, r in b["restored"].items():
        assert r["prompt_len"] - r["num_cached_tokens"] <= 1, (rid, r)  # the engine's count
        assert loaded[rid] > 0  # ...and the connector did load them (not a local hit)


def test_next_turn_is_warm_from_restored_prefix(runs: dict) -> None:
    a, b = runs["a"], runs["b"]
    for rid, hist in a["turn1"].items():
        t2 = b["turn2"][rid + "-t2"]
        # The finished turn's KV covers all but its last token (never fed back);
        # full blocks come from the prefix cache, the partial tail from the
        # tail saved at request_finished.
        assert t2["num_cached_tokens"] >= len(hist) - 1, (rid, t2, len(hist))
        assert b["connector"]["restored_tokens"][rid + "-t2"] > 0


def test_idle_engine_capture_returns_prefix_cache(runs: dict) -> None:
    a = runs["a"]
    idle = a["idle_capture"]
    assert idle["ledger_requests"] == 0
    # conv0 (143 tokens of KV) + conv1 (160) share a 2-block system prompt: 4 + 5 - 2 full blocks
    assert idle["prefix_pages"] >= 7, idle
    assert idle["tail_pages"] >= 1, idle  # conv0's 15-token tail, saved when it finished
    assert idle["pages"] == idle["prefix_pages"] + idle["tail_pages"]


def test_seeded_sampling_continues_identically(runs: dict) -> None:
    a, b = runs["a"], runs["b"]
    assert a["ledger_generators"] == ["seeded0"]
    assert b["restore_stats"]["generators"] == 1
    r = b["restored"]["seeded0"]
    assert r["prompt_len"] - r["num_cached_tokens"] <= 1
    assert r["full"] == a["reference"]["seeded0"]
    # control: the cold replay (no generator state carried) diverges
    assert runs["c"]["restored"]["seeded0"]["full"] != a["reference"]["seeded0"]


def test_shared_prefix_is_stored_once(runs: dict) -> None:
    a = runs["a"]
    # five conversations share a 2-block system prompt; 31 unique blocks were captured
    per_request_blocks = sum(len(t) // 32 for t in a["turn1"].values())
    assert a["sizes"]["blocks"] == a["checkpoint_stats"]["pages"]
    assert a["sizes"]["blocks"] < per_request_blocks + sum(-(-len(t) // 32) for t in a["reference"].values())


def test_block_size_mismatch_refuses_warm_and_replays(runs: dict) -> None:
    a, c = runs["a"], runs["c"]
    assert not c["warm"]
    assert any(r.startswith("block_size") and "32" in r and "64" in r for r in c["reasons"]), c["reasons"]
    assert c["connector_after_restore"]["restored_tokens"] == {}
    for rid, r in c["restored"].items():
        assert len(r["full"]) == len(a["reference"][rid])  # replayed to completion


def test_corrupt_blocks_are_not_offered_and_never_give_a_wrong_token(runs: dict) -> None:
    a, d = runs["a"], runs["d"]
    assert runs["flipped"] >= 5
    assert d["warm"], d["reasons"]
    st = d["restore_stats"]
    assert st["failed_blocks"] == runs["flipped"], st
    assert st["blocks"] == a["checkpoint_stats"]["pages"] - runs["flipped"]
    recomputed = {rid: r["prompt_len"] - r["num_cached_tokens"] for rid, r in d["restored"].items()}
    assert max(recomputed.values()) > 1, recomputed  # some request needed a corrupted block
    for rid, r in d["restored"].items():
        assert r["full"] == a["reference"][rid], rid


def test_canary_recorded_and_matched_after_warm_restore(runs: dict) -> None:
    from agent.engines import canary

    a, b, d = runs["a"], runs["b"], runs["d"]
    cn = a["canary"]
    assert cn["kind"] == canary.KIND
    assert cn["prompt_token_ids"] == canary.probe()
    assert len(cn["expected"]) == cn["new_tokens"] == 8
    # the probe shares no prefix with the client requests
    assert all(ref[0] != cn["prompt_token_ids"][0] for ref in a["reference"].values())
    for run in (b, d):  # warm restores (d: some blocks corrupted and not offered)
        st = run["restore_stats"]["canary"]
        assert st["checked"], st
        assert st["match"], st
        assert st["got"] == st["expected"] == cn["expected"]
    # the probe read the restored cache: the connector loaded its tokens on the new worker
    assert b["connector_after_restore"]["restored_tokens"].get("gpuckpt-canary-0", 0) >= 32
    # the cold (refused) restore never ran the probe
    assert runs["c"]["restore_stats"].get("canary") is None


def test_canary_mismatch_fails_closed_and_replays_cold(runs: dict) -> None:
    a, f = runs["a"], runs["d"]["canary_fault"]
    assert not f["warm"]
    assert len(f["reasons"]) == 1, f["reasons"]
    assert f["reasons"][0].startswith("canary:"), f["reasons"]
    st = f["restore_stats"]["canary"]
    assert st["checked"]
    assert not st["match"]
    assert str(st["expected"]) in f["reasons"][0]
    assert str(st["got"]) in f["reasons"][0]
    assert f["restore_stats"]["withdrawn"] > 0
    assert f["connector_after_restore"]["offered"] == 0  # the offer was withdrawn
    assert f["connector_after_restore"]["generators_pending"] == 0
    assert set(f["restored"]) == set(a["reference"])
    for rid, full in f["restored"].items():
        if rid.startswith("seeded"):  # a cold replay re-seeds: complete, not identical
            assert len(full) == len(a["reference"][rid]), rid
        else:
            assert full == a["reference"][rid], rid
