"""The agent: checkpoints one worker on its triggers, restores it at start, keeps retention.

:class:`Agent` is the daemon: :meth:`Agent.start` wires its parts — the
repository, the control API (:mod:`agent.daemon.api`, which reaches the agent
through its own small port), the metrics endpoint, the restore at start
(:mod:`agent.daemon.restore_at_start`), the scheduler
(:mod:`agent.daemon.triggers`) and systemd's notifications — and
:meth:`Agent.run` serves until a signal. Its threads (all daemon threads; the
main thread waits for a stop signal):

* **checkpointer** — runs one checkpoint at a time from the tickets
  (:class:`~agent.daemon.triggers.Tickets`) that :meth:`Agent.request_checkpoint`
  queues or joins; the work is :func:`agent.session.checkpoint`'s.
* **scheduler** — periodic checkpoints, the preemption-notice poll (a file
  appearing or an HTTP metadata URL answering), pre-copies and scheduled ``gc``.
* **api** — the control API, answering while a checkpoint runs; **watchdog**
  — systemd pings while the threads are alive.

On SIGTERM the agent takes a final checkpoint within ``stop_deadline`` and
exits 0; a final checkpoint that fails is reported and the agent still
exits (the previous checkpoint stays the newest good one).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from agent import engines, fs, session
from agent.daemon.api import ApiServer
from agent.daemon.config import AgentConfig
from agent.daemon.metrics import Metrics
from agent.daemon.notify import Notifier
from agent.daemon.reporting import describe_error, now
from agent.daemon.restore_at_start import RestoreAtStart, RestoreReport
from agent.daemon.triggers import TRIGGERS, Scheduler, Ticket, Tickets
from agent.engines import canary as canary_mod
from agent.engines import ledgers
from agent.engines.types import CaptureStats, ServingClient, Staging
from ckpt import EngineMismatch, GpuckptError, KeySource, OperationAborted, Repository, host_facts
from ckpt.save import SaveProgress

log = logging.getLogger("gpuckpt.agent")

#: how long a checkpoint waits for the background canary record of a new worker process before it
#: asks whether the worker's batch is full (then it waits no more: see Agent._canary_record), and
#: how long at most whatever the worker says
CANARY_WAIT_S = 1.0
CANARY_WAIT_MAX_S = 30.0
#: how often the background recorder looks for a new worker process
CANARY_POLL_S = 2.0


class Agent:
    def __init__(self, cfg: AgentConfig, *, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.notifier = notifier or Notifier()
        self.metrics = Metrics(cfg.worker_id)
        self.repo: Repository | None = None
        self.tickets = Tickets()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.state = "starting"
        self.worker: dict[str, Any] = {"attached": False, "last_seen": None, "error": None}
        self.last_checkpoint: dict[str, Any] | None = None
        self.last_error: dict[str, Any] | None = None
        self.last_gc: dict[str, Any] | None = None
        self.last_precopy: dict[str, Any] | None = None
        self._restore: RestoreAtStart | None = None
        self._swept_connector = False
        #: the worker, reached through its engine (every worker call goes through its channel)
        self.engine = engines.get(
            cfg.engine, cfg.connector_socket, Staging(cfg.staging_dir, fs.Trust.of(cfg.shared_group))
        )
        self.preempted: dict[str, Any] | None = None
        self._canary: tuple[int, dict[str, Any]] | None = None  # (worker pid, record)
        self._canary_recorder = False  # the background recorder runs (start)
        self._client: ServingClient | None = None  # the worker's API (canary, logprobs), made once
        self._api: ApiServer | None = None
        self._metrics_server: Any = None

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def trust_domain(self) -> str:
        """Whose checkpoints this worker's share blocks with by key, and may restore: by default
        the worker alone."""
        return self.cfg.trust_domain or self.cfg.worker_id

    @property
    def restore_report(self) -> RestoreReport | None:
        """The restore at start, as far as it has come (None before it began, or without one)."""
        return self._restore.report if self._restore is not None else None

    def open_repository(self) -> Repository:
        key = KeySource.parse(self.cfg.key) if self.cfg.key else None
        self.repo = Repository.open(self.cfg.repository, key=key, create=True)
        return self.repo

    def start(self) -> None:
        """Open the repository, start the API and threads, restore if configured, report ready."""
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
        # after the restore: a probe run before the restore's own canary check would put the
        # probe's blocks in the cache from local compute, and the check would not read restored ones
        if self.cfg.worker_url and self.cfg.checkpoint.canary:
            self._canary_recorder = True
            self._spawn(self._record_canary, "gpuckpt-canary")
        self._spawn(Scheduler(self.cfg, self, self._stopping).run, "gpuckpt-scheduler")
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
        self.tickets.wake()
        if self._api is not None:
            self._api.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.notifier.close()

    def _spawn(self, fn: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def healthy(self) -> bool:
        """Every agent thread alive (the watchdog stops pinging otherwise and systemd restarts us)."""
        return all(t.is_alive() for t in self._threads)

    # -- checkpoints ---------------------------------------------------------------------

    def request_checkpoint(self, trigger: str, *, deadline_s: float | None = None) -> Ticket:
        """Queue (or join) a checkpoint; returns its ticket at once."""
        budget = deadline_s if deadline_s is not None else self.cfg.checkpoint.deadline.total_seconds()
        return self.tickets.request(trigger, budget, stopping=self.state == "stopping")

    def ticket(self, ticket_id: int) -> Ticket | None:
        return self.tickets.get(ticket_id)

    def idle(self) -> bool:
        """No checkpoint running or pending."""
        return self.tickets.idle()

    def _checkpointer(self) -> None:
        while (t := self.tickets.take(self._stopping)) is not None:
            try:
                self._run_checkpoint(t)
            finally:
                self.tickets.finish(t)

    def _run_checkpoint(self, t: Ticket) -> None:
        assert self.repo is not None
        log.info("checkpoint started", extra={"ticket": t.id, "triggers": list(t.triggers)})
        t0 = time.monotonic()
        deadline = t0 + t.deadline_s
        t.started_at = now()
        trigger = t.triggers[0]
        self.notifier.status(f"checkpointing ({', '.join(t.triggers)})")
        client = self._serving_client()

        def captured(stats: CaptureStats) -> None:
            t.state = "saving"
            t.progress = {"phase": "saving", "blocks": 0, "total_blocks": stats.get("pages", 0), "uploaded_bytes": 0}

        def progress(p: SaveProgress) -> None:
            t.progress.update(phase=p.phase, blocks=p.blocks, uploaded_bytes=p.uploaded_bytes, new_blocks=p.new_blocks)

        c = self.cfg.checkpoint
        try:
            with self.tickets.lock:
                t.state = "capturing"  # from here on a new trigger queues another checkpoint
            t.progress = {"phase": "capturing"}
            done = session.checkpoint(
                self.engine,
                self.repo,
                self.cfg.worker_id,
                session.CheckpointOptions(
                    trust_domain=self.trust_domain,
                    # the pool's label: a replacement of another name finds this checkpoint by it (ckpt/claims.py)
                    labels={
                        "trigger": ",".join(sorted(set(t.triggers))),
                        **({"pool": self.cfg.pool} if self.cfg.pool else {}),
                    },
                    timeout=c.capture_timeout.total_seconds(),
                    max_staging=c.max_staging,
                    copy_per_step=c.copy_per_step,
                    canary=self._canary_record(client if self.cfg.checkpoint.canary else None),
                    # vLLM's server: the logprobs it gave out for the captured requests
                    complete_ledger=getattr(client, "complete_ledger", None),
                    deadline=deadline,
                    progress=progress,
                    on_captured=captured,
                    cancel=t.cancel,
                ),
            )
        except Exception as exc:  # every failure is reported, none kills the agent
            t.state, t.error = "failed", describe_error(exc)
            outcome = "abandoned" if isinstance(exc, OperationAborted) else "failed"
            self.metrics.checkpoints.labels(trigger=trigger, outcome=outcome).inc()
            self.last_error = {"at": now(), "operation": "checkpoint", "ticket": t.id, "error": t.error}
            self._note_worker(exc)
            log.error("checkpoint %s", outcome, extra={"ticket": t.id, "triggers": t.triggers, "error": t.error})
            self.notifier.status(f"checkpoint {outcome}: {t.error}"[:200])
            return
        m, stats = done.manifest, done.stats
        total_s = time.monotonic() - t0
        t.state, t.checkpoint, t.stats = "done", m.id, {**stats, "total_s": total_s}
        t.progress["phase"] = "done"
        self.worker.update(attached=True, last_seen=now(), error=None)
        self.metrics.checkpoint_done(trigger, seconds=total_s, stats=stats, sizes=m.sizes)
        # the worker writes the first chunk's page files within the capture call: the parts are
        # disjoint, so the capture is logged without that write (which is logged on its own)
        capture_s = float(stats.get("capture_s", 0.0))
        write_s = min(float(stats.get("write_s", 0.0)), capture_s)
        timings = {
            "canary_s": stats.get("canary_s", 0.0),
            "wait_s": stats.get("wait_s", 0.0),
            "capture_s": capture_s - write_s,
            "write_s": write_s,
            "save_s": stats.get("save_s", 0.0),
        }
        # the whole duration is accounted for: what the parts leave is named, not hidden
        timings["other_s"] = max(0.0, total_s - sum(timings.values()))
        self.last_checkpoint = {
            "id": m.id,
            "at": now(),
            "triggers": t.triggers,
            "duration_s": round(total_s, 3),
            "pause_ms": round(stats.get("copy_s", 0.0) * 1000, 2),
            "staged_peak_bytes": stats.get("staged_peak_bytes"),
            "lost_pages": stats.get("lost_pages", 0),
            "blocks": m.sizes.blocks,
            "new_blocks": m.sizes.new_blocks,
            "stored_bytes": m.sizes.stored_bytes,
            "new_stored_bytes": m.sizes.new_stored_bytes,
            "requests": ledgers.request_count(m.ledger),
            "timings": {k: round(float(v), 4) for k, v in timings.items()},
        }
        log.info(
            "checkpoint saved",
            extra={"checkpoint": m.id, **{k: v for k, v in self.last_checkpoint.items() if k != "id"}},
        )
        self.notifier.status(self._status_line())
        self._retention()

    def _serving_client(self) -> ServingClient | None:
        """The worker's API client (``None``: no ``worker_url``), made once and kept: a final
        checkpoint must not build one."""
        if self._client is None and self.cfg.worker_url:
            self._client = self.engine.client(self.cfg.worker_url)
        return self._client

    def _canary_record(self, client: ServingClient | None) -> dict[str, Any] | None:
        """The worker's canary, probed once per worker process and reused by every checkpoint.

        A checkpoint never waits for the probe: it is a request like any other, and on a worker at
        full batch it queues until a sequence slot frees — the final checkpoint of a busy worker
        then missed its preemption notice. The background recorder (:meth:`_record_canary`)
        probes as soon as the worker is up; a checkpoint that finds no record for this worker
        process waits for it while the worker has a free sequence slot — after
        :data:`CANARY_WAIT_S` it asks the adapter, and stops waiting as soon as every slot is
        taken, or after :data:`CANARY_WAIT_MAX_S` whatever it says — then goes without one (its
        manifest has no canary: a restore of it is cold, and the log says so). An agent whose
        recorder is not running (not started) probes here, as before."""
        if client is None:
            return None
        pid = self.engine.channel.ping().pid
        if not self._canary_recorder:
            if self._canary is None or self._canary[0] != pid:
                self._canary = (pid, canary_mod.record(client.generate))
            return self._canary[1]
        t0 = time.monotonic()
        while (cached := self._canary) is None or cached[0] != pid:
            waited = time.monotonic() - t0
            full = waited >= CANARY_WAIT_S and self._worker_full()
            if full or waited >= CANARY_WAIT_MAX_S:
                why = "every sequence slot of the worker is taken" if full else f"not done in {waited:.0f} s"
                log.warning(
                    f"checkpoint without a canary: the worker's probe is still queued ({why}); a restore of "
                    "this checkpoint will be cold",
                    extra={"worker_pid": pid},
                )
                return None
            time.sleep(0.1)
        return cached[1]

    def _worker_full(self) -> bool:
        """Whether the worker's batch is full, as its adapter says (unknown: no)."""
        try:
            st = self.engine.channel.stats()
        except Exception:
            return False
        cap = st.get("max_num_seqs")
        return isinstance(cap, int) and int(st.get("live") or 0) >= cap

    def _record_canary(self) -> None:
        """Record the canary of each worker process as soon as the worker answers, in the background
        (see :meth:`_canary_record`); again when the worker process changes."""
        while not self._stopping.is_set():
            try:
                client = self._serving_client()
                pid = self.engine.channel.ping().pid
                if client is not None and (self._canary is None or self._canary[0] != pid):
                    t0 = time.monotonic()
                    self._canary = (pid, canary_mod.record(client.generate))
                    log.info("canary recorded", extra={"worker_pid": pid, "seconds": round(time.monotonic() - t0, 3)})
            except Exception as exc:  # the worker may be starting or gone: try again
                log.debug("canary not recorded yet", extra={"error": describe_error(exc)})
            self._stopping.wait(CANARY_POLL_S)

    def _retention(self) -> None:
        assert self.repo is not None
        r = self.cfg.retention
        try:
            removed = self.repo.forget(keep_last=r.keep_last, keep_within=r.keep_within, worker_id=self.cfg.worker_id)
            if removed:
                log.info("retention forgot checkpoints", extra={"forgotten": [str(x) for x in removed]})
        except GpuckptError as exc:
            log.warning("retention failed", extra={"error": describe_error(exc)})

    def _note_worker(self, exc: BaseException) -> None:
        if isinstance(exc, OSError):  # the connector socket: refused, missing, timed out
            self.worker.update(attached=False, error=describe_error(exc))

    # -- between checkpoints (the scheduler's) -------------------------------------------------

    def precopy(self) -> None:
        """Store the worker's new cached blocks ahead of the next checkpoint (see
        :func:`agent.session.precopy`); a checkpoint's capture supersedes it, and any failure
        only costs that checkpoint a larger copy."""
        assert self.repo is not None
        c = self.cfg.checkpoint
        try:
            out = session.precopy(
                self.engine,
                self.repo,
                session.CheckpointOptions(
                    trust_domain=self.trust_domain,
                    timeout=c.capture_timeout.total_seconds(),
                    copy_per_step=c.copy_per_step,
                    max_staging=c.max_staging,
                    deadline=time.monotonic() + c.deadline.total_seconds(),
                ),
            )
            self.last_precopy = {"at": now(), **out}
            self.metrics.precopy_bytes.inc(int(out.get("new_raw_bytes") or 0))
            log.info("pre-copy stored", extra=dict(out))
        except Exception as exc:
            self.last_precopy = {"at": now(), "error": describe_error(exc)}
            log.info("pre-copy did not complete", extra={"error": describe_error(exc)})

    def gc(self) -> None:
        """The repository's gc, its report kept for the status (a failure too)."""
        assert self.repo is not None
        try:
            rep = self.repo.gc(grace=self.cfg.retention.gc_grace)
            self.last_gc = {"at": now(), "report": _jsonable(rep)}
        except GpuckptError as exc:
            self.last_gc = {"at": now(), "error": describe_error(exc)}
            log.warning("gc failed", extra={"error": describe_error(exc)})

    # -- the worker, and restore at start ------------------------------------------------------

    def _sweep_staging(self) -> None:
        """Delete what a killed predecessor left staged (users' KV): its restore staging
        directories, and capture page files in the connector's staging directory."""
        for d in session.sweep_restore_dirs():
            log.info("removed a dead agent's restore staging", extra={"path": d})
        if self._swept_connector:
            return
        try:
            removed = session.sweep(self.engine)
        except (OSError, ValueError, GpuckptError):
            return  # no worker yet: swept when it attaches
        self._swept_connector = True
        if removed:
            log.info("removed stale capture page files", extra={"files": len(removed)})

    def _wait_for_worker(self, budget: float) -> bool:
        end = time.monotonic() + budget
        warned = False
        while time.monotonic() < end and not self._stopping.is_set():
            try:
                # a connector socket someone else could have made is never talked to
                fs.check_socket(self.cfg.connector_socket, self.engine.staging.trust)
                session.describe(self.engine)
                self.worker.update(attached=True, last_seen=now(), error=None)
                self._sweep_staging()
                return True
            except (fs.UnsafePath, EngineMismatch) as exc:
                self.worker.update(attached=False, error=describe_error(exc))
                if not warned:
                    log.error("refusing the connector socket", extra={"error": str(exc)})
                    warned = True
                time.sleep(0.5)
            except (OSError, ValueError, GpuckptError) as exc:
                self.worker.update(attached=False, error=describe_error(exc))
                time.sleep(0.5)
        return False

    def worker_died(self) -> list[str]:
        """``launch`` saw the worker exit unasked: record the requests a worker that died soon after
        its restore was running (:meth:`RestoreAtStart.worker_died`); returns them."""
        return self._restore.worker_died() if self._restore is not None else []

    def restore_at_start(self) -> RestoreReport:
        """Restore this worker's checkpoint (warm or cold with replay) into the attached worker."""
        assert self.repo is not None

        def failed(record: dict[str, Any]) -> None:
            self.last_error = record

        self._restore = RestoreAtStart(
            self.cfg,
            self.repo,
            self.engine,
            self.metrics,
            trust_domain=self.trust_domain,
            attach=self._wait_for_worker,
            worker_error=lambda: self.worker.get("error"),
            on_error=failed,
        )
        return self._restore.run()

    # -- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        running, pending = self.tickets.views()
        rr = self.restore_report
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
            # without the results (large; GET /restore has them)
            "restore": rr.to_json(results=False) if rr is not None else None,
            "preempted": self.preempted,
            "last_gc": self.last_gc,
            "last_precopy": self.last_precopy,
            # the canary the next checkpoint records (probed in the background, once per worker process)
            "canary": {"worker_pid": self._canary[0]} if self._canary is not None else None,
        }

    def _status_line(self) -> str:
        lc = self.last_checkpoint
        last = f"last checkpoint {lc['id']}" if lc else "no checkpoint yet"
        rr = self.restore_report
        rs = f"; restore {rr.outcome}" if rr is not None and rr.outcome else ""
        return f"{self.state}: worker {self.cfg.worker_id}, {last}{rs}"


def _redact(url: str) -> str:
    """Repository URL without userinfo or query secrets (credentials never belong there, but be safe)."""
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
