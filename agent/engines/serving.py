"""What the engines' HTTP clients share (no engine import): a finished completion as the agent
sees it, the error a worker's API answers with, the agent's calls to gpuckpt's middleware in
the worker's server (its token, ``expect``, the retry hold: :class:`AgentCalls`), and the client
itself less what differs by engine (:class:`ServingHttpClient`: readiness, the resubmission of a
restored ledger; an engine supplies one request's call)."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import httpx

from agent import fs
from agent.engines.retries import EXPECT_PATH, RESUBMIT_HEADER, TOKEN_HEADER
from ckpt.errors import EngineRefused

log = logging.getLogger("gpuckpt.serve")

__all__ = [
    "NO_KEEPALIVE",
    "AgentCalls",
    "Completion",
    "ServeError",
    "ServingHttpClient",
    "check_response",
    "split_left",
    "tell_done",
]

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


class AgentCalls:
    """The agent's calls to gpuckpt's middleware in a worker's server, alike on every engine:
    the worker's resubmission token (the file beside its control socket), ``expect`` and the
    retry hold. A client sets ``_http`` (its :class:`httpx.Client`), ``_token_file`` and
    ``_trust``."""

    _http: httpx.Client
    _token_file: str | os.PathLike[str] | None = None
    _trust: fs.Trust | None = None
    _token: str | None = None

    def token(self) -> str | None:
        """The worker's resubmission token (``None``: no token file, e.g. no gpuckpt middleware)."""
        if self._token_file is None:
            return None
        if self._token is not None:
            return self._token
        try:
            fd = fs.open_checked(self._token_file, directory=None, trust=self._trust or fs.Trust.of())
        except FileNotFoundError:
            return None
        except (OSError, fs.UnsafePath) as exc:
            # resubmissions still run, as plain requests: only the clients' retries lose the attach
            log.warning("gpuckpt: the worker's resubmission token is not usable: %s", exc)
            return None
        with os.fdopen(fd, "rb") as f:
            self._token = f.read(256).decode("ascii", "replace").strip() or None
        return self._token

    def expect(
        self, requests: Sequence[Any], token: str, wait_s: float = 60.0, left: dict[str, str] | None = None
    ) -> int:
        """Tell the worker's middleware these requests (:class:`agent.engines.types.Resubmission`:
        ``request_id``, ``api``) are about to be resubmitted: their clients'
        retries wait for the continuations instead of starting anew (``left``: those that are
        not, and why, which their retries' response headers then say). Returns how many it
        expects."""
        left = left or {}
        body = {
            "requests": [
                {
                    "id": r.request_id,
                    "n": (r.api or {}).get("n", 1),
                    "left": left.get(r.request_id),
                    "api": r.api or {},
                }
                for r in requests
            ],
            "wait_s": wait_s,
        }
        r = self._http.post(EXPECT_PATH, json=body, headers={TOKEN_HEADER: token})
        check_response(r)
        return int(r.json().get("expected", 0))

    def release(self) -> None:
        """Nothing will be resubmitted: the worker's middleware stops holding possible retries
        (``retry_hold_s``, set when a restore was to follow its start)."""
        token = self.token()
        if token is not None:
            self.expect([], token)

    def hold_retries(self, seconds: float, *, timeout: float = 5.0) -> float:
        """The restore is still under way: the worker's middleware holds possible retries
        ``seconds`` more (a lease the agent renews while it restores; nothing holds once
        :meth:`expect` or :meth:`release` was sent). Returns the seconds the hold has left; 0
        where the worker holds nothing (released, or no gpuckpt middleware or token)."""
        token = self.token()
        if token is None:
            return 0.0
        # its own short timeout: a renewal stuck on a loaded server must not outlive the lease
        r = self._http.post(EXPECT_PATH, json={"hold_s": seconds}, headers={TOKEN_HEADER: token}, timeout=timeout)
        check_response(r)
        return float(r.json().get("held_s", 0.0))


def tell_done(on_done: Callable[[str], None], request_id: str, done: Future[Any]) -> None:
    """A resubmission's completion came back: say so (a client's ``submit``'s ``on_done``). One
    that failed is not said to be done: a worker that died was still running it."""
    if not done.cancelled() and done.exception() is None:
        on_done(request_id)


