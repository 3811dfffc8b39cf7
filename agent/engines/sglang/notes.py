"""Rank 0's step notes on SGLang's request broadcast, and the other ranks' way back (no SGLang or
torch import: tested on its own).

A tensor-parallel SGLang server keeps its ranks in step by giving every
rank's scheduler the same requests in the same loop iteration: rank 0
receives them and ``broadcast_pyobj`` hands the list to every rank
(``SchedulerRequestReceiver.recv_requests``,
``srt/managers/scheduler_components/request_receiver.py``). :class:`Relay`
wraps that receiver so that rank 0's linker can add a *step note* to the
list — a string, :data:`NOTE` + JSON, among SGLang's own ``local_reqs`` — and
every rank's linker takes the notes out before SGLang dispatches the
requests. Why and what the notes say: :mod:`.ranks`.

The way back, the other ranks' reports of their page files, is a Unix socket
rank 0 serves beside its control socket (:func:`rank_socket`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["NOTE", "Relay", "decode_note", "encode_note", "rank_socket"]

log = logging.getLogger("gpuckpt.sglang")

#: A step note's prefix: a string among SGLang's received requests that is gpuckpt's.
NOTE = "gpuckpt-step:"


def encode_note(ops: list[dict[str, Any]]) -> str:
    return NOTE + json.dumps(ops, separators=(",", ":"))


def decode_note(item: Any) -> list[dict[str, Any]] | None:
    """The operations of a step note, or None for anything else SGLang received."""
    if not isinstance(item, str) or not item.startswith(NOTE):
        return None
    ops = json.loads(item[len(NOTE) :])
    if not isinstance(ops, list) or not all(isinstance(op, dict) and isinstance(op.get("op"), str) for op in ops):
        raise ValueError(f"a gpuckpt step note that is not a list of operations: {item[:200]!r}")
    return ops


def rank_socket(control_socket: str) -> str:
    """Where the leader takes the other ranks' chunk reports: beside the agent's control socket."""
    return f"{control_socket}.ranks"


class Relay:
    """SGLang's request receiver, with gpuckpt's step notes riding its broadcast (see the module
    docstring). ``outgoing()`` (rank 0 only) gives the note to send or None; ``sent(note, out)``
    says whether it went out (SGLang's receive may skip an iteration, ``--scheduler-recv-interval``);
    ``incoming(ops)`` takes each received note's operations, on every rank. Whatever fails here
    is logged and SGLang's requests go on as received."""

    def __init__(
        self,
        inner: Any,
        *,
        leader: bool,
        outgoing: Callable[[], str | None],
        sent: Callable[[str, bool], None],
        incoming: Callable[[list[dict[str, Any]]], None],
    ) -> None:
        self.inner = inner
        self.leader = leader
        self._outgoing = outgoing
        self._sent = sent
        self._incoming = incoming

    def recv_requests(self, local_reqs: list[Any] | None = None) -> list[Any]:
        note = None
        if self.leader:
            try:
                note = self._outgoing()
            except Exception:
                log.exception("gpuckpt: preparing a step note failed")
        if note is not None:
            local_reqs = [*(local_reqs or []), note]
        reqs: list[Any] = self.inner.recv_requests(local_reqs=local_reqs)
        if not reqs:
            if note is not None:
                self._sent(note, False)
            return reqs
        mine: list[list[dict[str, Any]]] = []
        rest = []
        for r in reqs:
            try:
                ops = decode_note(r)
            except Exception:
                log.exception("gpuckpt: a step note could not be read; dropped")
                continue
            if ops is None:
                rest.append(r)
            else:
                mine.append(ops)
        if note is not None:
            self._sent(note, any(r is note or r == note for r in reqs))
        for ops in mine:
            try:
                self._incoming(ops)
            except Exception:
                log.exception("gpuckpt: applying a step note failed")
        return rest

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
