"""The answer reaches the client on SGLang too: gpuckpt's middleware in SGLang's own server.

SGLang's server takes no middleware flag; gpuckpt's launcher (:mod:`.server`, which ``gpuckpt
launch`` runs in place of ``python -m sglang.launch_server``, same arguments) adds this one to
SGLang's FastAPI application before it serves, and wraps its ``TokenizerManager.generate_request``
(:func:`install`) — nothing of SGLang's code is changed. It runs in SGLang's main process, where
the HTTP server and the tokenizer manager live, and does what vLLM's does
(:mod:`agent.engines.vllm.middleware`; the shared part is :mod:`agent.engines.retries`):

1. **Records the API-level facts** of every chat and completions call — the endpoint, digests of
   the body and of the ``Authorization`` header, ``n``, the client's id (``X-Request-Id``, or the
   body's ``rid``) — by the engine request id (``rid``) it runs under: the agent takes them into
   the checkpoint's ledger after each capture (``POST /gpuckpt/v1/requests``), since SGLang's
   scheduler never sees them. A call without a ``rid`` gets one (``gpuckpt-<hex>``).
2. **Keeps the continuations** of a restore: the agent resubmits a ledger entry through
   ``/generate`` under its original ``rid`` with ``X-Gpuckpt-Resubmit`` and the worker's token;
   its tokens are kept (:class:`agent.engines.continuations.Book`), bounded.
3. **Attaches retries**: the same call again — same id, body and tenant — is served from the
   continuation through SGLang's own OpenAI handler (chat or completion chunks, streamed or not):
   the wrapped ``generate_request`` yields what SGLang's would, the checkpoint's outputs then the
   continuation's, detokenized by the server's tokenizer. Anything else is served as new, and
   ``X-Gpuckpt-Attach`` says why.
4. **A worker's end is never an answer**: a call SGLang ends with ``finish_reason`` ``abort``
   (an operator's ``/abort_request``, the server ending it) reaches its client as an error,
   never as a short answer that looks finished. (On SIGTERM SGLang finishes the requests in
   flight before it exits; what ``launch``'s watchdog cuts after its grace is a closed
   connection, an error too.)

What is not carried on SGLang (each retry is served anew, saying so): parallel sampling
(``n > 1``: SGLang gives each sample a fresh id), logprobs, and the requests SGLang's ledger
marks inexact (seeded, penalised, structured, stop strings), which the agent computes again
from their prompt (:meth:`agent.engines.types.Resubmission.from_prompt`) — such a retry attaches
to that recomputation. A server run with ``--tokenizer-worker-num`` > 1 serves its HTTP calls in
worker processes this module does not reach: nothing is recorded or attached there.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.engines.continuations import Book, Choice, Continuation, body_digest, not_attachable, tenant_digest
from agent.engines.retries import (
    ENDPOINTS,
    EXPECT_PATH,
    RESUBMIT_HEADER,
    WAIT_S,
    RetryServer,
    authentic,
    expect,
    find_retry,
    read_body,
    rewritten,
    send_json,
    write_token,
)

log = logging.getLogger("gpuckpt.middleware")

#: the agent's call for the API facts of the requests its capture holds
REQUESTS_PATH = "/gpuckpt/v1/requests"
GENERATE_PATH = "/generate"
#: facts kept of requests (a checkpoint needs those of the requests in flight): at most this many,
#: for at most this long
MAX_FACTS = 65536
FACTS_KEEP_S = 24 * 3600.0

_CTX: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("gpuckpt_sglang_call", default=None)


def key_of(cid: str, api: Mapping[str, Any]) -> tuple[str, str, int] | None:
    """A ledger entry's ``(client id, endpoint, choice)``: SGLang's ids say nothing of the client's,
    the API facts recorded for the request do."""
    base, endpoint = api.get("request_id"), api.get("endpoint")
    if not (isinstance(base, str) and base and endpoint in ("chat", "completions")):
        return None
    return base, str(endpoint), 0


def sglang_unattachable(doc: Mapping[str, Any]) -> str | None:
    """Why a call's retry cannot be served from a continuation on SGLang (``None``: it can)."""
    if int(doc.get("n") or 1) > 1:
        return "parallel sampling is not carried on SGLang (each sample runs under a fresh id)"
    lp = doc.get("logprobs")
    if (lp is not None and lp is not False) or doc.get("top_logprobs"):
        return "logprobs are not carried on SGLang"
    return not_attachable(doc)