class ServingHttpClient(AgentCalls):
    """A worker's HTTP API as the agent uses it (an :class:`agent.engines.types.ServingClient`), the
    same on every engine: readiness and the
    resubmission of a restored ledger (each request under its ledger id, kept by gpuckpt's
    middleware for its client's retry). Thread-safe (one :class:`httpx.Client`). An engine's client
    supplies :meth:`resubmit_one` (one request's call to its API), its canary's ``generate`` and
    its ``complete_ledger``."""

    #: what the server is called in errors ("the worker", "the server")
    WHAT = "the worker"
    #: whether a resubmission is streamed unless the caller says (vLLM: yes; SGLang: one response)
    STREAM = True
    #: whether a resubmission without API facts still goes to the middleware (SGLang's renders
    #: a continuation from those facts only)
    TEE_WITHOUT_API = True

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        transport: httpx.BaseTransport | None = None,
        token_file: str | os.PathLike[str] | None = None,
        trust: fs.Trust | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """``token_file``: the worker's resubmission token (beside its control socket, written by
        gpuckpt's middleware; read when :meth:`submit` first needs it, checked like every file a
        worker hands the agent, ``trust`` saying whose it may be)."""
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers=headers or {},
            timeout=timeout,
            transport=transport,
            limits=NO_KEEPALIVE,
        )
        self._token_file, self._trust = token_file, trust
        self._token: str | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ServingHttpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 300.0, alive: Callable[[], bool] | None = None) -> float:
        """Poll ``/health`` until it answers 200; returns the seconds waited. ``alive()`` (e.g.
        ``lambda: proc.poll() is None``) ends the wait early when the worker process has died."""
        t0 = time.monotonic()
        while True:
            try:
                if self._http.get("/health", timeout=5).status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            if alive is not None and not alive():
                raise ServeError(f"{self.WHAT} exited before its API became ready")
            if time.monotonic() - t0 > timeout:
                raise ServeError(f"{self.WHAT}'s API was not ready after {timeout:.0f} s")
            time.sleep(0.25)

    def resubmit_one(self, r: Any, token: str | None, headers: dict[str, str] | None, stream: bool) -> Completion:
        """One resubmission's call to the engine's API (``r``: an
        :class:`agent.engines.types.Resubmission`; ``headers``: the middleware's, or none)."""
        raise NotImplementedError

    def tee_headers(self, r: Any, token: str | None) -> dict[str, str] | None:
        """The headers that hand a resubmission to the middleware (kept for its client's retry)."""
        if token is None or (not r.api and not self.TEE_WITHOUT_API):
            return None
        info = {"id": r.request_id, "api": r.api, "prompt_len": r.num_prompt_tokens}
        return {RESUBMIT_HEADER: json.dumps(info, separators=(",", ":")), TOKEN_HEADER: token}

    def submit(
        self,
        requests: Iterable[Any],
        *,
        max_concurrency: int = 64,
        stream: bool | None = None,
        on_done: Callable[[str], None] | None = None,
    ) -> dict[str, Completion]:
        """Resubmit a restored ledger (:class:`agent.engines.types.Resubmission` each); returns each
        request's completion under its original id.

        The completions hold only the new tokens; a request's whole output is
        ``r.output_token_ids + result[r.request_id].token_ids``. With gpuckpt's middleware on the
        worker (its token file readable), each runs under its ledger id and its continuation is
        kept there for the client's retry. The requests run concurrently, so they batch in the
        engine as they did before the checkpoint. ``stream=False`` asks for one response per
        request (nobody watches the agent's own resubmission; the continuation is still kept token
        by token for the retries). ``on_done(request_id)``: each that completed.
        """
        reqs = list(requests)
        if not reqs:
            return {}
        stream = self.STREAM if stream is None else stream
        token = self.token()
        # a request whose input the ledger does not carry is never resubmitted (it would run on
        # another input); its client's retry sends the input again
        left, _ = split_left(reqs)
        if token is not None:
            # a continuation its client cannot collect (the middleware serves such a retry as a new
            # request) would be computed twice: leave it to the retry
            for r in reqs:
                if r.request_id not in left and (why := (r.api or {}).get("unattachable")):
                    left[r.request_id] = Completion(r.request_id, left_to_client=why)
            self.expect(reqs, token, left={rid: c.left_to_client or "" for rid, c in left.items()})
        reqs = [r for r in reqs if r.request_id not in left]
        if not reqs:
            return left
        with ThreadPoolExecutor(max_workers=min(max_concurrency, len(reqs))) as pool:
            futs = {
                r.request_id: pool.submit(self.resubmit_one, r, token, self.tee_headers(r, token), stream) for r in reqs
            }
            if on_done is not None:
                for rid, f in futs.items():
                    f.add_done_callback(functools.partial(tell_done, on_done, rid))
            return {**left, **{rid: f.result() for rid, f in futs.items()}}
