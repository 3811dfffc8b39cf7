"""Restored requests reach the clients that sent them, through ``vllm serve`` and the ``openai``
client: chat and completions, streamed and not, the request kinds production traffic has.

Worker A (CPU build, a generated model with a tokenizer and a chat template, gpuckpt's connector
and middleware) serves seven clients, each with its own ``X-Request-Id``; a checkpoint is taken
once every engine request has 40 outputs; the same worker then finishes them (the uninterrupted
reference: what each client got) and its process group is SIGKILLed. Worker B restores the
checkpoint (warm, canary checked), the agent's path resubmits the ledger, and then:

- each client retries its call (same id, same body): it gets the whole original response, in its
  endpoint's format, equal to the reference, and the engine generates each request's missing
  tokens once (the engine's own counter);
- a router re-issues three of them as prompt + more tokens than the checkpoint held: each gets
  the exact rest;
- a request under a reused id with another body, or another tenant's key, is never attached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from agent import session
from agent.daemon import watchdog
from agent.engines import canary
from agent.engines.channel import WorkerChannel
from agent.engines.retries import ATTACH_HEADER, REISSUE_HEADER
from agent.testing import ServeProcess
from ckpt import Repository
from tests.harness.cli import CLI
from tests.harness.clients import Calls, call, checkpoint_during, generated, same_logprobs
from tests.harness.launched import ARGS, agent_status, chat_model, healthy, kill_all, launch, until
from tests.harness.net import free_port
from tests.harness.paths import short_dir
from tests.harness.procs import running_in_group
from tests.harness.vllm import RESTORE_FOLLOWS, serve_worker

pytestmark = pytest.mark.slow

N = 160
# "words" before "kind": the order the grammar generates them in, which a ledger that kept the
# schema as a dict lost to the manifest's sorted keys (the restored grammar then rejected the
# earlier outputs: issue 38)
SCHEMA = {
    "type": "object",
    "properties": {
        "words": {
            "type": "array",
            "items": {"type": "string", "enum": ["alpha", "beta", "gamma", "delta"]},
            "minItems": 30,
            "maxItems": 30,
        },
        "kind": {"type": "string", "enum": ["x", "yy", "zzz"]},
    },
    "required": ["words", "kind"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "pick",
        "description": "pick words",
        "parameters": {
            "type": "object",
            "properties": {"kind": {"type": "string", "enum": ["x", "yy"]}, "words": SCHEMA["properties"]["words"]},
            "required": ["kind", "words"],
            "additionalProperties": False,
        },
    },
}
CHOICES = [" ".join(["alpha beta gamma"] * 12) + end for end in (" delta", " epsilon zeta", " eta")]
NOEOS = {"ignore_eos": True, "return_token_ids": True}


def kinds(rng: random.Random) -> dict[str, tuple[str, dict[str, Any], int]]:
    """id → (endpoint, body, engine requests)."""

    def words(k: int) -> str:
        return " ".join(rng.choice(["alpha", "beta", "gamma", "quick", "brown", "fox", "jumps"]) for _ in range(k))

    def chat(k: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": "the quick brown fox"}, {"role": "user", "content": words(k)}]

    return {
        "greedy": ("chat", {"messages": chat(20), "temperature": 0.0, "max_tokens": N, **NOEOS, "stream": True}, 1),
        "twice": (
            "chat",
            {"messages": chat(22), "n": 2, "temperature": 0.8, "seed": 7, "max_tokens": N, **NOEOS, "stream": False},
            2,
        ),
        "logprobs": (
            "completions",
            {"prompt": words(30), "temperature": 0.0, "max_tokens": N, "logprobs": 2, **NOEOS, "stream": True},
            1,
        ),
        # the top logprobs of a chat answer, in one response at the end
        "chatlp": (
            "chat",
            {"messages": chat(16), "temperature": 0.0, "max_tokens": N, "logprobs": True, "top_logprobs": 3, **NOEOS},
            1,
        ),
        "stopstr": (
            "completions",
            {"prompt": words(26), "temperature": 0.0, "max_tokens": N, "stop": ["qqqq"], **NOEOS, "stream": False},
            1,
        ),
        "json": (
            "chat",
            {
                "messages": chat(18),
                "temperature": 0.0,
                "max_tokens": 400,
                "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
                "return_token_ids": True,
                "stream": True,
            },
            1,
        ),
        # any JSON object (vLLM's json_object grammar), not streamed
        "jsonobj": (
            "chat",
            {
                "messages": chat(15),
                "temperature": 0.0,
                "max_tokens": 300,
                "response_format": {"type": "json_object"},
                "return_token_ids": True,
            },
            1,
        ),
        "penalised": (
            "chat",
            {
                "messages": chat(24),
                "temperature": 0.0,
                "frequency_penalty": 0.8,
                "presence_penalty": 0.4,
                "max_tokens": N,
                **NOEOS,
                "stream": True,
            },
            1,
        ),
        "topp": (
            "chat",
            {"messages": chat(21), "temperature": 1.0, "top_p": 0.9, "seed": 11, "max_tokens": N, **NOEOS},
            1,
        ),
        "mixed": (
            "completions",
            {
                "prompt": words(28),
                "temperature": 0.7,
                "top_k": 20,
                "min_p": 0.05,
                "seed": 5,
                "repetition_penalty": 1.2,
                "logit_bias": {"7": -5.0},
                "bad_words": ["fox"],
                "min_tokens": 100,
                "stop_token_ids": [3],
                "max_tokens": N,
                **NOEOS,
                "stream": True,
            },
            1,
        ),
        # a prompt given as embeddings: the ledger cannot carry it, so it is left to its client
        "embeds": (
            "completions",
            {"prompt_embeds": prompt_embeds(rng, 36), "temperature": 0.0, "max_tokens": N, **NOEOS, "stream": True},
            1,
        ),
        "regex": (
            "chat",
            {
                "messages": chat(19),
                "temperature": 0.0,
                "max_tokens": 400,
                "structured_outputs": {"regex": "(alpha|beta|gamma|delta)(,(alpha|beta|gamma|delta)){59}"},
                "return_token_ids": True,
                "stream": False,
            },
            1,
        ),
        "tool": (
            "chat",
            {
                "messages": chat(17),
                "temperature": 0.0,
                "max_tokens": 400,
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "pick"}},
                "return_token_ids": True,
                "stream": True,
            },
            1,
        ),
        "choice": (
            "completions",
            {
                "prompt": words(23),
                "temperature": 0.0,
                "max_tokens": 400,
                "structured_outputs": {"choice": CHOICES},
                "return_token_ids": True,
                "stream": True,
            },
            1,
        ),
    }


#: the request whose carried grammar state the test makes unappliable: the agent resubmits it
#: under another constraint, which rejects its earlier outputs
VOIDED = "regex"
#: the seeded request the test judges unable to continue exactly: computed again from its prompt
RECOMPUTE = "topp"
WITHHELD = "seeded sampling: the sampler state is carried on a warm restore only"


def prompt_embeds(rng: random.Random, n: int, hidden: int = 256) -> str:
    """A prompt of ``n`` embeddings of the tiny Llama's width, as the completions API takes it
    (``torch.save``, base64)."""
    import base64
    import io

    import torch

    buf = io.BytesIO()
    torch.save(torch.tensor([[rng.gauss(0.0, 1.0) for _ in range(hidden)] for _ in range(n)]), buf)
    return base64.b64encode(buf.getvalue()).decode()


def worker(model: Path, tmp: Path, name: str, cpu: int = 0, extra: dict[str, Any] | None = None) -> ServeProcess:
    """A test worker (connector and middleware), with the tokenizer, serving the model as "m"."""
    return serve_worker(model, tmp, name, [*ARGS, "--served-model-name", "m"], extra, cpu=cpu)


@pytest.fixture(scope="module")
def retried(
    tiny_llama_text: Path, tmp_path_factory: pytest.TempPathFactory, module_cleanup: ExitStack
) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-retries")
    model = chat_model(tiny_llama_text, tmp)
    repo = Repository.open(str(tmp / "repo"), create=True)
    reqs = kinds(random.Random(5))
    out: dict[str, Any] = {"kinds": reqs}
    with worker(model, tmp, "a") as a:
        a.wait_ready()
        # B starts once A is up, while A works, on another CPU: an engine start costs ~20 s here,
        # and B is still fresh when its turn comes
        b_early = module_cleanup.enter_context(worker(model, tmp, "b", cpu=1, extra=RESTORE_FOLLOWS))
        probe = canary.record(a.client.generate)
        calls = {k: partial(call, a.url, k, endpoint, body) for k, (endpoint, body, _) in reqs.items()}
        # as the agent does: the logprobs the server gave out for the captured outputs go in the ledger
        live = sum(n for _, _, n in reqs.values())
        m, ref = checkpoint_during(a, calls, repo, live=live, canary=probe, complete_ledger=a.client.complete_ledger)
        out["checkpoint"], out["reference"] = m, ref
        a.kill()
    with b_early as b:
        b.wait_ready()
        plan = session.restore(
            repo, m.id, b.control_socket, staging_dir=str(tmp / "stage-b"), generate=b.client.generate
        )
        out["plan"] = plan
        g0 = generated(b.url)
        # one request's grammar state made unappliable: resubmitted under a constraint that rejects
        # its earlier outputs, as a ledger whose grammar facts were corrupt would have it; and one
        # judged unable to continue exactly (its generator state withheld, as a cold restore has
        # it), which the agent's path computes again from its prompt (session.resubmit)
        requests = [
            dataclasses.replace(r, sampling={**r.sampling, "structured_outputs": {"regex": "(zeta)+"}})
            if r.request_id == f"chatcmpl-{VOIDED}"
            else dataclasses.replace(r, exact=False, reasons=(WITHHELD,)).from_prompt()
            if r.request_id == f"chatcmpl-{RECOMPUTE}"
            else r
            for r in plan.requests
        ]
        resumer = Calls({"resumed": partial(b.client.submit, requests)})  # the agent's path
        retries = Calls({k: partial(retrying, b.url, k, endpoint, body) for k, (endpoint, body, _) in reqs.items()})
        resumer.start()
        retries.start()
        out["retries"], out["resumed"] = retries.join(), resumer.join()["resumed"]
        out["generated"] = generated(b.url) - g0
        # a router re-issues three streams as prompt + what it had delivered (10 tokens past the checkpoint)
        entries = {e["client_request_id"]: e for e in m.ledger.data["requests"]}
        reissued = {}
        for k, cid in (("topp", "chatcmpl-topp"), ("penalised", "chatcmpl-penalised"), ("json", "chatcmpl-json")):
            e = entries[cid]
            delivered = ref[k]["choices"][0]["ids"][: len(e["output_token_ids"]) + 10]
            body = {"prompt": e["prompt_token_ids"] + delivered, "max_tokens": 1000, "temperature": 0.0, **NOEOS}
            with httpx.Client(timeout=600) as h:
                r = h.post(
                    f"{b.url}/v1/completions",
                    json={"model": "m", **body},
                    headers={"X-Request-Id": k, "Authorization": "Bearer k1", REISSUE_HEADER: "1"},
                )
            assert r.status_code == 200, r.text
            reissued[k] = {
                "delivered": len(delivered),
                "attach": r.headers.get(ATTACH_HEADER),
                **r.json()["choices"][0],
            }
        out["reissued"] = reissued
        # the same id with another body, and another tenant's key with the same body: never attached
        endpoint, body, _ = reqs["greedy"]
        out["other_body"] = call(b.url, "greedy", endpoint, {**body, "max_tokens": 8, "stream": False})
        out["other_tenant"] = call(b.url, "greedy", endpoint, {**body, "stream": False}, key="k2")
        out["connector"] = session.stats(b.control_socket)
        out["metrics"] = httpx.get(f"{b.url}/metrics", timeout=30).text
    return out


def retrying(url: str, rid: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """A client's call as the ``openai`` client's users make it: an error it raises (a stream cut,
    a 5xx) is retried once with the same id and body; ``first_error`` says what the first try got."""
    try:
        return {**call(url, rid, endpoint, body), "first_error": None}
    except openai.APIError as exc:
        return {**call(url, rid, endpoint, body), "first_error": str(exc)}


#: the retries a restore leaves to be computed anew, and the header that says why
LEFT = {"embeds": "new: its prompt embeddings are not carried by the ledger"}


def test_the_ledger_judges_every_kind_exact_and_carries_the_api_facts(retried: dict[str, Any]) -> None:
    entries = {e["client_request_id"]: e for e in retried["checkpoint"].ledger.data["requests"]}
    assert set(entries) == {
        "chatcmpl-greedy",
        "0_chatcmpl-twice",
        "1_chatcmpl-twice",
        "cmpl-logprobs-0",
        "chatcmpl-chatlp",
        "cmpl-stopstr-0",
        "chatcmpl-json",
        "chatcmpl-jsonobj",
        "chatcmpl-penalised",
        "chatcmpl-topp",
        "cmpl-mixed-0",
        "chatcmpl-regex",
        "chatcmpl-tool",
        "cmpl-choice-0",
    }
    # the request whose prompt came as embeddings is not among them: its input is not carried,
    # and it is filed apart, without tokens, so that no reader resubmits it on another input
    assert retried["checkpoint"].ledger.data["left_to_client"] == [
        {
            "request_id": retried["checkpoint"].ledger.data["left_to_client"][0]["request_id"],
            "client_request_id": "cmpl-embeds-0",
            "left_to_client": "its prompt embeddings are not carried by the ledger",
            "api": retried["checkpoint"].ledger.data["left_to_client"][0]["api"],
        }
    ]
    for cid, e in entries.items():
        assert e["exact"], (cid, e["inexact_reasons"])
        assert len(e["output_token_ids"]) >= 40, "checkpointed mid-decode"
        assert e["api"]["endpoint"] == ("completions" if cid.startswith("cmpl") else "chat")
        assert len(e["api"]["body"]) == len(e["api"]["tenant"]) == 64
        # the logprobs the server gave out for the captured outputs: one position per output, the
        # sampled token first, then as many top ones as were asked for (or one more: the sampled)
        if e["sampling"].get("logprobs") is not None:
            assert len(e["logprobs"]) == len(e["output_token_ids"]), cid
            for tok, pos in zip(e["output_token_ids"], e["logprobs"], strict=True):
                assert pos[0][0] == tok, cid
                assert len(pos) in (e["sampling"]["logprobs"] + 1, e["sampling"]["logprobs"]), (cid, pos)
        else:
            assert "logprobs" not in e, cid


#: what the retry of the request whose grammar state could not be applied is told
VOID_ATTACH = "new: its grammar could not be applied to the earlier outputs (the grammar rejects the earlier outputs)"


def test_each_retry_gets_the_whole_uninterrupted_answer(retried: dict[str, Any]) -> None:
    assert retried["plan"].warm, retried["plan"].reasons
    for k, ref in retried["reference"].items():
        got = retried["retries"][k]
        assert got["attach"] == LEFT.get(k, VOID_ATTACH if k == VOIDED else "attached"), (k, got["attach"])
        if k != VOIDED:
            assert got["first_error"] is None, (k, got["first_error"])
        assert got["choices"].keys() == ref["choices"].keys(), k
        for i, c in ref["choices"].items():
            assert got["choices"][i]["ids"] == c["ids"], f"{k} choice {i}: tokens differ from the uninterrupted run"
            assert got["choices"][i]["text"] == c["text"], f"{k} choice {i}: text differs"
            assert got["choices"][i]["tools"] == c["tools"], f"{k} choice {i}: tool call differs"
            assert got["choices"][i]["finish"] == c["finish"], k
            # every token's logprobs, the checkpoint's and the continuation's: those it was given
            assert (why := same_logprobs(got["choices"][i]["logprobs"], c["logprobs"])) is None, (k, i, why)
    for k in ("logprobs", "chatlp"):
        lps = retried["retries"][k]["choices"][0]["logprobs"]
        assert len(lps) == len(retried["reference"][k]["choices"][0]["ids"]), k
        # chat: the 3 asked for; completions: up to the 2 asked for and the sampled token, keyed
        # by their text (the sampled token is one of the top ones, and tokens of one text are one key)
        assert (
            all(len(top) == 3 for _, _, top in lps) if k == "chatlp" else all(1 <= len(top) <= 3 for _, _, top in lps)
        ), k
    doc = json.loads(retried["retries"]["json"]["choices"][0]["text"])
    assert len(doc["words"]) == 30
    assert doc["kind"] in ("x", "yy", "zzz")
    args = json.loads(retried["retries"]["tool"]["choices"][0]["tools"])
    assert len(args["words"]) == 30
    assert retried["retries"]["choice"]["choices"][0]["text"] in CHOICES
    # a JSON object where the grammar finished it (a random model may spend its budget first: the
    # uninterrupted run's answer, compared above, is then cut alike)
    obj = retried["retries"]["jsonobj"]["choices"][0]
    if obj["finish"] == "stop":
        assert isinstance(json.loads(obj["text"]), dict)


def test_a_continuation_whose_grammar_could_not_be_applied_never_reaches_a_client(retried: dict[str, Any]) -> None:
    """The worker could not advance the resubmitted request's grammar by its earlier outputs: the
    continuation is dropped, never served — a retry that had attached to it got an error it
    retries (after the checkpoint's own tokens only), and the retry is computed anew, equal to
    the uninterrupted answer (test_each_retry_gets_the_whole_uninterrupted_answer) — and the
    worker says so."""
    got = retried["retries"][VOIDED]
    if got["first_error"] is not None:  # the retry had attached before the worker dropped it
        assert "the restored continuation was dropped" in got["first_error"], got["first_error"]
    voided = retried["connector"]["states_voided"]
    assert list(voided) == [f"chatcmpl-{VOIDED}"]
    assert "the grammar rejects the earlier outputs" in voided[f"chatcmpl-{VOIDED}"]
    assert retried["resumed"][f"chatcmpl-{VOIDED}"].token_ids.__len__() <= 1, "stopped at once"
    assert 'gpuckpt_continuations_total{event="voided"} 1.0' in retried["metrics"]


def test_the_missing_tokens_are_generated_once(retried: dict[str, Any]) -> None:
    resumed = retried["resumed"]
    # the ledger does not carry the embeddings request's input: it is left to its retry, which
    # computes it whole (the logprobs requests are continued: their logprobs are carried)
    assert "embeddings" in resumed["cmpl-embeds-0"].left_to_client
    assert resumed["cmpl-embeds-0"].token_ids == []
    assert resumed["cmpl-logprobs-0"].left_to_client is None
    # and the request whose continuation was dropped is computed anew by its retry; the one that
    # could not continue exactly was computed whole from its prompt (in resumed: its whole answer)
    again = sum(len(retried["reference"][k]["choices"][0]["ids"]) for k in ("embeds", VOIDED))
    assert resumed[f"chatcmpl-{RECOMPUTE}"].token_ids == retried["reference"][RECOMPUTE]["choices"][0]["ids"]
    assert retried["generated"] == sum(len(c.token_ids) for c in resumed.values()) + again
    for e in retried["checkpoint"].ledger.data["requests"]:
        cid = e["client_request_id"]
        if cid in (f"chatcmpl-{VOIDED}", f"chatcmpl-{RECOMPUTE}"):
            continue
        m = re.match(r"^(?:(\d+)_)?(?:chatcmpl-(.+)|cmpl-(.+)-0)$", cid)
        assert m is not None, cid
        ref = retried["reference"][m.group(2) or m.group(3)]["choices"][int(m.group(1) or 0)]["ids"]
        assert len(resumed[cid].token_ids) == len(ref) - len(e["output_token_ids"]), cid


def test_a_router_reissue_continues_exactly(retried: dict[str, Any]) -> None:
    for k, r in retried["reissued"].items():
        assert r["attach"] == "reissue", (k, r["attach"])
        want = retried["reference"][k]["choices"][0]["ids"][r["delivered"] :]
        assert r["token_ids"] == want, f"{k}: the re-issued stream diverged"


def test_a_reused_id_with_another_body_or_tenant_is_never_attached(retried: dict[str, Any]) -> None:
    assert retried["other_body"]["attach"] == "new: its body differs from the checkpointed request's"
    assert len(retried["other_body"]["choices"][0]["ids"]) == 8
    assert retried["other_tenant"]["attach"] == "new: another tenant's request id"
    # their engine requests ran under the restored id without its state
    # (the one computed again from its prompt never claims its carried generator state)
    assert retried["connector"]["states_waiting"] == [f"chatcmpl-{RECOMPUTE}"]
    assert 'gpuckpt_continuations_total{event="attached"}' in retried["metrics"]


def test_through_gpuckpt_launch_the_clients_retries_get_their_answers(
    tiny_llama_text: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The user's path: ``gpuckpt launch -- vllm serve``, clients with their own ids, a checkpoint
    mid-decode, SIGKILL, a relaunch with the same worker id and repository: the clients' retries,
    sent as soon as the port answers, wait for the agent's restore and get their whole answers,
    and the status reports the restore."""
    tmp = short_dir("gpr-")
    model = chat_model(tiny_llama_text, tmp_path_factory.mktemp("launch-model"))
    repo = tmp / "repo"
    reqs = {k: v for k, v in kinds(random.Random(9)).items() if k in ("greedy", "twice", "json", "topp", "logprobs")}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_a = tmp / "launch-a.log"
    a = launch(model, tmp / "run-a", repo, port, log_a)
    sock_a = tmp / "run-a" / "w1-connector.sock"
    ref: dict[str, Any] = {}
    try:
        until(lambda: healthy(url) and sock_a.exists(), 240, "the launched worker", a, log_a)
        from agent.engines.retries import token_path
        from agent.engines.vllm.serve import ServeClient

        probe = canary.record(ServeClient(url).generate)
        errors: list[BaseException] = []

        def run(k: str) -> None:
            try:
                ref[k] = call(url, k, reqs[k][0], reqs[k][1])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(k,)) for k in reqs]
        live = sum(n for _, _, n in reqs.values())

        def start() -> None:
            for t in threads:
                t.start()

        session.hold(str(sock_a), live, timeout=300)
        when = {"live": live, "min_outputs": 40}
        r = Repository.open(str(repo))
        # the agent's hook (its daemon passes the same): the logprobs the server gave out
        serving = ServeClient(url, token_file=token_path(str(sock_a)))
        m = session.checkpoint_around(
            str(sock_a), start, r, "w1", canary=probe, when=when, timeout=300, complete_ledger=serving.complete_ledger
        ).manifest
        for t in threads:
            t.join(600)
        assert not errors, errors
    finally:
        kill_all(a, sock_a)
    log_b = tmp / "launch-b.log"
    b = launch(model, tmp / "run-b", repo, port, log_b)
    try:
        until(lambda: healthy(url), 240, "the relaunched worker", b, log_b)
        retries: dict[str, Any] = {}
        errors = []

        def retry(k: str) -> None:
            try:
                retries[k] = call(url, k, reqs[k][0], reqs[k][1])
            except BaseException as exc:
                errors.append(exc)

        rthreads = [threading.Thread(target=retry, args=(k,)) for k in reqs]
        for t in rthreads:
            t.start()
        for t in rthreads:
            t.join(600)
        assert not errors, errors
        api = tmp / "run-b" / "w1.sock"

        def done() -> dict[str, Any] | None:
            st = subprocess.run(
                [*CLI, "status", "--agent", str(api), "--json"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            doc = json.loads(st.stdout) if st.returncode == 0 else None
            rr = (doc or {}).get("restore") or {}
            return doc if (rr.get("resubmission") or {}).get("state") == "done" else None

        status = until(done, 240, "the agent's resubmission", b, log_b)
    finally:
        kill_all(b, tmp / "run-b" / "w1-connector.sock")
    rr = status["restore"]
    assert rr["outcome"] == "warm", rr
    assert rr["checkpoint"] == m.id
    assert sorted(rr["requests"]) == sorted(e["client_request_id"] for e in m.ledger.data["requests"])
    # every request continued, the logprobs one too (its logprobs carried)
    assert not rr.get("left_to_client"), rr["left_to_client"]
    assert not rr.get("inexact"), rr["inexact"]
    for k, want in ref.items():
        got = retries[k]
        assert got["attach"] == "attached", (k, got["attach"])
        for i, c in want["choices"].items():
            assert (got["choices"][i]["ids"], got["choices"][i]["text"]) == (c["ids"], c["text"]), (k, i)
            assert got["choices"][i]["finish"] == c["finish"], (k, i)
            assert (why := same_logprobs(got["choices"][i]["logprobs"], c["logprobs"])) is None, (k, i, why)


@pytest.mark.parametrize("killed", ["launch", "engine core"])
def test_a_sigkill_under_gpuckpt_launch_ends_every_stream_as_an_error_and_leaves_no_worker(
    tiny_llama_text: Path, tmp_path_factory: pytest.TempPathFactory, killed: str
) -> None:
    """``launch`` SIGKILLed (the OOM killer, ``kill -9``), or the worker's engine core (a GPU
    fault, an OOM kill of the engine), with four streams in flight, chat and completions: no
    client gets a finished answer — each call raises (an error event vLLM's shutdown sent through
    gpuckpt's middleware, or the connection the watchdog closed), so each retries — and within
    the watchdog's bound no process of the worker runs."""
    tmp = short_dir("gpk-")
    model = chat_model(tiny_llama_text, tmp_path_factory.mktemp("orphan-model"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "launch.log"
    p = launch(model, tmp / "run", tmp / "repo", port, log)
    sock = tmp / "run" / "w1-connector.sock"
    pgid = None
    long = {"temperature": 0.0, "max_tokens": 900, **NOEOS, "stream": True}
    bodies = {
        "c0": ("chat", {"messages": [{"role": "user", "content": "alpha beta"}], **long}),
        "c1": ("chat", {"messages": [{"role": "user", "content": "gamma fox"}], **long}),
        "p0": ("completions", {"prompt": "quick brown fox", **long}),
        "p1": ("completions", {"prompt": "jumps over", **long}),
    }
    outcome: dict[str, Any] = {}

    def run(k: str) -> None:
        try:
            outcome[k] = call(url, k, *bodies[k])
        except Exception as exc:  # what the client's own code sees, and retries on
            outcome[k] = exc

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in bodies]
    try:
        until(lambda: healthy(url) and sock.exists(), 240, "the launched worker", p, log)
        pgid = os.getpgid(WorkerChannel(str(sock)).ping().pid)
        assert pgid != os.getpgid(p.pid), "the worker runs in a session of its own"
        # the agent's canary probe first, then the clients, held to start together: the engine
        # itself says when every one is decoding, its client's stream open (no poll races them)
        until(lambda: (agent_status(tmp / "run" / "w1.sock") or {}).get("canary"), 240, "the canary", p, log)
        session.hold(str(sock), len(bodies), timeout=300)
        for t in threads:
            t.start()
        session.wait_until(str(sock), live=len(bodies), min_outputs=8, timeout=300)
        if killed == "launch":
            os.kill(p.pid, signal.SIGKILL)  # the supervisor alone: nothing of it runs after this
        else:
            os.kill(WorkerChannel(str(sock)).ping().pid, signal.SIGKILL)  # the connector's process
        p.wait(300)  # launch sees its worker end, and ends with it
        died = time.monotonic()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "a client's stream stayed open"
        for k, got in outcome.items():
            if isinstance(got, Exception):
                continue  # what its client retries
            # a stream that finished before the kill (a busy host) has its whole answer, never less
            (c,) = got["choices"].values()
            assert (c["finish"], len(c["ids"])) == ("length", long["max_tokens"]), f"{k}: a short answer: {got}"
        cut = sum(isinstance(x, Exception) for x in outcome.values())
        print(f"{cut} of {len(bodies)} streams were in flight at the kill")
        gone = _until_gone(pgid, 120)
        # the documented bound (README: watchdog.GRACE_S after launch's death, SIGKILL) plus what a
        # busy CI host takes to end the processes
        assert gone - died < watchdog.GRACE_S + 60, gone - died
    finally:
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
            p.wait()


def test_sigterm_of_launch_with_the_batch_full_checkpoints_at_once_and_every_retry_attaches(
    tiny_llama_text: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A planned stop of a worker whose every sequence slot is taken by a long stream (as many as
    ``--max-num-seqs``): the final checkpoint waits for nothing the queue holds — its canary was
    recorded in the background when the worker came up — and its logged timings account for its
    whole duration; every client's call raises (vLLM's shutdown ends the streams, the middleware
    makes that an error), and each retry to the relaunched worker attaches and equals the same
    engine's uninterrupted answer."""
    tmp = short_dir("gpf-")
    model = chat_model(tiny_llama_text, tmp_path_factory.mktemp("full-model"))
    repo = tmp / "repo"
    slots = 4
    # streams far longer than a stop takes, so that they are in flight at it whatever the host's load
    flags = ("--max-num-seqs", str(slots), "--max-model-len", "2048")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    long = {"temperature": 0.0, "max_tokens": 2000, **NOEOS, "stream": True}
    bodies = {
        f"s{i}": ("chat", {"messages": [{"role": "user", "content": f"alpha {i} beta"}], **long})
        if i % 2
        else ("completions", {"prompt": f"quick {i} brown fox", **long})
        for i in range(slots)
    }
    log_a = tmp / "launch-a.log"
    a = launch(model, tmp / "run-a", repo, port, log_a, flags)
    sock_a = tmp / "run-a" / "w1-connector.sock"
    first: dict[str, Any] = {}

    def run(k: str) -> None:
        try:
            first[k] = call(url, k, *bodies[k])
        except Exception as exc:
            first[k] = exc

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in bodies]
    try:
        until(lambda: healthy(url) and sock_a.exists(), 240, "the launched worker", a, log_a)
        until(lambda: (agent_status(tmp / "run-a" / "w1.sock") or {}).get("canary"), 240, "the canary", a, log_a)
        session.hold(str(sock_a), slots, timeout=300)  # every slot taken at once: a full batch
        for t in threads:
            t.start()
        session.wait_until(str(sock_a), live=slots, min_outputs=8, timeout=300)
        a.send_signal(signal.SIGTERM)  # a planned stop: the final checkpoint, then the worker
        a.wait(300)
        for t in threads:
            t.join(300)
    finally:
        kill_all(a, sock_a)
    saved = [ln for ln in log_a.read_text().splitlines() if "checkpoint saved" in ln and "stop" in ln]
    assert saved, log_a.read_text()[-3000:]
    timings = json.loads(re.search(r"timings=(\{[^}]*\})", saved[-1]).group(1))  # type: ignore[union-attr]
    duration = float(re.search(r"duration_s=([0-9.]+)", saved[-1]).group(1))  # type: ignore[union-attr]
    print(f"the stop checkpoint at a full batch: {duration:.2f} s, {timings}")
    assert timings["canary_s"] < 1.0, timings  # the recorded canary: no probe queued behind the batch
    assert sum(timings.values()) == pytest.approx(duration, abs=0.01)
    _, manifest = Repository.open(str(repo)).latest("w1")
    assert manifest.canary is not None
    assert len(manifest.ledger.data["requests"]) == slots  # type: ignore[union-attr]

    log_b = tmp / "launch-b.log"
    b = launch(model, tmp / "run-b", repo, port, log_b, flags)
    try:
        until(lambda: healthy(url), 240, "the relaunched worker", b, log_b)
        retries = Calls({k: partial(call, url, k, *bodies[k]) for k in bodies})
        retries.start()
        got = retries.join()
        # the same engine's uninterrupted answers: the same requests under new ids, computed whole
        fresh = Calls({k: partial(call, url, f"{k}-fresh", *bodies[k]) for k in bodies})
        fresh.start()
        want = fresh.join()
    finally:
        kill_all(b, tmp / "run-b" / "w1-connector.sock")
    for k in bodies:
        assert got[k]["attach"] == "attached", (k, got[k]["attach"])
        assert got[k]["choices"][0]["ids"] == want[k]["choices"][0]["ids"], k
        assert got[k]["choices"][0]["finish"] == want[k]["choices"][0]["finish"] == "length", k
        # before the stop: a call that returned got the whole answer (its stream finished while the
        # final checkpoint was taken); every other one raised, and its retry above got it whole
        if not isinstance(first[k], Exception):
            assert first[k]["choices"][0]["ids"] == want[k]["choices"][0]["ids"], f"{k}: a short answer"
    cut = sum(isinstance(x, Exception) for x in first.values())
    print(f"{cut} of {slots} streams were in flight at the stop (the rest finished while it checkpointed)")


def _until_gone(pgid: int, timeout: float) -> float:
    """When no process of group ``pgid`` runs any more (``time.monotonic()``)."""
    deadline = time.monotonic() + timeout
    while running_in_group(pgid):
        assert time.monotonic() < deadline, f"the worker's processes outlived launch: {running_in_group(pgid)}"
        time.sleep(0.1)
    return time.monotonic()


def test_a_schema_request_continues_under_the_server_s_default_structured_outputs_settings(
    tiny_llama_text: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same JSON-schema chat request (streamed) and json_object one (not) on servers started
    without ``--structured-outputs-config`` (vLLM's defaults: any whitespace): checkpointed
    mid-decode, the worker SIGKILLed, restored on another; each retry attaches and equals the
    uninterrupted answer (the grammar the restore compiles is the one the original ran under)."""
    tmp = tmp_path_factory.mktemp("vllm-retries-default")
    model = chat_model(tiny_llama_text, tmp)
    repo = Repository.open(str(tmp / "repo"), create=True)
    args = [
        a
        for i, a in enumerate(ARGS)
        if a != "--structured-outputs-config" and ARGS[i - 1] != "--structured-outputs-config"
    ]
    reqs = {k: v for k, v in kinds(random.Random(5)).items() if k in ("json", "jsonobj")}

    def start(name: str, cpu: int, extra: dict[str, Any] | None = None) -> ServeProcess:
        return serve_worker(model, tmp, name, [*args, "--served-model-name", "m"], extra, cpu=cpu)

    with start("a", 0) as a:
        a.wait_ready()
        probe = canary.record(a.client.generate)
        calls = {k: partial(call, a.url, k, endpoint, body) for k, (endpoint, body, _) in reqs.items()}
        m, ref = checkpoint_during(a, calls, repo, live=len(reqs), canary=probe)
        a.kill()
    with start("b", 1, RESTORE_FOLLOWS) as b:
        b.wait_ready()
        plan = session.restore(
            repo, m.id, b.control_socket, staging_dir=str(tmp / "stage-b"), generate=b.client.generate
        )
        resumer = Calls({"resumed": partial(session.resubmit, b.client, plan.requests, worker=b.control_socket)})
        retries = Calls({k: partial(retrying, b.url, k, endpoint, body) for k, (endpoint, body, _) in reqs.items()})
        resumer.start()
        retries.start()
        got, done = retries.join(), resumer.join()["resumed"]
    assert plan.warm, plan.reasons
    assert done.newly_inexact() == {}, done.newly_inexact()
    for e in m.ledger.data["requests"]:
        assert e["structured_outputs"]["settings"]["disable_any_whitespace"] is False, e["structured_outputs"]
    for k, want in ref.items():
        assert got[k]["attach"] == "attached", (k, got[k]["attach"])
        assert got[k]["choices"][0]["ids"] == want["choices"][0]["ids"], k
    # a document where the grammar finished it (any whitespace lets a random model spend its budget)
    if got["json"]["choices"][0]["finish"] == "stop":
        assert len(json.loads(got["json"]["choices"][0]["text"])["words"]) == 30
