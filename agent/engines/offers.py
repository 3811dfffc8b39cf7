"""A worker half's restore offer and durable keys, engine-neutral (the vLLM connector and the
SGLang linker keep theirs in one of these).

From the ``offer`` on, an offered page file belongs to the worker half: it is deleted when the
offer ends — ``withdraw``, or ``ttl`` seconds after the offer — and a streaming restore's later
parts carry the first part's ``generation``, so a part that arrives after its offer ended is
refused (and its file deleted by the caller). ``durable`` are the keys the repository holds
(acknowledged by the agent after a commit, or read from it by a restore): an incremental
capture does not copy them.

Not locked: the owner's lock guards every call, and the owner's ``on_expire`` (called from the
TTL timer's thread) takes that lock before it calls :meth:`OfferBook.expired`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["AWAIT_S", "MAX_AWAIT_S", "WANT_S", "OfferBook"]

#: How long a streaming restore's requests wait for their pages with no part arriving before they
#: go on without them (what is missing recomputes): an agent that died mid-restore holds no
#: request for longer.
AWAIT_S = 10.0
#: ...and the most an agent may ask for
MAX_AWAIT_S = 120.0
#: How long a request that matches pages the restore has yet to bring (a returning conversation
#: whose history is still streaming) waits for them once it asked; then it recomputes what is
#: not there. Short: the agent brings asked-for pages in its next part.
WANT_S = 2.0

log = logging.getLogger("gpuckpt.offers")


def _bounded(seconds: Any) -> float:
    """An agent's wait, in ``[0, MAX_AWAIT_S]``."""
    return min(max(0.0, float(seconds)), MAX_AWAIT_S)


class OfferBook:
    def __init__(self, on_expire: Callable[[], None]) -> None:
        #: key → page file index path; replaced, never mutated, so a reader without the lock
        #: holds a consistent snapshot
        self.keys: dict[bytes, str] = {}
        self.files: set[str] = set()
        self.generation = 0  # one per restore offer; ends with it
        self.durable: set[bytes] = set()
        #: a streaming restore's requests whose pages later parts bring (client ids); see :meth:`holds`
        self.awaiting: set[str] = set()
        self._await_until = 0.0
        #: keys the restore's later parts will bring (the rest of the prefix cache): a request that
        #: matches them waits for them (:meth:`want`) rather than recompute them
        self.coming: set[bytes] = set()
        #: coming keys requests wait on, in the order asked: the agent brings them next (:meth:`take_wanted`)
        self.wanted: dict[bytes, None] = {}
        self._wanting: dict[str, float] = {}  # request id → until when it waits
        self.want_s = WANT_S
        self._on_expire = on_expire
        self._expiry: threading.Timer | None = None

    def admit(self, generation: Any) -> bool:
        """Whether a part of ``generation`` may be offered (``None``: a new restore's first part,
        which starts a new generation); False for a part of an offer that has ended."""
        if generation is not None:
            return int(generation) == self.generation
        self.generation += 1
        return True

    def add(self, path: str, keys: Iterable[bytes]) -> int:
        """Offer ``keys`` from the page file ``path`` (now the owner's to delete); how many."""
        self.files.add(path)
        keys = list(keys)
        if keys:
            new = dict(self.keys)
            for k in keys:
                new[k] = path
            self.keys = new
            self.durable.update(keys)  # read from the repository: it holds them
            if self.coming:
                self.coming.difference_update(keys)
                for k in keys:
                    self.wanted.pop(k, None)
        return len(keys)

    def expect_keys(self, coming: Iterable[Any], want_s: Any = WANT_S) -> None:
        """The agent's word on the rest of the restore: the hex keys its later parts bring (see
        :meth:`want`); a request waits at most ``want_s`` (bounded by :data:`MAX_AWAIT_S`) for them."""
        self.coming = {bytes.fromhex(str(k)) for k in coming} - self.keys.keys()
        self.want_s = _bounded(want_s)

    def want(self, request_id: str, keys: list[bytes]) -> bool:
        """Whether request ``request_id``, whose next pages ``keys`` are coming, waits for them: yes
        for :attr:`want_s` from its first ask (``keys`` are then asked for), no after that."""
        now = time.monotonic()
        until = self._wanting.setdefault(request_id, now + self.want_s)
        if now >= until:
            return False
        for k in keys:
            self.wanted[k] = None
        return True

    def asked(self) -> int:
        """Requests that asked for coming pages (since the rest began)."""
        return len(self._wanting)

    def take_wanted(self) -> list[bytes]:
        """The asked-for keys still coming (then forgotten: a request still waiting asks again).
        A request's wait is not renewed by asking again: its first ask set it (kept until the
        rest is over, one float per request that asked)."""
        out = [k for k in self.wanted if k in self.coming]
        self.wanted = {}
        return out

    def no_more(self) -> None:
        """The rest is over (all offered, or it stopped): nothing more is coming, no request waits."""
        self.coming, self.wanted, self._wanting = set(), {}, {}

    def expect(self, awaiting: Iterable[Any], ready: Iterable[Any], await_s: Any = AWAIT_S) -> None:
        """A part's word on the requests: ``awaiting`` wait for pages later parts bring, ``ready``
        have all theirs now; those still waiting get ``await_s`` (at most :data:`MAX_AWAIT_S`)
        more before they go on without them."""
        self.awaiting.update(str(c) for c in awaiting)
        self.awaiting.difference_update(str(c) for c in ready)
        if self.awaiting:
            self._await_until = time.monotonic() + _bounded(await_s)

    def holds(self, request_id: str) -> bool:
        """Whether request ``request_id`` still waits for its pages. Once the wait ran out with no
        part, none does any more: they go on with what was offered, and the rest recomputes."""
        if request_id not in self.awaiting:
            return False
        if time.monotonic() < self._await_until:
            return True
        log.warning("gpuckpt: %d restored requests waited too long for their pages", len(self.awaiting))
        self.awaiting = set()
        return False

    def expire_after(self, ttl: float) -> None:
        """The offer ends ``ttl`` seconds from now (idle engine or not)."""
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = threading.Timer(float(ttl), self._on_expire)
        self._expiry.daemon = True
        self._expiry.start()

    def end(self) -> list[str]:
        """Withdraw every offered key; the page files to delete (once no load reads them)."""
        self.generation += 1  # later parts of a streaming restore are refused
        self.keys = {}
        self.awaiting = set()
        self.no_more()
        files, self.files = sorted(self.files), set()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        return files

    def expired(self) -> list[str] | None:
        """The TTL ran out: :meth:`end`'s files, or None when nothing was offered any more."""
        self._expiry = None
        return self.end() if self.keys or self.files else None

    def mark(self, req: dict[str, Any]) -> dict[str, Any]:
        """``durable {"add", "remove"}`` (hex keys) → the reply: the agent's word on what the repository holds."""
        try:
            add = [bytes.fromhex(k) for k in req.get("add") or []]
            remove = [bytes.fromhex(k) for k in req.get("remove") or []]
        except (TypeError, ValueError):
            return {"ok": False, "error": "durable: keys must be hex strings"}
        self.durable.update(add)
        self.durable.difference_update(remove)
        return {"ok": True, "durable": len(self.durable)}
