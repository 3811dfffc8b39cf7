"""What gpuckpt's API-server middleware does alike on every engine: the agent's endpoints and
token, the hold of possible retries while a restore runs, and the decision whether a client's
call is a retry of a kept continuation (:class:`agent.engines.continuations.Book`).

vLLM's middleware (:mod:`agent.engines.vllm.middleware`, loaded by ``vllm serve``'s own
``--middleware``) and SGLang's (:mod:`agent.engines.sglang.middleware`, added to SGLang's server
by gpuckpt's launcher) each serve a retry through their engine's own handler; what a retry is,
who may resubmit, and what the agent's ``expect`` does are here, once. No engine import.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.engines.continuations import Book, Continuation, not_attachable

log = logging.getLogger("gpuckpt.middleware")

#: the endpoints whose calls may be retries (path → endpoint name)
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
EXPECT_PATH = "/gpuckpt/v1/expect"
RESUBMIT_HEADER = "x-gpuckpt-resubmit"
TOKEN_HEADER = "x-gpuckpt-token"  # noqa: S105 - a header name
REISSUE_HEADER = "x-gpuckpt-reissue"
ATTACH_HEADER = "x-gpuckpt-attach"
#: the file beside the control socket that holds this worker's resubmission token
TOKEN_SUFFIX = ".api-token"  # noqa: S105 - a file name

#: how long a retry waits for the continuation it expects (the agent's ``expect``), or a router's
#: re-issue for the continuation to reach the tokens it delivered
WAIT_S = 60.0

#: the longest one renewal of the retry hold may reach (the agent renews a short lease while it
#: restores; ``POST /gpuckpt/v1/expect`` with ``{"hold_s": …}``)
MAX_HOLD_S = 600.0


@dataclass
class RetryServer:
    """One API server's gpuckpt state: the book, the token, the settings."""

    book: Book
    token: str | None
    wait_s: float
    #: a restore will follow this start: requests that may be retries wait for the agent's ``expect``
    #: (which releases them) until this ``time.monotonic()``
    hold_until: float = 0.0
    released: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class Retry:
    """What a client's call is to the book: ``attach`` (``cont``), ``new`` (``outcome`` says why:
    the response header's value) or nothing of ours (``None`` kind: no id, nothing kept)."""

    kind: str | None
    cont: Continuation | None = None
    outcome: str | None = None


async def find_retry(
    server: RetryServer, base: str, endpoint: str, tenant: str, body: str, doc: Mapping[str, Any]
) -> Retry:
    """Whether a client's call (``base``: its ``X-Request-Id``; ``tenant`` and ``body``: digests)
    is a retry of a kept continuation. While a restore is to say what it resubmits the call waits
    (the hold), and a retry of a request the agent is about to resubmit waits (bounded) for it: a
    retry must never start a duplicate. Another tenant's or another body under the id, or a
    request whose response needs what is not carried, is served anew, saying why."""
    # the hold may be renewed while this request waits (a long restore), so it is read again
    while not server.released.is_set() and (left := server.hold_until - time.monotonic()) > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.released.wait(), left)
    book = server.book
    key = (base, endpoint)
    cont = book.get(base, endpoint)
    out = Retry(None)
    if cont is None and key in book.left:
        out = Retry("new", outcome=f"new: {book.left[key]}")
    if (cont is None or len(cont.choices) < cont.n) and key in book.expected:
        cont = await wait_for(book, key, server.wait_s)
    if cont is None:
        return out
    why = not_attachable(doc)
    if cont.api.get("tenant") != tenant:
        why = "another tenant's request id"
    elif cont.api.get("body") != body:
        why = "its body differs from the checkpointed request's"
    if why is None:
        return Retry("attach", cont=cont)
    book.count("refused")
    return Retry("new", outcome=f"new: {why}")


