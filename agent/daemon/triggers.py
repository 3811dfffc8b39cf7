"""What starts a checkpoint: the triggers, the tickets they share, and the scheduler's clock.

* :class:`Tickets` — one checkpoint at a time. Triggers that arrive before a
  checkpoint's capture has begun join it (two triggers at once are one
  checkpoint); later ones queue one more. Each has a deadline; past it the
  save is abandoned by the repository and nothing becomes visible. An urgent
  trigger (:data:`URGENT`) does not wait out a running checkpoint of others.
* :class:`Scheduler` — the scheduler thread: periodic checkpoints, the
  preemption-notice poll (:mod:`agent.daemon.preemption`), pre-copies and
  scheduled ``gc``, each of which it asks of the agent (:class:`Scheduled`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.daemon import preemption as preemption_mod
from agent.daemon.config import AgentConfig
from agent.daemon.reporting import now

__all__ = ["TRIGGERS", "URGENT", "URGENT_GRACE_S", "Scheduled", "Scheduler", "Ticket", "Tickets"]

log = logging.getLogger("gpuckpt.agent")

TRIGGERS = ("periodic", "request", "stop", "preemption", "drain", "rebalance")
#: triggers whose checkpoint has a window to make: a running save of other triggers makes way
URGENT = frozenset({"stop", "preemption", "drain"})
#: how long a running requested checkpoint may go on once an urgent one waits (a periodic one: 0)
URGENT_GRACE_S = 5.0


@dataclass
class Ticket:
    """One checkpoint, shared by every trigger that joined it."""

    id: int
    triggers: list[str]
    requested_at: str = field(default_factory=now)
    deadline_s: float = 300.0
    state: str = "pending"  # pending → capturing → saving → done | failed
    started_at: str | None = None
    progress: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event, repr=False)
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "triggers": list(self.triggers),
            "state": self.state,
            "requested_at": self.requested_at,
            "started_at": self.started_at,
            "progress": dict(self.progress),
            "checkpoint": self.checkpoint,
            "error": self.error,
        }


class Tickets:
    """The checkpoint queue: at most one running and one pending ticket (see the module docstring).

    ``lock`` guards every ticket's ``state`` change from ``pending`` (a
    trigger joins a pending ticket under it)."""

    #: tickets kept for status queries
    KEEP = 32

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)
        self._ids = itertools.count(1)
        self.pending: Ticket | None = None
        self.running: Ticket | None = None
        self._all: dict[int, Ticket] = {}

    def request(self, trigger: str, deadline_s: float, *, stopping: bool) -> Ticket:
        """Queue (or join) a checkpoint for ``trigger``; returns its ticket at once. While the agent
        is ``stopping``, only its final checkpoint (``stop``) is taken."""
        if trigger not in TRIGGERS:
            raise ValueError(f"unknown trigger {trigger!r}; one of {', '.join(TRIGGERS)}")
        with self._wake:
            if stopping and trigger != "stop":
                # The final checkpoint is the last one: nothing may land after it.
                t = Ticket(next(self._ids), [trigger], state="failed", error="the agent is stopping")
                t.done.set()
                return t
            r = self.running
            if r is not None and r.state == "pending":  # not captured yet: this trigger rides along
                r.triggers.append(trigger)
                return r
            if r is not None and trigger in URGENT and not URGENT & set(r.triggers) and not r.cancel.is_set():
                # A checkpoint in progress (perhaps saving to a slow or hung store) must not make a
                # preemption or final checkpoint miss its window. A periodic one is abandoned at once
                # (nothing of it becomes visible; one still capturing stops when its capture
                # returns); one somebody asked for gets URGENT_GRACE_S to finish first.
                grace = 0.0 if set(r.triggers) <= {"periodic"} else URGENT_GRACE_S
                log.warning(
                    "an urgent checkpoint is waiting on a running one",
                    extra={"ticket": r.id, "running": list(r.triggers), "trigger": trigger, "abandon_after_s": grace},
                )
                if grace:
                    threading.Timer(grace, lambda r=r: r.done.is_set() or r.cancel.set()).start()
                else:
                    r.cancel.set()
            if self.pending is None:
                self.pending = Ticket(next(self._ids), [trigger], deadline_s=deadline_s)
                self._all[self.pending.id] = self.pending
                self._wake.notify_all()
            else:
                self.pending.triggers.append(trigger)
                self.pending.deadline_s = min(self.pending.deadline_s, deadline_s)
            # Keep the last few tickets for status queries.
            for old in sorted(self._all)[: -self.KEEP]:
                if self._all[old].done.is_set():
                    del self._all[old]
            return self.pending

    def get(self, ticket_id: int) -> Ticket | None:
        with self.lock:
            return self._all.get(ticket_id)

    def take(self, stopped: threading.Event) -> Ticket | None:
        """The next pending ticket, now running; None once ``stopped`` with nothing pending."""
        with self._wake:
            while self.pending is None and not stopped.is_set():
                self._wake.wait()
            if self.pending is None:
                return None
            t, self.pending = self.pending, None
            self.running = t
            return t

    def finish(self, t: Ticket) -> None:
        """``t`` ran (done or failed): its waiters are told."""
        with self.lock:
            self.running = None
        t.done.set()

    def wake(self) -> None:
        """Wake :meth:`take` (to see that the agent stopped)."""
        with self._wake:
            self._wake.notify_all()

    def idle(self) -> bool:
        """No checkpoint running or pending."""
        return self.running is None and self.pending is None

    def views(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The running and the pending ticket, as the status shows them."""
        with self.lock:
            running = self.running.to_json() if self.running is not None else None
            pending = self.pending.to_json() if self.pending is not None else None
        return running, pending


