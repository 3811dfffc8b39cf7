"""The answer reaches the client: gpuckpt's ASGI middleware for ``vllm serve``.

Loaded by vLLM's own ``--middleware agent.engines.vllm.middleware.GpuckptMiddleware``
(``gpuckpt launch`` and :func:`agent.engines.vllm.serve.serve_command` add it).
It runs in the API server process and does three things, all on the chat and
completions endpoints (``POST /v1/chat/completions``, ``POST /v1/completions``):

1. **Records the API-level facts** of every request the engine will see — the
   endpoint, a digest of the body and one of the ``Authorization`` header (the
   tenant), ``n`` and why its retry could not be served from a continuation
   (``unattachable``: it asked for prompt logprobs, say) — by adding them to the
   body's ``vllm_xargs`` (``gpuckpt_api``). They reach the engine as
   ``SamplingParams.extra_args`` and so the checkpoint's ledger
   (:func:`agent.engines.vllm.ledger.api_facts`): the engine core never sees the
   endpoint or the chat messages, the ledger must.
2. **Keeps the continuations** of a restore. The agent resubmits a restored
   request with ``X-Gpuckpt-Resubmit`` (the ledger entry's id and facts) and
   ``X-Gpuckpt-Token`` (the secret this process wrote beside the connector's
   control socket, readable by the agent's group only). Such a request runs
   in the engine under the ledger's own id (so the connector hands it the
   carried state) and its tokens are kept here, bounded in bytes and time.
3. **Attaches retries.** A client that sends its request again — the same
   ``X-Request-Id``, the same body, the same tenant — is served *from the
   continuation*: vLLM's own handler renders the response (chat or completion
   chunks, streamed or not, every choice, stop strings, tool calls, usage), but
   the engine client hands it the kept tokens — the checkpoint's outputs, then
   the continuation as it is produced — instead of starting the request again.
   A router's re-issue (``X-Gpuckpt-Reissue: 1``, ``/v1/completions`` with the
   prompt + the tokens it already delivered, ``docs/router-contract.md``) is
   served the rest after those tokens, once they are verified against the
   continuation. Anything that does not match — another body under a reused
   id, another tenant, tokens that differ, a request that asked for prompt
   logprobs (not carried) — is served as a new request, and the response
   header ``X-Gpuckpt-Attach`` says why.
4. **Records the logprobs** of every request that asked for them, as they are
   produced (``POST /gpuckpt/v1/logprobs``: the agent takes those of the
   outputs its capture holds into the checkpoint's ledger — the engine core
   never keeps them), and serves an attached retry the checkpoint's logprobs of
   the earlier tokens, then the continuation's own.

**Holding retries for a restore.** A worker started with a restore to follow
(``retry_hold_s`` in ``kv_connector_extra_config``: ``gpuckpt launch`` sets it
when there is a checkpoint) holds requests that carry an ``X-Request-Id``, each
a possible retry, until the agent's ``expect`` says what it resubmits. The
agent renews the hold while its restore runs (``{"hold_s": …}`` on the same
endpoint), so a restore longer than the first hold (a large checkpoint from a
bucket) still lets no retry start a duplicate, and the hold lapses shortly
after an agent that died.

The response header ``X-Gpuckpt-Attach`` is ``attached``, ``reissue`` or
``new: <why>`` on every request the middleware considered. Nothing here can
fail a request: any error of ours is logged and the request goes on as vLLM
would serve it.

How the engine client is reached: vLLM hands middleware the ASGI app only, so
the engine client (``app.state.engine_client``) is wrapped once, at the first
request, by an object that forwards ``generate`` to vLLM's own unless this
request is a resubmission or an attached retry (a context variable set here
says so). Only ``EngineClient.generate``'s public signature is relied on.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from agent.engines.continuations import (
    KEEP_S,
    LOGPROBS_KEEP_S,
    LOGPROBS_MAX_BYTES,
    MAX_BYTES,
    Book,
    Choice,
    Continuation,
    Logprobs,
    Position,
    body_digest,
    encode_position,
    not_attachable,
    tenant_digest,
    valid_positions,
)
from agent.engines.retries import (
    ENDPOINTS,
    EXPECT_PATH,
    REISSUE_HEADER,
    RESUBMIT_HEADER,
    WAIT_S,
    Refuse,
    RetryServer,
    find_retry,
    rewritten,
    write_token,
)
from agent.engines.retries import authentic as _authentic
from agent.engines.retries import expect as _expect
from agent.engines.retries import read_body as _read_body
from agent.engines.retries import send_json as _json
from agent.engines.vllm.ledger import API_XARG, VOID_PARAM

log = logging.getLogger("gpuckpt.middleware")

LOGPROBS_PATH = "/gpuckpt/v1/logprobs"
#: the resubmission body's field with the logprobs of its earlier outputs (the checkpoint's):
#: taken out of the body here, never seen by vLLM
LOGPROBS_FIELD = "gpuckpt_logprobs"
#: how long the agent's ``logprobs`` call waits, at most, for the API server to have streamed the
#: tokens the checkpoint captured (it lags the engine on a busy host)
LOGPROBS_WAIT_S = 10.0

_CTX: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("gpuckpt_call", default=None)


@dataclass
class _Call:
    """What this HTTP request is to the engine-client wrapper (the context variable's value)."""

    kind: str  # "resubmit" | "attach" | "reissue"
    outcome: str | None = None
    cid: str = ""
    api: dict[str, Any] = field(default_factory=dict)
    prompt_len: int = 0
    cont: Continuation | None = None
    choice: Choice | None = None
    offset: int = 0  # reissue: the tokens the router already delivered
    earlier_lps: list[Position] | None = None  # resubmit: the checkpoint's logprobs of the outputs


class _Wrapped:
    """The API server's engine client, with ``generate`` answered from a continuation when the
    current HTTP request (``_CTX``) is an attached retry, and teed into one when it is a resubmission;
    every other attribute is the engine client's."""

    def __init__(self, inner: Any, book: Book, logs: Logprobs | None = None) -> None:
        self._inner, self._book, self._logs = inner, book, logs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kw: Any) -> Any:
        call = _CTX.get()
        real: Callable[..., Any] = self._inner.generate
        if call is None or call.kind == "new":  # "new": the middleware already said why not
            if self._logs is not None and getattr(sampling_params, "logprobs", None) is not None:
                return _never_aborted(self._recorded(real, prompt, sampling_params, request_id, args, kw))
            return _never_aborted(real(prompt, sampling_params, request_id, *args, **kw))
        try:
            ids = _prompt_ids(prompt)
            if call.kind == "resubmit":
                return self._resubmit(call, ids, real, prompt, sampling_params, args, kw)
            why = self._check(call, ids, sampling_params)
        except Exception as exc:
            log.exception("gpuckpt: engine-client wrapper")
            why = f"internal error: {exc}"
        if why is not None:
            call.outcome = f"new: {why}"
            self._book.count("refused")
            return real(prompt, sampling_params, request_id, *args, **kw)
        call.outcome = "reissue" if call.kind == "reissue" else "attached"
        self._book.count(call.outcome)
        return self._replay(call, sampling_params, request_id)

    def _check(self, call: _Call, ids: list[int] | None, sp: Any) -> str | None:
        cont = call.cont
        assert cont is not None
        if ids is None:
            return "its prompt has no token ids"
        if call.kind == "reissue":
            ch = call.choice
            assert ch is not None
            return None if ids == ch.prompt_ids + ch.tokens()[: call.offset] else "its tokens changed meanwhile"
        if int(getattr(sp, "n", 1) or 1) != cont.n or len(cont.choices) != cont.n:
            return f"{cont.n - len(cont.choices)} of its {cont.n} choices finished before the checkpoint"
        if any(c.prompt_ids != ids for c in cont.choices.values()):
            return "its prompt renders to other tokens than the checkpointed request's"
        if getattr(sp, "logprobs", None) is not None and any(c.earlier_lps is None for c in cont.choices.values()):
            return "the logprobs of its tokens before the checkpoint are not carried"
        return None

    async def _recorded(
        self, real: Any, prompt: Any, sp: Any, request_id: str, args: Any, kw: Any
    ) -> AsyncGenerator[Any, None]:
        """A request that asked for logprobs, as vLLM serves it, with the logprobs of its outputs
        recorded as they are produced (a checkpoint carries those of the outputs it captured). A
        request that wants one response at the end gets it, merged here from deltas: only deltas
        show its logprobs while it runs."""
        # late: the agent's process imports this module without vLLM installed
        from vllm.sampling_params import RequestOutputKind

        logs = self._logs
        assert logs is not None
        kind = getattr(sp, "output_kind", RequestOutputKind.DELTA)
        engine_sp = sp
        if kind == RequestOutputKind.FINAL_ONLY:
            engine_sp = sp.clone()
            engine_sp.output_kind = RequestOutputKind.DELTA
        whole = getattr(engine_sp, "output_kind", None) == RequestOutputKind.CUMULATIVE
        seen: dict[int, int] = {}
        logs.start(request_id)
        inner = real(prompt, engine_sp, request_id, *args, **kw)

        async def recorded() -> AsyncGenerator[Any, None]:
            try:
                async for ro in inner:
                    for out in getattr(ro, "outputs", ()) or ():
                        lps = getattr(out, "logprobs", None)
                        if lps is None:
                            continue
                        fresh = list(lps)[seen.get(out.index, 0) :] if whole else list(lps)
                        seen[out.index] = seen.get(out.index, 0) + len(fresh)
                        try:
                            logs.add(request_id, int(out.index), [encode_position(p) for p in fresh])
                        except Exception:  # recording never fails the request
                            log.exception("gpuckpt: recording logprobs of %s", request_id)
                    yield ro
            finally:
                logs.end(request_id)
                await _close(inner)

        async for ro in _as_asked(recorded(), merge=engine_sp is not sp):
            yield ro

    def _resubmit(
        self, call: _Call, ids: list[int] | None, real: Any, prompt: Any, sp: Any, args: Any, kw: Any
    ) -> AsyncGenerator[Any, None]:
        kept = (
            self._book.register(call.cid, call.api, ids, call.prompt_len, call.earlier_lps)
            if ids is not None and call.api
            else None
        )
        cont, ch = kept if kept is not None else (None, None)
        call.outcome = "kept" if kept is not None else "new: not kept (no API facts, or over the bound)"
        engine_sp = sp
        if ch is not None:
            # late: the agent's process imports this module (serve.py, engine.py) without vLLM installed
            from vllm.sampling_params import RequestOutputKind

            if getattr(sp, "output_kind", RequestOutputKind.DELTA) != RequestOutputKind.DELTA:
                # the continuation is kept token by token whatever the agent asked for; the agent
                # gets one response at the end (a resubmission that streams to nobody costs the
                # API server a chunk per token)
                engine_sp = sp.clone()
                engine_sp.output_kind = RequestOutputKind.DELTA
        # under the ledger's own id: the connector hands the carried state to exactly this request
        inner = real(prompt, engine_sp, call.cid, *args, **kw)

        async def tee() -> AsyncGenerator[Any, None]:
            try:
                async for ro in inner:
                    void = (getattr(ro, "kv_transfer_params", None) or {}).get(VOID_PARAM)
                    if void is not None and cont is not None:
                        self._book.void(cont, str(void))  # its last token is never kept nor served
                    elif ch is not None and cont is not None:
                        for out in ro.outputs:
                            ch.new.extend(int(t) for t in out.token_ids)
                            if out.logprobs is not None:
                                ch.new_lps.extend(encode_position(p) for p in out.logprobs)
                            if out.finish_reason is not None:
                                ch.finish_reason, ch.stop_reason, ch.done = out.finish_reason, out.stop_reason, True
                        cont.notify()
                    yield ro
            finally:
                if ch is not None and cont is not None and not ch.done:
                    ch.finish_reason, ch.done = ABORT, True
                if cont is not None:
                    if cont.complete and cont.ended is None:
                        cont.ended = time.monotonic()
                    cont.notify()

        return _as_asked(tee(), merge=engine_sp is not sp)

    async def _replay(self, call: _Call, sp: Any, request_id: str) -> AsyncGenerator[Any, None]:
        """The response's engine outputs, from the continuation: each choice's tokens from
        ``offset`` on, detokenized by vLLM's own incremental detokenizer primed with the prompt
        (stop strings and ``min_tokens`` judged over the whole output, across the checkpoint)."""
        # late: vLLM is there only in the API server's process (see above)
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        def decoded(positions: list[Position]) -> list[dict[int, Logprob]]:
            return [
                {int(t): Logprob(float("-inf") if v is None else float(v), rank, text) for t, v, rank, text in pos}
                for pos in positions
            ]

        cont = call.cont
        assert cont is not None
        chosen = [call.choice] if call.kind == "reissue" and call.choice else list(cont.choices.values())
        tokenizer = self._inner.renderer.tokenizer
        kind = getattr(sp, "output_kind", RequestOutputKind.DELTA)
        delta = kind == RequestOutputKind.DELTA
        state: dict[int, dict[str, Any]] = {}
        for c in chosen:
            assert c is not None
            fake = SimpleNamespace(
                request_id=request_id, prompt_token_ids=c.prompt_ids + c.tokens()[: call.offset], sampling_params=sp
            )
            state[c.index] = {
                "detok": IncrementalDetokenizer.from_new_request(tokenizer, fake),
                "read": call.offset,
                "emitted": 0,
                "finish": None,
                "stop": None,
            }
        prompt_ids = chosen[0].prompt_ids if chosen and chosen[0] else []
        # the checkpoint's logprobs of the earlier outputs, then the continuation's (``_check``)
        with_logprobs = getattr(sp, "logprobs", None) is not None
        stopped_early: list[int] = []
        last: dict[int, Any] = {}  # each choice's latest output (cumulative kinds yield them all)
        while True:
            wake = cont.changed
            if cont.void is not None:
                # what was served so far is the checkpoint's (the uninterrupted run's) own; the rest
                # would not be: the client gets an error it retries, and its retry is served anew
                raise _retryable(f"gpuckpt: the restored continuation was dropped ({cont.void}); retry the request")
            outs = []
            for c in chosen:
                assert c is not None
                st = state[c.index]
                if st["finish"] is not None:
                    continue
                total = c.count()
                fresh = c.since(st["read"])
                at_end = c.done
                if fresh:
                    stop_term = at_end and c.finish_reason == "stop" and not isinstance(c.stop_reason, str)
                    stop_str = st["detok"].update(fresh, stop_term)
                    st["read"] = total
                    if stop_str is not None:
                        st["finish"], st["stop"] = "stop", stop_str
                        if not c.done:
                            stopped_early.append(c.index)
                if st["finish"] is None and at_end and st["read"] >= total:
                    if c.finish_reason == ABORT:  # the continuation was cut (its worker stopping, say)
                        raise _retryable(_ENDED)
                    st["finish"], st["stop"] = c.finish_reason, c.stop_reason
                finished = st["finish"] is not None
                all_ids = st["detok"].output_token_ids
                if delta:
                    ids, text = all_ids[st["emitted"] :], st["detok"].get_next_output_text(finished, True)
                else:
                    ids, text = list(all_ids), st["detok"].get_next_output_text(finished, False)
                if delta and not ids and not text and not finished:
                    continue
                # the logprobs of exactly the tokens given (a re-issue's count from its offset)
                start = call.offset + (st["emitted"] if delta else 0)
                lps = decoded(c.logprobs(start, start + len(ids))) if with_logprobs else None
                st["emitted"] = len(all_ids)
                last[c.index] = CompletionOutput(
                    index=c.index,
                    text=text,
                    token_ids=list(ids),
                    cumulative_logprob=None,
                    logprobs=lps,
                    finish_reason=st["finish"],
                    stop_reason=st["stop"],
                )
                outs.append(last[c.index])
            done = all(s["finish"] is not None for s in state.values())
            if outs and (kind != RequestOutputKind.FINAL_ONLY or done):
                if delta:
                    for o in outs:
                        yield RequestOutput(request_id, None, prompt_ids, None, [o], done and o is outs[-1])
                else:  # cumulative kinds: every choice's whole output so far
                    yield RequestOutput(request_id, None, prompt_ids, None, [last[i] for i in sorted(last)], done)
            if done:
                break
            await wake.wait()
        if stopped_early:
            # a stop string that spans the checkpoint: the uninterrupted run stopped here too
            try:
                await self._inner.abort(cont.engine_ids)
            except Exception:
                log.exception("gpuckpt: aborting a continuation past its stop string")


