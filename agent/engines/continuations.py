"""Restored continuations kept for their clients: the book gpuckpt's API-server middleware serves
retries and re-issues from (vLLM's :mod:`agent.engines.vllm.middleware`, SGLang's
:mod:`agent.engines.sglang.middleware`), and the identities it matches them by.

Pure Python (no engine import): a continuation is the checkpointed prompt and outputs of each
choice of one request, and the continuation's tokens as the agent's resubmission produces them.
Run in the API server's event loop only (no locking). Which client request a ledger entry is
(``(X-Request-Id, endpoint, choice)``) is the engine's word (``Book``'s ``key_of``): vLLM's ids
say it (:func:`parse_id`), SGLang's API facts do (``api["request_id"]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("gpuckpt.middleware")

#: kept continuations, by default (``kv_connector_extra_config``: ``continuations_max_bytes``,
#: ``continuations_keep_s``, ``continuations_wait_s``)
MAX_BYTES = 256 << 20
KEEP_S = 600.0
#: bytes counted per kept token (ids in Python lists, generously)
TOKEN_BYTES = 16
#: bytes counted per kept token's logprobs (a few top entries in Python lists, generously)
POSITION_BYTES = 256
#: recorded logprobs of requests in flight, by default (``logprobs_max_bytes``), and how long those
#: of a finished request stay for a checkpoint that captured it (``logprobs_keep_s``)
LOGPROBS_MAX_BYTES = 64 << 20
LOGPROBS_KEEP_S = 120.0

#: one output token's logprobs: ``[[token id, logprob (None: -inf), rank, decoded text], …]`` — the
#: sampled token's first, then the top ones, as vLLM gives them
Position = list[list[Any]]


def body_digest(body: Mapping[str, Any]) -> str:
    """A request body's identity: canonical JSON (sorted keys), SHA-256."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tenant_digest(authorization: str | None) -> str:
    """Whose request it is: the ``Authorization`` header's SHA-256 (empty without one)."""
    return hashlib.sha256(authorization.encode()).hexdigest() if authorization else ""


def not_attachable(body: Mapping[str, Any]) -> str | None:
    """Why a request's retry cannot be served from a continuation, whatever it continues (the
    response would need what the checkpoint does not carry). A request's ``logprobs`` and
    ``top_logprobs`` are carried (:class:`Logprobs`: the API server records them, the checkpoint
    keeps them); those of its prompt, and its echoed prompt, are not."""
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
    #: vLLM's stop reason (a token id, a stop string); SGLang's whole ``finish_reason`` document
    stop_reason: Any = None
    done: bool = False
    #: the logprobs of ``earlier`` (one position per token, :func:`encode_position`), as the
    #: checkpoint carried them; ``None``: not carried (a retry asking for logprobs is served anew)
    earlier_lps: list[Position] | None = None
    #: the continuation's own, one per token of ``new`` (when the resubmission asked for them)
    new_lps: list[Position] = field(default_factory=list)
    #: the engine's last word on the continuation beside its tokens (SGLang's ``meta_info``: the
    #: weight version and the like, which a retry served in the engine's own form repeats)
    meta: dict[str, Any] = field(default_factory=dict)

    def tokens(self) -> list[int]:
        return self.earlier + self.new

    def count(self) -> int:
        return len(self.earlier) + len(self.new)

    def since(self, i: int) -> list[int]:
        """The output tokens from position ``i`` on (without copying the whole output)."""
        e = len(self.earlier)
        return self.new[i - e :] if i >= e else self.earlier[i:] + self.new

    def has_logprobs(self) -> bool:
        """Every output token so far has its logprobs (the checkpoint's and the continuation's)."""
        return (
            self.earlier_lps is not None
            and len(self.earlier_lps) == len(self.earlier)
            and (len(self.new_lps) == len(self.new))
        )

    def logprobs(self, i: int, j: int) -> list[Position]:
        """The logprobs of output tokens ``i`` to ``j``."""
        e = len(self.earlier)
        out = list((self.earlier_lps or [])[i : min(j, e)]) if i < e else []
        if j > e:
            out += self.new_lps[max(i, e) - e : j - e]
        return out


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
        tokens = sum(len(c.prompt_ids) + len(c.earlier) + len(c.new) for c in self.choices.values())
        positions = sum(len(c.earlier_lps or ()) + len(c.new_lps) for c in self.choices.values())
        return TOKEN_BYTES * tokens + POSITION_BYTES * positions


