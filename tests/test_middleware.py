"""gpuckpt's ``vllm serve`` middleware without an engine: ids, digests, the book's bounds, and the
ASGI surface (facts recorded in ``vllm_xargs``, resubmissions refused without the token, retries
that do not match never attached). The end-to-end behaviour is ``tests/vllm/test_retries.py``."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.engines.continuations import Book, body_digest, not_attachable, parse_id
from agent.engines.retries import ATTACH_HEADER, RESUBMIT_HEADER, TOKEN_HEADER, token_path
from agent.engines.vllm.ledger import API_XARG, VOID_PARAM, api_facts, resubmitted_id
from agent.engines.vllm.middleware import GpuckptMiddleware

# vLLM's Python classes only: run against every supported vLLM release (make test)
pytestmark = pytest.mark.vllm_classes


def test_ledger_ids_map_to_the_request_id_and_endpoint_a_retry_carries() -> None:
    assert parse_id("chatcmpl-abc", 1) == ("abc", "chat", 0)
    assert parse_id("1_chatcmpl-abc", 2) == ("abc", "chat", 1)
    assert parse_id("1_chatcmpl-abc", 1) is None, "a child prefix only where the request had n > 1"
    assert parse_id("cmpl-a-b-0", 1) == ("a-b", "completions", 0)
    assert parse_id("cmpl-a-1", 1) is None, "a completion's second prompt is not attached"
    assert parse_id("offline-7", 1) is None
    assert resubmitted_id("chatcmpl-x") == "cmpl-chatcmpl-x-0"
    assert resubmitted_id("cmpl-x-0") == "cmpl-x-0"


def test_body_digest_is_canonical_and_what_is_not_carried_is_not_attachable() -> None:
    assert body_digest({"a": 1, "b": [1, 2]}) == body_digest({"b": [1, 2], "a": 1})
    assert body_digest({"a": 1}) != body_digest({"a": 2})
    # a request's own logprobs are carried (the API server records them for the checkpoint) …
    assert not_attachable({"logprobs": 2}) is None
    assert not_attachable({"logprobs": True, "top_logprobs": 3}) is None
    # … its prompt's and an echoed prompt are not
    assert not_attachable({"prompt_logprobs": 1}) is not None
    assert not_attachable({"echo": True}) is not None
    assert not_attachable({"logprobs": False, "temperature": 0}) is None


def test_api_facts_round_trip_through_extra_args() -> None:
    facts = {"endpoint": "chat", "body": "0" * 64, "tenant": "", "n": 1}
    sp = SimpleNamespace(extra_args={API_XARG: json.dumps(facts)})
    assert api_facts(sp) == facts
    assert api_facts(SimpleNamespace(extra_args={API_XARG: "not json"})) is None
    assert api_facts(SimpleNamespace(extra_args=None)) is None


def test_the_book_drops_finished_continuations_by_age_and_bytes_never_running_ones() -> None:
    book = Book(max_bytes=16 * 100, keep_s=0.05)
    api = {"endpoint": "chat", "body": "b", "tenant": "", "n": 1}
    kept = book.register("chatcmpl-a", api, list(range(50)), 10)
    assert kept is not None
    cont, ch = kept
    assert ch.prompt_ids == list(range(10))
    assert ch.earlier == list(range(10, 50))
    # a second one does not fit while the first runs: not kept, counted
    assert book.register("chatcmpl-b", api, list(range(60)), 10) is None
    assert book.counts["not_kept_bytes"] == 1
    cont.ended = time.monotonic() - 1
    assert book.register("chatcmpl-b", api, list(range(60)), 10) is not None
    assert book.get("a", "chat") is None
    assert book.counts["dropped_ttl"] == 1


async def _post(mw: GpuckptMiddleware, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """One POST through the middleware to an app that answers ``{}`` (the engine's handler)."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in {**headers, "content-length": str(len(raw))}.items()],
        "app": SimpleNamespace(state=SimpleNamespace(_state={}, engine_client=None, vllm_config=None)),
    }
    got: dict[str, Any] = {"headers": {}}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            got["status"] = msg["status"]
            got["headers"] = {k.decode(): v.decode() for k, v in msg.get("headers", ())}
        else:
            got["body"] = json.loads(msg["body"])

    await mw(scope, receive, send)
    return got


