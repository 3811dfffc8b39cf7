"""Restored continuations kept for their clients: the book gpuckpt's middleware serves retries
and re-issues from (:mod:`agent.engines.vllm.middleware`), and the identities it matches them by.

Pure Python (no vLLM import): a continuation is the checkpointed prompt and outputs of each choice
of one request, and the continuation's tokens as the agent's resubmission produces them. Run in
the API server's event loop only (no locking).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("gpuckpt.middleware")

#: kept continuations, by default (``kv_connector_extra_config``: ``continuations_max_bytes``,
#: ``continuations_keep_s``, ``continuations_wait_s``)
MAX_BYTES = 256 << 20
KEEP_S = 600.0
#: bytes counted per kept token (ids in Python lists, generously)
TOKEN_BYTES = 16


def body_digest(body: Mapping[str, Any]) -> str:
    """A request body's identity: canonical JSON (sorted keys), SHA-256."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tenant_digest(authorization: str | None) -> str:
    """Whose request it is: the ``Authorization`` header's SHA-256 (empty without one)."""
    return hashlib.sha256(authorization.encode()).hexdigest() if authorization else ""


def not_attachable(body: Mapping[str, Any]) -> str | None:
    """Why a request's retry cannot be served from a continuation, whatever it continues (the
    response would need what the checkpoint does not carry)."""
    lp = body.get("logprobs")
    if (lp is not None and lp is not False) or body.get("top_logprobs"):
        return "logprobs of the tokens before the checkpoint are not carried"
    if body.get("prompt_logprobs") is not None:
        return "prompt logprobs are not carried"
    if body.get("echo"):
        return "an echoed prompt is not carried"
    if body.get("use_beam_search"):
        return "beam search is not carried"
    return None


_CHILD = re.compile(r"^(?P<choice>\d+)_(?P<rest>.+)$")
_CHAT = re.compile(r"^chatcmpl-(?P<base>.+)$")
_CMPL = re.compile(r"^cmpl-(?P<base>.+)-(?P<prompt>\d+)$")


def parse_id(cid: str, n: int) -> tuple[str, str, int] | None:
    """A ledger client id as ``(X-Request-Id, endpoint, choice)``; ``None``: not a served request's
    (or a completion's second prompt, which is not attached)."""
    choice = 0
    if n > 1 and (m := _CHILD.match(cid)):
        choice, cid = int(m.group("choice")), m.group("rest")
    if m := _CHAT.match(cid):
        return m.group("base"), "chat", choice
    if (m := _CMPL.match(cid)) and m.group("prompt") == "0":
        return m.group("base"), "completions", choice
    return None


@dataclass
class Choice:
    """One choice of a kept continuation: the prompt, the outputs before the checkpoint and the
    continuation's tokens as they come."""

    index: int
    prompt_ids: list[int]
    earlier: list[int]
    new: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    done: bool = False

    def tokens(self) -> list[int]:
        return self.earlier + self.new

    def count(self) -> int:
        return len(self.earlier) + len(self.new)

    def since(self, i: int) -> list[int]:
        """The output tokens from position ``i`` on (without copying the whole output)."""
        e = len(self.earlier)
        return self.new[i - e :] if i >= e else self.earlier[i:] + self.new


@dataclass
class Continuation:
    """A restored request's continuation, kept for its client: every choice, and a wake-up for
    whoever is streaming it."""

    base: str
    endpoint: str
    api: dict[str, Any]
    n: int
    choices: dict[int, Choice] = field(default_factory=dict)
    engine_ids: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    ended: float | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: why the continuation must never be served (a carried state it needed was not applied)
    void: str | None = None

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    @property
    def complete(self) -> bool:
        return len(self.choices) == self.n and all(c.done for c in self.choices.values())

    def cost(self) -> int:
        return TOKEN_BYTES * sum(len(c.prompt_ids) + len(c.earlier) + len(c.new) for c in self.choices.values())


