"""The control protocol between the agent and a worker's adapter, as one thing.

The transport (:mod:`agent.engines.control`) carries one JSON object per line;
this module says which objects those are. Every request is one of the
messages below: ``{"cmd": NAME, "v": PROTOCOL_VERSION, ...its fields}``.
Every reply is ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``;
the typed replies (:class:`Reply` subclasses) name the fields the agent reads
and keep the whole object (``raw``) for what it passes on.

Both sides use this module: the agent builds messages in
:class:`agent.engines.channel.WorkerChannel`, and the worker side
(:class:`agent.engines.service.WorkerService`, for every engine) parses each
request with :func:`parse_request`, which refuses — with
:class:`ProtocolError`, naming what — an unknown command, an unknown key, a
malformed value, and a version other than :data:`PROTOCOL_VERSION`. The
adapter and the agent ship in one package, so one version is spoken; a
worker that runs an older gpuckpt than its agent says so instead of
misreading a field.

The commands (agent → worker):

============  ===============================================================
``ping``      the adapter is loaded and answering → ``pid``
``describe``  the worker's pins, layout and namespace fields
``capture``   a checkpoint's consistent point at the next step boundary
              (where ``when`` holds) → chunk 0 of the capture stream
``wait``      the next step boundary where ``when`` holds → progress
``next``      acknowledge consumed chunks → the chunks ready since, or done
``cancel``    abandon a capture stream
``offer``     offer a page file's pages and request states (a restore);
              a streaming restore's later parts carry its ``generation``
``keys``      the page keys of token sequences, hashed by this engine
``hold``      hold new requests until ``requests`` have arrived
``withdraw``  end the restore offer (its page files are deleted)
``durable``   keys the repository holds (not copied by the next capture)
``sweep``     end any capture stream, delete page files no stream owns
``stats``     counters
============  ===============================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from agent.engines.control import ControlError

__all__ = [
    "PROTOCOL_VERSION",
    "Cancel",
    "Capture",
    "CaptureReply",
    "Describe",
    "Description",
    "Durable",
    "Hold",
    "KeyRequest",
    "Keys",
    "Message",
    "Next",
    "NextReply",
    "Offer",
    "OfferReply",
    "Ping",
    "ProtocolError",
    "Reply",
    "Stats",
    "Sweep",
    "Wait",
    "Withdraw",
    "parse_request",
]

#: The version every request carries (``"v"``). Bump it when a message's meaning changes.
PROTOCOL_VERSION = 1


class ProtocolError(ControlError):
    """A message that is not one of this protocol's: an unknown command, key or version, or a field
    of the wrong type. The worker answers it ``ok: false`` naming the cause; the agent raises it for
    a reply it cannot read."""


# ------------------------------------------------------------------ field checks


def _int(cmd: str, key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
        raise ProtocolError(f"{cmd}: {key} must be an integer, not {v!r}")
    return int(v)


def _num(cmd: str, key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(f"{cmd}: {key} must be a number, not {v!r}")
    return float(v)


def _opt_int(cmd: str, key: str, v: Any) -> int | None:
    return None if v is None or v == 0 else _int(cmd, key, v)


def _opt_num(cmd: str, key: str, v: Any) -> float | None:
    return None if v is None else _num(cmd, key, v)


def _bool(cmd: str, key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(f"{cmd}: {key} must be true or false, not {v!r}")
    return v


def _strs(cmd: str, key: str, v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ProtocolError(f"{cmd}: {key} must be a list of strings")
    return tuple(v)


def _hex_keys(cmd: str, key: str, v: Any) -> tuple[str, ...]:
    out = _strs(cmd, key, v)
    for k in out:
        try:
            bytes.fromhex(k)
        except ValueError:
            raise ProtocolError(f"{cmd}: {key} must hold hex strings, not {k[:80]!r}") from None
    return out


def _condition(cmd: str, v: Any) -> dict[str, int] | None:
    """``{"live": n, "min_outputs": k}``: at least ``n`` unfinished requests with ``k`` outputs each."""
    if not v:
        return None
    if not isinstance(v, dict) or not set(v) <= {"live", "min_outputs"}:
        raise ProtocolError(f"{cmd}: a condition is {{'live': n, 'min_outputs': k}}, not {v!r}")
    return {k: _int(cmd, f"when.{k}", x) for k, x in v.items()}


# ------------------------------------------------------------------ requests


@dataclass(frozen=True)
class Message:
    """A request. ``CMD`` is its name on the wire; its fields are its keys."""

    CMD: ClassVar[str] = ""
    #: the reply type the agent reads this message's answer as
    REPLY: ClassVar[type[Reply]]

    def to_json(self) -> dict[str, Any]:
        """The request's keys (without ``cmd`` and ``v``, which the channel adds)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                v = [x.to_json() if isinstance(x, KeyRequest) else x for x in v]
            out[f.name] = v
        return out

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Message:
        """The message from its keys (``cmd`` and ``v`` already taken off); refuses unknown keys."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ProtocolError(f"{cls.CMD}: unknown keys {unknown} (this worker speaks protocol v{PROTOCOL_VERSION})")
        return cls._from(raw)

    @classmethod
    def _from(cls, raw: Mapping[str, Any]) -> Message:
        return cls()


@dataclass(frozen=True)
class Ping(Message):
    CMD = "ping"


@dataclass(frozen=True)
class Describe(Message):
    CMD = "describe"


@dataclass(frozen=True)
class Capture(Message):
    """A checkpoint's consistent point. ``full``: copy durable pages too; ``prefix_only``: a
    pre-copy (cached full blocks not durable, no ledger, gives way to any real capture);
    ``max_staging`` / ``copy_per_step``: this capture's bounds (bytes), else the adapter's."""

    CMD = "capture"
    when: dict[str, int] | None = None
    full: bool = False
    prefix_only: bool = False
    max_staging: int | None = None
    copy_per_step: int | None = None
    timeout: float = 60.0

    @classmethod
    def _from(cls, raw: Mapping[str, Any]) -> Capture:
        c = cls.CMD
        return cls(
            when=_condition(c, raw.get("when")),
            full=_bool(c, "full", raw.get("full", False)),
            prefix_only=_bool(c, "prefix_only", raw.get("prefix_only", False)),
            max_staging=_opt_int(c, "max_staging", raw.get("max_staging")),
            copy_per_step=_opt_int(c, "copy_per_step", raw.get("copy_per_step")),
            timeout=_num(c, "timeout", raw.get("timeout", 60.0)),
        )


@dataclass(frozen=True)
class Wait(Message):
    """The next step boundary where ``when`` holds."""

    CMD = "wait"
    when: dict[str, int] | None = None
    timeout: float = 60.0

    @classmethod
    def _from(cls, raw: Mapping[str, Any]) -> Wait:
        return cls(
            when=_condition(cls.CMD, raw.get("when")), timeout=_num(cls.CMD, "timeout", raw.get("timeout", 60.0))
        )


@dataclass(frozen=True)
class Next(Message):
    """The agent consumed chunks ``ack`` of capture ``seq`` (their files are gone): the next ones."""

    CMD = "next"
    seq: int = -1
    ack: tuple[int, ...] = ()
    timeout: float = 60.0

    @classmethod
    def _from(cls, raw: Mapping[str, Any]) -> Next:
        c = cls.CMD
        a = raw.get("ack")
        acks = [a] if isinstance(a, int) and not isinstance(a, bool) else a or []
        if not isinstance(acks, list):
            raise ProtocolError(f"{c}: ack must be a chunk number or a list of them")
        return cls(
            seq=_int(c, "seq", raw.get("seq", -1)),
            ack=tuple(_int(c, "ack", k) for k in acks),
            timeout=_num(c, "timeout", raw.get("timeout", 60.0)),
        )


@dataclass(frozen=True)
class Cancel(Message):
    CMD = "cancel"
    seq: int = -1

    @classmethod
    def _from(cls, raw: Mapping[str, Any]) -> Cancel:
        return cls(seq=_int(cls.CMD, "seq", raw.get("seq", -1)))


@dataclass(frozen=True)
class Offer(Message):
    """Offer a page file (``index``; None: request states alone) and request states (by client
    id). A streaming restore's later parts carry the first reply's ``generation`` and are refused
    once that offer ended. ``awaiting``: requests whose pages later parts bring (they wait until a
    part names them ``ready``, or ``await_s`` pass with no part); ``coming``: the keys the rest
    brings (a request needing them waits up to ``want_s``); ``done``: nothing more comes;
    ``ttl``: the offer ends this many seconds from now."""

    CMD = "offer"
    index: str | None = None
    requests: dict[str, Any] = field(default_factory=dict)
    ttl: float | None = None
    generation: int | None = None
    awaiting: tuple[str, ...] = ()
    ready: tuple[str, ...] = ()
    await_s: float | None = None
    coming: tuple[str, ...] | None = None
    want_s: float | None = None
    done: bool = False

    @classmethod
    def _from(cls, raw: Mapping[str, Any]) -> Offer:
        c = cls.CMD
        index = raw.get("index")
        if index is not None and not isinstance(index, str):
            raise ProtocolError(f"{c}: index must be a path or null")
        requests = raw.get("requests") or {}
        if not isinstance(requests, dict):
            raise ProtocolError(f"{c}: requests must be an object (client id → state)")
        gen = raw.get("generation")
        coming = raw.get("coming")
        return cls(
            index=index or None,
            requests=dict(requests),
            ttl=_opt_num(c, "ttl", raw.get("ttl")),
            generation=None if gen is None else _int(c, "generation", gen),
            awaiting=_strs(c, "awaiting", raw.get("awaiting")),
            ready=_strs(c, "ready", raw.get("ready")),
            await_s=_opt_num(c, "await_s", raw.get("await_s")),
            coming=None if coming is None else _hex_keys(c, "coming", coming),
            want_s=_opt_num(c, "want_s", raw.get("want_s")),
            done=_bool(c, "done", raw.get("done", False)),
        )

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        # absent, not null: a worker applies its own defaults (and ``coming`` absent ≠ empty)
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class KeyRequest:
    """A token sequence whose first ``kv_tokens`` tokens' page keys are asked for."""

    token_ids: tuple[int, ...]
    kv_tokens: int
    cache_salt: str | None = None
    extra_key: str | None = None  # SGLang's extra key (LoRA id and the like)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"token_ids": list(self.token_ids), "kv_tokens": self.kv_tokens}
        if self.cache_salt is not None:
            out["cache_salt"] = self.cache_salt
        if self.extra_key is not None:
            out["extra_key"] = self.extra_key
        return out

    @classmethod
    def parse(cls, raw: Any) -> KeyRequest:
        c = "keys"
        if not isinstance(raw, dict) or not set(raw) <= {"token_ids", "kv_tokens", "cache_salt", "extra_key"}:
            raise ProtocolError(f"{c}: a request is {{token_ids, kv_tokens, cache_salt, extra_key}}")
        ids = raw.get("token_ids") or []
        if not isinstance(ids, list):
            raise ProtocolError(f"{c}: token_ids must be a list of token ids")
        toks = tuple(_int(c, "token_ids", t) for t in ids)
        n = min(_int(c, "kv_tokens", raw.get("kv_tokens", len(toks))), len(toks))
        salt, extra = raw.get("cache_salt"), raw.get("extra_key")
        for k, v in (("cache_salt", salt), ("extra_key", extra)):
            if v is not None and not isinstance(v, str):
                raise ProtocolError(f"{c}: {k} must be a string or null")
        return cls(toks, n, salt, extra)


