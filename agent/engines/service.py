"""The worker side of the control protocol, written once for every engine.

An engine's adapter (vLLM's scheduler half, SGLang's cache linker) is a
:class:`WorkerService`: it serves :mod:`agent.engines.protocol` on the
control socket and implements only what differs by engine — how the worker
is described, what a capture copies at the step boundary, how its stream
goes on, how page keys are computed. This class holds what does not differ:

- **dispatch**: every request is parsed by :func:`~agent.engines.protocol.parse_request`
  (unknown commands, keys and versions are refused by name) and handed to
  ``on_<command>``;
- **waiters**: ``capture`` and ``wait`` register a :class:`Waiter` that the
  engine's step boundary answers (:meth:`answer`), with one timeout rule;
- **the offer**: page files and request states of a restore, its
  generations (a later part of an ended offer is refused and its file
  deleted), its TTL, and the files of an ended offer, deleted at the next
  step boundary (:meth:`retire_files`) once no load can name them;
- **durable keys** (:class:`~agent.engines.offers.OfferBook`);
- **sweep**: capture page files no stream owns (a killed agent's);
- **the hook guard** (:func:`guard`): nothing an adapter's hook raises reaches
  the engine.

Threads: control calls run on the control server's threads; the engine's
hooks on its own. :attr:`lock` guards everything here and the engine's
state beside it; :attr:`cond` (on the same lock) wakes a control call
waiting for the engine.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agent import fs
from agent.engines import control, staging
from agent.engines.offers import AWAIT_S, WANT_S, OfferBook
from agent.engines.protocol import (
    Cancel,
    Capture,
    Describe,
    Durable,
    Hold,
    Keys,
    Next,
    Offer,
    Ping,
    ProtocolError,
    Stats,
    Sweep,
    Wait,
    Withdraw,
    parse_request,
)
from agent.fs import Trust
from ckpt.errors import GpuckptError

__all__ = ["InjectedFault", "Waiter", "WorkerService", "guard"]

log = logging.getLogger("gpuckpt.worker")

Reply = dict[str, Any]


class InjectedFault(GpuckptError):
    """Raised inside a hook named in ``inject_faults`` (tests of the hooks' guards)."""


_F = TypeVar("_F", bound=Callable[..., Any])


def guard(recover: Callable[..., Any]) -> Callable[[_F], _F]:
    """Run an adapter's hook so that nothing it raises reaches the engine.

    The hook's object has ``faults`` (names of hooks to fail on purpose) and
    ``failures`` (name → count). On an exception (or an injected fault) the
    failure is logged and counted, and ``recover(self, *args, **kwargs)``
    gives the hook's safe answer. ``recover`` must not raise; if it does,
    ``None`` is returned.
    """

    def deco(fn: _F) -> _F:
        name = fn.__name__

        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                if name in self.faults:
                    raise InjectedFault(f"injected fault in {name}")
                return fn(self, *args, **kwargs)
            except Exception:
                log.exception("gpuckpt: %s failed; the engine goes on without it", name)
                self.failures[name] = self.failures.get(name, 0) + 1
                try:
                    return recover(self, *args, **kwargs)
                except Exception:
                    log.exception("gpuckpt: recovering from a failed %s failed", name)
                    return None

        return wrapper  # type: ignore[return-value]

    return deco


@dataclass
class Waiter:
    """A ``capture`` or ``wait`` call waiting for a step boundary (answered on the engine's thread)."""

    kind: str  # "capture" or "wait"
    # {"live": n, "min_outputs": k}: a step boundary where at least n unfinished requests have k
    # outputs each (judged on the engine's thread)
    when: dict[str, int] | None = None
    full: bool = False  # copy every page, durable or not
    prefix_only: bool = False  # a pre-copy: non-durable full blocks only, no ledger
    max_staging: int | None = None  # this capture's staging bound (bytes), else the adapter's
    copy_per_step: int | None = None  # bytes of full blocks copied per step after the consistent point
    event: threading.Event = field(default_factory=threading.Event)
    reply: Reply | None = None
    requested: float = field(default_factory=time.monotonic)


class WorkerService:
    """The engine-neutral worker side (see the module docstring). Subclasses implement the
    ``describe_worker``, ``wake`` and stream hooks and the engine's commands."""

    #: whether this engine holds a streaming restore's ``awaiting`` requests until their pages come
    AWAITS = False

    def __init__(self, *, staging_dir: str, trust: Trust, faults: set[str] | None = None) -> None:
        self.staging_dir = staging_dir
        self.trust = trust
        self.faults: set[str] = set(faults or ())
        self.failures: dict[str, int] = {}
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.capture_calls: list[Waiter] = []  # capture calls waiting for their consistent point
        self.wait_calls: list[Waiter] = []  # wait calls waiting for their condition
        # The restore offer (key → page file; an offered file is the adapter's, deleted when the
        # offer ends, once the engine can no longer load from it) and the durable keys, which an
        # incremental capture does not copy.
        self.offers = OfferBook(self._expire_offer)
        self.retired: list[str] = []  # ended offers' files: deleted at the next step boundary
        self.last_stream: dict[str, Any] = {}
        self.stream: Any = None  # the capture stream in flight (one at a time; lock held)
        self._facts: dict[str, Any] | None = None
        self._facts_lock = threading.Lock()
        self._server: control.ControlServer | None = None

    # ------------------------------------------------------------------ lifecycle

    def serve(self, socket: str | os.PathLike[str]) -> None:
        """Serve the protocol on ``socket`` (never in a directory another account made or can write
        to: it could answer for us); with a shared group, the agent's account reaches it through it."""
        path = Path(socket)
        fs.ensure_socket_dir(path.parent, self.trust)
        self._server = control.ControlServer(path, self.handle)
        if self.trust.gid is not None:
            os.chown(path, -1, self.trust.gid)
            os.chmod(path, 0o660)

    def close_server(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    # ------------------------------------------------------------------ what an engine implements

    def describe_worker(self) -> dict[str, Any]:
        """The worker's pins, layout and namespace fields (computed once; may take seconds)."""
        raise NotImplementedError

    def wake(self) -> None:
        """Make an idle engine reach a step boundary soon (a control call waits for one)."""

    def forget_waiter(self, w: Waiter) -> None:
        """A capture call gave up (lock held): drop ``w`` from the engine's own bookkeeping."""

    def end_stream_of(self, w: Waiter, seq: int, why: str) -> None:
        """A capture answered as its caller gave up: abandon its stream ``seq`` (lock held)."""
        self.stream_cancel(seq, why)

    def waiting_for(self, w: Waiter) -> str:
        """What a timed-out call was waiting for, for its error (lock held)."""
        return f"waiting for {w.when}" if w.when else "is the engine idle?"

    def check_page_file(self, pf: staging.PageFile) -> None:
        """Refuse (raise) an offered page file this engine cannot load from."""

    def keep_page_file(self, path: str, pf: staging.PageFile) -> bool:
        """Whether the adapter keeps ``pf`` open for loads (else it is closed after its keys are read)."""
        return False

    def check_states(self, raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """The offered request states this engine applies, and why the others are not (by client id)."""
        return {}, {}

    def take_states(self, states: dict[str, Any]) -> None:
        """Keep offered request states for their requests' first schedule (lock held)."""

    def offer_ended(self) -> None:
        """The offer ended (lock held): drop what it carried beside its pages."""

    def stream_cancel(self, seq: int, why: str) -> bool:
        """End capture stream ``seq`` (any, for a negative one) with ``why`` (lock held); whether
        there was one."""
        st = self.stream
        if st is not None and (seq < 0 or st.seq == seq):
            self.end_stream(st, why)
            return True
        return False

    def stream_names(self) -> set[str]:
        """The page-file names of captures in flight (lock held): :meth:`on_sweep` keeps them."""
        return {self.stream.name} if self.stream is not None else set()

    def engine_stats(self) -> dict[str, Any]:
        """This engine's counters beside the common ones (lock held)."""
        return {}

    def end_stream(self, st: Any, error: str | None) -> None:
        """Close capture stream ``st`` (lock held): answer or fail its waiters, leave its staged
        files to be deleted, record it in :attr:`last_stream` and clear :attr:`stream`."""
        raise NotImplementedError

    def on_next(self, msg: Next) -> Reply:
        """The agent consumed the chunks ``ack`` names (their files are gone); answer with every
        chunk complete by then (``parts``, at least one: one round trip per batch, not per chunk —
        under load a round trip costs the agent tens of milliseconds), or ``done`` after the last
        one. The stream is :attr:`stream` (an :class:`agent.engines.streams.StreamBook`)."""
        seq = msg.seq
        deadline = time.monotonic() + msg.timeout
        with self.lock:
            st = self.stream
            if st is None or st.seq != seq:
                last = self.last_stream
                if last.get("seq") == seq and last.get("error") is None:
                    return {"ok": True, "done": True, **last}
                why = last.get("error") if last.get("seq") == seq else "no such capture in flight"
                return {"ok": False, "error": f"capture {seq}: {why}"}
            for k in msg.ack:
                st.ack(k)
            if st.done:
                self.end_stream(st, None)
                return {"ok": True, "done": True, **self.last_stream}
            st.touched = time.monotonic()
        self.wake()  # a chunk may be issued now: an idle engine must step
        with self.cond:
            while True:
                if self.stream is not st or st.error is not None:
                    return {"ok": False, "error": f"capture {seq} failed: {st.error}"}
                parts = []
                while (part := st.hand_out()) is not None:
                    parts.append(part)
                if parts:
                    return {"ok": True, "seq": seq, "done": False, "parts": parts}
                left = deadline - time.monotonic()
                if left <= 0:
                    why = "no chunk within the timeout (is the engine stepping?)"
                    return {"ok": False, "error": f"capture {seq}: {why}"}
                self.cond.wait(min(left, 1.0))

    def on_keys(self, msg: Keys) -> Reply:
        raise NotImplementedError

    def on_hold(self, msg: Hold) -> Reply:
        return {"ok": False, "error": "hold: this engine's adapter does not hold requests"}

    # ------------------------------------------------------------------ dispatch

    def handle(self, raw: dict[str, Any]) -> Reply:
        """One control request (a JSON object) → its reply. A request that is not the protocol's
        is refused naming why (``refused: "protocol"``); a handler's exception becomes an error
        reply in the transport."""
        try:
            msg = parse_request(raw)
        except ProtocolError as exc:
            return {"ok": False, "error": str(exc), "refused": "protocol"}
        handler: Callable[[Any], Reply] = getattr(self, f"on_{msg.CMD}")
        return handler(msg)

    def description(self) -> dict[str, Any]:
        with self._facts_lock:  # one computation, whoever asks first (a warm-up or a command)
            if self._facts is None:
                self._facts = self.describe_worker()
            return self._facts

    def warm_description(self) -> None:
        """Work the description out now, beside the engine's start: a restore at start asks for it
        first, and every second of it would come before the first resumed token."""

        def run() -> None:
            try:
                self.description()
            except Exception:  # ``describe`` computes it again and reports the error
                log.debug("gpuckpt: describing the worker ahead of time failed", exc_info=True)

        threading.Thread(target=run, name="gpuckpt-describe", daemon=True).start()

    # ------------------------------------------------------------------ the step boundary's side

    @staticmethod
    def answer(waiters: list[Waiter], reply: Reply) -> None:
        for w in waiters:
            w.reply = reply
            w.event.set()

    def retire_files(self) -> list[str]:
        """Delete the page files of ended offers (lock held; at a step boundary, so that no load
        planned from now on names them); returns them for the loaders to close. A load planned
        before the offer ended and run after finds its file gone: a load error, recomputed."""
        out, self.retired = self.retired, []
        for path in out:
            try:
                staging.unlink_pair(path)
            except OSError as exc:
                log.warning("gpuckpt: could not delete the page file %s: %s", path, exc)
        return out

    def end_offer(self) -> None:
        """Withdraw every offered page and state (lock held); their files go at the next boundary."""
        self.offer_ended()
        self.retired.extend(self.offers.end())

    def _expire_offer(self) -> None:
        with self.lock:
            n = len(self.offers.keys)
            files = self.offers.expired()
            if files is not None:
                log.info("gpuckpt: the restore offer expired (%d pages)", n)
                self.offer_ended()
                self.retired.extend(files)
        self.wake()  # an idle engine must step for the files to go

    # ------------------------------------------------------------------ the commands every engine shares

    def on_ping(self, msg: Ping) -> Reply:
        return {"ok": True, "pid": os.getpid()}

    def on_describe(self, msg: Describe) -> Reply:
        return {"ok": True, **self.description()}

    def on_capture(self, msg: Capture) -> Reply:
        w = Waiter("capture", msg.when, msg.full, msg.prefix_only, msg.max_staging, msg.copy_per_step)
        return self._wait_for_boundary(w, msg.timeout)

    def on_wait(self, msg: Wait) -> Reply:
        return self._wait_for_boundary(Waiter("wait", msg.when), msg.timeout)

    def _queue(self, w: Waiter) -> list[Waiter]:
        """The list ``w`` waits in (lock held); the engine replaces these lists, so never keep one."""
        return self.capture_calls if w.kind == "capture" else self.wait_calls

    def _wait_for_boundary(self, w: Waiter, timeout: float) -> Reply:
        with self.lock:
            self._queue(w).append(w)
        self.wake()
        if w.event.wait(timeout):
            assert w.reply is not None
            return w.reply
        with self.lock:
            queue = self._queue(w)
            if w in queue:
                queue.remove(w)
            self.forget_waiter(w)
            late = w.reply
            if late is not None and w.kind == "capture" and late.get("ok"):
                # answered as the wait ran out: nobody will read that stream
                self.end_stream_of(w, int(late.get("seq", -1)), "the capture call timed out")
                return {"ok": False, "error": "the capture call timed out as it was answered"}
            if late is not None:
                return late
            what = self.waiting_for(w)
        if w.kind == "wait":
            why = f"the wait timed out: the engine did not reach {w.when} in {timeout:g} s: {what}"
            return {"ok": False, "error": why}
        failing = ", ".join(f"{k} ({n}×)" for k, n in sorted(self.failures.items()))
        why = f"; failing hooks: {failing}" if failing else ""
        return {
            "ok": False,
            "error": f"the capture timed out: no step boundary planned it within {timeout:g} s ({what}){why}",
        }

    def on_cancel(self, msg: Cancel) -> Reply:
        """The agent gives up on a capture (its save failed): stop copying, delete its chunks."""
        with self.lock:
            cancelled = self.stream_cancel(msg.seq, "cancelled by the agent")
        return {"ok": True, "cancelled": cancelled}

    def on_offer(self, msg: Offer) -> Reply:
        """Offer a page file's pages and request states (see :class:`~agent.engines.protocol.Offer`)."""
        keys: list[bytes] = []
        pf: staging.PageFile | None = None
        if msg.index:
            pf = staging.PageFile(msg.index, trust=self.trust)
            try:
                self.check_page_file(pf)
                keys = list(pf.index.keys)
            except BaseException:
                pf.close()
                raise
        states, rejected = self.check_states(msg.requests)
        with self.lock:
            if not self.offers.admit(msg.generation):
                # a streaming restore's later part, after its offer ended (withdrawn, expired)
                if pf is not None:
                    pf.close()
                    staging.unlink_pair(msg.index or "")
                return {"ok": False, "error": f"the offer of generation {msg.generation} has ended", "ended": True}
            if pf is not None and msg.index:
                if not self.keep_page_file(msg.index, pf):
                    pf.close()
                self.offers.add(msg.index, keys)
            self.take_states(states)
            if self.AWAITS:
                self.offers.expect(msg.awaiting, msg.ready, AWAIT_S if msg.await_s is None else msg.await_s)
                if msg.coming is not None:
                    self.offers.expect_keys(msg.coming, WANT_S if msg.want_s is None else msg.want_s)
                if msg.done:
                    self.offers.no_more()
            wanted = [k.hex() for k in self.offers.take_wanted()]
            if msg.ttl is not None:
                self.offers.expire_after(msg.ttl)
            generation = self.offers.generation
        self.offered()
        reply: Reply = {
            "ok": True,
            "offered": len(keys),
            "requests": len(msg.requests) if not self.AWAITS else len(states),
            "rejected": rejected,
            "generation": generation,
        }
        if self.AWAITS:
            reply.update(awaits=True, wanted=wanted)
        return reply

    def offered(self) -> None:
        """An offer (or a part) was taken: wake whatever waits for pages."""

    def on_withdraw(self, msg: Withdraw) -> Reply:
        """End the restore offer (its files go at the next step boundary)."""
        with self.lock:
            files = len(self.offers.files)
            self.end_offer()
        self.wake()
        return {"ok": True, "files": files}

    def on_durable(self, msg: Durable) -> Reply:
        with self.lock:
            return self.offers.mark({"add": list(msg.add), "remove": list(msg.remove)})

    def on_sweep(self, msg: Sweep) -> Reply:
        """A (re)started agent: end any capture stream (its reader is gone) and delete capture page
        files no stream owns — left by a killed agent (mid-save) or a killed worker."""
        with self.lock:
            self.stream_cancel(-1, "the agent restarted (sweep)")
            live = self.stream_names()
        removed: list[str] = []
        d = Path(self.staging_dir)
        if not d.is_dir():
            return {"ok": True, "removed": removed}

        def owned(stem: str) -> bool:  # "<capture name>" or "<capture name>-r<rank>"
            return any(stem == n or stem.startswith(n + "-") for n in live)

        for p in sorted(d.glob("capture-*.json")):
            if not owned(p.stem):
                staging.unlink_pair(p)
                removed.append(p.name)
        for p in sorted(d.glob("capture-*.bin")):  # data whose index was never written (killed mid-write)
            if not owned(p.stem) and not p.with_suffix(".json").exists():
                p.unlink(missing_ok=True)
                removed.append(p.name)
        return {"ok": True, "removed": removed}

    def on_stats(self, msg: Stats) -> Reply:
        with self.lock:
            return {
                "ok": True,
                "offered": len(self.offers.keys),
                "offer_files": sorted(self.offers.files),
                "files_to_delete": len(self.retired),
                "durable": len(self.offers.durable),
                "captures_pending": len(self.capture_calls),
                "waits_pending": len(self.wait_calls),
                "last_stream": dict(self.last_stream),
                "hook_failures": dict(self.failures),
                **self.engine_stats(),
            }