class Book:
    """The continuations this worker keeps, bounded: finished ones go ``keep_s`` after they ended,
    and the oldest finished ones go first when the bytes would exceed ``max_bytes`` (a running one
    is never dropped; a new one that does not fit is not kept). Drops are counted."""

    def __init__(
        self,
        *,
        max_bytes: int = MAX_BYTES,
        keep_s: float = KEEP_S,
        key_of: Callable[[str, Mapping[str, Any]], tuple[str, str, int] | None] | None = None,
    ) -> None:
        self.max_bytes, self.keep_s = max_bytes, keep_s
        #: a ledger entry's ``(X-Request-Id, endpoint, choice)`` from its id and API facts
        self.key_of = key_of or (lambda cid, api: parse_id(cid, int(api.get("n") or 1)))
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
        self,
        cid: str,
        api: dict[str, Any],
        all_ids: list[int],
        prompt_len: int,
        earlier_lps: list[Position] | None = None,
    ) -> tuple[Continuation, Choice] | None:
        """The continuation and choice a resubmission of ledger entry ``cid`` fills (``None``: not
        kept, counted); ``earlier_lps``: the logprobs of its earlier outputs, as the checkpoint
        carried them."""
        n = int(api.get("n") or 1)
        parsed = self.key_of(cid, api)
        if parsed is None:
            self.count("not_kept_id")
            return None
        base, endpoint, index = parsed
        need = TOKEN_BYTES * len(all_ids) + POSITION_BYTES * len(earlier_lps or ())
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
        if not ch.earlier:  # computed from its prompt: every logprob is the continuation's
            ch.earlier_lps = []
        elif earlier_lps is not None and len(earlier_lps) == len(ch.earlier):
            ch.earlier_lps = list(earlier_lps)
        cont.choices[index] = ch
        cont.engine_ids.append(cid)
        if len(cont.choices) >= cont.n:
            self.expected.pop(key, None)
        self.arrived.set()
        self.arrived = asyncio.Event()
        self.count("kept")
        return cont, ch


def encode_position(position: Mapping[int, Any] | None) -> Position:
    """One token's logprobs as vLLM gives them (``{token id: Logprob}``) in plain JSON values; a
    logprob of -inf (a token a grammar or a bias excluded) is ``None``."""
    out: Position = []
    for tid, lp in (position or {}).items():
        v = float(lp.logprob)
        out.append([int(tid), v if math.isfinite(v) else None, lp.rank, lp.decoded_token])
    return out


def valid_positions(value: Any, count: int) -> list[Position] | None:
    """``value`` as ``count`` encoded positions (:func:`encode_position`), or ``None`` if it is not
    exactly that — what a checkpoint's ledger or a resubmission carries is checked before it is
    served to anyone."""
    if not isinstance(value, list) or len(value) != count:
        return None
    for pos in value:
        if not isinstance(pos, list):
            return None
        for e in pos:
            if not (
                isinstance(e, list)
                and len(e) == 4
                and isinstance(e[0], int)
                and (e[1] is None or (isinstance(e[1], float | int) and math.isfinite(e[1])))
                and (e[2] is None or isinstance(e[2], int))
                and (e[3] is None or isinstance(e[3], str))
            ):
                return None
    return value


@dataclass
class _Recorded:
    positions: dict[int, list[Position]] = field(default_factory=dict)  # by choice index
    ended: float | None = None
    dropped: bool = False  # over the bound: never served from (incomplete)


