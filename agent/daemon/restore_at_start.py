"""Restore at start: this worker's newest checkpoint (or the configured one) into the worker the
agent attaches to, warm or cold with replay, and the report ``GET /restore`` serves.

With ``restore.adopt = "claim"`` (a pool's workers, new names on every replacement) the
checkpoint is claimed first (:mod:`ckpt.claims`): this worker's own newest if it has one, else
the newest orphaned final checkpoint of its pool that it wins the claim of; the claim is
renewed while the restore runs, marked done when it finished (warm or cold: a cold restore
replays the ledger, so the checkpoint's sessions went on here and must not be replayed again
elsewhere), and released when nothing was restored (the worker never answered, the restore
failed before its plan), so that another worker takes it. The report names the adopted
checkpoint, its original worker and the claim.

The restore and the resubmission are :mod:`agent.session`'s, as the CLI's
``gpuckpt restore`` uses them; what is the daemon's is when they run (the
rest of a streaming restore and the resubmitted requests each on a thread of
their own, so the agent is ready meanwhile), the metrics, and the report
(:class:`RestoreReport`), replaced whole at each step so that a reader never
sees half of one.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent import session
from agent.daemon import quarantine
from agent.daemon.config import AgentConfig
from agent.daemon.metrics import Metrics
from agent.daemon.reporting import describe_error, now
from agent.engines.base import Engine
from agent.engines.types import CanaryStats, RestorePlan, Resubmission, ServingClient
from ckpt import GpuckptError, ObjectNotFound, Policy, Repository, claims
from ckpt.manifest import CheckpointInfo

__all__ = ["RestoreAtStart", "RestoreReport"]

log = logging.getLogger("gpuckpt.agent")

#: how long a failed resubmission waits for the worker to stop answering before it takes the worker
#: for alive (and quarantines nothing)
WORKER_GONE_WAIT_S = 5.0


@dataclass(frozen=True)
class RestoreReport:
    """The restore at start, as far as it has come (:meth:`to_json`: ``GET /restore``'s document).

    ``outcome``: ``none`` (nothing to restore), ``failed``, ``warm`` or ``cold``;
    once planned (``planned``), the requests to resubmit, why some are replayed
    cold (``inexact``), the blocks offered and the canary; then the rest of a
    streaming restore (``rest``) and the resubmission, with a bounded summary of
    each continuation (``results``) and the requests left to their clients.
    """

    started_at: str
    checkpoint: str | None = None
    outcome: str | None = None
    reasons: tuple[str, ...] = ()
    planned: bool = False
    requests: tuple[str, ...] = ()
    inexact: Mapping[str, list[str]] = field(default_factory=dict)
    blocks_offered: int = 0
    plan_s: float = 0.0
    canary: CanaryStats | None = None
    rest: Mapping[str, Any] | None = None
    resubmission: Mapping[str, Any] | None = None
    left_to_client: Mapping[str, str] = field(default_factory=dict)
    results: Mapping[str, Mapping[str, Any]] | None = None
    #: the checkpoint adopted by a claim: its original worker, the claim's name and state
    adopted: Mapping[str, Any] | None = None
    #: checkpoints looked at for adoption and passed over, each with why
    passed_over: tuple[str, ...] = ()
    #: requests of the checkpoint not resubmitted because a worker died running them after an
    #: earlier restore (:mod:`.quarantine`), each with why; and why a quarantine record was refused
    quarantined: Mapping[str, str] = field(default_factory=dict)
    quarantine_refused: str | None = None

    def to_json(self, *, results: bool = True) -> dict[str, Any]:
        """The report; without ``results`` (large: ``GET /restore`` has them) for the status."""
        out: dict[str, Any] = {
            "checkpoint": self.checkpoint,
            "outcome": self.outcome,
            "reasons": list(self.reasons),
            "started_at": self.started_at,
        }
        if self.planned:
            out.update(
                requests=list(self.requests),
                # per request, why it is replayed cold rather than continued exactly (GET /restore, status)
                inexact={k: list(v) for k, v in self.inexact.items()},
                blocks_offered=self.blocks_offered,
                plan_s=self.plan_s,
                canary=self.canary,
            )
        if self.rest is not None:
            out["rest"] = dict(self.rest)
        if self.resubmission is not None:
            out["resubmission"] = dict(self.resubmission)
        if self.left_to_client:
            out["left_to_client"] = dict(self.left_to_client)
        if results and self.results is not None:
            out["results"] = {k: dict(v) for k, v in self.results.items()}
        if self.adopted is not None:
            out["adopted"] = dict(self.adopted)
        if self.passed_over:
            out["passed_over"] = list(self.passed_over)
        if self.quarantined:
            out["quarantined"] = dict(self.quarantined)
        if self.quarantine_refused:
            out["quarantine_refused"] = self.quarantine_refused
        return out


class RestoreAtStart:
    """One restore at start (:meth:`run`), and its report as it goes (:attr:`report`).

    ``attach(budget)`` waits up to ``budget`` seconds for the worker to
    answer (False: it did not; ``worker_error()`` says why); ``on_error``
    receives the agent's ``last_error`` record of a restore that failed.
    """

    def __init__(
        self,
        cfg: AgentConfig,
        repo: Repository,
        engine: Engine,
        metrics: Metrics,
        *,
        trust_domain: str,
        attach: Callable[[float], bool],
        worker_error: Callable[[], object],
        on_error: Callable[[dict[str, Any]], None],
    ) -> None:
        self.cfg = cfg
        self.repo = repo
        self.engine = engine
        self.metrics = metrics
        self.trust_domain = trust_domain
        self._attach = attach
        self._worker_error = worker_error
        self._on_error = on_error
        self._lock = threading.Lock()
        self._report: RestoreReport | None = None
        self._claim: claims.Claim | None = None
        self._parts = 0  # the threads still running for a claimed restore (the rest, the resubmission)
        self._verdict: tuple[str, str] = ("", "")
        #: the crash-loop record beside the worker (:mod:`.quarantine`), and what this restore has
        #: running in the worker: since when, of which checkpoint, the requests not yet finished
        self._quarantine = quarantine.path_for(Path(cfg.connector_socket).parent, cfg.worker_id)
        self._resubmitted_at: float | None = None
        self._checkpoint: str | None = None
        self._pending: set[str] = set()
        #: what the worker's death quarantined (once recorded), and the lock that makes it once
        self._death = threading.Lock()
        self._died: list[str] | None = None

    @property
    def report(self) -> RestoreReport | None:
        with self._lock:
            return self._report

    def _update(self, **changes: Any) -> RestoreReport:
        with self._lock:
            assert self._report is not None
            self._report = dataclasses.replace(self._report, **changes)
            return self._report

    def run(self) -> RestoreReport:
        """Restore the configured checkpoint (warm or cold with replay) into the attached worker;
        returns the report as of the plan (the rest and the resubmission follow on their threads)."""
        cfg = self.cfg
        ref = cfg.restore.checkpoint
        ref = f"{cfg.worker_id}:latest" if ref == "latest" else ref
        t0 = time.monotonic()
        with self._lock:
            self._report = RestoreReport(started_at=now())
        if cfg.restore.adopt == "claim" and cfg.restore.checkpoint == "latest":
            try:
                found = self._claimed()
            except GpuckptError as exc:
                self.metrics.restores.labels(outcome="failed", reason=type(exc).__name__).inc()
                log.error("could not claim a checkpoint", extra={"error": describe_error(exc)})
                return self._update(outcome="failed", reasons=(f"claiming a checkpoint: {describe_error(exc)}",))
            if found is None:
                self.metrics.restores.labels(outcome="none", reason="no checkpoint").inc()
                report = self.report
                assert report is not None
                why = f"nothing to claim in pool {cfg.pool!r}" + (
                    f" ({len(report.passed_over)} passed over)" if report.passed_over else ""
                )
                log.info("no checkpoint to adopt", extra={"pool": cfg.pool, "passed_over": list(report.passed_over)})
                return self._update(outcome="none", reasons=(why,))
            info = found
            ref = f"{info.worker_id}/{info.id}"
        else:
            try:
                info = self.repo.resolve(ref)
            except (ObjectNotFound, GpuckptError) as exc:
                self.metrics.restores.labels(outcome="none", reason="no checkpoint").inc()
                log.info("no checkpoint to restore", extra={"ref": ref})
                return self._update(outcome="none", reasons=(f"nothing to restore: {describe_error(exc)}",))
            ref = info.id
        self._update(checkpoint=info.id)
        budget = cfg.restore.wait_for_worker.total_seconds()
        if not self._attach(budget):
            self.metrics.restores.labels(outcome="failed", reason="worker unreachable").inc()
            self._release(f"worker not reachable: {self._worker_error()}")
            return self._update(outcome="failed", reasons=(f"worker not reachable: {self._worker_error()}",))
        client = self.engine.client(cfg.worker_url) if cfg.worker_url else None
        hold = _RetryHold(client)
        try:
            if client is not None:
                client.wait_ready(budget)
                hold.start()
            plan = session.restore(
                self.repo,
                ref,
                self.engine,
                session.RestoreOptions(
                    trust_domain=self.trust_domain,
                    policy=Policy.from_strings(ignore=cfg.restore.ignore_rules),
                    generate=client.generate if client is not None else None,
                    require_canary=cfg.restore.require_canary,
                    offer_ttl=cfg.restore.offer_ttl.total_seconds(),
                    max_staging=cfg.restore.max_staging,
                ),
            )
        except Exception as exc:
            hold.stop()
            report = self._update(outcome="failed", reasons=(describe_error(exc),))
            self.metrics.restores.labels(outcome="failed", reason=type(exc).__name__).inc()
            self._on_error({"at": now(), "operation": "restore", "error": describe_error(exc)})
            log.error("restore failed", extra={"checkpoint": info.id, "error": describe_error(exc)})
            self._release(f"restore failed: {describe_error(exc)}")
            if client is not None:
                _release_retries(client)
                client.close()
            return report
        # what is resubmitted is said next (expect, or release): the last renewal's lease covers it
        hold.stop()
        return self._planned(plan, info.id, client, t0)

    # -- adoption by claim (ckpt/claims.py) --------------------------------------------------------

    def _claimed(self) -> CheckpointInfo | None:
        """Claim this worker's own newest checkpoint, else the newest orphaned final checkpoint
        of its pool that this worker wins; the claim is then kept (renewed on a thread) until
        :meth:`_finish` or :meth:`_release`. None: nothing to claim (the report says what was
        passed over, and why)."""
        cfg = self.cfg
        store = self.repo.store
        assert cfg.pool is not None  # the configuration requires it with adopt = "claim"
        lease = cfg.restore.claim_lease.total_seconds()
        passed: list[str] = []

        def claim(info: CheckpointInfo) -> bool:
            got = claims.try_claim(store, info.worker_id, info.id, cfg.worker_id, pool=cfg.pool, lease_s=lease)
            if isinstance(got, claims.Refusal):
                passed.append(str(got))
                log.info(
                    "checkpoint not claimed", extra={"checkpoint": f"{info.worker_id}/{info.id}", "why": got.reason}
                )
                return False
            self._claim = got
            got.keep()
            adopted = {"worker_id": info.worker_id, "checkpoint": info.id, "claim": got.name, "state": "held"}
            self._update(adopted=adopted, passed_over=tuple(passed))
            log.info(
                "adopting a checkpoint" if info.worker_id != cfg.worker_id else "restoring this worker's checkpoint",
                extra={"checkpoint": info.id, "original_worker": info.worker_id, "claim": got.name},
            )
            return True

        try:
            own: CheckpointInfo | None = self.repo.latest(cfg.worker_id)[0]
        except GpuckptError:
            own = None
        if own is not None and claim(own):
            return own
        found, refused = claims.candidates(
            store, self.repo.keyring, pool=cfg.pool, trust_domain=self.trust_domain, exclude=[cfg.worker_id]
        )
        passed += [str(r) for r in refused]
        for c in found:
            if claim(c.info):
                return c.info
        self._update(passed_over=tuple(passed))
        return None

    def _claim_state(self, state: str, **more: Any) -> None:
        report = self.report
        if report is not None and report.adopted is not None:
            self._update(adopted={**report.adopted, "state": state, **more})

    def _release(self, why: str) -> None:
        """Nothing was restored: give the claim back, so that another worker takes the checkpoint."""
        c, self._claim = self._claim, None
        if c is None:
            return
        try:
            c.release(why)
            self._claim_state("released", reason=why)
        except GpuckptError as exc:  # its lease runs out instead
            log.warning("could not release the claim", extra={"claim": c.name, "error": describe_error(exc)})

    def _part_done(self) -> None:
        """One of the claimed restore's threads finished; the last one marks the claim done."""
        with self._lock:
            self._parts -= 1
            last = self._parts == 0
        if last:
            self._finish(*self._verdict)

    def _finish(self, outcome: str, reason: str) -> None:
        """The claimed checkpoint was restored (warm or cold): mark it done, never to be adopted
        again; then forget what retention no longer keeps of an adopted worker (retired)."""
        c, self._claim = self._claim, None
        if c is None:
            return
        try:
            c.finish(outcome, reason)
            self._claim_state("done", outcome=outcome)
        except claims.ClaimLost as exc:
            self._claim_state("lost", reason=str(exc))
            return
        except GpuckptError as exc:
            # not written: its lease runs out and another worker may restore it again; say so loudly
            self._claim_state("unfinished", reason=describe_error(exc))
            log.error("could not mark the claim done", extra={"claim": c.name, "error": describe_error(exc)})
            return
        if c.worker_id != self.cfg.worker_id:
            r = self.cfg.retention
            try:
                gone = self.repo.forget(keep_last=r.keep_last, keep_within=r.keep_within, worker_id=c.worker_id)
                if gone:
                    log.info(
                        "retention forgot the adopted worker's checkpoints", extra={"forgotten": [str(x) for x in gone]}
                    )
            except GpuckptError as exc:
                log.warning("retention of the adopted worker failed", extra={"error": describe_error(exc)})

    def _planned(self, plan: RestorePlan, checkpoint: str, client: ServingClient | None, t0: float) -> RestoreReport:
        # a request a worker died running after an earlier restore of this checkpoint is left to its
        # client (its retry runs it anew): a crash loop is broken, not repeated
        verdict = quarantine.verdict(
            self._quarantine,
            worker_id=self.cfg.worker_id,
            checkpoint=checkpoint,
            ledger_ids=[r.request_id for r in plan.requests],
        )
        if verdict.quarantined:
            plan = dataclasses.replace(
                plan,
                requests=[
                    Resubmission.left(r.request_id, verdict.quarantined[r.request_id], r.api)
                    if r.request_id in verdict.quarantined
                    else r
                    for r in plan.requests
                ],
            )
            for rid, reason in verdict.quarantined.items():
                log.error("request quarantined: not resubmitted", extra={"request": rid, "why": reason})
        self._update(quarantined=verdict.quarantined, quarantine_refused=verdict.refused)
        outcome = "warm" if plan.warm else "cold"
        reason = "pins match" if plan.warm else (plan.reasons[0].split(":")[0] if plan.reasons else "unknown")
        self.metrics.restores.labels(outcome=outcome, reason=reason).inc()
        self.metrics.restore_seconds.observe(time.monotonic() - t0)
        report = self._update(
            outcome=outcome,
            reasons=tuple(plan.reasons),
            planned=True,
            requests=tuple(r.request_id for r in plan.requests),
            inexact=plan.inexact(),
            left_to_client=plan.left_to_client(),
            blocks_offered=plan.blocks_offered,
            plan_s=round(time.monotonic() - t0, 3),
            canary=plan.stats.get("canary"),
        )
        extra = {"checkpoint": checkpoint, "outcome": outcome, "reasons": plan.reasons, "requests": len(plan.requests)}
        if report.adopted is not None:
            extra["original_worker"] = report.adopted["worker_id"]
        log.info("restore planned", extra=extra)
        resubmitting = client is not None and bool(plan.requests)
        with self._lock:
            self._verdict = (outcome, "pins match" if plan.warm else "; ".join(plan.reasons) or "cold")
            self._parts = (plan.rest is not None) + resubmitting + 1  # + this thread's own part
        for rid, why in report.inexact.items():
            log.warning("request replayed cold", extra={"request": rid, "reasons": why})
        for rid, left in report.left_to_client.items():
            log.warning("request not resubmitted: its client's retry computes it", extra={"request": rid, "why": left})
        if plan.rest is not None:
            report = self._update(rest={"state": "streaming"})
            threading.Thread(target=self._await_rest, args=(plan,), name="gpuckpt-restore-rest", daemon=True).start()
        if client is not None and plan.requests:
            with self._lock:
                self._checkpoint, self._resubmitted_at = checkpoint, time.monotonic()
                self._pending = {r.request_id for r in plan.requests if r.left_to_client is None}
            # A one-shot thread: not among the agent's threads, whose liveness the watchdog checks.
            threading.Thread(
                target=self._resubmit, args=(client, plan.requests), name="gpuckpt-resubmit", daemon=True
            ).start()
        else:
            state = "done" if not plan.requests else "not configured (no worker_url): GET /restore lists them"
            report = self._update(resubmission={"state": state, "requests": len(plan.requests)}, results={})
            if client is not None:
                _release_retries(client)
                client.close()
        self._part_done()
        return self.report or report

    def _finished(self, request_id: str) -> None:
        with self._lock:
            self._pending.discard(request_id)

    def _worker_gone(self) -> bool:
        """Whether the worker stopped answering on its control socket within
        :data:`WORKER_GONE_WAIT_S` (an engine that died is gone in a moment; one that merely
        refused a request still answers)."""
        deadline = time.monotonic() + WORKER_GONE_WAIT_S
        while True:
            try:
                self.engine.channel.ping()
            except Exception:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def worker_died(self) -> list[str]:
        """The worker died (``launch`` saw it exit without being asked to stop): if that was within
        :data:`quarantine.WINDOW_S` of this restore's resubmission, record the resubmitted requests
        it was still running (:func:`quarantine.record`), so that the next restore of the
        checkpoint leaves them to their clients. Returns those requests. One death, one record:
        ``launch`` and the failed resubmission may both see it; the second is told the first's."""
        with self._death:
            if self._died is None:
                self._died = self._record_death()
            return list(self._died)

    def _record_death(self) -> list[str]:
        with self._lock:
            since, checkpoint, running = self._resubmitted_at, self._checkpoint, sorted(self._pending)
        if since is None or checkpoint is None or not running:
            return []
        after = time.monotonic() - since
        if after > quarantine.WINDOW_S:
            return []
        why = f"{after:.0f} s after the restore of {checkpoint} resubmitted it"
        try:
            quarantine.record(
                self._quarantine,
                worker_id=self.cfg.worker_id,
                checkpoint=checkpoint,
                requests=running,
                why=why,
                at=now(),
            )
        except OSError as exc:
            log.error("could not record the quarantine", extra={"path": str(self._quarantine), "error": str(exc)})
            return []
        log.error(
            "worker died after the restore: requests quarantined", extra={"checkpoint": checkpoint, "requests": running}
        )
        return running

    def _await_rest(self, plan: RestorePlan) -> None:
        """The rest of a streaming restore arrives behind the resubmitted requests: record when it has."""
        try:
            plan.wait_offered()
            assert plan.rest is not None
            report = self._update(blocks_offered=plan.offered_total, rest={"state": "done", **plan.rest.stats})
            log.info("restore offered the rest", extra={"checkpoint": report.checkpoint, **plan.rest.stats})
        finally:
            self._part_done()

    def _resubmit(self, client: ServingClient, requests: Sequence[Resubmission]) -> None:
        """Resubmit the ledger and record a bounded summary of each continuation (its length and
        digest, not its tokens: the worker keeps those for the client's retry, bounded there).
        A request whose carried state the worker never applied is reported a cold replay."""
        self._update(resubmission={"state": "running", "requests": len(requests)})
        try:
            # one response per request: nobody watches the agent's streams, the clients' retries do
            done = session.resubmit(client, requests, stream=False, worker=self.engine, on_done=self._finished)
        except Exception as exc:
            self._update(resubmission={"state": "failed", "error": describe_error(exc)})
            log.error("resubmission failed", extra={"error": describe_error(exc)})
            # the worker died under it (its engine killed by what it ran, say): what it was running
            # is quarantined — whether or not a ``launch`` is there to see the death (the chart's pod)
            if self._worker_gone():
                self.worker_died()
            self._part_done()
            return
        finally:
            client.close()
        cold = done.newly_inexact()
        for rid, reasons in cold.items():
            log.warning("resubmitted request replayed cold", extra={"request": rid, "reasons": reasons})
        with self._lock:
            assert self._report is not None
            r = self._report
            self._report = dataclasses.replace(
                r,
                inexact={**r.inexact, **cold},
                left_to_client={**r.left_to_client, **done.left_to_client()},
                resubmission={"state": "done", "requests": len(requests)},
                results=done.summaries(),
            )
        log.info("resubmitted requests finished", extra={"requests": len(requests)})
        self._part_done()


#: the lease the agent keeps on the worker's retry hold while its restore runs, and how often it
#: renews it: a hold lapses at most ``HOLD_LEASE_S`` after an agent that died mid-restore
HOLD_LEASE_S = 30.0
HOLD_RENEW_S = 10.0
HOLD_JOIN_S = 6.0


class _RetryHold:
    """Keeps a vLLM worker's server holding possible retries while the restore runs, however long
    it takes (a large checkpoint from a bucket): a thread renews a short lease
    (``ServeClient.hold_retries``) until :meth:`stop`. The hold itself ends when the agent says
    what it resubmits (``expect``) or that it resubmits nothing (``release``); renewals after
    that hold nothing. A worker without gpuckpt's middleware, or an engine whose client has no
    such hold (SGLang), gets no thread."""

    def __init__(self, client: ServingClient | None) -> None:
        self._renew: Callable[[float], float] | None = getattr(client, "hold_retries", None)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._renew is not None:
            self._thread = threading.Thread(target=self._run, name="gpuckpt-retry-hold", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        assert self._renew is not None
        while True:
            try:
                if self._renew(HOLD_LEASE_S) <= 0:
                    return  # nothing held there (no middleware or token, or already released)
            except Exception as exc:  # the next renewal may get through; the lease covers the gap
                log.warning("could not renew the worker's retry hold", extra={"error": describe_error(exc)})
            if self._stop.wait(HOLD_RENEW_S):
                return

    def stop(self) -> None:
        """No more renewals (before the client is used to say what is resubmitted, or closed)."""
        self._stop.set()
        if self._thread is not None:
            # a renewal under way takes its client's short timeout at most (ServeClient.hold_retries)
            self._thread.join(timeout=HOLD_JOIN_S)


def _release_retries(client: ServingClient) -> None:
    """Tell the worker's server that nothing will be resubmitted, where it holds possible retries
    for the restore (a vLLM worker with gpuckpt's middleware); never fails the restore."""
    release = getattr(client, "release", None)
    if release is None:
        return
    try:
        release()
    except Exception as exc:
        log.warning("could not release the worker's held retries", extra={"error": describe_error(exc)})