class Scheduled(Protocol):
    """What the scheduler asks of the agent."""

    @property
    def state(self) -> str: ...

    preempted: dict[str, Any] | None

    def request_checkpoint(self, trigger: str) -> Ticket: ...

    def idle(self) -> bool:
        """No checkpoint running or pending (a pre-copy then may run)."""
        ...

    def precopy(self) -> None:
        """Store the worker's new cached blocks now (never raises)."""
        ...

    def gc(self) -> None:
        """Run the repository's gc now (never raises)."""
        ...


class Scheduler:
    """The scheduler thread's loop (:meth:`run`): periodic checkpoints, preemption notices (a final
    one starts the ``preemption`` checkpoint and stops pre-copies and gc; an early one, AWS's
    rebalance recommendation, a ``rebalance`` checkpoint), pre-copies while idle, gc."""

    def __init__(self, cfg: AgentConfig, agent: Scheduled, stopping: threading.Event) -> None:
        self.cfg = cfg
        self.agent = agent
        self.stopping = stopping
        self._gc_running = threading.Event()
        self._precopy_running = threading.Event()

    def run(self) -> None:
        c = self.cfg.checkpoint
        agent = self.agent
        t = time.monotonic()
        next_periodic = t + c.interval.total_seconds() if c.interval else None
        notices = preemption_mod.source(
            c.preemption, metadata_url=c.preemption_metadata_url, url=c.preemption_url, file=c.preemption_file
        )
        extra_file = (
            preemption_mod.NoticeSource("file", file=c.preemption_file)
            if c.preemption_file and notices is not None and notices.provider != "file"
            else None
        )
        poll_s = (c.preemption_poll.total_seconds() if c.preemption_poll else None) or (
            preemption_mod.RECOMMENDED_POLL_S.get(notices.provider, 5.0) if notices else 5.0
        )
        next_poll = t if notices is not None else None
        early_seen: set[str] = set()
        gc_every = self.cfg.retention.gc_interval
        next_gc = t + gc_every.total_seconds() if gc_every else None
        next_precopy = t + c.precopy_interval.total_seconds() if c.precopy_interval else None
        while not self.stopping.wait(0.2):
            t = time.monotonic()
            if agent.state == "stopping":
                continue
            if next_periodic is not None and t >= next_periodic:
                agent.request_checkpoint("periodic")
                next_periodic = t + c.interval.total_seconds()  # type: ignore[union-attr]
            if next_poll is not None and t >= next_poll and notices is not None:
                next_poll = t + poll_s
                notice = (extra_file.poll() if extra_file else None) or notices.poll()
                if notice is not None and not notice.final and notice.detail not in early_seen:
                    early_seen.add(notice.detail)
                    log.warning("early preemption signal: checkpointing", extra={"notice": notice.detail})
                    agent.request_checkpoint("rebalance")
                elif notice is not None and notice.final and agent.preempted is None:
                    agent.preempted = {"at": now(), "notice": notice.detail, "provider": notice.provider}
                    log.warning("preemption notice", extra={"notice": notice.detail, "provider": notice.provider})
                    ticket = agent.request_checkpoint("preemption")
                    if notice.ack:
                        threading.Thread(
                            target=_acknowledge, args=(ticket, notices, notice), name="gpuckpt-ack", daemon=True
                        ).start()
            if next_precopy is not None and t >= next_precopy:
                next_precopy = t + c.precopy_interval.total_seconds()  # type: ignore[union-attr]
                if agent.idle() and agent.preempted is None:
                    self._once(self._precopy_running, agent.precopy, "gpuckpt-precopy")
            if next_gc is not None and t >= next_gc:
                next_gc = t + gc_every.total_seconds()  # type: ignore[union-attr]
                # Off this thread: it also polls for preemption notices, which a
                # long gc must not delay. Never while stopping or preempted.
                if agent.preempted is None and not self.stopping.is_set():
                    self._once(self._gc_running, agent.gc, "gpuckpt-gc")

    @staticmethod
    def _once(running: threading.Event, fn: Callable[[], None], name: str) -> None:
        """Run ``fn`` on a thread of its own unless its previous run still goes on."""
        if running.is_set():
            return
        running.set()

        def run() -> None:
            try:
                fn()
            finally:
                running.clear()

        threading.Thread(target=run, name=name, daemon=True).start()


def _acknowledge(t: Ticket, source: preemption_mod.NoticeSource, notice: preemption_mod.Notice) -> None:
    """Once the preemption checkpoint is done (or failed: waiting helps nobody), tell the
    provider the instance may go (Azure's scheduled events)."""
    t.done.wait()
    source.acknowledge(notice)