class Refuse(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def authentic(server: RetryServer, headers: Mapping[str, str]) -> bool:
    """The request carries this worker's token: it is the agent's."""
    given = headers.get(TOKEN_HEADER, "").encode("latin-1", "replace")
    return bool(server.token) and hmac.compare_digest(given, (server.token or "").encode())


async def wait_for(book: Book, key: tuple[str, str], wait_s: float) -> Continuation | None:
    """A retry that came before the agent's resubmission of its request (of each of its choices):
    wait (bounded) for it."""
    deadline = min(book.expected.get(key, 0.0), time.monotonic() + wait_s)
    while ((cont := book.items.get(key)) is None or len(cont.choices) < cont.n) and time.monotonic() < deadline:
        ev = book.arrived
        try:
            await asyncio.wait_for(ev.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            break
    return cont


async def expect(server: RetryServer, headers: dict[str, str], body: bytes, send: Any) -> None:
    """``POST /gpuckpt/v1/expect`` (the agent, with the token): these ledger ids are about to be
    resubmitted; a retry of one of them waits for its continuation instead of starting anew."""
    if not authentic(server, headers):
        return await send_json(send, 403, {"error": {"message": "gpuckpt: expect needs this worker's token"}})
    try:
        doc = json.loads(body)
        if "hold_s" in doc:
            return await send_json(send, 200, {"held_s": renew_hold(server, float(doc["hold_s"]))})
        ids = [(str(r["id"]), int(r.get("n") or 1), r.get("left"), r.get("api") or {}) for r in doc["requests"]]
        wait_s = min(float(doc.get("wait_s", server.wait_s)), 600.0)
    except (ValueError, KeyError, TypeError) as exc:
        return await send_json(send, 400, {"error": {"message": f"gpuckpt: bad expect body: {exc}"}})
    deadline = time.monotonic() + wait_s
    server.hold_until = 0.0
    server.released.set()
    n = 0
    for cid, choices, left, api in ids:
        parsed = server.book.key_of(cid, {**api, "n": choices})
        if parsed is None:
            continue
        if left:
            server.book.left[parsed[:2]] = str(left)[:200]
        else:
            server.book.expected[parsed[:2]] = deadline
            n += 1
    await send_json(send, 200, {"expected": n})


def renew_hold(server: RetryServer, hold_s: float) -> float:
    """The agent's restore is still under way: hold possible retries ``hold_s`` seconds more from
    now (at most :data:`MAX_HOLD_S`; a renewal never shortens the hold). The agent renews while it
    restores, so the hold outlasts a restore of any length, and lapses soon after an agent that
    died. Only a hold in force is renewed: a server started without one (no restore was to
    follow its start) or whose hold ran out never starts holding its clients' requests here,
    and once the agent has said what it resubmits (or that it resubmits nothing), nothing holds
    again. Returns the seconds the hold has left (0: none)."""
    now = time.monotonic()
    if server.released.is_set() or server.hold_until <= now:
        return 0.0
    if hold_s > 0:  # false for NaN too
        server.hold_until = max(server.hold_until, now + min(hold_s, MAX_HOLD_S))
    return max(0.0, server.hold_until - now)


def rewritten(
    scope: dict[str, Any], receive: Any, send: Any, body: bytes, new_body: bytes, outcome: Callable[[], str | None]
) -> tuple[dict[str, Any], Any, Any]:
    """The ASGI ``(scope, receive, send)`` that hand the application ``new_body`` (the body read,
    rewritten: its ``Content-Length`` set anew) and add ``X-Gpuckpt-Attach: outcome()`` to the
    response when it starts (read then: what the call turned out to be)."""
    if new_body is not body:
        scope = dict(scope)
        scope["headers"] = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-length"] + [
            (b"content-length", str(len(new_body)).encode())
        ]
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": new_body, "more_body": False}
        return await receive()  # type: ignore[no-any-return]

    async def send_with_outcome(msg: dict[str, Any]) -> None:
        if msg.get("type") == "http.response.start" and (said := outcome()):
            msg = {**msg, "headers": [*msg.get("headers", ()), (ATTACH_HEADER.encode(), header_value(said))]}
        await send(msg)

    return scope, replay, send_with_outcome


async def read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        if msg.get("type") != "http.request":
            break
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    return b"".join(chunks)


async def send_json(send: Any, status: int, doc: dict[str, Any]) -> None:
    data = json.dumps(doc).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})


def header_value(s: str) -> bytes:
    return s.encode("ascii", "backslashreplace")[:400]


def token_path(control_socket: str) -> Path:
    """Where the worker's resubmission token lives: beside the connector's control socket."""
    return Path(control_socket + TOKEN_SUFFIX)


def write_token(extra: Mapping[str, Any]) -> str | None:
    """A fresh token for this server, in a file only the agent (the socket's group) can read."""
    sock = extra.get("control_socket")
    if not sock:
        return None
    try:
        return _write_token_file(str(sock), extra.get("shared_group"))
    except (OSError, KeyError, ValueError) as exc:
        log.error("gpuckpt: no resubmission token (retries will not attach): %s", exc)
        return None


def _write_token_file(sock: str, group: Any) -> str:
    token = secrets.token_urlsafe(32)
    p = token_path(str(sock))
    tmp = p.with_name(f".{p.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a killed server with this pid
    mode = 0o640 if group else 0o600
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        if group:
            os.fchown(fd, -1, grp.getgrnam(str(group)).gr_gid if not str(group).isdigit() else int(group))
        os.fchmod(fd, mode)
        os.write(fd, token.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, p)
    return token