@dataclass(frozen=True)
class Keys(Message):
    """The page keys (hex, in order) holding each request's first ``kv_tokens`` tokens: the
    engine's own block hashes, then the key of a partial last page."""

    CMD = "keys"
    requests: tuple[KeyRequest, ...] = ()

    @classmethod
    def _from(cls, raw: Mapping[str, Any]) -> Keys:
        reqs = raw.get("requests") or []
        if not isinstance(reqs, list):
            raise ProtocolError("keys: requests must be a list")
        return cls(tuple(KeyRequest.parse(r) for r in reqs))


@dataclass(frozen=True)
class Hold(Message):
    """Hold new requests until ``requests`` have arrived (never longer than ``timeout``)."""

    CMD = "hold"
    requests: int = 0
    timeout: float = 60.0

    @classmethod
    def _from(cls, raw: Mapping[str, Any]) -> Hold:
        return cls(
            _int(cls.CMD, "requests", raw.get("requests", 0)), _num(cls.CMD, "timeout", raw.get("timeout", 60.0))
        )


@dataclass(frozen=True)
class Withdraw(Message):
    CMD = "withdraw"


@dataclass(frozen=True)
class Durable(Message):
    """Keys (hex) the repository holds (``add``) or no longer holds (``remove``)."""

    CMD = "durable"
    add: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()

    @classmethod
    def _from(cls, raw: Mapping[str, Any]) -> Durable:
        return cls(_hex_keys(cls.CMD, "add", raw.get("add")), _hex_keys(cls.CMD, "remove", raw.get("remove")))