async def _as_asked(outputs: AsyncGenerator[Any, None], *, merge: bool) -> AsyncGenerator[Any, None]:
    """A request's engine outputs as its caller asked for them: as they come, or — ``merge``: the
    caller wants one response at the end, and the engine was asked for deltas so that gpuckpt
    sees each token — merged into that one response."""
    merged = None
    try:
        async for ro in outputs:
            if not merge:
                yield ro
            elif merged is None:
                merged = ro
            else:
                merged.add(ro, aggregate=True)
        if merged is not None:
            yield merged
    finally:
        await _close(outputs)


async def _close(outputs: Any) -> None:
    """End an engine-output generator at once (vLLM's own handler aborts an unfinished request)."""
    if (aclose := getattr(outputs, "aclose", None)) is not None:
        await aclose()


#: vLLM's finish reason of a request the engine ended before it finished (not an OpenAI one)
ABORT = "abort"
_ENDED = "gpuckpt: the worker ended this request before it finished (it is stopping or restarting); retry the request"


async def _never_aborted(outputs: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    """A request's engine outputs, where an end the engine gave it before it finished — ``abort``:
    the server shutting down (``launch`` killed, SIGTERM, a stop), the engine aborting it — is an
    error the client retries (vLLM renders it as an HTTP 503, or an error event in a stream, on
    which the ``openai`` client raises), never a finish reason that ends a short answer as if it
    were whole. A client that went away itself hears nothing either way."""
    try:
        async for ro in outputs:
            if any(getattr(o, "finish_reason", None) == ABORT for o in getattr(ro, "outputs", ()) or ()):
                raise _retryable(_ENDED)
            yield ro
    finally:
        await _close(outputs)


#: how often the API server's watch looks whether its engine is still there, while requests run
ENGINE_POLL_S = 1.0


def _engine_gone(engine: Any) -> bool:
    """Whether the API server's engine client says its engine is dead or stopped (vLLM's
    ``errored``: the engine core died, or its output handler ended with the server's shutdown)."""
    try:
        return bool(getattr(engine, "errored", False))
    except Exception:
        return False


async def _watch_engine(server: _Server) -> None:
    """While requests run through the middleware, look every :data:`ENGINE_POLL_S` whether the
    engine is gone; if it is, end each of them (its HTTP task is cancelled: the server closes the
    connection, or answers 500 before a response started), so that its client retries at once.
    A dead engine core does not always end the requests waiting on it, and vLLM's server then
    waits for their streams, open and silent, to close — for ever, its clients with it."""
    while True:
        await asyncio.sleep(ENGINE_POLL_S)
        if server.inflight and _engine_gone(server.engine):
            log.error("gpuckpt: the engine is gone: ending %d requests in flight", len(server.inflight))
            for task in list(server.inflight):
                task.cancel()
            server.inflight.clear()


def _retryable(message: str) -> Exception:
    """vLLM's error for a request-level failure a client may retry (HTTP 503; in a stream, an
    error event, on which the ``openai`` client raises)."""
    # late: vLLM is there only in the API server's process (see above)
    from vllm import exceptions

    # a vLLM without it: its generic server error (a 500) is retried as well
    cls = getattr(exceptions, "RetryableRequestError", None) or exceptions.GenerationError
    err: Exception = cls(message)
    return err


def _prompt_ids(prompt: Any) -> list[int] | None:
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, Mapping) else getattr(prompt, "prompt_token_ids", None)
    return [int(t) for t in ids] if ids is not None else None


