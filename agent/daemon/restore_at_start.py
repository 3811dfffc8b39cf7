"""Restore at start: this worker's newest checkpoint (or the configured one) into the worker the
agent attaches to, warm or cold with replay, and the report ``GET /restore`` serves.

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
from typing import Any

from agent import session
from agent.daemon.config import AgentConfig
from agent.daemon.metrics import Metrics
from agent.daemon.reporting import describe_error, now
from agent.engines.base import Engine
from agent.engines.types import CanaryStats, RestorePlan, Resubmission, ServingClient
from ckpt import GpuckptError, ObjectNotFound, Policy, Repository

__all__ = ["RestoreAtStart", "RestoreReport"]

log = logging.getLogger("gpuckpt.agent")


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
        try:
            info = self.repo.resolve(ref)
        except (ObjectNotFound, GpuckptError) as exc:
            self.metrics.restores.labels(outcome="none", reason="no checkpoint").inc()
            log.info("no checkpoint to restore", extra={"ref": ref})
            return self._update(outcome="none", reasons=(f"nothing to restore: {describe_error(exc)}",))
        self._update(checkpoint=info.id)
        budget = cfg.restore.wait_for_worker.total_seconds()
        if not self._attach(budget):
            self.metrics.restores.labels(outcome="failed", reason="worker unreachable").inc()
            return self._update(outcome="failed", reasons=(f"worker not reachable: {self._worker_error()}",))
        client = self.engine.client(cfg.worker_url) if cfg.worker_url else None
        try:
            if client is not None:
                client.wait_ready(budget)
            plan = session.restore(
                self.repo,
                info.id,
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
            report = self._update(outcome="failed", reasons=(describe_error(exc),))
            self.metrics.restores.labels(outcome="failed", reason=type(exc).__name__).inc()
            self._on_error({"at": now(), "operation": "restore", "error": describe_error(exc)})
            log.error("restore failed", extra={"checkpoint": info.id, "error": describe_error(exc)})
            if client is not None:
                _release_retries(client)
                client.close()
            return report
        return self._planned(plan, info.id, client, t0)

    def _planned(self, plan: RestorePlan, checkpoint: str, client: ServingClient | None, t0: float) -> RestoreReport:
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
            blocks_offered=plan.blocks_offered,
            plan_s=round(time.monotonic() - t0, 3),
            canary=plan.stats.get("canary"),
        )
        extra = {"checkpoint": checkpoint, "outcome": outcome, "reasons": plan.reasons, "requests": len(plan.requests)}
        log.info("restore planned", extra=extra)
        for rid, why in report.inexact.items():
            log.warning("request replayed cold", extra={"request": rid, "reasons": why})
        if plan.rest is not None:
            report = self._update(rest={"state": "streaming"})
            threading.Thread(target=self._await_rest, args=(plan,), name="gpuckpt-restore-rest", daemon=True).start()
        if client is not None and plan.requests:
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
        return report

    def _await_rest(self, plan: RestorePlan) -> None:
        """The rest of a streaming restore arrives behind the resubmitted requests: record when it has."""
        plan.wait_offered()
        assert plan.rest is not None
        report = self._update(blocks_offered=plan.offered_total, rest={"state": "done", **plan.rest.stats})
        log.info("restore offered the rest", extra={"checkpoint": report.checkpoint, **plan.rest.stats})

    def _resubmit(self, client: ServingClient, requests: Sequence[Resubmission]) -> None:
        """Resubmit the ledger and record a bounded summary of each continuation (its length and
        digest, not its tokens: the worker keeps those for the client's retry, bounded there).
        A request whose carried state the worker never applied is reported a cold replay."""
        self._update(resubmission={"state": "running", "requests": len(requests)})
        try:
            # one response per request: nobody watches the agent's streams, the clients' retries do
            done = session.resubmit(client, requests, stream=False, worker=self.engine)
        except Exception as exc:
            self._update(resubmission={"state": "failed", "error": describe_error(exc)})
            log.error("resubmission failed", extra={"error": describe_error(exc)})
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
