"""Sliding-window models with vLLM's hybrid KV cache manager on (gpuckpt declares ``SupportsHMA``).

Two tiny random models with a 64-token window and 32-token blocks: a Gemma-3-style one
(interleaved sliding and global layers: two KV cache groups) and a Mistral-style one (every
layer slides: one sliding group). Each is checkpointed mid-decode with prompts and outputs well
past the window — blocks have left it — and restored into a fresh engine, warm and token-exact;
the KV capacity vLLM allocates with gpuckpt loaded equals the capacity without it.

A tiny Qwen3-Next (Gated DeltaNet linear attention and full attention: a state-space group in
vLLM's ``mamba_cache_mode='align'``, 160-token blocks) starts with the allocator on too, with
the KV capacity of a worker without gpuckpt; its
state blocks are carried — the running state of each request in flight, the states at block
boundaries vLLM keeps — and it restores warm and token-exact. At tensor parallel size 2 it
restores warm and token-exact onto the same size, and cold onto another, naming the state
group; with a single KV head at that size (its ranks hold replicas of the head and different
state: the stored pages keep one slot per rank) it restores warm and token-exact too.

A Qwen3-Next whose four linear-attention layers and three full-attention layers vLLM pads into
groups of four (a state layer in a physical slot no attention layer shares: a group gpuckpt cannot
carry) starts all the same, its checkpoint holds the ledger and no pages, and its restore is cold
with the group named.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.models import write_tiny_qwen3_next, write_tiny_sliding
from tests.harness.vllm import run_worker, run_workers

pytestmark = pytest.mark.slow

KINDS = ("gemma3", "mistral")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("vllm-hybrid")
    base = {
        k: {"model": str(write_tiny_sliding(tmp / f"model-{k}", kind=k)), "repo": str(tmp / f"repo-{k}")} for k in KINDS
    }

    def at(k: str, name: str) -> dict:
        return {"socket": str(tmp / f"{k}-{name}.sock"), "staging": str(tmp / f"stage-{k}-{name}")}

    base["qwen3next"] = {
        "model": str(write_tiny_qwen3_next(tmp / "model-qwen3next")),
        "repo": str(tmp / "repo-qwen3next"),
        "dtype": "bfloat16",
        # vLLM makes its blocks 256 tokens (a state block's page): a system prompt past the first
        # block boundary gives every request a state there to hit
        "system_len": 300,
        # vLLM's CPU build fails seeded sampling on this model ("CPU Generator does not use offset",
        # raised in its model runner's own bookkeeping): greedy requests only
        "seeded": False,
    }
    # 4 linear + 3 full layers: vLLM groups them by 4 (4 < 3 · 1.5), the attention group padded, so
    # physical slot 3 holds a state layer alone — pages are read through attention layers' views
    base["uncarried"] = {
        **base["qwen3next"],
        "model": str(
            write_tiny_qwen3_next(
                tmp / "model-uncarried", layer_types=["linear_attention", "full_attention"] * 3 + ["linear_attention"]
            )
        ),
        "repo": str(tmp / "repo-uncarried"),
    }
    every = (*KINDS, "qwen3next", "uncarried")
    a = run_workers({k: {**base[k], **at(k, "a"), "mode": "checkpoint"} for k in every}, tmp, kill_after_result=True)
    jobs = {
        f"{k}-b": {**base[k], **at(k, "b"), "mode": "restore", "checkpoint": a[k]["checkpoint"], "turn1": a[k]["turn1"]}
        for k in every
    }
    jobs |= {
        f"{k}-plain": {**base[k], **at(k, "plain"), "mode": "capacity", "connector": False}
        for k in every
        if k != "uncarried"
    }
    # every load of the restore fails (two KV cache groups: vLLM takes no failed block ids from such
    # a worker, only failed requests)
    jobs["gemma3-fail"] = {
        **jobs["gemma3-b"],
        **at("gemma3", "fail"),
        "inject_faults": ["start_load_kv"],
    }
    done = run_workers(jobs, tmp)
    runs = {k: {"a": a[k], "b": done[f"{k}-b"], "plain": done[f"{k}-plain"]} for k in KINDS}
    runs["gemma3"]["fail"] = done["gemma3-fail"]
    runs["qwen3next"] = {"a": a["qwen3next"], "b": done["qwen3next-b"], "plain": done["qwen3next-plain"]}
    return runs | {"uncarried": {"a": a["uncarried"], "b": done["uncarried-b"]}}


@pytest.mark.parametrize("kind", [*KINDS, "qwen3next"])
def test_the_hybrid_manager_stays_on_and_the_kv_capacity_is_unchanged(runs: dict, kind: str) -> None:
    r = runs[kind]
    assert not r["a"]["kv"]["hybrid_manager_off"], "gpuckpt turned vLLM's hybrid KV cache manager off"
    assert not r["plain"]["kv"]["hybrid_manager_off"]
    assert r["a"]["kv"]["num_gpu_blocks"] == r["plain"]["kv"]["num_gpu_blocks"], r


@pytest.mark.parametrize("kind", KINDS)
def test_checkpointed_past_the_window(runs: dict, kind: str) -> None:
    a = runs[kind]["a"]
    for rid, n in a["ledger_outputs"].items():
        assert 40 <= n < 240, (rid, n)
        assert len(a["reference"][rid]) - n > 64 + 32, "the checkpoint is not past the window"
    assert a["checkpoint_stats"]["pages"] > 0


@pytest.mark.parametrize("kind", [*KINDS, "qwen3next"])
def test_restore_is_warm_and_token_exact(runs: dict, kind: str) -> None:
    a, b = runs[kind]["a"], runs[kind]["b"]
    assert b["warm"], b["reasons"]
    assert b["restore_stats"]["failed_blocks"] == 0
    assert set(b["restored"]) == set(a["reference"])
    for rid, r in b["restored"].items():
        assert r["full"] == a["reference"][rid], rid
    loaded = b["connector_after_restore"]["restored_tokens"]
    for rid, r in b["restored"].items():
        assert r["prompt_len"] - r["num_cached_tokens"] <= 1, (rid, r)
        assert loaded[rid] > 0, rid  # loaded by the connector, not recomputed


@pytest.mark.parametrize("kind", [*KINDS, "qwen3next"])
def test_next_turn_finds_what_the_uninterrupted_engine_kept(runs: dict, kind: str) -> None:
    """A sliding group keeps only the blocks a hit can use (vLLM caches those), a state group the
    states it took: the restored engine's next turn hits at least as far as the uninterrupted
    engine's own, past the shared system prompt."""
    a, b = runs[kind]["a"], runs[kind]["b"]
    for rid in a["turn1"]:
        got, kept = b["turn2"][rid + "-t2"]["num_cached_tokens"], a["turn2"][rid + "-t2"]["num_cached_tokens"]
        assert got >= kept > 64, (rid, got, kept)