@dataclass
class _Server(RetryServer):
    """This API server's gpuckpt state: the shared one (book, token, hold), and vLLM's."""

    #: the logprobs streamed to clients of requests in flight, for the agent's checkpoint
    logprobs: Logprobs = field(default_factory=Logprobs)
    #: the engine client (vLLM's, unwrapped), and the HTTP tasks of the requests in flight here
    engine: Any = None
    inflight: set[asyncio.Task[Any]] = field(default_factory=set)
    watch: asyncio.Task[None] | None = None


class GpuckptMiddleware:
    """A pure ASGI middleware (no response buffering: streams pass through as they are)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._server: _Server | None = None

    def _setup(self, fastapi_app: Any) -> _Server:
        """This server's state, made once; the engine client wrapped as soon as it exists."""
        state = fastapi_app.state
        if self._server is None:
            extra = {}
            ktc = getattr(getattr(state, "vllm_config", None), "kv_transfer_config", None)
            if ktc is not None:
                extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
            book = Book(
                max_bytes=int(extra.get("continuations_max_bytes", MAX_BYTES)),
                keep_s=float(extra.get("continuations_keep_s", KEEP_S)),
            )
            hold = float(extra.get("retry_hold_s", 0.0))
            self._server = _Server(
                book,
                _write_token(extra),
                float(extra.get("continuations_wait_s", WAIT_S)),
                hold_until=time.monotonic() + hold if hold > 0 else 0.0,
                logprobs=Logprobs(
                    max_bytes=int(extra.get("logprobs_max_bytes", LOGPROBS_MAX_BYTES)),
                    keep_s=float(extra.get("logprobs_keep_s", LOGPROBS_KEEP_S)),
                ),
            )
        ec = getattr(state, "engine_client", None)
        if ec is not None and not isinstance(ec, _Wrapped):
            self._server.engine = ec
            wrapped = _Wrapped(ec, self._server.book, self._server.logprobs)
            state.engine_client = wrapped
            # the handlers were built with the engine client: hand them the wrapper
            for obj in list(getattr(state, "_state", {}).values()):
                if getattr(obj, "engine_client", None) is ec:
                    obj.engine_client = wrapped
        return self._server

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        endpoint = ENDPOINTS.get(path)
        server = None
        if "app" in scope:
            # at the server's start (lifespan): the token file must exist before the agent looks
            try:
                server = self._setup(scope["app"])
            except Exception:
                log.exception("gpuckpt: middleware set-up")
        ours = (
            scope.get("type") == "http"
            and scope.get("method") == "POST"
            and (endpoint or path in (EXPECT_PATH, LOGPROBS_PATH))
        )
        if server is None or not ours:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if path == EXPECT_PATH:
            return await _expect(server, headers, body, send)
        if path == LOGPROBS_PATH:
            return await _logprobs(server, headers, body, send)
        try:
            call, new_body = await self._decide(server, endpoint or "", headers, body)
        except Refuse as r:
            return await _json(send, r.status, {"error": {"message": r.message, "type": "gpuckpt"}})
        except Exception:
            log.exception("gpuckpt: middleware")
            call, new_body = None, body
        scope, replay, send_with_outcome = rewritten(
            scope, receive, send, body, new_body, lambda: call.outcome if call is not None else None
        )
        tok = _CTX.set(call)
        task = asyncio.current_task()
        if task is not None and server.engine is not None:
            server.inflight.add(task)
            if server.watch is None or server.watch.done():
                server.watch = asyncio.get_running_loop().create_task(_watch_engine(server))
        try:
            await self.app(scope, replay, send_with_outcome)
        finally:
            _CTX.reset(tok)
            server.inflight.discard(task)

    async def _decide(
        self, server: _Server, endpoint: str, headers: dict[str, str], body: bytes
    ) -> tuple[_Call | None, bytes]:
        try:
            doc = json.loads(body)
        except ValueError:
            return None, body  # vLLM answers a malformed body itself
        if not isinstance(doc, dict):
            return None, body
        tenant = tenant_digest(headers.get("authorization"))
        facts = {
            "endpoint": endpoint,
            "body": body_digest(doc),
            "tenant": tenant,
            "n": int(doc.get("n") or 1),
            "unattachable": not_attachable(doc),
        }
        call: _Call | None = None
        if RESUBMIT_HEADER in headers:
            if not _authentic(server, headers):
                raise Refuse(403, "gpuckpt: a resubmission needs this worker's token")
            info = json.loads(headers[RESUBMIT_HEADER])
            api = info.get("api") or {}
            if api:
                # the original request's facts: a retry matches them after another checkpoint too
                api = {**api, "prompt_tokens": int(api.get("prompt_tokens", info.get("prompt_len", 0)))}
            call = _Call("resubmit", cid=str(info["id"]), api=api, prompt_len=int(api.get("prompt_tokens") or 0))
            lps = doc.pop(LOGPROBS_FIELD, None)
            call.earlier_lps = valid_positions(lps, len(lps)) if isinstance(lps, list) else None
            facts = api or facts
        elif REISSUE_HEADER in headers and endpoint == "completions" and (base := headers.get("x-request-id")):
            call = await self._reissue(server, base, tenant, doc)
        elif _authentic(server, headers):
            pass  # the agent's own request (the canary): never held, never attached
        elif base := headers.get("x-request-id"):
            found = await find_retry(server, base, endpoint, tenant, str(facts["body"]), doc)
            if found.kind == "attach":
                call = _Call("attach", cont=found.cont)
            elif found.kind == "new":
                call = _Call("new", outcome=found.outcome)
        xargs = doc.get("vllm_xargs")
        packed = json.dumps(facts, separators=(",", ":"))
        doc["vllm_xargs"] = {**(xargs if isinstance(xargs, dict) else {}), API_XARG: packed}
        return call, json.dumps(doc).encode()

    async def _reissue(self, server: _Server, base: str, tenant: str, doc: dict[str, Any]) -> _Call:
        prompt = doc.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return _Call("new", outcome="new: a re-issue sends its prompt as token ids")
        if why := not_attachable(doc):
            return _Call("new", outcome=f"new: {why}")
        book = server.book
        conts = [c for c in book.find(base) if c.api.get("tenant") == tenant]
        for cont in conts:
            for ch in cont.choices.values():
                if prompt[: len(ch.prompt_ids)] != ch.prompt_ids:
                    continue
                offset = len(prompt) - len(ch.prompt_ids)
                deadline = time.monotonic() + server.wait_s
                while len(ch.tokens()) < offset and not ch.done and time.monotonic() < deadline:
                    wake = cont.changed
                    try:
                        await asyncio.wait_for(wake.wait(), max(0.0, deadline - time.monotonic()))
                    except TimeoutError:
                        break
                if ch.tokens()[:offset] == prompt[len(ch.prompt_ids) :]:
                    return _Call("reissue", cont=cont, choice=ch, offset=offset)
        book.count("refused")
        return _Call("new", outcome="new: no continuation of this id holds these tokens")