def _run_app(mw: GpuckptMiddleware, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict, dict]:
    """A chat request through the middleware to an app that records what reaches it."""
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        msg = await receive()
        seen["body"] = json.loads(msg["body"])
        seen["length"] = dict(scope["headers"])[b"content-length"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    mw.app = app
    got = asyncio.run(_post(mw, "/v1/chat/completions", body, headers))
    return got["status"], got, seen


def test_the_middleware_records_the_facts_and_refuses_a_resubmission_without_the_token(tmp_path: Path) -> None:
    mw = GpuckptMiddleware(None)
    status, _, seen = _run_app(mw, {"messages": [], "n": 2}, {"X-Request-Id": "r1", "Authorization": "Bearer k"})
    assert status == 200
    facts = json.loads(seen["body"]["vllm_xargs"][API_XARG])
    assert facts["endpoint"] == "chat"
    assert facts["n"] == 2
    assert facts["body"] == body_digest({"messages": [], "n": 2})
    assert seen["length"] == str(len(json.dumps(seen["body"]).encode())).encode()
    # a forged resubmission: this server has no token (no control socket), so none is accepted
    status, got, _ = _run_app(mw, {"prompt": [1, 2]}, {RESUBMIT_HEADER: json.dumps({"id": "chatcmpl-r1"})})
    assert status == 403
    assert "token" in got["body"]["error"]["message"]
    status, got, _ = _run_app(mw, {"prompt": [1]}, {RESUBMIT_HEADER: "{}", TOKEN_HEADER: "guess"})
    assert status == 403


def test_a_retry_with_another_body_under_a_kept_id_is_served_as_new() -> None:
    mw = GpuckptMiddleware(None)
    _run_app(mw, {"messages": []}, {})
    assert mw._server is not None
    api = {"endpoint": "chat", "body": body_digest({"messages": ["x"]}), "tenant": "", "n": 1}
    mw._server.book.register("chatcmpl-r2", api, [1, 2, 3], 2)
    _, got, _ = _run_app(mw, {"messages": ["y"]}, {"X-Request-Id": "r2"})
    assert got["headers"][ATTACH_HEADER] == "new: its body differs from the checkpointed request's"
    _, got, _ = _run_app(mw, {"messages": ["x"]}, {"X-Request-Id": "r2", "Authorization": "Bearer other"})
    assert got["headers"][ATTACH_HEADER] == "new: another tenant's request id"


def test_the_token_file_is_written_for_the_agent_only(tmp_path: Path) -> None:
    from agent.engines.vllm.middleware import _write_token

    sock = str(tmp_path / "w.sock")
    token = _write_token({"control_socket": sock})
    p = token_path(sock)
    assert p.read_text() == token
    assert p.stat().st_mode & 0o077 == 0


def test_the_agent_renews_the_retry_hold_while_it_restores_and_expect_ends_it() -> None:
    """A restore longer than the worker's first hold (a large checkpoint from a bucket): the
    agent's renewals keep a retry waiting past the first hold's end, so it cannot start a
    duplicate of the continuation about to be resubmitted; the agent's ``expect`` lets it go,
    and after that a renewal holds nothing. Only the agent (the token) renews, and only a hold in
    force."""
    from agent.engines.retries import EXPECT_PATH, MAX_HOLD_S

    async def scenario() -> None:
        mw = GpuckptMiddleware(None)

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await receive()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        mw.app = app
        await _post(mw, "/v1/completions", {"prompt": [1]}, {})  # sets the server up
        server = mw._server
        assert server is not None
        server.token = "t0k"
        agent = {TOKEN_HEADER: "t0k"}
        loop = asyncio.get_running_loop()
        first = time.monotonic() + 2.0  # the first hold, which the restore outlasts
        server.hold_until = first
        retry = loop.create_task(_post(mw, "/v1/chat/completions", {"messages": []}, {"X-Request-Id": "r9"}))
        for _ in range(50):  # the retry reaches its wait (a few steps of the loop; no clock involved)
            await asyncio.sleep(0)
        assert (await _post(mw, EXPECT_PATH, {"hold_s": 5.0}, {}))["status"] == 403
        got = await _post(mw, EXPECT_PATH, {"hold_s": 1e9}, agent)
        assert got["status"] == 200
        assert 0 < got["body"]["held_s"] <= MAX_HOLD_S, "one renewal reaches MAX_HOLD_S at most"
        # a renewal never shortens the hold
        assert (await _post(mw, EXPECT_PATH, {"hold_s": 1.0}, agent))["body"]["held_s"] > 1.0
        await asyncio.sleep(max(0.0, first - time.monotonic()) + 0.3)  # past the first hold's end
        assert not retry.done(), "the renewed hold keeps the retry waiting for the agent's word"
        got = await _post(mw, EXPECT_PATH, {"requests": []}, agent)  # nothing resubmitted: released
        assert got["body"] == {"expected": 0}
        assert (await asyncio.wait_for(retry, 60))["status"] == 200
        # released: a late renewal holds nothing, and the next request goes straight through
        assert (await _post(mw, EXPECT_PATH, {"hold_s": 30.0}, agent))["body"]["held_s"] == 0.0
        done = await asyncio.wait_for(_post(mw, "/v1/chat/completions", {"messages": []}, {"X-Request-Id": "r10"}), 60)
        assert done["status"] == 200
        # a server started with no hold (no restore was to follow) never starts holding on a renewal
        fresh = GpuckptMiddleware(None)
        fresh.app = app
        await _post(fresh, "/v1/completions", {"prompt": [1]}, {})
        assert fresh._server is not None
        fresh._server.token = "t0k"
        assert (await _post(fresh, EXPECT_PATH, {"hold_s": 30.0}, agent))["body"]["held_s"] == 0.0
        assert fresh._server.hold_until == 0.0

    asyncio.run(scenario())


def test_a_voided_continuation_is_never_served_and_its_retries_are_served_anew() -> None:
    """The connector could not apply a restored request's carried state (its grammar rejected the
    earlier outputs): the engine request ends at once with ``VOID_PARAM`` in its
    ``kv_transfer_params``. Its last token is never kept, a retry already attached raises vLLM's
    retryable error (a stream cut the ``openai`` client raises on, or a 503) after the
    checkpoint's own tokens, and a later retry is served anew, saying why."""
    RetryableRequestError = pytest.importorskip("vllm.exceptions").RetryableRequestError
    RequestOutputKind = pytest.importorskip("vllm.sampling_params").RequestOutputKind
    from agent.engines.vllm import middleware as mwmod

    why = "its grammar could not be applied to the earlier outputs (the grammar rejects them)"

    async def scenario() -> tuple[Book, list[Any], BaseException | None, list[Any]]:
        book = Book()
        api = {"endpoint": "chat", "body": body_digest({"messages": ["x"]}), "tenant": "", "n": 1}

        class Engine:
            renderer = SimpleNamespace(tokenizer=None)

            def generate(self, prompt: Any, sp: Any, rid: str, *a: Any, **kw: Any) -> Any:
                async def outs() -> Any:
                    await asyncio.sleep(0.05)  # the attached retry is streaming by now
                    out = SimpleNamespace(token_ids=[99], finish_reason="length", stop_reason=None)
                    yield SimpleNamespace(outputs=[out], kv_transfer_params={VOID_PARAM: why})

                return outs()

        wrapped = mwmod._Wrapped(Engine(), book)
        sp = pytest.importorskip("vllm.sampling_params").SamplingParams(output_kind=RequestOutputKind.DELTA)
        token = mwmod._CTX.set(mwmod._Call("resubmit", cid="chatcmpl-v", api=api, prompt_len=2))
        try:
            gen = wrapped.generate({"prompt_token_ids": [1, 2, 3, 4]}, sp, "chatcmpl-v")
        finally:
            mwmod._CTX.reset(token)
        cont = book.get("v", "chat")
        assert cont is not None
        served: list[Any] = []
        err: BaseException | None = None

        async def attached() -> None:
            nonlocal err
            try:
                async for ro in wrapped._replay(mwmod._Call("attach", cont=cont), sp, "chatcmpl-retry"):
                    served.extend(ro.outputs)
            except RetryableRequestError as exc:
                err = exc

        retry = asyncio.create_task(attached())
        agent_saw = [ro async for ro in gen]
        await retry
        return book, served, err, agent_saw

    book, served, err, agent_saw = asyncio.run(scenario())
    # the checkpoint's own tokens (the uninterrupted run's) were served, nothing of the void run
    assert [t for o in served for t in o.token_ids] == [3, 4]
    assert all(o.finish_reason is None for o in served), "a void continuation never finishes an answer"
    assert isinstance(err, RetryableRequestError)
    assert why in str(err)
    assert book.get("v", "chat") is None
    assert book.left[("v", "chat")] == why
    assert book.counts["voided"] == 1
    assert len(agent_saw) == 1  # the agent's resubmission still gets its (reported) response

    mw = GpuckptMiddleware(None)
    _run_app(mw, {"messages": []}, {})
    assert mw._server is not None
    mw._server.book.left.update(book.left)
    _, got, _ = _run_app(mw, {"messages": ["x"]}, {"X-Request-Id": "v"})
    assert got["headers"][ATTACH_HEADER] == f"new: {why}"


def test_a_request_the_engine_ended_reaches_its_client_as_an_error_it_retries_never_as_an_answer() -> None:
    """vLLM ends every request in flight with ``finish_reason: "abort"`` when its server shuts
    down (``launch`` killed, SIGTERM): the ``openai`` client took that for a finished answer.
    Through the middleware the end is vLLM's retryable error instead (a 503, or an error event in
    a stream), after the tokens the request had; an answer that finishes is untouched, and the
    engine's generator is closed either way."""
    RetryableRequestError = pytest.importorskip("vllm.exceptions").RetryableRequestError
    from agent.engines.vllm import middleware as mwmod

    closed: list[str] = []

    def engine(finish: str) -> Any:
        class Engine:
            def generate(self, prompt: Any, sp: Any, rid: str, *a: Any, **kw: Any) -> Any:
                async def outs() -> Any:
                    try:
                        for i, f in enumerate((None, None, finish)):
                            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[i], finish_reason=f)])
                    finally:
                        closed.append(rid)

                return outs()

        return Engine()

    async def serve(finish: str) -> tuple[list[Any], BaseException | None]:
        wrapped = mwmod._Wrapped(engine(finish), Book())
        got: list[Any] = []
        try:
            async for ro in wrapped.generate({"prompt_token_ids": [1]}, SimpleNamespace(), f"r-{finish}"):
                got.append(ro)
        except RetryableRequestError as exc:
            return got, exc
        return got, None

    got, err = asyncio.run(serve("abort"))
    assert len(got) == 2, "the tokens before the end were served, the end was not"
    assert err is not None
    assert "retry" in str(err)
    got, err = asyncio.run(serve("length"))
    assert err is None
    assert [ro.outputs[0].finish_reason for ro in got] == [None, None, "length"]
    assert closed == ["r-abort", "r-length"]


