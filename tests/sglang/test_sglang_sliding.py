"""A sliding-window model on SGLang: checkpointed past its window, SIGKILLed, restored warm.

SGLang 0.5.23 keeps a Gemma-3-style model's KV in its one full pool (it turns its hybrid SWA
memory off for that architecture, with or without gpuckpt's linker) and applies the window as an
attention mask, so the linker carries every layer's KV as a dense model's. A tiny Gemma-3-style
model (sliding and global layers interleaved, a 64-token window) is checkpointed mid-decode with
prompts and outputs past the window; a fresh server restores it warm, and each request continues
token-exact against the uninterrupted run on the first server. The linker changes neither the
pool's kind nor its size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agent import session
from ckpt import Repository
from tests.harness.models import write_tiny_sliding
from tests.harness.sglang import GREEDY, Servers, checkpoint_in_flight

PAGE = 16
WINDOW = 64
#: in-flight requests: rid → (prompt, budget), prompts past the window
REQUESTS = {
    "s-short": ([5 + i % 400 for i in range(70)], 100),
    "s-long": ([11 + (7 * i) % 480 for i in range(150)], 90),
}
WHEN = {"live": 2, "min_outputs": 20}


@pytest.fixture(scope="module")
def restored(sglang_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("sglang-sliding")
    model = write_tiny_sliding(tmp / "gemma3", kind="gemma3", window=WINDOW)
    (tmp / "run").mkdir()
    servers = Servers(sglang_python, model, tmp / "run")
    try:
        a = servers.start("a")
        ref = {rid: a.client.complete(p, {**GREEDY, "max_new_tokens": n}).token_ids for rid, (p, n) in REQUESTS.items()}
        httpx.post(a.url + "/flush_cache", timeout=30).raise_for_status()
        repo = Repository.open(str(tmp / "repo"), create=True)
        taken = checkpoint_in_flight(a, REQUESTS, repo, "sglang-sw", WHEN)
        info_a = httpx.get(a.url + "/server_info", timeout=30).json()
        a.kill()
        b = servers.start("b")
        plan = session.restore(repo, taken.manifest.id, b.control_socket, generate=b.client.generate, wait=True)
        results = b.client.submit(plan.requests)
        yield {
            "reference": ref,
            "manifest": taken.manifest,
            "plan": plan,
            "results": results,
            "loaded": session.stats(b.control_socket)["restored_tokens"],
            "describe": session.describe(b.control_socket),
            "info": info_a,
        }
    finally:
        servers.close()


def test_sglang_keeps_the_model_in_one_full_pool_and_the_linker_carries_it(restored: dict[str, Any]) -> None:
    info = restored["info"]
    # SGLang turned its hybrid SWA memory off for the architecture: one full pool, no SWA pool
    assert info["disable_hybrid_swa_memory"] is True, "SGLang ran a hybrid SWA pool: this test's premise changed"
    mem = info["internal_states"][0]["memory_usage"]
    assert mem["token_capacity"] > 0
    assert not mem.get("token_capacity_swa")
    assert not restored["describe"].layout.get("kv_not_carried"), restored["describe"].layout


def test_restore_past_the_window_is_warm_and_token_exact(restored: dict[str, Any]) -> None:
    plan = restored["plan"]
    assert plan.warm, plan.reasons
    assert {r.request_id for r in plan.requests} == set(REQUESTS)
    for r in plan.requests:
        prompt, _ = REQUESTS[r.request_id]
        assert len(prompt) + len(r.output_token_ids) > WINDOW + PAGE, "the checkpoint is not past the window"
        got = list(r.output_token_ids) + restored["results"][r.request_id].token_ids
        assert got == restored["reference"][r.request_id], r.request_id
        assert restored["loaded"].get(r.request_id, 0) > 0, restored["loaded"]  # loaded, not recomputed