@dataclass(frozen=True)
class Sweep(Message):
    CMD = "sweep"


@dataclass(frozen=True)
class Stats(Message):
    CMD = "stats"


MESSAGES: dict[str, type[Message]] = {
    m.CMD: m for m in (Ping, Describe, Capture, Wait, Next, Cancel, Offer, Keys, Hold, Withdraw, Durable, Sweep, Stats)
}


def parse_request(raw: Any) -> Message:
    """The message a request line holds; :class:`ProtocolError` names what is wrong with it."""
    if not isinstance(raw, dict):
        raise ProtocolError("a request is a JSON object")
    body = dict(raw)
    cmd = body.pop("cmd", None)
    cls = MESSAGES.get(cmd) if isinstance(cmd, str) else None
    if cls is None:
        raise ProtocolError(f"unknown command {cmd!r}")
    v = body.pop("v", None)
    if v != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{cmd}: protocol version {v!r}; this worker's gpuckpt speaks v{PROTOCOL_VERSION} "
            "(run the same gpuckpt release in the agent and the worker)"
        )
    return cls.parse(body)


# ------------------------------------------------------------------ replies


@dataclass(frozen=True)
class Reply:
    """An ``ok`` reply; ``raw`` is the whole object (what the agent passes on as it came)."""

    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Reply:
        return cls(raw=raw)

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)