def test_requests_in_flight_end_when_the_engine_is_gone_never_hang() -> None:
    """A dead engine core does not always end the requests waiting on it, and vLLM's server then
    waits for their silent streams to close, for ever. The middleware watches the engine while
    requests run: once vLLM's engine client says ``errored``, each request in flight is ended
    (its HTTP task cancelled: the connection closes, or a 500 before the response started), so
    its client retries at once; a request on a live engine is left alone."""
    from agent.engines.vllm import middleware as mwmod

    engine = SimpleNamespace(errored=False)
    started = asyncio.Event()

    async def silent_stream(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        started.set()
        await asyncio.Event().wait()  # the engine never answers again

    async def scenario() -> tuple[bool, bool]:
        mw = GpuckptMiddleware(silent_stream)
        state = SimpleNamespace(_state={}, engine_client=engine, vllm_config=None)
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": [(b"content-length", b"2")],
            "app": SimpleNamespace(state=state),
        }

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(msg: dict[str, Any]) -> None:
            pass

        call = asyncio.create_task(mw(scope, receive, send))
        await started.wait()
        await asyncio.sleep(mwmod.ENGINE_POLL_S * 2.5)
        alive_on_a_live_engine = not call.done()
        engine.errored = True
        await asyncio.wait({call}, timeout=mwmod.ENGINE_POLL_S * 30)  # (never cancels it itself)
        ended = call.cancelled()
        if not call.done():
            call.cancel()
        return alive_on_a_live_engine, ended

    alive, ended = asyncio.run(scenario())
    assert alive, "a request on a live engine was ended"
    assert ended, "the request in flight was not ended when the engine went"