class Book:
    """The continuations this worker keeps, bounded: finished ones go ``keep_s`` after they ended,
    and the oldest finished ones go first when the bytes would exceed ``max_bytes`` (a running one
    is never dropped; a new one that does not fit is not kept). Drops are counted."""

    def __init__(self, *, max_bytes: int = MAX_BYTES, keep_s: float = KEEP_S) -> None:
        self.max_bytes, self.keep_s = max_bytes, keep_s
        self.items: OrderedDict[tuple[str, str], Continuation] = OrderedDict()
        self.expected: dict[tuple[str, str], float] = {}
        #: restored requests the agent did not resubmit, and why (their retries are served anew)
        self.left: dict[tuple[str, str], str] = {}
        self.arrived = asyncio.Event()
        self.counts: dict[str, int] = {}

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n
        _metric(what, n)

    def bytes(self) -> int:
        return sum(c.cost() for c in self.items.values())

    def sweep(self, need: int = 0) -> None:
        now = time.monotonic()
        for k, c in list(self.items.items()):
            if c.ended is not None and now - c.ended > self.keep_s:
                del self.items[k]
                self.count("dropped_ttl")
        total = self.bytes()
        for k, c in list(self.items.items()):
            if total + need <= self.max_bytes:
                break
            if c.ended is not None:
                total -= c.cost()
                del self.items[k]
                self.count("dropped_bytes")
        for k, deadline in list(self.expected.items()):
            if deadline < now:
                del self.expected[k]

    def get(self, base: str, endpoint: str) -> Continuation | None:
        self.sweep()
        return self.items.get((base, endpoint))

    def find(self, base: str) -> list[Continuation]:
        self.sweep()
        return [c for (b, _), c in self.items.items() if b == base]

    def void(self, cont: Continuation, why: str) -> None:
        """``cont`` must never be served: it is dropped, its streaming retries are woken (and cut:
        the middleware raises a retryable error) and later retries are served anew, saying why."""
        cont.void = why
        key = (cont.base, cont.endpoint)
        if self.items.get(key) is cont:
            del self.items[key]
        self.expected.pop(key, None)
        self.left[key] = why
        self.count("voided")
        log.error("gpuckpt: continuation of %s (%s) is void: %s", cont.base, cont.endpoint, why)
        cont.notify()

    def register(
        self, cid: str, api: dict[str, Any], all_ids: list[int], prompt_len: int
    ) -> tuple[Continuation, Choice] | None:
        """The continuation and choice a resubmission of ledger entry ``cid`` fills (``None``: not
        kept, counted)."""
        n = int(api.get("n") or 1)
        parsed = parse_id(cid, n)
        if parsed is None:
            self.count("not_kept_id")
            return None
        base, endpoint, index = parsed
        need = TOKEN_BYTES * len(all_ids)
        self.sweep(need)
        if self.bytes() + need > self.max_bytes:
            self.count("not_kept_bytes")
            log.warning("gpuckpt: continuation of %s not kept: over %d bytes", cid, self.max_bytes)
            return None
        key = (base, endpoint)
        cont = self.items.get(key)
        if cont is None or cont.api.get("body") != api.get("body") or index in cont.choices:
            cont = Continuation(base, endpoint, dict(api), n)
            self.items[key] = cont
        ch = Choice(index, list(all_ids[:prompt_len]), list(all_ids[prompt_len:]))
        cont.choices[index] = ch
        cont.engine_ids.append(cid)
        if len(cont.choices) >= cont.n:
            self.expected.pop(key, None)
        self.arrived.set()
        self.arrived = asyncio.Event()
        self.count("kept")
        return cont, ch


def _metric(what: str, n: int) -> None:
    """Count in the API server's Prometheus registry (its ``/metrics``), if it has one."""
    try:
        c = _COUNTER[0]
        if c is None:
            from prometheus_client import Counter

            c = _COUNTER[0] = Counter(
                "gpuckpt_continuations_total",
                "Restored continuations: kept, attached to retries and re-issues, refused, dropped",
                ["event"],
            )
        c.labels(event=what).inc(n)
    except Exception as exc:  # a metric never fails a request
        log.debug("gpuckpt: metric %s not counted: %s", what, exc)


_COUNTER: list[Any] = [None]