class Logprobs:
    """The logprobs the API server has streamed to the clients of requests in flight, by request
    and choice, so that a checkpoint can carry those of its requests' earlier outputs (the engine
    core that the checkpoint captures never keeps them). Bounded in bytes: a request that does
    not fit is dropped whole (its checkpoint then carries none, and its retry is served anew);
    a finished request's go :data:`LOGPROBS_KEEP_S` after it ended."""

    def __init__(self, *, max_bytes: int = LOGPROBS_MAX_BYTES, keep_s: float = LOGPROBS_KEEP_S) -> None:
        self.max_bytes, self.keep_s = max_bytes, keep_s
        self.items: OrderedDict[str, _Recorded] = OrderedDict()
        self.size = 0
        self.changed = asyncio.Event()

    def start(self, request_id: str) -> None:
        """A request that asked for logprobs reached the engine: from now on a checkpoint that
        captured it waits for its logprobs (:meth:`wait`)."""
        self._sweep()
        self.items[request_id] = _Recorded()

    def add(self, request_id: str, index: int, positions: list[Position]) -> None:
        r = self.items.get(request_id)
        if r is None:
            self._sweep()
            r = self.items[request_id] = _Recorded()
        if r.dropped or not positions:
            return
        need = POSITION_BYTES * len(positions)
        if self.size + need > self.max_bytes:
            self._sweep(need)
        if self.size + need > self.max_bytes:
            self.size -= POSITION_BYTES * sum(len(p) for p in r.positions.values())
            r.positions.clear()
            r.dropped = True
            log.warning("gpuckpt: logprobs of %s not recorded: over %d bytes", request_id, self.max_bytes)
            return
        r.positions.setdefault(index, []).extend(positions)
        self.size += need
        self.changed.set()
        self.changed = asyncio.Event()

    def end(self, request_id: str) -> None:
        if (r := self.items.get(request_id)) is not None:
            r.ended = time.monotonic()
            self.changed.set()
            self.changed = asyncio.Event()

    def _sweep(self, need: int = 0) -> None:
        now = time.monotonic()
        for k, r in list(self.items.items()):
            if r.ended is not None and (now - r.ended > self.keep_s or self.size + need > self.max_bytes):
                self.size -= POSITION_BYTES * sum(len(p) for p in r.positions.values())
                del self.items[k]

    def first(self, cid: str, n: int, count: int) -> list[Position] | bool | None:
        """The first ``count`` positions of ledger entry ``cid`` (a choice's own id when ``n`` > 1);
        ``True``: not yet (the API server lags the engine), ``None``: never (not recorded, dropped,
        or the request ended short of them)."""
        base, index = cid, 0
        if n > 1 and (m := _CHILD.match(cid)):
            base, index = m.group("rest"), int(m.group("choice"))
        r = self.items.get(base)
        if r is None or r.dropped:
            return None
        got = r.positions.get(index, [])
        if len(got) >= count:
            return got[:count]
        return None if r.ended is not None else True

    async def wait(self, wanted: list[tuple[str, int, int]], wait_s: float) -> dict[str, list[Position] | None]:
        """:meth:`first` of each ``(cid, n, count)``, waiting (at most ``wait_s``) for those the API
        server has not streamed yet."""
        deadline = time.monotonic() + wait_s
        while True:
            out = {cid: self.first(cid, n, k) for cid, n, k in wanted}
            if not any(v is True for v in out.values()) or (left := deadline - time.monotonic()) <= 0:
                return {cid: (v if isinstance(v, list) else None) for cid, v in out.items()}
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)


def _metric(what: str, n: int) -> None:
    """Count in the API server's Prometheus registry (its ``/metrics``), if it has one."""
    try:
        c = _COUNTER[0]
        if c is None:
            # late: only an API server that records continuations registers the counter
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