@dataclass(frozen=True)
class Pong(Reply):
    pid: int = 0

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Pong:
        return cls(raw=raw, pid=_reply_int(raw, "ping", "pid"))


@dataclass(frozen=True)
class Description(Reply):
    """``facts`` (the pins), ``layout`` and ``namespace`` fields (see :class:`WorkerDescription`)."""

    facts: Mapping[str, Any] = field(default_factory=dict)
    layout: Mapping[str, Any] = field(default_factory=dict)
    namespace: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Description:
        facts, layout, ns = (raw.get(k) for k in ("facts", "layout", "namespace"))
        if not (isinstance(facts, dict) and isinstance(layout, dict) and isinstance(ns, dict)):
            raise ProtocolError("describe: the reply has no facts, layout and namespace objects")
        return cls(raw, facts, layout, ns)


@dataclass(frozen=True)
class CaptureReply(Reply):
    """Chunk 0 of a capture: ``seq``, the ledger (absent for a pre-copy), the keys not copied
    (``skipped``: durable) and the first chunk's page files (``index`` or per-rank ``shards``)."""

    seq: int = 0
    ledger: Mapping[str, Any] | None = None
    skipped: tuple[str, ...] = ()

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> CaptureReply:
        ledger = raw.get("ledger")
        if ledger is not None and not isinstance(ledger, dict):
            raise ProtocolError("capture: the ledger is not an object")
        return cls(
            raw, _reply_int(raw, "capture", "seq"), ledger, tuple(_strs("capture", "skipped", raw.get("skipped")))
        )


@dataclass(frozen=True)
class NextReply(Reply):
    """The chunks complete since the last call (``parts``), or ``done`` with the stream's summary."""

    done: bool = False
    parts: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> NextReply:
        parts = raw.get("parts") or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
            raise ProtocolError("next: parts is not a list of objects")
        return cls(raw, bool(raw.get("done", False)), tuple(parts))


@dataclass(frozen=True)
class OfferReply(Reply):
    """``offered`` pages taken, ``rejected`` request states (client id → why), the offer's
    ``generation``, whether the worker holds ``awaiting`` requests (``awaits``) and the coming
    keys requests asked for since the last part (``wanted``)."""

    offered: int = 0
    rejected: Mapping[str, str] = field(default_factory=dict)
    generation: int | None = None
    awaits: bool = False
    wanted: tuple[str, ...] = ()

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> OfferReply:
        rejected = raw.get("rejected") or {}
        if not isinstance(rejected, dict):
            raise ProtocolError("offer: rejected is not an object")
        gen = raw.get("generation")
        return cls(
            raw,
            int(raw.get("offered", 0) or 0),
            {str(k): str(v) for k, v in rejected.items()},
            None if gen is None else int(gen),
            bool(raw.get("awaits", False)),
            _strs("offer", "wanted", raw.get("wanted")),
        )


@dataclass(frozen=True)
class KeysReply(Reply):
    keys: tuple[tuple[str, ...], ...] = ()

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> KeysReply:
        keys = raw.get("keys") or []
        if not isinstance(keys, list):
            raise ProtocolError("keys: the reply's keys is not a list")
        return cls(raw, tuple(_strs("keys", "keys", k) for k in keys))


@dataclass(frozen=True)
class Counted(Reply):
    """``withdraw`` (``files``), ``durable`` (``durable``) and ``cancel`` (``cancelled``)."""

    files: int = 0
    durable: int = 0
    cancelled: bool = False

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Counted:
        return cls(raw, int(raw.get("files", 0) or 0), int(raw.get("durable", 0) or 0), bool(raw.get("cancelled")))


@dataclass(frozen=True)
class Swept(Reply):
    removed: tuple[str, ...] = ()

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Swept:
        return cls(raw, _strs("sweep", "removed", raw.get("removed")))


def _reply_int(raw: Mapping[str, Any], cmd: str, key: str) -> int:
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"{cmd}: the reply's {key} is not an integer ({v!r})")
    return v


Ping.REPLY = Pong
Describe.REPLY = Description
Capture.REPLY = CaptureReply
Wait.REPLY = Reply
Next.REPLY = NextReply
Cancel.REPLY = Counted
Offer.REPLY = OfferReply
Keys.REPLY = KeysReply
Hold.REPLY = Reply
Withdraw.REPLY = Counted
Durable.REPLY = Counted
Sweep.REPLY = Swept
Stats.REPLY = Reply
