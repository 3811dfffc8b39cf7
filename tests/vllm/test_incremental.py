"""Incremental capture with ``vllm serve`` workers: a checkpoint copies only the pages the
repository does not hold yet.

The connector holds for durable the keys of every committed checkpoint (the
driver acknowledges them) and the keys a restore offered; a capture copies
the rest and hands the save the durable ones as :class:`ckpt.Existing`
blocks, so the manifest still references every page. When the repository no
longer holds such a key (here: every checkpoint deleted and gc'd), the save
says so, the connector forgets the keys and a second capture copies them.
Every checkpoint loads whole; a restore from the last continues token-exact.
"""

from __future__ import annotations

import random
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import pytest

from agent import session
from agent.engines import canary
from ckpt import Repository
from tests.harness.vllm import serve_worker

pytestmark = pytest.mark.slow
TURN = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}


def loads_whole(repo: Repository, m) -> bool:  # type: ignore[no-untyped-def]
    errors: list = []
    n = sum(1 for _ in repo.load(m.id, errors=errors))
    return n == len(m.blocks) and not errors


@pytest.fixture(scope="module")
def incr(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, module_cleanup: ExitStack) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-incr")
    repo = Repository.open(str(tmp / "repo"), create=True)
    rng = random.Random(5)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    system = toks(64)
    convs = {f"c{i}": system + toks(256) for i in range(9)}
    out: dict = {}
    with serve_worker(tiny_llama, tmp, "a") as a:
        a.wait_ready()
        # B starts once A is up, while A works, on another CPU: an engine start costs ~20 s here,
        # and B is still fresh when its turn comes
        b_early = module_cleanup.enter_context(serve_worker(tiny_llama, tmp, "b", cpu=1))
        probe = canary.record(a.client.generate)
        turn1 = {k: a.client.complete(convs[k], TURN, stream=False) for k in list(convs)[:8]}
        taken = session.checkpoint(a.control_socket, repo, "w0", canary=probe)
        out["m1"], out["s1"] = taken.manifest, taken.stats
        # about 10 % new KV: one more conversation
        turn1["c8"] = a.client.complete(convs["c8"], TURN, stream=False)
        taken = session.checkpoint(a.control_socket, repo, "w0", canary=probe)
        out["m2"], out["s2"] = taken.manifest, taken.stats
        out["loads"] = {"m1": loads_whole(repo, out["m1"]), "m2": loads_whole(repo, out["m2"])}
        # keys the connector holds for durable, gone from the repository
        for info in repo.list():
            repo.delete(info.id)
        repo.gc(now=True, grace=timedelta(0))
        taken = session.checkpoint(a.control_socket, repo, "w0", canary=probe)
        out["m3"], out["s3"] = taken.manifest, taken.stats
        out["loads"]["m3"] = loads_whole(repo, out["m3"])
        nxt = {k: convs[k] + turn1[k].token_ids + toks(16) for k in ("c0", "c8")}
        out["reference"] = {k: a.client.complete(p, TURN, stream=False).token_ids for k, p in nxt.items()}
        a.kill()
    with b_early as b:
        b.wait_ready()
        out["plan"] = session.restore(
            repo,
            out["m3"].id,
            b.control_socket,
            staging_dir=str(tmp / "restore-b"),
            generate=b.client.generate,
            wait=True,  # the conversations' next turns below need the whole prefix cache offered
        )
        out["resumed"] = {k: b.client.complete(p, TURN, stream=False) for k, p in nxt.items()}
        out["prompts"] = nxt
        # the restore's offered keys are durable: the restored worker's first checkpoint copies little
        taken = session.checkpoint(b.control_socket, repo, "w0", canary=probe)
        out["m4"], out["s4"] = taken.manifest, taken.stats
        out["loads"]["m4"] = loads_whole(repo, out["m4"])
    return out


def test_the_second_checkpoint_copies_only_new_and_changed_pages(incr: dict) -> None:
    s1, s2 = incr["s1"], incr["s2"]
    assert s1["skipped_pages"] == 0
    assert s1["pages"] >= 80
    assert s2["skipped_pages"] >= s1["pages"] - 8  # what was durable, less tails that grew
    assert s2["bytes"] <= 0.25 * s1["bytes"], (s2["bytes"], s1["bytes"])
    k1 = {b.key for b in incr["m1"].blocks}
    k2 = {b.key for b in incr["m2"].blocks}
    assert len(k2) > len(k1)
    assert len(k1 - k2) <= 8  # the manifest still names every cached page
    assert incr["m2"].sizes.new_blocks < 0.25 * incr["m1"].sizes.blocks


def test_every_checkpoint_loads_whole(incr: dict) -> None:
    assert incr["loads"] == {"m1": True, "m2": True, "m3": True, "m4": True}


def test_keys_believed_durable_but_gone_are_copied_not_left_dangling(incr: dict) -> None:
    s3, m3 = incr["s3"], incr["m3"]
    assert s3["recaptured"] > 0, "the save should have found the durable keys missing"
    assert m3.sizes.new_blocks == m3.sizes.blocks  # the repository held nothing: all copied anew


def test_a_restore_from_an_incremental_checkpoint_continues_token_exact(incr: dict) -> None:
    plan = incr["plan"]
    assert plan.warm, plan.reasons
    for k, p in incr["prompts"].items():
        c = incr["resumed"][k]
        assert c.token_ids == incr["reference"][k], f"{k} diverged after the restore"
        assert c.cached_tokens >= len(p) - 16 - 32, (k, c.cached_tokens, len(p))


def test_offered_keys_are_durable_for_the_restored_workers_checkpoints(incr: dict) -> None:
    """The restored worker caches the offered blocks its requests loaded (two conversations' prefixes);
    its first checkpoint references those and copies only what it computed itself."""
    s4 = incr["s4"]
    assert s4["skipped_pages"] >= 16, s4
    assert s4["pages"] < s4["skipped_pages"], s4
    assert incr["m4"].sizes.new_blocks <= s4["pages"]
