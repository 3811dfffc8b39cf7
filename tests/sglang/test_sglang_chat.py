"""Through SGLang's own OpenAI server, as its users run it: a server with the model's tokenizer and
chat template (the other SGLang tests take token ids alone), clients of the ``openai`` client on
the chat endpoint, streamed and not, and on completions, each with its own ``rid``.

Server A answers each call once uninterrupted (the reference), then serves the same calls again,
checkpointed once every one has 12 outputs, and is SIGKILLed as soon as the checkpoint is
committed (a call still running then loses its connection; whether one does is up to the cores'
speed, and nothing below depends on it). Server B restores the checkpoint (warm, canary checked):

- the agent's path (the ledger resubmitted through ``/generate``) continues each request from its
  exact next token: its outputs before the checkpoint and after it are the tokens the same
  engine generates for that prompt uninterrupted (B, its cache flushed);
- each client retries its call (the same body, its ``rid`` its id): gpuckpt's SGLang server (the
  launcher ``gpuckpt launch`` runs: SGLang's own server with gpuckpt's middleware added) serves
  it from the continuation — attached, the reference's text, computed once;
- a call under a reused id with another body is never attached: it is computed anew, with its
  prompt found in the restored prefix cache (``usage.prompt_tokens_details.cached_tokens``,
  ``--enable-cache-report``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import APIError, OpenAI

from agent import session
from agent.engines.retries import ATTACH_HEADER
from agent.testing import SglangProcess
from ckpt import Repository
from tests.harness.models import write_tiny_llama_text
from tests.harness.sglang import GREEDY, Servers, arriving_together

PAGE = 16
N = 90
TOPICS = ("the river and the mill", "a ledger of small debts", "seven ways to fold a map")
#: the clients' calls: name → (endpoint, stream, body); greedy, every budget spent
CALLS: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "chat-stream": (
        "chat",
        True,
        {"messages": [{"role": "system", "content": "Answer at length. " * 6}, {"role": "user", "content": TOPICS[0]}]},
    ),
    "chat": (
        "chat",
        False,
        {"messages": [{"role": "user", "content": f"Tell me about {TOPICS[1]}, with details. " * 3}]},
    ),
    "completion": ("completions", False, {"prompt": f"Notes on {TOPICS[2]}: " * 8}),
}
WHEN = {"live": len(CALLS), "min_outputs": 12}


def ask(url: str, name: str, *, rid: str | None = None, **more: Any) -> dict[str, Any]:
    """One client call as ``CALLS[name]`` says (``more``: other body fields), with the ``openai``
    client: its text, usage and gpuckpt's attach header."""
    endpoint, stream, body = CALLS[name]
    extra = {"ignore_eos": True, "rid": rid or name, **more}
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    kw: dict[str, Any] = {"model": "m", "max_tokens": N, "temperature": 0.0, "extra_body": extra, **body}
    if stream:
        kw |= {"stream": True, "stream_options": {"include_usage": True}}
    text, usage = "", None
    with client:
        raw = (client.chat.completions if endpoint == "chat" else client.completions).with_raw_response.create(**kw)
        attach = raw.headers.get(ATTACH_HEADER)
        got: Any = raw.parse()
        for event in got if stream else [got]:
            usage = event.usage or usage
            for ch in event.choices:
                if endpoint != "chat":
                    text += ch.text or ""
                else:
                    text += (ch.delta.content if stream else ch.message.content) or ""
    assert usage is not None, name
    cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
    return {
        "text": text,
        "completion_tokens": usage.completion_tokens,
        "prompt_tokens": usage.prompt_tokens,
        "cached": cached,
        "attach": attach,
    }