def test_failed_loads_of_a_hybrid_worker_are_recomputed_and_never_take_it_down(runs: dict) -> None:
    """With two KV cache groups a load is reported failed by request (``failed_recving``), never by
    block id (vLLM raises on those for such a worker, taking the engine down): every load of the
    restore failing, each request is recomputed and continues token-exact."""
    a, f = runs["gemma3"]["a"], runs["gemma3"]["fail"]
    assert f["warm"], f["reasons"]
    st = f["connector_after_restore"]
    assert st["restored_tokens"], st  # loads were planned ...
    assert set(st["load_failed_requests"]) == set(st["restored_tokens"]), st  # ... and every one failed
    assert set(f["restored"]) == set(a["reference"])
    for rid, r in f["restored"].items():
        if rid != "seeded0":  # (its sampler state goes with the failed hook's other work)
            assert r["full"] == a["reference"][rid], rid
        # nothing was loaded: recomputed, but for the system prompt another request recomputed first
        assert r["num_cached_tokens"] <= 64, (rid, r)


def test_models_are_what_they_claim(runs: dict) -> None:
    """The Gemma-3-style model has two KV cache groups (sliding, full), the Mistral-style one a
    single sliding group: both recorded in the checkpoint's pins, group by group."""
    assert runs["gemma3"]["a"]["kv_groups"] == "g0=sliding_window:64/2;g1=full/2"
    assert runs["mistral"]["a"]["kv_groups"] == "g0=sliding_window:64/2"


