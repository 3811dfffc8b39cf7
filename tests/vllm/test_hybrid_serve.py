"""Hybrid models' clients, through ``vllm serve``'s chat and completions endpoints, with vLLM's
hybrid KV cache manager on.

Worker A serves a hybrid model (with a tokenizer and a chat template; gpuckpt's connector and
middleware loaded) to three clients — chat streamed, chat not streamed, and completions streamed —
and a checkpoint is taken mid-decode; A finishes the requests (what each client got: the
reference) and is SIGKILLed. Worker B restores the checkpoint warm; each client retries its call
(same id, same body) and gets the whole original answer, token for token and character for
character. Two models:

- ``gemma3``: a Gemma-3-style model (sliding and global layers interleaved, a 64-token window);
  the prompts and outputs run well past the window (blocks have left it), and the non-streamed
  chat is seeded.
- ``qwen3next``: a Qwen3-Next-style model (Gated DeltaNet linear attention and full attention:
  a state-space group in ``mamba_cache_mode='align'``, 160-token blocks, bfloat16); each request's
  running state is carried. Greedy only: vLLM's CPU build fails seeded sampling on this model.
"""

from __future__ import annotations

import random
from contextlib import ExitStack
from functools import partial
from typing import Any

import pytest

from agent import session
from agent.engines import canary
from ckpt import Repository
from tests.harness.clients import Calls, call, checkpoint_during, generated
from tests.harness.models import write_tiny_qwen3_next, write_tiny_sliding
from tests.harness.vllm import ARGS as SERVE_ARGS
from tests.harness.vllm import RESTORE_FOLLOWS, serve_worker

pytestmark = pytest.mark.slow

WINDOW = 64
N = 200
ARGS = [*(a for a in SERVE_ARGS if a != "--skip-tokenizer-init"), "--max-num-seqs", "8", "--served-model-name", "m"]
NOEOS = {"ignore_eos": True, "return_token_ids": True}


def kinds(rng: random.Random, *, seeded: bool) -> dict[str, tuple[str, dict[str, Any]]]:
    """id → (endpoint, body): prompts longer than the window, outputs far past it; the chat not
    streamed is ``seeded`` (sampled with a seed) or greedy."""

    def words(k: int) -> str:
        return " ".join(rng.choice(["alpha", "beta", "gamma", "quick", "brown", "fox", "jumps"]) for _ in range(k))

    def chat(k: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": "the quick brown fox"}, {"role": "user", "content": words(k)}]

    return {
        "chat": ("chat", {"messages": chat(90), "temperature": 0.0, "max_tokens": N, **NOEOS, "stream": True}),
        "whole": (
            "chat",
            {"messages": chat(80), "max_tokens": N, **NOEOS, "stream": False}
            | ({"temperature": 0.8, "seed": 7} if seeded else {"temperature": 0.0}),
        ),
        "completion": (
            "completions",
            {"prompt": words(85), "temperature": 0.0, "max_tokens": N, **NOEOS, "stream": True},
        ),
    }


#: model kind → (what the checkpoint pins as its KV cache groups, the engine's arguments)
MODELS = {
    "gemma3": (f"g0=sliding_window:{WINDOW}/2;g1=full/2", ARGS),
    "qwen3next": (
        "g0=mamba/2;g1=full/2",
        [a if a != "float32" else "bfloat16" for a in ARGS],
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, module_cleanup: ExitStack
) -> dict[str, Any]:
    kind = request.param
    tmp = tmp_path_factory.mktemp(f"vllm-hybrid-serve-{kind}")
    if kind == "gemma3":
        model = write_tiny_sliding(tmp / "model", kind="gemma3", window=WINDOW, chat=True)
    else:
        model = write_tiny_qwen3_next(tmp / "model", chat=True)
    args = MODELS[kind][1]
    repo = Repository.open(str(tmp / "repo"), create=True)
    reqs = kinds(random.Random(3), seeded=kind == "gemma3")
    out: dict[str, Any] = {"kind": kind, "kinds": reqs}
    with serve_worker(model, tmp, "a", args) as a:
        a.wait_ready()
        # B starts while A works, on another CPU (an engine start costs ~20 s here)
        b_early = module_cleanup.enter_context(serve_worker(model, tmp, "b", args, RESTORE_FOLLOWS, cpu=1))
        probe = canary.record(a.client.generate)
        calls = {k: partial(call, a.url, k, *reqs[k]) for k in reqs}
        m, ref = checkpoint_during(a, calls, repo, live=len(reqs), canary=probe)
        out["checkpoint"], out["reference"] = m, ref
        a.kill()
    with b_early as b:
        b.wait_ready()
        plan = session.restore(
            repo, m.id, b.control_socket, staging_dir=str(tmp / "stage-b"), generate=b.client.generate
        )
        out["plan"] = plan
        g0 = generated(b.url)
        resumer = Calls({"resumed": partial(b.client.submit, plan.requests)})  # the agent's path
        retries = Calls({k: partial(call, b.url, k, *reqs[k]) for k in reqs})  # the clients'
        resumer.start()
        retries.start()
        out["retries"], out["resumed"] = retries.join(), resumer.join()["resumed"]
        out["generated"] = generated(b.url) - g0
        out["connector"] = session.stats(b.control_socket)
    return out


def test_checkpointed_mid_decode_with_both_groups_pinned(served: dict[str, Any]) -> None:
    m = served["checkpoint"]
    assert m.pins.worker.kv_groups == MODELS[served["kind"]][0]
    entries = m.ledger.data["requests"]
    assert len(entries) == 3
    for e in entries:
        assert e["exact"], (e["client_request_id"], e["inexact_reasons"])
        assert 40 <= len(e["output_token_ids"]) < N, "checkpointed mid-decode"
        assert len(e["prompt_token_ids"]) + len(e["output_token_ids"]) > WINDOW + 32, "not past the window"


def test_each_client_gets_the_whole_uninterrupted_answer(served: dict[str, Any]) -> None:
    assert served["plan"].warm, served["plan"].reasons
    loaded = served["connector"]["restored_tokens"]  # the canary's request too
    for e in served["checkpoint"].ledger.data["requests"]:
        assert loaded.get(e["client_request_id"], 0) > 0, loaded  # loaded by the connector, not recomputed
    for k, ref in served["reference"].items():
        got = served["retries"][k]
        assert got["attach"] == "attached", (k, got["attach"])
        assert got["choices"].keys() == ref["choices"].keys() == {0}, k
        assert got["choices"][0]["ids"] == ref["choices"][0]["ids"], f"{k}: tokens differ from the uninterrupted run"
        assert got["choices"][0]["text"] == ref["choices"][0]["text"], f"{k}: text differs"
        assert got["choices"][0]["finish"] == ref["choices"][0]["finish"] == "length", k
        assert len(ref["choices"][0]["ids"]) == N


def test_the_missing_tokens_are_generated_once(served: dict[str, Any]) -> None:
    resumed = served["resumed"]
    missing = sum(N - len(e["output_token_ids"]) for e in served["checkpoint"].ledger.data["requests"])
    assert sum(len(c.token_ids) for c in resumed.values()) == missing
    assert served["generated"] == missing