def _lp(tid: int, v: float) -> dict[int, Any]:
    """One token's logprobs as vLLM gives them: the sampled token first, then a top one."""
    Logprob = pytest.importorskip("vllm.logprobs").Logprob
    return {tid: Logprob(v, 1, f"t{tid}"), tid + 100: Logprob(float("-inf"), 2, None)}


def test_logprobs_are_recorded_as_served_and_an_attached_retry_gets_them_all() -> None:
    """A request that asked for logprobs and wants one response at the end: the engine is asked for
    deltas (only those show its logprobs while it runs), its client still gets one response, whole;
    the logprobs are recorded, and the agent's ``logprobs`` call gets the first ones its capture
    held (waiting for those the server has yet to stream). A restored continuation kept with the
    checkpoint's logprobs of the earlier tokens serves a retry every token's logprobs, in order;
    one kept without them serves a retry that asks for logprobs anew."""
    vo = pytest.importorskip("vllm.outputs")
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from agent.engines.continuations import Logprobs, encode_position
    from agent.engines.vllm import middleware as mwmod

    asked: list[Any] = []

    class Engine:
        renderer = SimpleNamespace(tokenizer=None)

        def generate(self, prompt: Any, sp: Any, rid: str, *a: Any, **kw: Any) -> Any:
            asked.append(sp.output_kind)

            async def outs() -> Any:
                for i, tid in enumerate((5, 6, 7)):
                    await asyncio.sleep(0.01)
                    out = vo.CompletionOutput(
                        0, "", [tid], None, [_lp(tid, -0.5 * (i + 1))], "length" if i == 2 else None
                    )
                    yield vo.RequestOutput(rid, None, [1, 2], None, [out], i == 2)

            return outs()

    async def scenario() -> tuple[list[Any], Logprobs, Any, Any]:
        logs = Logprobs()
        wrapped = mwmod._Wrapped(Engine(), Book(), logs)
        sp = SamplingParams(logprobs=1, max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
        waiting = asyncio.create_task(logs.wait([("chatcmpl-a", 1, 3), ("chatcmpl-none", 1, 1)], 5.0))
        got = [ro async for ro in wrapped.generate({"prompt_token_ids": [1, 2]}, sp, "chatcmpl-a")]
        return got, logs, await waiting, await logs.wait([("chatcmpl-a", 1, 5)], 0.1)

    got, _, first, short = asyncio.run(scenario())
    assert asked == [RequestOutputKind.DELTA]
    assert len(got) == 1, "one response at the end, as the client asked"
    assert got[0].outputs[0].token_ids == [5, 6, 7]
    assert [list(p) for p in got[0].outputs[0].logprobs] == [[5, 105], [6, 106], [7, 107]]
    assert first["chatcmpl-a"] == [
        [[5, -0.5, 1, "t5"], [105, None, 2, None]],
        [[6, -1.0, 1, "t6"], [106, None, 2, None]],
        [[7, -1.5, 1, "t7"], [107, None, 2, None]],
    ]
    assert first["chatcmpl-none"] is None, "not recorded: its checkpoint carries none"
    assert short["chatcmpl-a"] is None, "a request that ended short of the count never has them"

    # the continuation: 2 earlier tokens (the checkpoint's, with their logprobs), 2 new
    async def replay(with_earlier: bool) -> tuple[list[Any], str | None]:
        book = Book()
        api = {"endpoint": "chat", "body": "b", "tenant": "", "n": 1}
        earlier = [encode_position(_lp(3, -0.1)), encode_position(_lp(4, -0.2))] if with_earlier else None
        kept = book.register("chatcmpl-r", api, [1, 2, 3, 4], 2, earlier)
        assert kept is not None
        cont, ch = kept
        ch.new, ch.new_lps = [5, 6], [encode_position(_lp(5, -0.3)), encode_position(_lp(6, -0.4))]
        ch.finish_reason, ch.done = "length", True
        wrapped = mwmod._Wrapped(Engine(), book, Logprobs())
        sp = SamplingParams(logprobs=1, max_tokens=4, output_kind=RequestOutputKind.DELTA)
        call = mwmod._Call("attach", cont=cont)
        why = wrapped._check(call, [1, 2], sp)
        if why is not None:
            return [], why
        return [o async for ro in wrapped._replay(call, sp, "chatcmpl-retry") for o in ro.outputs], None

    outs, why = asyncio.run(replay(True))
    assert why is None
    assert [t for o in outs for t in o.token_ids] == [3, 4, 5, 6]
    served = [
        (t, pos[t].logprob, pos[t].decoded_token) for o in outs for t, pos in zip(o.token_ids, o.logprobs, strict=True)
    ]
    assert served == [(3, -0.1, "t3"), (4, -0.2, "t4"), (5, -0.3, "t5"), (6, -0.4, "t6")]
    assert all(
        pos[t + 100].logprob == float("-inf") for o in outs for t, pos in zip(o.token_ids, o.logprobs, strict=True)
    )
    _, why = asyncio.run(replay(False))
    assert why == "the logprobs of its tokens before the checkpoint are not carried"


def test_the_checkpoint_carries_logprobs_the_server_gave_and_says_why_not() -> None:
    """``carry_logprobs`` puts each logprobs request's positions in its ledger entry; a request the
    server gave none for (or not one per output, or a server that did not answer) carries none and
    its ``api`` says why, so the agent leaves it to its client. A ledger entry whose logprobs are
    malformed is never served from."""
    from agent.engines.continuations import encode_position
    from agent.engines.vllm.ledger import NO_LOGPROBS, carry_logprobs, make_ledger, resubmissions

    def entry(cid: str, outputs: int, logprobs: int | None = 1) -> dict[str, Any]:
        return {
            "request_id": cid + "-abcdefgh",
            "client_request_id": cid,
            "prompt_token_ids": [1, 2],
            "output_token_ids": list(range(10, 10 + outputs)),
            "num_computed_tokens": 1 + outputs,
            "max_tokens": 10,
            "remaining_max_tokens": 10 - outputs,
            "min_tokens": 0,
            "sampling": {"temperature": 0.0, "logprobs": logprobs},
            "structured_outputs": None,
            "exact": True,
            "inexact_reasons": [],
            "cache_salt": None,
            "lora": None,
            "priority": 0,
            "arrival_time": 0.0,
            "api": {"endpoint": "chat", "body": "b", "tenant": "", "n": 1, "unattachable": None},
        }

    pos = encode_position(_lp(10, -0.25))
    ledger = make_ledger(
        [entry("chatcmpl-a", 2), entry("chatcmpl-b", 2), entry("chatcmpl-c", 1, None)], step=1, block_size=16
    )
    asked: list[Any] = []

    def fetch(reqs: list[dict[str, Any]]) -> dict[str, Any]:
        asked.extend(reqs)
        return {"chatcmpl-a": [pos, pos], "chatcmpl-b": [pos]}  # b: not one per output

    done = carry_logprobs(ledger, fetch)
    assert asked == [{"id": "chatcmpl-a", "n": 1, "outputs": 2}, {"id": "chatcmpl-b", "n": 1, "outputs": 2}]
    by = {e["client_request_id"]: e for e in done.data["requests"]}
    assert by["chatcmpl-a"]["logprobs"] == [pos, pos]
    assert "logprobs" not in by["chatcmpl-b"]
    assert by["chatcmpl-b"]["api"]["unattachable"] == NO_LOGPROBS
    assert by["chatcmpl-c"] == entry("chatcmpl-c", 1, None), "a request without logprobs is untouched"
    subs = {r.request_id: r for r in resubmissions(done)}
    assert subs["chatcmpl-a"].logprobs == [pos, pos]
    assert subs["chatcmpl-b"].api is not None
    assert subs["chatcmpl-b"].api["unattachable"] == NO_LOGPROBS

    def down(reqs: list[dict[str, Any]]) -> dict[str, Any]:
        raise OSError("connection refused")

    by = {e["client_request_id"]: e for e in carry_logprobs(ledger, down).data["requests"]}
    assert "connection refused" in by["chatcmpl-a"]["api"]["unattachable"]
    # a planted or damaged entry: positions that are not what the server gives
    bad = make_ledger([{**entry("chatcmpl-a", 2), "logprobs": [[["x", 1, 1, "t"]], pos]}], step=1, block_size=16)
    (r,) = resubmissions(bad)
    assert r.logprobs is None
    assert r.api is not None
    assert "malformed" in r.api["unattachable"]
