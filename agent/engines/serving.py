"""What the engines' HTTP clients share (no engine import): a finished completion as the agent
sees it, and the error a worker's API answers with."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import httpx

from ckpt.errors import EngineRefused

__all__ = ["NO_KEEPALIVE", "Completion", "ServeError", "check_response", "split_left"]

#: The agent's connections to a worker's server are not kept alive between calls. A server closes
#: an idle connection after a few seconds (uvicorn, under vLLM's and SGLang's servers: 5 s); a call
#: that takes that connection from the pool as the server closes it fails with "Server
#: disconnected without sending a response" — a resubmission lost to a race, seen under load
#: (the agent's hold renewals leave such connections behind). The agent's calls are few and on
#: loopback: a connection each costs nothing, and no call can meet a connection the server closed.
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


class ServeError(EngineRefused):
    """The worker's API refused or failed a request; the message carries its answer."""


@dataclass
class Completion:
    """One finished completion: token ids, timings and the server's accounting."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    first_token_s: float | None = None  # from sending to the first token
    total_s: float = 0.0
    #: not resubmitted, and why: its client's retry is served as a new request (computed once, there)
    left_to_client: str | None = None


class _Leavable(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def left_to_client(self) -> str | None: ...


_R = TypeVar("_R", bound=_Leavable)


def split_left(requests: Iterable[_R]) -> tuple[dict[str, Completion], list[_R]]:
    """Resubmissions (:class:`agent.engines.types.Resubmission`) split into those left to their
    clients (their input is not in the ledger: never sent, each a completion saying why) and
    those to send."""
    left: dict[str, Completion] = {}
    send: list[_R] = []
    for r in requests:
        if r.left_to_client is not None:
            left[r.request_id] = Completion(r.request_id, left_to_client=r.left_to_client)
        else:
            send.append(r)
    return left, send


def check_response(r: httpx.Response) -> None:
    """Nothing for a 200; else :class:`ServeError` with the server's own message."""
    if r.status_code == 200:
        return
    try:
        msg = r.json().get("message") or r.json().get("error", {}).get("message") or r.text
    except (ValueError, AttributeError):
        msg = r.text
    raise ServeError(f"{r.request.method} {r.request.url.path}: HTTP {r.status_code}: {str(msg)[:300]}")