async def _logprobs(server: _Server, headers: dict[str, str], body: bytes, send: Any) -> None:
    """``POST /gpuckpt/v1/logprobs`` (the agent, with the token, after a capture):
    ``{"requests": [{"id": ledger client id, "n": choices, "outputs": count}, …]}`` →
    ``{"logprobs": {id: [the first ``count`` positions] | null}}``, waiting (bounded) for the
    tokens this server has yet to stream; ``null``: not recorded (its checkpoint does not carry
    them, and its retry is served anew)."""
    if not _authentic(server, headers):
        return await _json(send, 403, {"error": {"message": "gpuckpt: logprobs needs this worker's token"}})
    try:
        doc = json.loads(body)
        wanted = [(str(r["id"]), int(r.get("n") or 1), int(r["outputs"])) for r in doc["requests"]]
        wait_s = min(float(doc.get("wait_s", LOGPROBS_WAIT_S)), 60.0)
    except (ValueError, KeyError, TypeError) as exc:
        return await _json(send, 400, {"error": {"message": f"gpuckpt: bad logprobs body: {exc}"}})
    await _json(send, 200, {"logprobs": await server.logprobs.wait(wanted, wait_s)})


def _write_token(extra: Mapping[str, Any]) -> str | None:
    return write_token(extra)