@pytest.fixture(scope="module")
def servers(sglang_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    model = write_tiny_llama_text(tmp_path_factory.mktemp("sglang-chat-model") / "llama", chat=True)
    s = Servers(sglang_python, model, tmp_path_factory.mktemp("sglang-chat-run"), tokenizer=True)
    yield s
    s.close()


def _start(servers: Servers, name: str) -> SglangProcess:
    return servers.start(name, page_size=PAGE, args=["--enable-cache-report"], middleware=True)


@pytest.fixture(scope="module")
def run(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    a = _start(servers, "a")
    reference = {name: ask(a.url, name, rid=f"ref-{name}") for name in CALLS}
    httpx.post(a.url + "/flush_cache", timeout=30).raise_for_status()  # nothing of the references is cached
    repo = Repository.open(str(tmp_path_factory.mktemp("sglang-chat-repo") / "repo"), create=True)
    threads = []

    def client(name: str) -> None:
        with contextlib.suppress(APIError, httpx.HTTPError):  # the server may be killed under it
            ask(a.url, name)

    def start() -> None:
        with arriving_together(a, list(CALLS)):  # all three decoding at once, on a busy host too
            for name in CALLS:
                t = threading.Thread(target=client, args=(name,), name=f"client-{name}")
                t.start()
                threads.append(t)

    # as the agent does: the API facts the server recorded of the captured requests go in the ledger
    taken = session.checkpoint_around(
        a.control_socket,
        start,
        repo,
        "sglang-chat",
        when=WHEN,
        timeout=300,
        generate=a.client.generate,
        complete_ledger=a.client.complete_ledger,
    )
    a.kill()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a client call did not return after the kill"
    b = _start(servers, "b")
    plan = session.restore(repo, taken.manifest.id, b.control_socket, generate=b.client.generate, wait=True)
    resumed = b.client.submit(plan.requests)  # the agent's path
    # read before the retries, which reuse the ids: what the resubmissions loaded
    restored_tokens = session.stats(b.control_socket)["restored_tokens"]
    retries = {name: ask(b.url, name) for name in CALLS}  # each client, again
    # the same id with another body: never attached (computed anew, from the restored prefix)
    other = ask(b.url, "completion", stop=["never-in-the-output"])
    # the same engine's uninterrupted run of each restored request's prompt, from an empty cache
    httpx.post(b.url + "/flush_cache", timeout=30).raise_for_status()
    uninterrupted = {
        r.request_id: b.client.complete(r.token_ids[: r.num_prompt_tokens], {**GREEDY, "max_new_tokens": N}).token_ids
        for r in plan.requests
    }
    b.kill()
    return {
        "reference": reference,
        "manifest": taken.manifest,
        "plan": plan,
        "resumed": resumed,
        "retries": retries,
        "other": other,
        "restored_tokens": restored_tokens,
        "uninterrupted": uninterrupted,
    }


def test_the_checkpoint_holds_every_client_s_request_mid_decode(run: dict[str, Any]) -> None:
    led = {e["rid"]: e for e in run["manifest"].ledger.data["requests"]}
    assert set(led) == set(CALLS), led.keys()
    for name, e in led.items():
        assert 12 <= len(e["output_token_ids"]) < N, (name, len(e["output_token_ids"]))


def test_the_restore_is_warm_and_the_ledger_continues_from_the_exact_next_token(run: dict[str, Any]) -> None:
    plan = run["plan"]
    assert plan.warm, plan.reasons
    assert plan.stats["canary"]["match"]
    assert {r.request_id for r in plan.requests} == set(CALLS)
    for r in plan.requests:
        got = list(r.output_token_ids) + run["resumed"][r.request_id].token_ids
        assert len(got) == N, r.request_id
        assert got == run["uninterrupted"][r.request_id], r.request_id
        assert run["restored_tokens"].get(r.request_id, 0) > 0, run["restored_tokens"]


def test_each_client_s_retry_is_attached_to_its_continuation_and_gets_the_uninterrupted_answer(
    run: dict[str, Any],
) -> None:
    led = {e["rid"]: e for e in run["manifest"].ledger.data["requests"]}
    for name in CALLS:
        # the facts the server recorded of the call, carried by the checkpoint
        api = led[name]["api"]
        assert (api["request_id"], api["endpoint"], api["n"]) == (name, CALLS[name][0], 1), api
        ref, got = run["reference"][name], run["retries"][name]
        assert got["attach"] == "attached", (name, got["attach"])
        assert got["text"] == ref["text"], name
        assert got["completion_tokens"] == ref["completion_tokens"] == N, name
        assert got["prompt_tokens"] == ref["prompt_tokens"], name


def test_a_reused_id_with_another_body_is_computed_anew_from_a_warm_prefix(run: dict[str, Any]) -> None:
    ref, got = run["reference"]["completion"], run["other"]
    assert got["attach"] == "new: its body differs from the checkpointed request's", got["attach"]
    assert got["text"] == ref["text"]  # the stop string never matches: the same greedy answer
    # the prompt's whole pages are cached: restored (the resubmission loaded them) and kept
    assert got["cached"] >= ref["prompt_tokens"] - PAGE, (got, ref)
