"""A restore: a checkpoint into a fresh worker, streaming, in-flight requests first.

Order: read the manifest → ask the new worker for its pins → run the
compatibility rules (:func:`agent.session.plan.restore_decision`) → on a
match, load and verify the blocks into page files and offer them to the
worker → hand back the requests to resubmit. On a refusal, the same requests
are returned for a cold replay, with the reasons. With a ``generate``
callable, a warm restore re-runs the checkpoint's canary
(:mod:`agent.engines.canary`) after the first offer, before anything is
resubmitted: a different continuation withdraws the offer and turns the plan
cold (fail closed: never serve from a cache the new worker disagrees with).
Blocks that fail verification are not offered: the requests that needed them
recompute that part (never a wrong token).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Literal

from agent.engines import canary as canary_mod
from agent.engines import ledgers, staging
from agent.engines.channel import WorkerChannel
from agent.engines.control import ControlError
from agent.engines.offers import AWAIT_S
from agent.engines.types import CanaryStats, RestorePlan, RestoreStats, Resubmission, Staging
from agent.fs import Trust
from agent.session import restore_rest
from agent.session.plan import restore_decision
from agent.session.worker import WorkerLike, describe, reach
from ckpt import BlockFailure, Manifest, Policy, Repository
from ckpt.compat import STRICT

__all__ = ["DEFAULT_OFFER_TTL", "Release", "RestoreOptions", "restore"]

log = logging.getLogger("gpuckpt.session")

#: how long a restore's blocks stay offered (for conversations whose next turn comes later)
DEFAULT_OFFER_TTL = 600.0
#: when a streaming restore's resubmitted requests run (see :func:`restore`)
Release = Literal["each", "together"]


@dataclasses.dataclass(frozen=True)
class RestoreOptions:
    """Everything a restore can be told (see :func:`restore` for how each is used).

    ``staging_dir``: where the restore's page files go (default: a directory of this process's,
    see :mod:`agent.session.restore_rest`); ``trust``: the accounts the worker reads them as
    (default: an Engine's staging trust); ``engine``: the engine the worker must run (default:
    an Engine's name); ``policy``: the compatibility rules to enforce; ``trust_domain``: a
    checkpoint of another trust domain is a cold plan that says so; ``generate``: the canary
    probe on the new worker; ``require_canary``: no warm plan without it; ``offer_ttl``: how
    long the blocks stay offered; ``max_staging``: the bound on the page files' bytes (default:
    half the staging filesystem's free space); ``wait``: return once every block is offered;
    ``release``: when the resubmitted requests run."""

    staging_dir: str | os.PathLike[str] | None = None
    policy: Policy = STRICT
    generate: canary_mod.Generate | None = None
    require_canary: bool = True
    offer_ttl: float | None = DEFAULT_OFFER_TTL
    max_staging: int | None = None
    wait: bool = False
    trust: Trust | None = None
    engine: str | None = None
    release: Release | None = None
    trust_domain: str | None = None


def _request_states(m: Manifest, *, warm: bool) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """What each ledger entry needs beyond its tokens, by request id, and why some cannot have it
    (the ledger's own engine package judges: :func:`agent.engines.ledgers.format_of`)."""
    if m.ledger is None:
        return {}, {}
    return ledgers.format_of(m.ledger).request_states(m.ledger, warm=warm)


def _annotate(requests: list[Resubmission], problems: dict[str, list[str]]) -> list[Resubmission]:
    out = []
    for r in requests:
        extra = problems.get(r.request_id, [])
        if extra:
            reasons = (*r.reasons, *extra)
            r = dataclasses.replace(r, exact=False, reasons=reasons)
        out.append(r)
    return out


def _offer_states(channel: WorkerChannel, states: dict[str, dict[str, Any]], problems: dict[str, list[str]]) -> int:
    """Offer request states alone (no pages); the worker's rejections become per-request problems."""
    if not states:
        return 0
    reply = channel.offer(index=None, requests=states)
    for cid, why in reply.rejected.items():
        problems.setdefault(cid, []).append(f"request state rejected by the worker: {why}")
    return int(reply.get("requests", 0))


def _first_keys(channel: WorkerChannel, m: Manifest) -> tuple[list[tuple[str, list[bytes]]], list[bytes]]:
    """The checkpoint's pages each resubmitted request reads — (client id, keys), in the ledger's
    order — and those the canary probe reads: keys computed by the new worker's engine from their
    tokens (the ``keys`` command)."""
    if m.ledger is None and m.canary is None:
        return [], []
    reqs = ledgers.format_of(m.ledger).key_requests(m.ledger) if m.ledger is not None else []
    ids = [str(r.pop("request_id", "")) for r in reqs]
    if m.canary is not None:
        toks = list(m.canary.get("prompt_token_ids", [])) + list(m.canary.get("expected", []))
        reqs.append({"token_ids": toks, "kv_tokens": max(0, len(toks) - 1), "cache_salt": None})
    try:
        got = channel.keys(reqs).keys
    except ControlError as exc:  # an older worker: no order, the whole checkpoint at once
        log.warning("the worker cannot name the in-flight pages", extra={"error": str(exc)})
        return [], []
    have = {r.key for r in m.blocks}

    def held(keys: tuple[str, ...]) -> list[bytes]:
        return list(dict.fromkeys(bytes.fromhex(k) for k in keys if k in have))

    per_request = [(cid, held(keys)) for cid, keys in zip(ids, got, strict=False)]
    probe = held(got[len(ids)]) if m.canary is not None and len(got) > len(ids) else []
    return per_request, probe


def _probe(canary: dict[str, Any], generate: canary_mod.Generate) -> tuple[bool, list[int], str | None, float]:
    """Run the canary probe: (match, tokens got, why not, seconds). A probe that cannot run fails."""
    t = time.monotonic()
    try:
        ok, got, why = canary_mod.check(canary, generate)
    except Exception as exc:
        ok, got, why = False, [], f"canary: probe failed: {type(exc).__name__}: {exc}"
    return ok, list(got), why, time.monotonic() - t


def restore(
    repo: Repository, ref: str, worker: WorkerLike, options: RestoreOptions | None = None, /, **fields: Any
) -> RestorePlan:
    """Plan and prepare the restore of checkpoint ``ref`` into ``worker`` (``fields``: any of
    :class:`RestoreOptions`' as keywords, over ``options``).

    Streaming, in-flight first: the pages the canary probe and the
    resubmitted requests read — keys the new worker computes from their
    tokens — are fetched, verified and offered first, request by request
    (:class:`~agent.session.restore_rest.RestoreRest`). ``release`` says when
    the resubmitted requests run. ``"each"``: the plan is returned once the
    probe passed, and a worker that holds awaited requests (the offer's
    ``awaiting``; the vLLM connector does) runs each as soon as its own pages
    are offered, while later requests' pages still arrive. ``"together"``:
    the plan waits for every in-flight page (so does ``"each"`` with a worker
    that cannot hold requests). The default is ``"each"``, but ``"together"``
    for a worker that computes on the host's CPU: there the requests running
    early take the cores the fetch of the others needs (2 cores, 16 requests,
    medians of three runs ÷ the whole fetch: the first request resumed at
    0.22 with ``"each"`` and 0.35 together, but the median request at 1.2
    against 0.42; ``docs/benchmarks.md``). The prefix cache follows once the
    resubmitted requests have each produced a token (at most
    :data:`~agent.session.restore_rest.REST_AFTER_S` after the probe), in
    page files of verified blocks offered as each is written (``plan.rest``;
    ``plan.wait_offered()`` waits for it; ``wait`` does so before
    returning), up to ``max_staging`` bytes of staging in all (default: half
    the staging filesystem's free space); blocks past it are not offered and
    recompute when asked for. A request that needs blocks still to come waits
    for them briefly and the worker asks for them: they come in the next part.
    A block that fails verification is never offered: whoever needs it
    recomputes it.

    The page files go to ``staging_dir``; the worker owns each once offered
    and deletes them when the offer ends — :func:`agent.session.withdraw`, or
    ``offer_ttl`` seconds after the first part (returning conversations find
    their prefix warm until then) — and they are deleted here on any failure
    before that.

    A warm restore is never handed back on an unchecked cache: unless
    ``require_canary`` is false, a checkpoint without a recorded canary, or
    a caller without ``generate``, gets a cold plan that says so.

    Returns the requests to resubmit either way; ``warm`` says whether the
    worker was offered the checkpoint's blocks, ``reasons`` why not. Each
    request carries ``exact`` / ``reasons``: a request the restore cannot
    continue from the exact next token (a ledger that judged it so, a seeded
    request on a cold plan, a state the worker rejected) is a cold replay of
    that request, and says why. With ``generate`` (greedy, on the new
    worker) and a canary in the manifest, the probe runs after the first
    part's offer, on the probe's own restored pages, while the requests'
    pages are fetched behind it; on a mismatch the offer is withdrawn (the
    rest is then refused) and the plan is cold.
    """
    opts = dataclasses.replace(options or RestoreOptions(), **fields)
    w = reach(worker, engine=opts.engine)
    channel = w.channel
    generate = opts.generate
    t0 = time.monotonic()
    phases: dict[str, float] = {}  # where the time to the first offer goes (stats["phases"])

    def lap(name: str, since: float) -> float:
        now = time.monotonic()
        phases[name] = now - since
        return now

    m = repo.manifest(ref)
    t = lap("manifest_s", t0)
    fmt = ledgers.format_of(m.ledger) if m.ledger is not None else None
    requests = fmt.resubmissions(m.ledger) if fmt is not None and m.ledger is not None else []
    desc = describe(channel, w.engine)
    t = lap("describe_s", t)
    if fmt is not None:  # what this worker makes inexact that the ledger's writer did not
        requests = fmt.judged_on(requests, desc.layout)
    reasons = list(restore_decision(m, desc, opts.policy, opts.trust_domain, requests).reasons)
    if opts.require_canary and m.canary is None:
        reasons.append(f"canary: checkpoint {m.id} recorded no probe, so a warm restore could not be checked")
    elif opts.require_canary and generate is None:
        reasons.append("canary: no worker API to run the probe on, so a warm restore could not be checked")

    def cold(why: list[str], stats: RestoreStats) -> RestorePlan:
        states, problems = _request_states(m, warm=False)
        stats["request_states"] = _offer_states(channel, states, problems)
        stats["plan_s"] = time.monotonic() - t0
        return RestorePlan(False, why, _annotate(requests, problems), stats=stats)

    if reasons:
        return cold(reasons, RestoreStats())
    states, problems = _request_states(m, warm=True)
    out_dir = (
        Path(opts.staging_dir) if opts.staging_dir else staging.default_dir(f"{restore_rest.RESTORE_TAG}{os.getpid()}")
    )
    # the worker reads these files: with two accounts, through the shared group (see agent.fs)
    out = Staging(out_dir, opts.trust or w.where.trust)
    budget = opts.max_staging if opts.max_staging is not None else restore_rest.default_restore_staging(out_dir)
    t = time.monotonic()
    per_request, probe_keys = _first_keys(channel, m)
    t = lap("keys_s", t)
    page = max(1, m.blocks[0].raw_length if m.blocks else 1)
    probing = m.canary is not None and generate is not None
    if not probing:
        probe_keys = []  # the probe's pages are then part of the prefix cache like any other
    first = list(dict.fromkeys([*probe_keys, *(k for _, ks in per_request for k in ks)]))
    if len(first) * page > budget:
        first = first[: budget // page]
    chosen = set(first)
    rest = [] if not first else [k for k in (bytes.fromhex(r.key) for r in m.blocks) if k not in chosen]
    # The first part: the probe's own pages (it runs on them while the requests' pages are fetched
    # behind it; no request is resubmitted before it passed: the plan is returned after it), or
    # without a probe the first request's. Without an order (no in-flight request, an older
    # worker) the whole checkpoint is one part.
    waiting = [(cid, [k for k in ks if k in chosen]) for cid, ks in per_request]
    waiting = [(cid, ks) for cid, ks in waiting if ks]
    if not first:
        part0: list[bytes] | None = None
    elif probing:
        part0 = [k for k in probe_keys if k in chosen]
    else:
        part0 = waiting[0][1] if waiting else []
    in_part0 = set(part0 or ())
    waiting = [(cid, ks) for cid, ks in waiting if not set(ks) <= in_part0]
    errors: list[BlockFailure] = []
    pw: staging.PageWriter | None = None
    n = 0
    if part0 is None or part0:
        pw, n = restore_rest.write_pages(repo, m, part0, out, f"restore-{m.id}-0", errors)
    stats = RestoreStats(phases=phases, generators=sum(1 for st in states.values() if st.get("generator_state")))

    def count() -> None:
        stats["blocks"] = n
        stats["first_blocks"] = n
        stats["failed_blocks"] = len(errors)
        stats["failures"] = restore_rest.failures(errors)
        stats["first_s"] = time.monotonic() - t0

    if errors and not n and not rest and not waiting:
        count()
        if pw is not None:
            staging.unlink_pair(pw.index_path)
        none_ok = f"no block of checkpoint {m.id} could be verified ({len(errors)} failed; first: {errors[0].error})"
        return cold([none_ok], stats)
    index = str(pw.index_path) if pw is not None and n else None
    if pw is not None and not n:
        staging.unlink_pair(pw.index_path)
    each = opts.release == "each" or (opts.release is None and desc.layout.get("device") != "cpu")
    allowed = max(0, (budget - len(first) * page) // page)
    not_offered = max(0, len(rest) - allowed)
    if not_offered:
        log.warning(
            "restore staging bound reached: the rest of the checkpoint is not offered",
            extra={"checkpoint": m.id, "not_offered": not_offered, "bound": budget},
        )
        rest = rest[:allowed]
    try:
        reply = channel.offer(
            index=index,
            requests=states,
            ttl=opts.offer_ttl,
            awaiting=[cid for cid, _ in waiting] if each else [],
            await_s=AWAIT_S,
        )
    except BaseException:
        if index is not None:
            staging.unlink_pair(index)  # not offered: still ours to delete
        raise
    offered = reply.offered
    generation = reply.generation or 0
    # a worker that does not hold awaited requests gets every in-flight page before the plan
    holds = reply.awaits
    for cid, rejected in reply.rejected.items():
        problems.setdefault(cid, []).append(f"request state rejected by the worker: {rejected}")
    go = threading.Event()
    tail = None
    if waiting or rest:
        tail = restore_rest.RestoreRest(
            repo,
            m,
            channel,
            waiting,
            rest,
            out,
            generation,
            not_offered,
            go,
            each=each and holds,
            # the rest waits for these to start: not for those left to their clients, never sent
            resubmitted=sum(1 for r in requests if r.left_to_client is None),
        )
    count()
    if not probing:
        go.set()
        stats["canary"] = CanaryStats(checked=False, recorded=m.canary is not None)
    else:
        assert m.canary is not None
        assert generate is not None
        ok, got, why, secs = _probe(m.canary, generate)
        stats["canary"] = CanaryStats(
            checked=True,
            match=ok,
            expected=list(m.canary.get("expected", [])),
            got=got,
            canary_s=secs,
            on_restored_pages=n > 0,
        )
        if not ok:
            if tail is not None:
                tail.stop()
            channel.withdraw()  # fail closed: nothing of this checkpoint is served
            stats["withdrawn"] = offered
            return cold([str(why)], stats)
        go.set()
    stats["release"] = "each" if each and holds else "together"
    if tail is not None and stats["release"] == "together":
        tail.inflight_done.wait()
    lap("fetch_s", t)
    stats["plan_s"] = time.monotonic() - t0
    plan = RestorePlan(True, [], _annotate(requests, problems), blocks_offered=offered, stats=stats, rest=tail)
    if opts.wait:
        plan.wait_offered()
    return plan