@dataclass
class _Call:
    kind: str  # "resubmit" | "attach" | "serve" (a client's call SGLang serves itself)
    rid: str = ""
    api: dict[str, Any] = field(default_factory=dict)
    prompt_len: int = 0
    cont: Continuation | None = None


@dataclass
class _Server(RetryServer):
    #: API facts by rid, oldest first (``time.monotonic()`` when recorded, facts)
    facts: OrderedDict[str, tuple[float, dict[str, Any]]] = field(default_factory=OrderedDict)
    incremental: bool = False

    def record(self, rid: str, facts: dict[str, Any]) -> None:
        now = time.monotonic()
        self.facts[rid] = (now, facts)
        self.facts.move_to_end(rid)
        while self.facts and (len(self.facts) > MAX_FACTS or next(iter(self.facts.values()))[0] < now - FACTS_KEEP_S):
            self.facts.popitem(last=False)


_SERVERS: list[_Server] = []


class GpuckptSglangMiddleware:
    """A pure ASGI middleware (streams pass through as they are); ``extra``: the linker's extra
    config (the control socket beside which the worker's token is written, the shared group,
    ``retry_hold_s``, ``continuations_*`` bounds)."""

    def __init__(self, app: Any, extra: Mapping[str, Any] | None = None, incremental: bool = False) -> None:
        self.app = app
        extra = dict(extra or {})
        hold = float(extra.get("retry_hold_s", 0.0))
        self.server = _Server(
            Book(
                max_bytes=int(extra.get("continuations_max_bytes", 256 << 20)),
                keep_s=float(extra.get("continuations_keep_s", 600.0)),
                key_of=key_of,
            ),
            write_token(extra),
            float(extra.get("continuations_wait_s", WAIT_S)),
            hold_until=time.monotonic() + hold if hold > 0 else 0.0,
            incremental=incremental,
        )
        _SERVERS[:] = [self.server]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        endpoint = ENDPOINTS.get(path)
        ours = scope.get("type") == "http" and scope.get("method") == "POST"
        if not ours or not (endpoint or path in (EXPECT_PATH, REQUESTS_PATH, GENERATE_PATH)):
            await self.app(scope, receive, send)
            return
        server = self.server
        body = await read_body(receive)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if path == EXPECT_PATH:
            return await expect(server, headers, body, send)
        if path == REQUESTS_PATH:
            return await _requests(server, headers, body, send)
        call: _Call | None = None
        outcome: str | None = None
        new_body = body
        try:
            if path == GENERATE_PATH:
                if RESUBMIT_HEADER in headers:
                    if not authentic(server, headers):
                        return await send_json(
                            send, 403, {"error": {"message": "gpuckpt: a resubmission needs this worker's token"}}
                        )
                    info = json.loads(headers[RESUBMIT_HEADER])
                    api = dict(info.get("api") or {})
                    call = _Call("resubmit", rid=str(info["id"]), api=api, prompt_len=int(info.get("prompt_len") or 0))
                    outcome = "kept" if api else "new: not kept (no API facts)"
            else:
                call, outcome, new_body = await self._decide(server, endpoint or "", headers, body)
        except Exception:
            log.exception("gpuckpt: middleware")
            call, outcome, new_body = None, None, body
        said = outcome if endpoint else None
        scope, replay, send_with_outcome = rewritten(scope, receive, send, body, new_body, lambda: said)
        tok = _CTX.set(call)
        try:
            await self.app(scope, replay, send_with_outcome)
        finally:
            _CTX.reset(tok)

    async def _decide(
        self, server: _Server, endpoint: str, headers: dict[str, str], body: bytes
    ) -> tuple[_Call | None, str | None, bytes]:
        try:
            doc = json.loads(body)
        except ValueError:
            return None, None, body  # SGLang answers a malformed body itself
        if not isinstance(doc, dict) or authentic(server, headers):
            return None, None, body  # the agent's own call: never held, never attached
        tenant = tenant_digest(headers.get("authorization"))
        given = doc.get("rid")
        base = headers.get("x-request-id") or (given if isinstance(given, str) else None)
        facts = {
            "endpoint": endpoint,
            "body": body_digest(doc),
            "tenant": tenant,
            "n": int(doc.get("n") or 1),
            "unattachable": sglang_unattachable(doc),
            "request_id": base,
        }
        call, outcome = None, None
        if base:
            found = await find_retry(server, base, endpoint, tenant, str(facts["body"]), doc)
            why = sglang_unattachable(doc)
            if found.kind == "attach" and why is None:
                call, outcome = _Call("attach", cont=found.cont), "attached"
                server.book.count("attached")
            elif found.kind == "attach":
                outcome = f"new: {why}"
                server.book.count("refused")
            elif found.kind == "new":
                outcome = found.outcome
        if call is None:
            call = _Call("serve")  # served by SGLang itself: an end it did not ask for is an error
        if int(doc.get("n") or 1) > 1 or (given is not None and not isinstance(given, str)):
            return call, outcome, body  # SGLang names each sample itself
        rid = given if isinstance(given, str) else f"gpuckpt-{uuid.uuid4().hex}"
        running = server.book.get(base, endpoint) if base and call.kind == "serve" else None
        if running is not None and not running.complete:
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"  # its continuation runs under the same rid
        doc["rid"] = rid
        call.rid = rid
        server.record(rid, facts)
        return call, outcome, json.dumps(doc).encode()


