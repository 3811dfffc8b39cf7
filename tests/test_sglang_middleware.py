"""gpuckpt's middleware in SGLang's server, without SGLang: the facts it records by rid, the rids it
gives, a resubmission kept and a retry served in SGLang's own output form, and the ledger's API
facts. The end-to-end behaviour is ``tests/sglang/test_sglang_chat.py``."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from agent.engines.continuations import body_digest
from agent.engines.retries import ATTACH_HEADER
from agent.engines.sglang import middleware as mw
from agent.engines.sglang.ledger import carry_api, resubmissions, valid_api
from ckpt import Ledger


async def _post(m: mw.GpuckptSglangMiddleware, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
    """One POST through the middleware to an app that records the body and the call it saw."""
    raw = json.dumps(body).encode()
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        msg = await receive()
        seen["body"] = json.loads(msg["body"])
        seen["call"] = mw._CTX.get()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    m.app = app
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in {**headers, "content-length": str(len(raw))}.items()],
    }
    got: dict[str, Any] = {}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            got["status"] = msg["status"]
            got["headers"] = {k.decode(): v.decode() for k, v in msg.get("headers", ())}

    await m(scope, receive, send)
    return got, seen


def test_calls_get_rids_and_their_facts_are_recorded_and_a_retry_attaches() -> None:
    m = mw.GpuckptSglangMiddleware(None, extra={})

    async def scenario() -> tuple[Any, ...]:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        _, seen = await _post(m, "/v1/chat/completions", body, {"X-Request-Id": "r1", "Authorization": "Bearer k"})
        rid = seen["body"]["rid"]
        # the client's own rid is kept, and is its id where no X-Request-Id is given
        _, own = await _post(m, "/v1/completions", {"prompt": "x", "rid": "mine"}, {})
        # n > 1: SGLang names each sample itself; nothing to give
        _, many = await _post(m, "/v1/completions", {"prompt": "x", "n": 2}, {"X-Request-Id": "r2"})
        # a continuation of r1 kept (the agent's resubmission): the same call again attaches; another
        # body or tenant does not
        api = m.server.facts[rid][1]
        m.server.book.register(rid, api, [1, 2, 3, 4], 2)
        got, again = await _post(m, "/v1/chat/completions", body, {"X-Request-Id": "r1", "Authorization": "Bearer k"})
        other, _ = await _post(
            m, "/v1/chat/completions", {**body, "max_tokens": 9}, {"X-Request-Id": "r1", "Authorization": "Bearer k"}
        )
        stranger, _ = await _post(m, "/v1/chat/completions", body, {"X-Request-Id": "r1", "Authorization": "Bearer z"})
        return rid, own, many, api, got, again, other, stranger

    rid, own, many, api, got, again, other, stranger = asyncio.run(scenario())
    assert rid.startswith("gpuckpt-")
    assert api["request_id"] == "r1"
    assert api["endpoint"] == "chat"
    assert api["body"] == body_digest({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert own["body"]["rid"] == "mine"
    assert m.server.facts["mine"][1]["request_id"] == "mine"
    assert "rid" not in many["body"]
    assert got["headers"][ATTACH_HEADER] == "attached"
    assert again["call"].kind == "attach"
    assert other["headers"][ATTACH_HEADER] == "new: its body differs from the checkpointed request's"
    assert stranger["headers"][ATTACH_HEADER] == "new: another tenant's request id"


def test_a_resubmission_is_kept_and_a_retry_is_served_in_sglang_s_own_output_form() -> None:
    """The agent's resubmission (one response at the end) is streamed by the engine and kept token
    by token; a streamed retry gets SGLang's cumulative outputs — text decoded by the server's
    tokenizer, a trailing partial character held back, SGLang's finish reason at the end — and a
    call that does not stream gets one output at the end."""
    m = mw.GpuckptSglangMiddleware(None, extra={})
    api = {"endpoint": "completions", "body": "b", "tenant": "", "n": 1, "request_id": "r", "unattachable": None}
    fin = {"type": "length", "length": 4}

    async def engine() -> Any:
        for i in range(2):
            await asyncio.sleep(0.01)
            done = i == 1
            yield {
                "text": "",
                "output_ids": [3, 4][: i + 1],
                "meta_info": {"completion_tokens": i + 1, "finish_reason": fin if done else None},
            }

    tm = SimpleNamespace(
        tokenizer=SimpleNamespace(
            decode=lambda ids, skip_special_tokens=True: (
                "".join(f"<{t}>" for t in ids) + ("\ufffd" if len(ids) == 3 else "")
            )
        )
    )

    async def scenario() -> tuple[list[Any], list[Any], list[Any]]:
        obj = SimpleNamespace(input_ids=[1, 2, 9, 8], stream=False, sampling_params={})
        gen = mw._resubmitted(m.server, mw._Call("resubmit", rid="rid-1", api=api, prompt_len=2), engine(), obj)
        assert obj.stream is True, "the engine streams it: the continuation is kept token by token"
        cont = m.server.book.get("r", "completions")
        assert cont is not None
        streamed = mw._attached(
            m.server, mw._Call("attach", rid="retry-1", cont=cont), tm, SimpleNamespace(stream=True, sampling_params={})
        )
        whole = mw._attached(
            m.server,
            mw._Call("attach", rid="retry-2", cont=cont),
            tm,
            SimpleNamespace(stream=False, sampling_params={}),
        )
        t1 = asyncio.create_task(_all(streamed))
        t2 = asyncio.create_task(_all(whole))
        agent = await _all(gen)
        return agent, await t1, await t2

    agent, streamed, whole = asyncio.run(scenario())
    assert len(agent) == 1, "the agent asked for one response"
    assert agent[0]["output_ids"] == [3, 4]
    assert streamed[-1]["output_ids"] == [9, 8, 3, 4], "the checkpoint's outputs, then the continuation's"
    assert streamed[-1]["text"] == "<9><8><3><4>"
    assert streamed[-1]["meta_info"]["finish_reason"] == fin
    assert streamed[-1]["meta_info"]["completion_tokens"] == 4
    assert all(s["meta_info"]["finish_reason"] is None for s in streamed[:-1])
    assert all("\ufffd" not in s["text"] for s in streamed), "a partial character is held back"
    assert all(s["meta_info"]["id"] == "retry-1" for s in streamed)
    assert [w["output_ids"] for w in whole] == [[9, 8, 3, 4]]


async def _all(gen: Any) -> list[Any]:
    return [x async for x in gen]


def _ledger(**entry: Any) -> Ledger:
    e = {
        "rid": "a",
        "prompt_token_ids": [1, 2],
        "output_token_ids": [3],
        "kv_tokens": 2,
        "sampling": {"temperature": 0.0, "max_new_tokens": 5},
        "priority": None,
        "extra_key": None,
        "cache_salt": None,
        "return_logprob": False,
        "inexact_reasons": [],
        **entry,
    }
    return Ledger.model_validate(
        {"schema": "gpuckpt-sglang-ledger", "version": 1, "data": {"page_size": 16, "requests": [e]}}
    )


def test_the_checkpoint_carries_each_request_s_api_facts_and_refuses_malformed_ones() -> None:
    facts = {"endpoint": "chat", "body": "b" * 64, "tenant": "", "n": 1, "request_id": "r", "unattachable": None}
    done = carry_api(_ledger(), lambda rids: {"a": facts})
    (r,) = resubmissions(done)
    assert r.api == facts
    # a server that does not answer: the checkpoint goes on, no retry of it attaches
    same = carry_api(_ledger(), lambda rids: (_ for _ in ()).throw(OSError("refused")))
    assert resubmissions(same)[0].api is None
    # planted or damaged facts are never matched to anyone's retry
    assert valid_api({**facts, "n": "1"}) is None
    assert resubmissions(_ledger(api={"endpoint": "chat"}))[0].api is None
    assert mw.key_of("a", facts) == ("r", "chat", 0)
    assert mw.key_of("a", {**facts, "request_id": None}) is None


def test_an_end_the_worker_gave_a_call_reaches_its_client_as_an_error_never_as_an_answer() -> None:
    """SGLang ends a request it aborts (an operator's ``/abort_request``, the server ending it)
    with ``finish_reason`` ``abort`` in a 200: through the middleware the client's call gets an
    error instead (SGLang's handler answers the ``ValueError`` as an error), after what it had;
    an answer that finishes is untouched."""

    async def engine(fin: dict[str, Any]) -> Any:
        yield {"text": "a", "output_ids": [1], "meta_info": {"finish_reason": None}}
        yield {"text": "ab", "output_ids": [1, 2], "meta_info": {"finish_reason": fin}}

    async def serve(fin: dict[str, Any]) -> tuple[list[Any], BaseException | None]:
        got: list[Any] = []
        try:
            async for item in mw._never_aborted(engine(fin)):
                got.append(item)
        except ValueError as exc:
            return got, exc
        return got, None

    got, err = asyncio.run(serve({"type": "abort", "message": "Aborted"}))
    assert len(got) == 1
    assert err is not None
    assert "retry" in str(err)
    got, err = asyncio.run(serve({"type": "length", "length": 2}))
    assert err is None
    assert len(got) == 2
