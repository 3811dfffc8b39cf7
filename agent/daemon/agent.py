"""The agent: checkpoints one worker on its triggers, restores it at start, keeps retention.

Threads (all daemon threads; the main thread waits for a stop signal):

* **checkpointer** — runs one checkpoint at a time from :meth:`Agent.request_checkpoint`
  tickets. Triggers that arrive before a checkpoint's capture has begun join
  it (two triggers at once are one checkpoint); later ones queue one more.
  Each has a deadline; past it the save is abandoned by the repository and
  nothing becomes visible.
* **scheduler** — periodic checkpoints, the preemption-notice poll (a file
  appearing or an HTTP metadata URL answering), and scheduled ``gc``.
* **api** — the control API (:mod:`agent.daemon.api`), answering while a
  checkpoint runs; **watchdog** — systemd pings while the threads are alive.

On SIGTERM the agent takes a final checkpoint within ``stop_deadline`` and
exits 0; a final checkpoint that fails is reported and the agent still
exits (the previous checkpoint stays the newest good one).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from agent.daemon import preemption as preemption_mod
from agent.daemon.config import AgentConfig
from agent.daemon.metrics import Metrics
from agent.daemon.notify import Notifier
from agent.engines import ledgers
from agent.engines.base import token_digest
from ckpt import EngineMismatch, GpuckptError, KeySource, ObjectNotFound, OperationAborted, Policy, Repository
from ckpt.save import SaveProgress

log = logging.getLogger("gpuckpt.agent")

TRIGGERS = ("periodic", "request", "stop", "preemption", "drain", "rebalance")
#: triggers whose checkpoint has a window to make: a running save of other triggers makes way
URGENT = frozenset({"stop", "preemption", "drain"})
#: how long a running requested checkpoint may go on once an urgent one waits (a periodic one: 0)
URGENT_GRACE_S = 5.0


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


@dataclass
class Ticket:
    """One checkpoint, shared by every trigger that joined it."""

    id: int
    triggers: list[str]
    requested_at: str = field(default_factory=_now)
    deadline_s: float = 300.0
    state: str = "pending"  # pending → capturing → saving → done | failed
    started_at: str | None = None
    progress: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event, repr=False)
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def view(self) -> dict[str, Any]:
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


class Agent:
    def __init__(self, cfg: AgentConfig, *, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.notifier = notifier or Notifier()
        self.metrics = Metrics(cfg.worker_id)
        self.repo: Repository | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._pending: Ticket | None = None
        self._running: Ticket | None = None
        self._tickets: dict[int, Ticket] = {}
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.state = "starting"
        self.worker: dict[str, Any] = {"attached": False, "last_seen": None, "error": None}
        self.last_checkpoint: dict[str, Any] | None = None
        self.last_error: dict[str, Any] | None = None
        self.restore_report: dict[str, Any] | None = None
        self.last_gc: dict[str, Any] | None = None
        self._gc_running = threading.Event()
        self.last_precopy: dict[str, Any] | None = None
        self._precopy_running = threading.Event()
        self._swept_connector = False
        from agent.engines import driver, get
        from agent.fs import Trust

        #: the worker, reached through its engine's adapter (every worker call goes through it)
        self.engine = get(cfg.engine, cfg.connector_socket, driver.Staging(cfg.staging_dir, Trust.of(cfg.shared_group)))
        self.preempted: dict[str, Any] | None = None
        self._canary: tuple[Any, dict[str, Any]] | None = None  # (worker pid, record)
        self._client: Any = None  # ServeClient for the canary, made at the first checkpoint
        self._api: Any = None
        self._metrics_server: Any = None

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def trust_domain(self) -> str:
        """Whose checkpoints this worker's share blocks with by key, and may restore: by default
        the worker alone."""
        return self.cfg.trust_domain or self.cfg.worker_id

    def open_repository(self) -> Repository:
        key = KeySource.parse(self.cfg.key) if self.cfg.key else None
        self.repo = Repository.open(self.cfg.repository, key=key, create=True)
        return self.repo

    def start(self) -> None:
        """Open the repository, start the API and threads, restore if configured, report ready."""
        from agent.daemon.api import ApiServer

        self._probe_host()
        self.open_repository()
        self._api = ApiServer(self, self.cfg.api.socket, mode=self.cfg.api.mode, group=self.cfg.api.group)
        self._api.start()
        if self.cfg.metrics_address:
            self._metrics_server = self.metrics.serve(self.cfg.metrics_address)
        self._spawn(self._checkpointer, "gpuckpt-checkpointer")
        self._sweep_staging()
        if self.cfg.restore.on_start:
            self.state = "restoring"
            self.notifier.status(f"restoring worker {self.cfg.worker_id}")
            self.restore_at_start()
        self.state = "ready"
        self._spawn(self._scheduler, "gpuckpt-scheduler")
        self.notifier.ready(self._status_line())
        self.notifier.start_watchdog(self.healthy)
        log.info("agent ready", extra={"worker_id": self.cfg.worker_id, "api": str(self.cfg.api.socket)})

    def _probe_host(self) -> None:
        """The host's facts (GPU, driver, CUDA, torch), probed once, before any other thread runs.

        The probe imports torch and loads the CUDA and NVML libraries, holding
        the interpreter for seconds (over a minute was seen on a busy 2-core
        host): done lazily at the first checkpoint, that stalled the control
        API and would stall the watchdog's pings. ``host_facts`` is cached
        for the process, so every checkpoint and restore then reuses it.
        """
        from agent.engines import driver  # noqa: F401 - imported now for the same reason
        from ckpt import host_facts

        t0 = time.monotonic()
        facts = host_facts()
        took = round(time.monotonic() - t0, 3)
        log.info("host probed", extra={"seconds": took, "gpu": facts.gpu_product, "driver": facts.driver_version})

    def run(self) -> int:
        """Start, then serve until SIGTERM/SIGINT; take the final checkpoint; return the exit status."""
        stop = threading.Event()
        received: list[int] = []

        def on_signal(signum: int, _frame: Any) -> None:
            received.append(signum)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        self.start()
        while not stop.wait(1.0):
            pass
        log.info("stop requested", extra={"signal": signal.Signals(received[0]).name if received else None})
        self.shutdown(final=self.cfg.checkpoint.on_stop)
        return 0

    def shutdown(self, *, final: bool) -> None:
        self.state = "stopping"
        self.notifier.stopping(f"stopping: {'final checkpoint' if final else 'no final checkpoint'}")
        if final:
            budget = self.cfg.checkpoint.stop_deadline.total_seconds()
            t = self.request_checkpoint("stop", deadline_s=budget)
            if not t.done.wait(budget + 5):
                log.error("final checkpoint did not finish in its deadline", extra={"ticket": t.id})
            elif t.error:
                log.error("final checkpoint failed", extra={"ticket": t.id, "error": t.error})
            else:
                log.info("final checkpoint saved", extra={"checkpoint": t.checkpoint})
        self._stopping.set()
        with self._wake:
            self._wake.notify_all()
        if self._api is not None:
            self._api.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.notifier.close()

    def _spawn(self, fn: Any, name: str) -> None:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def healthy(self) -> bool:
        """Every agent thread alive (the watchdog stops pinging otherwise and systemd restarts us)."""
        return all(t.is_alive() for t in self._threads)

    # -- checkpoints ---------------------------------------------------------------------

    def request_checkpoint(self, trigger: str, *, deadline_s: float | None = None) -> Ticket:
        """Queue (or join) a checkpoint; returns its ticket at once."""
        if trigger not in TRIGGERS:
            raise ValueError(f"unknown trigger {trigger!r}; one of {', '.join(TRIGGERS)}")
        budget = deadline_s if deadline_s is not None else self.cfg.checkpoint.deadline.total_seconds()
        with self._wake:
            if self.state == "stopping" and trigger != "stop":
                # The final checkpoint is the last one: nothing may land after it.
                t = Ticket(next(self._ids), [trigger], state="failed", error="the agent is stopping")
                t.done.set()
                return t
            r = self._running
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
            if self._pending is None:
                self._pending = Ticket(next(self._ids), [trigger], deadline_s=budget)
                self._tickets[self._pending.id] = self._pending
                self._wake.notify_all()
            else:
                self._pending.triggers.append(trigger)
                self._pending.deadline_s = min(self._pending.deadline_s, budget)
            # Keep the last few tickets for status queries.
            for old in sorted(self._tickets)[:-32]:
                if self._tickets[old].done.is_set():
                    del self._tickets[old]
            return self._pending

    def ticket(self, ticket_id: int) -> Ticket | None:
        with self._lock:
            return self._tickets.get(ticket_id)

    def _checkpointer(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._stopping.is_set():
                    self._wake.wait()
                if self._pending is None:
                    return
                t, self._pending = self._pending, None
                self._running = t
            try:
                self._run_checkpoint(t)
            finally:
                with self._lock:
                    self._running = None
                t.done.set()

    def _run_checkpoint(self, t: Ticket) -> None:
        assert self.repo is not None
        log.info("checkpoint started", extra={"ticket": t.id, "triggers": list(t.triggers)})
        t0 = time.monotonic()
        deadline = t0 + t.deadline_s
        t.started_at = _now()
        trigger = t.triggers[0]
        self.notifier.status(f"checkpointing ({', '.join(t.triggers)})")
        if self._client is None and self.cfg.worker_url and self.cfg.checkpoint.canary:
            self._client = self.engine.client(self.cfg.worker_url)  # kept: a final checkpoint must not build one
        client = self._client

        def captured(stats: dict[str, Any]) -> None:
            t.state = "saving"
            t.progress = {"phase": "saving", "blocks": 0, "total_blocks": stats.get("pages", 0), "uploaded_bytes": 0}

        def progress(p: SaveProgress) -> None:
            t.progress.update(phase=p.phase, blocks=p.blocks, uploaded_bytes=p.uploaded_bytes, new_blocks=p.new_blocks)

        try:
            with self._lock:
                t.state = "capturing"  # from here on a new trigger queues another checkpoint
            t.progress = {"phase": "capturing"}
            canary = self._canary_record(client)
            done = self.engine.checkpoint(
                self.repo,
                self.cfg.worker_id,
                trust_domain=self.trust_domain,
                labels={"trigger": ",".join(sorted(set(t.triggers)))},
                timeout=self.cfg.checkpoint.capture_timeout.total_seconds(),
                max_staging=self.cfg.checkpoint.max_staging,
                copy_per_step=self.cfg.checkpoint.copy_per_step,
                canary=canary,
                deadline=deadline,
                progress=progress,
                on_captured=captured,
                cancel=t.cancel,
            )
        except Exception as exc:  # every failure is reported, none kills the agent
            t.state, t.error = "failed", _describe(exc)
            outcome = "abandoned" if isinstance(exc, OperationAborted) else "failed"
            self.metrics.checkpoints.labels(trigger=trigger, outcome=outcome).inc()
            self.last_error = {"at": _now(), "operation": "checkpoint", "ticket": t.id, "error": t.error}
            self._note_worker(exc)
            log.error("checkpoint %s", outcome, extra={"ticket": t.id, "triggers": t.triggers, "error": t.error})
            self.notifier.status(f"checkpoint {outcome}: {t.error}"[:200])
            return
        m, stats = done.manifest, {**done.stats, "total_s": time.monotonic() - t0}
        t.state, t.checkpoint, t.stats = "done", m.id, stats
        t.progress["phase"] = "done"
        self.worker.update(attached=True, last_seen=_now(), error=None)
        self.metrics.checkpoint_done(trigger, stats, m.sizes)
        if stats.get("staged_peak_bytes") is not None:
            self.metrics.staging_peak.set(float(stats["staged_peak_bytes"]))
        self.last_checkpoint = {
            "id": m.id,
            "at": _now(),
            "triggers": t.triggers,
            "duration_s": round(stats["total_s"], 3),
            "pause_ms": round(stats.get("copy_s", 0.0) * 1000, 2),
            "staged_peak_bytes": stats.get("staged_peak_bytes"),
            "lost_pages": stats.get("lost_pages", 0),
            "blocks": m.sizes.blocks,
            "new_blocks": m.sizes.new_blocks,
            "stored_bytes": m.sizes.stored_bytes,
            "new_stored_bytes": m.sizes.new_stored_bytes,
            "requests": ledgers.request_count(m.ledger),
            "timings": {k: round(float(stats.get(k, 0.0)), 4) for k in ("wait_s", "capture_s", "write_s", "save_s")},
        }
        log.info(
            "checkpoint saved",
            extra={"checkpoint": m.id, **{k: v for k, v in self.last_checkpoint.items() if k != "id"}},
        )
        self.notifier.status(self._status_line())
        self._retention()

    def _canary_record(self, client: Any) -> dict[str, Any] | None:
        """The worker's canary, probed once per worker process and reused by every checkpoint."""
        from agent.engines import canary as canary_mod

        if client is None:
            return None
        pid = self.engine.ping()
        if self._canary is None or self._canary[0] != pid:
            self._canary = (pid, canary_mod.record(client.generate))
        return self._canary[1]

    def _retention(self) -> None:
        assert self.repo is not None
        r = self.cfg.retention
        try:
            removed = self.repo.forget(keep_last=r.keep_last, keep_within=r.keep_within, worker_id=self.cfg.worker_id)
            if removed:
                log.info("retention forgot checkpoints", extra={"forgotten": [str(x) for x in removed]})
        except GpuckptError as exc:
            log.warning("retention failed", extra={"error": _describe(exc)})

    def _note_worker(self, exc: BaseException) -> None:
        if isinstance(exc, OSError):  # the connector socket: refused, missing, timed out
            self.worker.update(attached=False, error=_describe(exc))

    # -- scheduler: periodic, preemption notices, gc ------------------------------------------

    def _scheduler(self) -> None:
        c = self.cfg.checkpoint
        now = time.monotonic()
        next_periodic = now + c.interval.total_seconds() if c.interval else None
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
        next_poll = now if notices is not None else None
        early_seen: set[str] = set()
        gc_every = self.cfg.retention.gc_interval
        next_gc = now + gc_every.total_seconds() if gc_every else None
        next_precopy = now + c.precopy_interval.total_seconds() if c.precopy_interval else None
        while not self._stopping.wait(0.2):
            now = time.monotonic()
            if self.state == "stopping":
                continue
            if next_periodic is not None and now >= next_periodic:
                self.request_checkpoint("periodic")
                next_periodic = now + c.interval.total_seconds()  # type: ignore[union-attr]
            if next_poll is not None and now >= next_poll and notices is not None:
                next_poll = now + poll_s
                notice = (extra_file.poll() if extra_file else None) or notices.poll()
                if notice is not None and not notice.final and notice.detail not in early_seen:
                    early_seen.add(notice.detail)
                    log.warning("early preemption signal: checkpointing", extra={"notice": notice.detail})
                    self.request_checkpoint("rebalance")
                elif notice is not None and notice.final and self.preempted is None:
                    self.preempted = {"at": _now(), "notice": notice.detail, "provider": notice.provider}
                    log.warning("preemption notice", extra={"notice": notice.detail, "provider": notice.provider})
                    t = self.request_checkpoint("preemption")
                    if notice.ack:
                        threading.Thread(
                            target=self._acknowledge, args=(t, notices, notice), name="gpuckpt-ack", daemon=True
                        ).start()
            if next_precopy is not None and now >= next_precopy:
                next_precopy = now + c.precopy_interval.total_seconds()  # type: ignore[union-attr]
                idle = self._running is None and self._pending is None
                if idle and not self._precopy_running.is_set() and self.preempted is None:
                    self._precopy_running.set()
                    threading.Thread(target=self._precopy, name="gpuckpt-precopy", daemon=True).start()
            if next_gc is not None and now >= next_gc:
                next_gc = now + gc_every.total_seconds()  # type: ignore[union-attr]
                # Off this thread: it also polls for preemption notices, which a
                # long gc must not delay. Never while stopping or preempted.
                if not self._gc_running.is_set() and self.preempted is None and not self._stopping.is_set():
                    self._gc_running.set()
                    threading.Thread(target=self._gc, name="gpuckpt-gc", daemon=True).start()

    def _acknowledge(self, t: Ticket, source: Any, notice: Any) -> None:
        """Once the preemption checkpoint is done (or failed: waiting helps nobody), tell the
        provider the instance may go (Azure's scheduled events)."""
        t.done.wait()
        source.acknowledge(notice)

    def _precopy(self) -> None:
        """Store the worker's new cached blocks ahead of the next checkpoint (see ``driver.precopy``);
        a checkpoint's capture supersedes it, and any failure only costs that checkpoint a larger copy."""
        assert self.repo is not None
        c = self.cfg.checkpoint
        try:
            out = self.engine.precopy(
                self.repo,
                trust_domain=self.trust_domain,
                timeout=c.capture_timeout.total_seconds(),
                copy_per_step=c.copy_per_step,
                max_staging=c.max_staging,
                deadline=time.monotonic() + c.deadline.total_seconds(),
            )
            self.last_precopy = {"at": _now(), **out}
            self.metrics.precopy_bytes.inc(int(out.get("new_raw_bytes") or 0))
            log.info("pre-copy stored", extra=out)
        except Exception as exc:
            self.last_precopy = {"at": _now(), "error": _describe(exc)}
            log.info("pre-copy did not complete", extra={"error": _describe(exc)})
        finally:
            self._precopy_running.clear()

    def _gc(self) -> None:
        assert self.repo is not None
        try:
            rep = self.repo.gc(grace=self.cfg.retention.gc_grace)
            self.last_gc = {"at": _now(), "report": _jsonable(rep)}
        except GpuckptError as exc:
            self.last_gc = {"at": _now(), "error": _describe(exc)}
            log.warning("gc failed", extra={"error": _describe(exc)})
        finally:
            self._gc_running.clear()

    # -- restore at start --------------------------------------------------------------------

    def _sweep_staging(self) -> None:
        """Delete what a killed predecessor left staged (users' KV): its restore staging
        directories, and capture page files in the connector's staging directory."""
        from agent.engines import driver

        for d in driver.sweep_restore_dirs():
            log.info("removed a dead agent's restore staging", extra={"path": d})
        if self._swept_connector:
            return
        try:
            removed = self.engine.sweep()
        except (OSError, ValueError, GpuckptError):
            return  # no worker yet: swept when it attaches
        self._swept_connector = True
        if removed:
            log.info("removed stale capture page files", extra={"files": len(removed)})

    def _wait_for_worker(self, budget: float) -> bool:
        from agent import fs

        end = time.monotonic() + budget
        warned = False
        while time.monotonic() < end and not self._stopping.is_set():
            try:
                # a connector socket someone else could have made is never talked to
                fs.check_socket(self.cfg.connector_socket, self.engine.staging.trust)
                self.engine.describe()
                self.worker.update(attached=True, last_seen=_now(), error=None)
                self._sweep_staging()
                return True
            except (fs.UnsafePath, EngineMismatch) as exc:
                self.worker.update(attached=False, error=_describe(exc))
                if not warned:
                    log.error("refusing the connector socket", extra={"error": str(exc)})
                    warned = True
                time.sleep(0.5)
            except (OSError, ValueError, GpuckptError) as exc:
                self.worker.update(attached=False, error=_describe(exc))
                time.sleep(0.5)
        return False

    def restore_at_start(self) -> dict[str, Any]:
        """Restore this worker's checkpoint (warm or cold with replay) into the attached worker."""
        assert self.repo is not None
        ref = self.cfg.restore.checkpoint
        ref = f"{self.cfg.worker_id}:latest" if ref == "latest" else ref
        t0 = time.monotonic()
        rep: dict[str, Any] = {"checkpoint": None, "outcome": None, "reasons": [], "started_at": _now()}
        self.restore_report = rep
        try:
            info = self.repo.resolve(ref)
        except (ObjectNotFound, GpuckptError) as exc:
            rep.update(outcome="none", reasons=[f"nothing to restore: {_describe(exc)}"])
            self.metrics.restores.labels(outcome="none", reason="no checkpoint").inc()
            log.info("no checkpoint to restore", extra={"ref": ref})
            return rep
        rep["checkpoint"] = info.id
        if not self._wait_for_worker(self.cfg.restore.wait_for_worker.total_seconds()):
            rep.update(outcome="failed", reasons=[f"worker not reachable: {self.worker.get('error')}"])
            self.metrics.restores.labels(outcome="failed", reason="worker unreachable").inc()
            return rep
        client = self.engine.client(self.cfg.worker_url) if self.cfg.worker_url else None
        try:
            if client is not None:
                client.wait_ready(self.cfg.restore.wait_for_worker.total_seconds())
            plan = self.engine.restore(
                self.repo,
                info.id,
                trust_domain=self.trust_domain,
                policy=Policy.from_strings(ignore=self.cfg.restore.ignore_rules),
                generate=client.generate if client is not None else None,
                require_canary=self.cfg.restore.require_canary,
                offer_ttl=self.cfg.restore.offer_ttl.total_seconds(),
                max_staging=self.cfg.restore.max_staging,
            )
        except Exception as exc:
            rep.update(outcome="failed", reasons=[_describe(exc)])
            self.metrics.restores.labels(outcome="failed", reason=type(exc).__name__).inc()
            self.last_error = {"at": _now(), "operation": "restore", "error": _describe(exc)}
            log.error("restore failed", extra={"checkpoint": info.id, "error": _describe(exc)})
            if client is not None:
                _release_retries(client)
                client.close()
            return rep
        outcome = "warm" if plan.warm else "cold"
        reason = "pins match" if plan.warm else (plan.reasons[0].split(":")[0] if plan.reasons else "unknown")
        self.metrics.restores.labels(outcome=outcome, reason=reason).inc()
        self.metrics.restore_seconds.observe(time.monotonic() - t0)
        rep.update(
            outcome=outcome,
            reasons=list(plan.reasons),
            requests=[r.request_id for r in plan.requests],
            # per request, why it is replayed cold rather than continued exactly (GET /restore, status)
            inexact={r.request_id: list(r.reasons) for r in plan.requests if not r.exact},
            blocks_offered=plan.blocks_offered,
            plan_s=round(time.monotonic() - t0, 3),
            canary=plan.stats.get("canary"),
        )
        log.info(
            "restore planned",
            extra={"checkpoint": info.id, "outcome": outcome, "reasons": plan.reasons, "requests": len(plan.requests)},
        )
        for rid, why in rep["inexact"].items():
            log.warning("request replayed cold", extra={"request": rid, "reasons": why})
        if plan.rest is not None:
            rep["rest"] = {"state": "streaming"}
            threading.Thread(
                target=self._await_rest, args=(plan, rep), name="gpuckpt-restore-rest", daemon=True
            ).start()
        if client is not None and plan.requests:
            # A one-shot thread: not in self._threads, whose liveness the watchdog checks.
            threading.Thread(
                target=self._resubmit, args=(client, plan.requests, rep), name="gpuckpt-resubmit", daemon=True
            ).start()
        else:
            state = "done" if not plan.requests else "not configured (no worker_url): GET /restore lists them"
            rep["resubmission"] = {"state": state, "requests": len(plan.requests)}
            rep["results"] = {}
            if client is not None:
                _release_retries(client)
                client.close()
        return rep

    def _await_rest(self, plan: Any, rep: dict[str, Any]) -> None:
        """The rest of a streaming restore arrives behind the resubmitted requests: record when it has."""
        plan.wait_offered()
        rep["blocks_offered"] = plan.offered_total
        rep["rest"] = {"state": "done", **plan.rest.stats}
        log.info("restore offered the rest", extra={"checkpoint": rep.get("checkpoint"), **plan.rest.stats})

    def _resubmit(self, client: Any, requests: list[Any], rep: dict[str, Any]) -> None:
        """Resubmit the ledger and record a bounded summary of each continuation (its length and
        digest, not its tokens: the worker keeps those for the client's retry, bounded there).
        A request whose carried state the worker never applied is reported a cold replay."""
        rep["resubmission"] = {"state": "running", "requests": len(requests)}
        try:
            # one response per request: nobody watches the agent's streams, the clients' retries do
            outs = client.submit(requests, stream=False)
        except Exception as exc:
            rep["resubmission"] = {"state": "failed", "error": _describe(exc)}
            log.error("resubmission failed", extra={"error": _describe(exc)})
            return
        finally:
            client.close()
        unapplied = self._unapplied_states()
        results = {}
        for r in requests:
            out = outs[r.request_id]
            reasons = [*r.reasons, *unapplied.get(r.request_id, [])]
            whole = r.output_token_ids + out.token_ids
            results[r.request_id] = {
                "output_tokens": len(whole),
                "output_digest": token_digest(whole),
                "new_tokens": len(out.token_ids),
                "finish_reason": out.finish_reason,
                "cached_tokens": out.cached_tokens,
                "prompt_tokens": len(r.token_ids),
                "exact": not reasons,
                "reasons": reasons,
                "left_to_client": out.left_to_client,
            }
            if reasons and r.exact:
                log.warning("resubmitted request replayed cold", extra={"request": r.request_id, "reasons": reasons})
                rep.setdefault("inexact", {})[r.request_id] = reasons
            if out.left_to_client:
                rep.setdefault("left_to_client", {})[r.request_id] = out.left_to_client
        rep["resubmission"] = {"state": "done", "requests": len(requests)}
        rep["results"] = results
        log.info("resubmitted requests finished", extra={"requests": len(requests)})

    def _unapplied_states(self) -> dict[str, list[str]]:
        """The worker's word on carried states no request claimed (by ledger id)."""
        try:
            st = self.engine.stats()
        except Exception as exc:  # the worker may be gone: nothing to add, and say so
            log.warning("could not ask the worker which request states were applied", extra={"error": str(exc)})
            return {}
        out: dict[str, list[str]] = {}
        for cid in st.get("states_waiting") or ():
            why = (st.get("states_refused") or {}).get(cid)
            out[cid] = [f"its carried state was never applied{f' ({why})' if why else ''}: replayed cold"]
        for cid, applied in (st.get("states_applied") or {}).items():
            for a in applied:
                if "failed" in str(a):
                    out.setdefault(cid, []).append(f"{a}: replayed cold")
        return out

    # -- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._lock:
            running = self._running.view() if self._running is not None else None
            pending = self._pending.view() if self._pending is not None else None
        rr = dict(self.restore_report) if self.restore_report else None
        if rr is not None:
            rr.pop("results", None)  # large; GET /restore has them
        return {
            "worker_id": self.cfg.worker_id,
            "state": self.state,
            "pid": os.getpid(),
            "repository": _redact(self.cfg.repository),
            "worker": dict(self.worker),
            "operation": running,
            "pending": pending,
            "last_checkpoint": self.last_checkpoint,
            "last_error": self.last_error,
            "restore": rr,
            "preempted": self.preempted,
            "last_gc": self.last_gc,
            "last_precopy": self.last_precopy,
        }

    def _status_line(self) -> str:
        lc = self.last_checkpoint
        last = f"last checkpoint {lc['id']}" if lc else "no checkpoint yet"
        rr = self.restore_report
        rs = f"; restore {rr['outcome']}" if rr and rr.get("outcome") else ""
        return f"{self.state}: worker {self.cfg.worker_id}, {last}{rs}"


def _release_retries(client: Any) -> None:
    """Tell the worker's server that nothing will be resubmitted, where it holds possible retries
    for the restore (a vLLM worker with gpuckpt's middleware); never fails the restore."""
    release = getattr(client, "release", None)
    if release is None:
        return
    try:
        release()
    except Exception as exc:
        log.warning("could not release the worker's held retries", extra={"error": _describe(exc)})


def _describe(exc: BaseException) -> str:
    msg = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _redact(url: str) -> str:
    """Repository URL without userinfo or query secrets (credentials never belong there, but be safe)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password or parts.username:
        netloc = parts.hostname or ""
        if parts.port:
            netloc += f":{parts.port}"
        parts = parts._replace(netloc=netloc)
    return urlunsplit(parts)


def _jsonable(obj: Any) -> Any:
    try:
        return json.loads(json.dumps(obj, default=lambda o: getattr(o, "__dict__", str(o))))
    except (TypeError, ValueError):
        return str(obj)


__all__ = ["TRIGGERS", "Agent", "Ticket"]