async def _requests(server: _Server, headers: dict[str, str], body: bytes, send: Any) -> None:
    """``POST /gpuckpt/v1/requests`` (the agent, with the token, after a capture):
    ``{"rids": [...]}`` → ``{"api": {rid: facts | null}}``."""
    if not authentic(server, headers):
        return await send_json(send, 403, {"error": {"message": "gpuckpt: requests needs this worker's token"}})
    try:
        rids = [str(r) for r in json.loads(body)["rids"]]
    except (ValueError, KeyError, TypeError) as exc:
        return await send_json(send, 400, {"error": {"message": f"gpuckpt: bad requests body: {exc}"}})
    got = {rid: (server.facts[rid][1] if rid in server.facts else None) for rid in rids}
    await send_json(send, 200, {"api": got})


def install(http_server: Any, extra: Mapping[str, Any], *, incremental: bool = False) -> None:
    """Add the middleware to SGLang's application (``http_server``: the module
    ``sglang.srt.entrypoints.http_server``) and wrap its tokenizer manager's ``generate_request``;
    before the server starts (Starlette refuses middleware after)."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    http_server.app.add_middleware(GpuckptSglangMiddleware, extra=dict(extra), incremental=incremental)
    real = TokenizerManager.generate_request
    if getattr(real, "__gpuckpt__", False):
        return

    def generate_request(self: Any, obj: Any, request: Any = None) -> AsyncGenerator[Any, None]:
        call = _CTX.get()
        if call is not None and _SERVERS:
            _CTX.set(None)  # this call only: whatever it starts is SGLang's own
            if call.kind == "resubmit":
                return _resubmitted(_SERVERS[0], call, real(self, obj, request), obj)
            if call.kind == "attach":
                return _attached(_SERVERS[0], call, self, obj)
            if call.kind == "serve":
                return _never_aborted(real(self, obj, request))
        return real(self, obj, request)  # type: ignore[no-any-return]

    generate_request.__gpuckpt__ = True  # type: ignore[attr-defined]
    TokenizerManager.generate_request = generate_request


#: what a client is told of a request the worker ended before it finished
ENDED = "gpuckpt: the worker ended this request before it finished (it is stopping or restarting); retry the request"


def _aborted(item: Any) -> bool:
    items = item if isinstance(item, list) else [item]
    for it in items:
        fin = (it.get("meta_info") or {}).get("finish_reason") if isinstance(it, Mapping) else None
        if isinstance(fin, Mapping) and fin.get("type") == "abort":
            return True
    return False


async def _never_aborted(inner: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    """A client's call as SGLang serves it, where an end the worker gave it before it finished —
    ``finish_reason`` ``abort`` (an operator's ``/abort_request``, the server ending it) — is an
    error the client sees (SGLang's handlers answer it as an error, in the stream or as the
    response), never a finish reason that ends a short answer as if it were whole. A client that
    went away itself hears nothing either way."""
    async for item in inner:
        if _aborted(item):
            raise ValueError(ENDED)
        yield item


def _ids(obj: Any) -> list[int] | None:
    ids = getattr(obj, "input_ids", None)
    return [int(t) for t in ids] if isinstance(ids, list) and all(isinstance(t, int) for t in ids) else None


def _resubmitted(server: _Server, call: _Call, inner: AsyncGenerator[Any, None], obj: Any) -> AsyncGenerator[Any, None]:
    """The agent's resubmission, as SGLang serves it, its tokens kept for the client's retry; the
    engine streams it (the continuation is kept token by token) whatever the agent asked."""
    ids = _ids(obj)
    kept = server.book.register(call.rid, call.api, ids, call.prompt_len) if ids is not None and call.api else None
    stream = bool(getattr(obj, "stream", False))
    if kept is not None:
        obj.stream = True

    async def tee() -> AsyncGenerator[Any, None]:
        cont, ch = kept if kept is not None else (None, None)
        last: Any = None
        try:
            async for item in inner:
                if ch is not None and isinstance(item, dict):
                    _take(ch, item, server.incremental)
                    assert cont is not None
                    cont.notify()
                if stream or kept is None:
                    yield item
                else:
                    last = item
                    if ch is not None and ch.done:
                        break
            if last is not None:
                # one response at the end, as asked: the whole continuation
                assert ch is not None
                yield {**last, "output_ids": list(ch.new), "text": last.get("text")}
        finally:
            if ch is not None and cont is not None:
                if not ch.done:
                    ch.finish_reason, ch.done = "abort", True
                if cont.complete and cont.ended is None:
                    cont.ended = time.monotonic()
                cont.notify()

    return tee()


def _take(ch: Choice, item: Mapping[str, Any], incremental: bool) -> None:
    """Fold one of SGLang's outputs (cumulative, or a delta with ``--incremental-streaming-output``)
    into the kept choice."""
    meta = item.get("meta_info") or {}
    ch.meta = dict(meta)
    got = [int(t) for t in item.get("output_ids") or ()]
    total = int(meta.get("completion_tokens") or 0)
    if incremental and len(got) != total:
        ch.new.extend(got)
    else:
        ch.new[:] = got
    fin = meta.get("finish_reason")
    if isinstance(fin, Mapping):
        ch.finish_reason, ch.stop_reason, ch.done = str(fin.get("type")), dict(fin), True


async def _attached(server: _Server, call: _Call, tm: Any, obj: Any) -> AsyncGenerator[Any, None]:
    """A retry served from the continuation in SGLang's own output form (what
    ``generate_request`` yields to the OpenAI handlers): the whole output so far — text and ids,
    cumulative, or deltas where the server streams incrementally — and, at the end, SGLang's
    finish reason. One output at the end for a call that does not stream."""
    cont = call.cont
    assert cont is not None
    ch = cont.choices.get(0)
    if ch is None:
        raise ValueError("gpuckpt: the continuation has no choice to serve; retry the request")
    stream = bool(getattr(obj, "stream", False))
    sp = getattr(obj, "sampling_params", None) or {}
    skip = bool(sp.get("skip_special_tokens", True)) if isinstance(sp, Mapping) else True
    rid = call.rid or f"gpuckpt-{uuid.uuid4().hex}"
    sent_ids, sent_text = 0, ""
    while True:
        wake = cont.changed
        ids = ch.tokens()
        done = ch.done
        if done and ch.finish_reason == "abort":
            raise ValueError(ENDED)
        text = _text(tm, ch, ids, skip, done)
        if (stream and (len(ids) > sent_ids or done)) or (not stream and done):
            if server.incremental and stream:
                out_ids, out_text = ids[sent_ids:], text[len(sent_text) :]
            else:
                out_ids, out_text = list(ids), text
            meta = {
                # the engine's own facts (weight version, …; SGLang's handlers read them), then ours
                "weight_version": getattr(getattr(tm, "server_args", None), "weight_version", "default"),
                **{k: v for k, v in ch.meta.items() if k not in _PER_CALL},
                "id": rid,
                "finish_reason": ch.stop_reason if done else None,
                "prompt_tokens": len(ch.prompt_ids),
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "reasoning_tokens": 0,
            }
            sent_ids, sent_text = len(ids), text
            yield {"text": out_text, "output_ids": out_ids, "meta_info": meta}
        if done:
            return
        await wake.wait()


#: SGLang's meta_info keys of one call, not repeated to another
_PER_CALL = frozenset({"e2e_latency", "response_sent_to_client_ts", "output_token_logprobs", "input_token_logprobs"})


def _text(tm: Any, ch: Choice, ids: list[int], skip: bool, done: bool) -> str:
    """The output's text, as SGLang's detokenizer gives it: the tokens decoded whole, a matched stop
    string trimmed at the end; before the end without a trailing partial character (held back, as
    SGLang's incremental detokenizer does)."""
    tokenizer = getattr(tm, "tokenizer", None)
    if tokenizer is None:
        return ""
    text = str(tokenizer.decode(ids, skip_special_tokens=skip))
    fin = ch.stop_reason if isinstance(ch.stop_reason, Mapping) else {}
    matched = fin.get("matched") if done else None
    if isinstance(matched, str) and matched and (at := text.rfind(matched)) >= 0:
        text = text[:at]
    if not done:
        text = text.rstrip("\ufffd")
    return text
