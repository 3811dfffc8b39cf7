"""The agent's side of the control protocol: one typed method per command.

:class:`WorkerChannel` is the only way the agent talks to a worker's adapter.
It builds each request from :mod:`agent.engines.protocol`'s messages, sends it
over :mod:`agent.engines.control`, and reads the reply as that message's
typed reply. It is the one place where the transport's failures become
gpuckpt errors:

- nothing answering on the socket (no worker yet, or it died):
  :class:`ckpt.errors.WorkerUnreachable`;
- the adapter refused or failed the call (``ok: false``), the connection broke
  or timed out, the reply was too large or not JSON:
  :class:`agent.engines.control.ControlError` (an :class:`~ckpt.errors.EngineRefused`);
- a reply that is not the protocol's: :class:`agent.engines.protocol.ProtocolError`.

No other exception escapes a call (an ``OSError`` of the socket is one of
the first two). A call blocks for at most its ``io_timeout``: the
adapter's own wait (``timeout``) plus a margin.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from agent.engines import control
from agent.engines.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Capture,
    CaptureReply,
    Counted,
    Describe,
    Description,
    Durable,
    Hold,
    KeyRequest,
    Keys,
    KeysReply,
    Message,
    Next,
    NextReply,
    Offer,
    OfferReply,
    Ping,
    Pong,
    Reply,
    Stats,
    Sweep,
    Swept,
    Wait,
    Withdraw,
)
from ckpt.errors import GpuckptError, WorkerUnreachable

__all__ = ["MARGIN_S", "WorkerChannel"]

#: how much longer than the adapter's own wait a blocking call waits for its reply
MARGIN_S = 5.0

_R = TypeVar("_R", bound=Reply)


class WorkerChannel:
    """The control socket of one worker's adapter (a path; each call connects anew).

    Thread-safe: calls share nothing but the path, so a blocking ``capture``
    or ``next`` and a ``stats`` may run at once from different threads.
    """

    def __init__(self, socket: str | os.PathLike[str], *, io_timeout: float = 60.0) -> None:
        self.socket = str(socket)
        self.io_timeout = io_timeout

    def __repr__(self) -> str:
        return f"WorkerChannel({self.socket!r})"

    def call(self, msg: Message, *, io_timeout: float | None = None) -> Reply:
        """Send ``msg``; its typed reply (``msg.REPLY``). Errors: see the module docstring."""
        wait = self.io_timeout if io_timeout is None else io_timeout
        try:
            raw = control.call(self.socket, msg.CMD, io_timeout=wait, v=PROTOCOL_VERSION, **msg.to_json())
        except GpuckptError:
            raise
        except TimeoutError as exc:
            raise control.ControlError(f"gpuckpt control {msg.CMD!r}: no progress within {wait:.0f} s") from exc
        except OSError as exc:
            raise WorkerUnreachable(f"gpuckpt control {msg.CMD!r} on {self.socket}: {exc}") from exc
        return msg.REPLY.parse(raw)

    def _call(self, msg: Message, kind: type[_R], io_timeout: float | None = None) -> _R:
        r = self.call(msg, io_timeout=io_timeout)
        assert isinstance(r, kind)
        return r

    # -- one method per command (see agent.engines.protocol for each one's meaning)

    def ping(self) -> Pong:
        return self._call(Ping(), Pong)

    def describe(self) -> Description:
        return self._call(Describe(), Description)

    def capture(
        self,
        *,
        when: Mapping[str, int] | None = None,
        full: bool = False,
        prefix_only: bool = False,
        max_staging: int | None = None,
        copy_per_step: int | None = None,
        timeout: float = 60.0,
    ) -> CaptureReply:
        msg = Capture(dict(when) if when else None, full, prefix_only, max_staging, copy_per_step, timeout)
        return self._call(msg, CaptureReply, timeout + MARGIN_S)

    def wait(self, *, when: Mapping[str, int] | None = None, timeout: float = 60.0) -> Reply:
        return self._call(Wait(dict(when) if when else None, timeout), Reply, timeout + MARGIN_S)

    def next(self, *, seq: int, ack: Iterable[int] = (), timeout: float = 60.0) -> NextReply:
        return self._call(Next(seq, tuple(ack), timeout), NextReply, timeout + MARGIN_S)

    def cancel(self, seq: int) -> Counted:
        return self._call(Cancel(seq), Counted)

    def offer(
        self,
        *,
        index: str | None = None,
        requests: Mapping[str, Any] | None = None,
        ttl: float | None = None,
        generation: int | None = None,
        awaiting: Iterable[str] = (),
        ready: Iterable[str] = (),
        await_s: float | None = None,
        coming: Iterable[str] | None = None,
        want_s: float | None = None,
        done: bool = False,
    ) -> OfferReply:
        msg = Offer(
            index=index,
            requests=dict(requests or {}),
            ttl=ttl,
            generation=generation,
            awaiting=tuple(awaiting),
            ready=tuple(ready),
            await_s=await_s,
            coming=None if coming is None else tuple(coming),
            want_s=want_s,
            done=done,
        )
        return self._call(msg, OfferReply)

    def keys(self, requests: Iterable[KeyRequest | Mapping[str, Any]]) -> KeysReply:
        reqs = tuple(r if isinstance(r, KeyRequest) else KeyRequest.parse(dict(r)) for r in requests)
        return self._call(Keys(reqs), KeysReply)

    def hold(self, requests: int, *, timeout: float = 60.0) -> Reply:
        return self._call(Hold(requests, timeout), Reply)

    def withdraw(self) -> Counted:
        return self._call(Withdraw(), Counted)

    def durable(self, *, add: Iterable[str] = (), remove: Iterable[str] = ()) -> Counted:
        return self._call(Durable(tuple(add), tuple(remove)), Counted)

    def sweep(self) -> Swept:
        return self._call(Sweep(), Swept)

    def stats(self) -> dict[str, Any]:
        """The adapter's counters (engine-specific keys beside the common ones)."""
        return dict(self._call(Stats(), Reply).raw)