def test_write_tiny_sliding_refuses_an_unknown_kind(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown sliding-window model kind"):
        write_tiny_sliding(tmp_path, kind="jamba")


def test_a_state_space_model_is_carried(runs: dict) -> None:
    """Qwen3-Next (Gated DeltaNet state + full attention, vLLM's ``mamba_cache_mode='align'``): the
    state group is carried — in flight, each request's running state after exactly its computed
    tokens, so it restores with all but its last token loaded (warm and token-exact above); in
    the prefix cache, the states at the block boundaries vLLM kept."""
    a, b = runs["qwen3next"]["a"], runs["qwen3next"]["b"]
    assert not a["kv"]["hybrid_manager_off"], "a hybrid SSM model needs the hybrid KV cache manager"
    assert a["kv_groups"] == "g0=mamba/2;g1=full/2"
    assert a["checkpoint_stats"]["pages"] > 0
    loaded = b["connector_after_restore"]["restored_tokens"]
    for rid, r in b["restored"].items():
        assert loaded[rid] == r["prompt_len"] - 1, (rid, loaded[rid], r)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The same Qwen3-Next at tensor parallel size 2 (each rank holds one of its 2 KV heads and its
    share of the state heads): checkpointed mid-decode and restored at the same size (each worker
    alone on the CPUs), and the same checkpoint restored onto one rank. Beside it, a Qwen3-Next
    with a single KV head at the same size — its ranks hold replicas of that head and different
    state — checkpointed and restored at the same size."""
    tmp = tmp_path_factory.mktemp("vllm-hybrid-tp2")
    base = {
        "model": str(write_tiny_qwen3_next(tmp / "model")),
        "repo": str(tmp / "repo"),
        "dtype": "bfloat16",
        "seeded": False,
        "system_len": 300,
        "max_tokens": 60,
        "tp": 2,
    }
    one = {
        **base,
        "model": str(write_tiny_qwen3_next(tmp / "model-1kv", kv_heads=1)),
        "repo": str(tmp / "repo-1kv"),
    }
    at = {n: {"socket": str(tmp / f"{n}.sock"), "staging": str(tmp / f"stage-{n}")} for n in ("a", "b", "c", "d", "e")}
    a = run_worker({**base, **at["a"], "mode": "checkpoint"}, tmp, kill_after_result=True)
    d = run_worker({**one, **at["d"], "mode": "checkpoint"}, tmp, kill_after_result=True)
    b = run_worker({**base, **at["b"], "mode": "restore", "checkpoint": a["checkpoint"], "turn1": a["turn1"]}, tmp)
    e = run_worker({**one, **at["e"], "mode": "restore", "checkpoint": d["checkpoint"], "turn1": d["turn1"]}, tmp)
    c = run_worker(
        {**base, **at["c"], "tp": 1, "mode": "restore", "checkpoint": a["checkpoint"], "turn1": a["turn1"]}, tmp
    )
    return {"a": a, "b": b, "c": c, "replicas": d, "replicas-restored": e}


def warm_and_exact(a: dict, b: dict) -> None:
    """``b`` restored ``a``'s checkpoint warm: each request had all but its last token loaded (its
    running state's tail) and continued token-exact."""
    assert b["warm"], b["reasons"]
    assert set(b["restored"]) == set(a["reference"])
    loaded = b["connector_after_restore"]["restored_tokens"]
    for rid, r in b["restored"].items():
        assert r["full"] == a["reference"][rid], rid
        assert loaded[rid] == r["prompt_len"] - 1, (rid, loaded[rid], r)


def test_a_state_space_model_at_tensor_parallel_size_2_restores_warm_onto_the_same_size(tp2: dict) -> None:
    a, b = tp2["a"], tp2["b"]
    assert a["kv_groups"] == "g0=mamba@tp2/2;g1=full/2"
    assert a["checkpoint_stats"]["pages"] > 0
    warm_and_exact(a, b)


def test_onto_another_tensor_parallel_size_its_restore_is_cold_naming_the_state_group(tp2: dict) -> None:
    a, c = tp2["a"], tp2["c"]
    assert not c["warm"]
    named = [
        r
        for r in c["reasons"]
        if r.startswith("kv_groups: mismatch") and "KV cache group 0 (mamba): its state is split" in r
    ]
    assert named, c["reasons"]
    assert "(checkpoint 2, here 1)" in named[0], named
    assert set(c["restored"]) == set(a["reference"])  # resubmitted, recomputed (by another TP size)


def test_above_the_model_s_kv_heads_the_state_is_carried_one_slot_per_rank(tp2: dict) -> None:
    """One KV head at TP 2 (Qwen3-Next's 2 at TP 4 or 8 alike): both ranks hold that head, each its
    own state; the stored pages keep a slot per rank, and the restore at the same size is warm and
    token-exact — each rank got its own state back."""
    a, b = tp2["replicas"], tp2["replicas-restored"]
    assert not a["kv"]["hybrid_manager_off"], "a hybrid SSM model needs the hybrid KV cache manager"
    assert a["kv_groups"] == "g0=mamba@tp2/2;g1=full/2"
    assert a["checkpoint_stats"]["pages"] > 0
    assert a["page_heads"] == 2
    assert a["shards"] == [[0, 1], [1, 1]]  # slot r is rank r's (by heads both would be head 0)
    # another page format than pages of the model's heads: their blocks never share a blob
    assert a["namespace_kv"].endswith("/slots2"), a["namespace_kv"]
    assert tp2["a"]["page_heads"] is None  # 2 KV heads at TP 2: each rank's own, by heads
    assert "/slots" not in tp2["a"]["namespace_kv"]
    assert tp2["a"]["shards"] == [[0, 1], [1, 1]]
    warm_and_exact(a, b)


def test_a_group_it_cannot_carry_starts_anyway_and_restores_cold_naming_the_group(runs: dict) -> None:
    a, b = runs["uncarried"]["a"], runs["uncarried"]["b"]
    assert not a["kv"]["hybrid_manager_off"], "a hybrid SSM model needs the hybrid KV cache manager"
    assert a["kv_groups"] == "g0=mamba/4;g1=full/3"
    assert a["checkpoint_stats"]["pages"] == 0
    assert len(a["ledger_outputs"]) == 3  # the ledger is carried: the requests come back
    assert not b["warm"]
    named = [r for r in b["reasons"] if r.startswith("KV not carried (checkpoint): KV cache group 0 (mamba, 4 layers)")]
    assert named, b["reasons"]
    assert "its layers fill 4 physical slots and attention layers only 3" in named[0], named
    assert set(b["restored"]) == set(a["reference"])  # resubmitted, recomputed
