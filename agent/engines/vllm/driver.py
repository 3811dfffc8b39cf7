"""The agent side of the vLLM adapter: checkpoint a running worker into a
repository, and restore a checkpoint into a fresh one.

Both talk to the connector's scheduler half over its control socket (see
:mod:`agent.engines.vllm.connector`), so they work the same for an offline
``vllm.LLM`` and for ``vllm serve``; the heavy work (hashing, compression,
upload, download, verification) runs here, never in the serving process.

Restore order: read the manifest → ask the new worker for its pins → run the
compatibility rules (:func:`ckpt.decide`) → on a match, load and verify the
blocks into a page file and offer it to the connector → hand back the
requests to resubmit. On a refusal, the same requests are returned for a
cold replay, with the reasons. With a ``generate`` callable, the checkpoint
records the canary (:mod:`agent.engines.vllm.canary`) just before the
capture, and a warm restore re-runs it after the offer, before anything is
resubmitted: a different continuation withdraws the offer and turns the plan
cold (fail closed: never serve from a cache the new worker disagrees with).
Blocks that fail verification are not offered: the requests that needed them
recompute that part (never a wrong token).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agent.engines.base import Capture, RestorePlan, Resubmission, WorkerDescription
from agent.engines.vllm import canary as canary_mod
from agent.engines.vllm import control, shards, staging
from agent.engines.vllm.ledger import read as read_ledger
from agent.engines.vllm.ledger import resubmissions
from ckpt import (
    Block,
    BlockFailure,
    BlocksMissing,
    Existing,
    Ledger,
    Manifest,
    Pins,
    Policy,
    Repository,
    WorkerFacts,
    decide,
    host_facts,
)
from ckpt.compat import STRICT
from ckpt.save import SaveProgress

Socket = str | os.PathLike[str]
log = logging.getLogger("gpuckpt.driver")


def describe(sock: Socket) -> WorkerDescription:
    r = control.call(sock, "describe")
    return WorkerDescription(WorkerFacts.model_validate(r["facts"]), r["layout"], r["namespace"])


def capture(sock: Socket, timeout: float = 60.0, when: dict[str, int] | None = None, *, full: bool = False) -> Capture:
    """Ask the connector for a snapshot at the next step boundary.

    A tensor-parallel worker answers with one page file per rank; their
    pages are joined here into stored pages holding every KV head
    (:mod:`agent.engines.vllm.shards`), so a checkpoint restores into any TP
    size. A capture whose ranks' parts do not cover every head is refused
    (:class:`~agent.engines.vllm.shards.ShardError`, naming the rank) and its
    page files are deleted. ``close`` deletes every page file. With ``when``
    (``{"live": n, "min_outputs": k}``) the capture is taken at the first step
    boundary where n unfinished requests have k outputs each. The capture is
    incremental: pages whose keys the connector holds for durable (acknowledged
    after a commit, or offered by a restore) are not copied and come as
    :class:`ckpt.Existing` blocks; ``full`` copies every page.
    """
    t0 = time.monotonic()
    r = control.call(sock, "capture", io_timeout=timeout + 5, timeout=timeout, when=when, full=full)
    shard_recs = r.get("shards") or [{"rank": 0, "index": r["index"]}]
    files: list[staging.PageFile] = []

    def close() -> None:
        for pf in files:
            pf.close()
        for rec in shard_recs:
            if rec.get("index"):
                staging.unlink_pair(rec["index"])

    try:
        for rec in shard_recs:
            files.append(staging.PageFile(rec["index"]))
        first = files[0].index
        shard_shape = tuple(first.page_shape)
        head_axis = int(shard_recs[0].get("head_axis", 0))
        total = int(shard_recs[0].get("total_kv_heads", shard_shape[1 + head_axis]))
        for rec in shard_recs:
            rec.setdefault("kv_heads", [0, shard_shape[1 + head_axis]])
        tp = int(r.get("tensor_parallel_size", len(shard_recs)))
        shards.check_cover(shard_recs, total, tp)
        for rec, pf in zip(shard_recs, files, strict=True):
            same = pf.index.keys == first.keys and tuple(pf.index.page_shape) == shard_shape
            if not same or pf.index.dtype != first.dtype:
                raise shards.ShardError(f"rank {rec['rank']}'s page file does not match rank 0's (keys, shape, dtype)")
        shape = shards.full_shape(shard_shape, head_axis, total)
    except BaseException:
        close()
        raise

    skipped = [bytes.fromhex(k) for k in r.get("skipped") or []]

    def pages() -> Iterator[Block | Existing]:
        joined = shards.join(
            [(v for _, v in pf.items()) for pf in files],
            shard_recs,
            dtype=first.dtype,
            shard_shape=shard_shape,
            head_axis=head_axis,
            total=total,
        )
        for key, view in zip(first.keys, joined, strict=True):
            yield Block(key, view, first.dtype, shape)
        for key in skipped:  # durable: the repository holds them (or the save says it does not)
            yield Existing(key, first.dtype, tuple(shape))

    keys = ("step", "pages", "prefix_pages", "tail_pages", "requests", "plan_s", "wait_s", "copy_s", "bytes")
    stats = {k: r[k] for k in keys}
    stats["write_s"] = r.get("write_s", 0.0)  # the worker's page-file write, off the engine's step
    stats["capture_s"] = time.monotonic() - t0
    stats["page_shape"] = list(shape)
    stats["page_dtype"] = first.dtype
    stats["layers"] = list(first.layers)
    stats["inexact_requests"] = r.get("inexact_requests", 0)
    stats["skipped_pages"] = len(skipped)
    stats["shards"] = [
        {k: rec[k] for k in ("rank", "device", "kv_heads", "pages_written", "bytes", "copy_s") if k in rec}
        for rec in shard_recs
    ]
    stats["head_axis"] = head_axis
    stats["tensor_parallel_size"] = tp
    return Capture(pages(), Ledger.model_validate(r["ledger"]), stats, close)


#: how long a restore's blocks stay offered (for conversations whose next turn comes later)
DEFAULT_OFFER_TTL = 600.0
RESTORE_TAG = "restore-"


def checkpoint(
    sock: Socket,
    repo: Repository,
    worker_id: str,
    *,
    labels: dict[str, str] | None = None,
    timeout: float = 60.0,
    generate: canary_mod.Generate | None = None,
    deadline: float | None = None,
    progress: Callable[[SaveProgress], None] | None = None,
    on_captured: Callable[[dict[str, Any]], None] | None = None,
    canary: dict[str, Any] | None = None,
    when: dict[str, int] | None = None,
    cancel: threading.Event | None = None,
) -> Manifest:
    """Capture the worker behind ``sock`` and save it; returns the visible manifest.

    ``generate(prompt_ids, n)`` (greedy, on this worker) records the canary
    just before the capture; without it the manifest has no canary.
    ``deadline`` (a ``time.monotonic()`` value) bounds the capture and the
    save: past it the checkpoint is abandoned (:class:`ckpt.OperationAborted`)
    and nothing becomes visible. ``on_captured(stats)`` is called once the
    worker's pages are staged (the worker is no longer involved).
    ``canary`` is a record from an earlier :func:`canary.record` on this
    worker, reused instead of probing again (the agent records it once: a
    probe costs engine steps, which a final checkpoint cannot spare).
    ``cancel`` abandons the save when set (nothing becomes visible).
    """
    if deadline is not None:
        timeout = max(0.1, min(timeout, deadline - time.monotonic()))
    desc = describe(sock)
    t_canary = time.monotonic()
    if canary is None and generate is not None:
        canary = canary_mod.record(generate)
    canary_s = time.monotonic() - t_canary
    cap = capture(sock, timeout, when)
    if on_captured is not None:
        on_captured(dict(cap.stats))
    recaptured = 0
    while True:
        try:
            t0 = time.monotonic()
            layout = {
                **desc.layout,
                "page_shape": cap.stats["page_shape"],
                "page_dtype": cap.stats["page_dtype"],
                "page_layers": cap.stats["layers"],
                "head_axis": cap.stats["head_axis"],
                # which rank held which heads when the checkpoint was taken
                "shards": cap.stats["shards"],
            }
            m = repo.save(
                cap.pages,
                worker_id=worker_id,
                namespace=desc.namespace,
                pins=Pins(host=host_facts(), worker=desc.facts),
                layout=layout,
                ledger=cap.ledger,
                labels=labels,
                canary=canary,
                deadline=deadline,
                progress=progress,
                cancel=cancel,
            )
            timings = {**cap.stats, "save_s": time.monotonic() - t0, "canary_s": canary_s, "recaptured": recaptured}
            break
        except BlocksMissing as exc:
            # Keys the connector took for durable that the repository no longer holds (gc, another
            # repository): the connector forgets them and a capture at the next step boundary
            # copies them — never a checkpoint that names what is not stored.
            if recaptured:
                raise
            recaptured = len(exc.keys)
            control.call(sock, "durable", remove=[k.hex() for k in exc.keys])
        finally:
            cap.close()
        remaining = timeout if deadline is None else max(0.1, min(timeout, deadline - time.monotonic()))
        cap = capture(sock, remaining, None)
    # The repository holds every key of the checkpoint now: the next capture need not copy them.
    try:
        control.call(sock, "durable", add=sorted({b.key for b in m.blocks}))
    except (OSError, control.ControlError) as exc:  # only costs the next capture a full copy
        log.warning("could not acknowledge durable keys", extra={"error": str(exc)})
    _LAST_STATS.clear()
    _LAST_STATS.update(timings)
    return m


#: Stats of the last :func:`checkpoint` in this process (pause, copy, save times).
_LAST_STATS: dict[str, Any] = {}


def last_checkpoint_stats() -> dict[str, Any]:
    return dict(_LAST_STATS)


def _request_states(m: Manifest, *, warm: bool) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """What each ledger entry needs beyond its tokens, by client id, and why some cannot have it.

    Earlier outputs (for penalties / bad words and to advance a grammar)
    apply warm or cold: they are the request's semantics, not the cache's.
    The seeded sampler state applies on a warm restore only.
    """
    from agent.engines.vllm.ledger import PRIOR_OUTPUTS_NEEDED

    states: dict[str, dict[str, Any]] = {}
    problems: dict[str, list[str]] = {}
    entries = read_ledger(m.ledger) if m.ledger is not None else []
    for e in entries:
        cid = e["client_request_id"]
        st: dict[str, Any] = {}
        outs = list(e["output_token_ids"])
        if outs and any(e["sampling"].get(f) for f in PRIOR_OUTPUTS_NEEDED):
            st["prior_outputs"] = outs
        if outs and e.get("structured_outputs"):
            st["grammar_outputs"] = outs
        g = e.get("generator_state")
        if g:
            if not warm:
                problems.setdefault(cid, []).append(
                    "seeded sampling: the sampler state is carried on a warm restore only"
                )
            else:
                try:
                    if not base64.b64decode(str(g), validate=True):
                        raise ValueError("empty")
                    st["generator_state"] = g
                except (ValueError, binascii.Error) as exc:
                    problems.setdefault(cid, []).append(f"seeded sampling: the generator state is corrupt ({exc})")
        if st:
            states[cid] = st
    return states, problems


def _annotate(requests: list[Resubmission], problems: dict[str, list[str]]) -> list[Resubmission]:
    out = []
    for r in requests:
        extra = problems.get(r.request_id, [])
        if extra:
            reasons = (*r.reasons, *extra)
            r = dataclasses.replace(r, exact=False, reasons=reasons)
        out.append(r)
    return out


def _offer_states(sock: Socket, states: dict[str, dict[str, Any]], problems: dict[str, list[str]]) -> int:
    """Offer request states alone (no pages); the connector's rejections become per-request problems."""
    if not states:
        return 0
    reply = control.call(sock, "offer", index=None, requests=states)
    for cid, why in (reply.get("rejected") or {}).items():
        problems.setdefault(cid, []).append(f"request state rejected by the worker: {why}")
    return int(reply.get("requests", 0))


def restore(
    repo: Repository,
    ref: str,
    sock: Socket,
    *,
    staging_dir: str | os.PathLike[str] | None = None,
    policy: Policy = STRICT,
    generate: canary_mod.Generate | None = None,
    require_canary: bool = True,
    offer_ttl: float | None = DEFAULT_OFFER_TTL,
) -> RestorePlan:
    """Plan and prepare the restore of checkpoint ``ref`` into the worker behind ``sock``.

    The verified pages go to a page file in ``staging_dir`` that the
    connector owns once offered: it deletes the file when the offer ends —
    :func:`withdraw`, or ``offer_ttl`` seconds after the offer (returning
    conversations find their prefix warm until then) — and it is deleted
    here on any failure before that.

    A warm restore is never handed back on an unchecked cache: unless
    ``require_canary`` is false, a checkpoint without a recorded canary, or
    a caller without ``generate``, gets a cold plan that says so.

    Returns the requests to resubmit either way; ``warm`` says whether the
    worker was offered the checkpoint's blocks, ``reasons`` why not. Each
    request carries ``exact`` / ``reasons``: a request the restore cannot
    continue from the exact next token (a ledger that judged it so, a seeded
    request on a cold plan, a state the worker rejected) is a cold replay of
    that request, and says why. With ``generate`` (greedy, on the new
    worker) and a canary in the manifest, the probe runs after the offer;
    on a mismatch the offer is withdrawn and the plan is cold.
    """
    t0 = time.monotonic()
    m = repo.manifest(ref)
    requests = resubmissions(m.ledger) if m.ledger is not None else []
    desc = describe(sock)
    decision = decide(m.pins, Pins(host=host_facts(), worker=desc.facts), policy)
    reasons = list(decision.reasons)
    if dict(m.namespace) != dict(desc.namespace_fields):
        reasons.append(f"namespace: checkpoint {m.namespace} != worker {dict(desc.namespace_fields)}")
    reasons += _shard_reasons(m)
    if require_canary and m.canary is None:
        reasons.append(f"canary: checkpoint {m.id} recorded no probe, so a warm restore could not be checked")
    elif require_canary and generate is None:
        reasons.append("canary: no worker API to run the probe on, so a warm restore could not be checked")

    def cold(why: list[str], stats: dict[str, Any]) -> RestorePlan:
        states, problems = _request_states(m, warm=False)
        stats["request_states"] = _offer_states(sock, states, problems)
        stats["plan_s"] = time.monotonic() - t0
        return RestorePlan(False, why, _annotate(requests, problems), stats=stats)

    if reasons:
        return cold(reasons, {})
    states, problems = _request_states(m, warm=True)
    out = Path(staging_dir) if staging_dir else staging.default_dir(f"{RESTORE_TAG}{os.getpid()}")
    errors: list[BlockFailure] = []
    w = staging.PageWriter(
        out,
        f"restore-{m.id}",
        dtype=m.layout["page_dtype"],
        page_shape=m.layout["page_shape"],
        layers=m.layout["page_layers"],
    )
    try:
        for lb in repo.load(m, errors=errors):
            w.write(lb.key, lb.data)
        idx = w.commit()
    except BaseException:
        w.abort()
        raise
    stats: dict[str, Any] = {
        "blocks": len(idx.keys),
        "failed_blocks": len(errors),
        "failures": [f"{f.key.hex()[:16]}: {f.error}" for f in errors],
        "generators": sum(1 for st in states.values() if st.get("generator_state")),
    }
    if errors and not idx.keys:
        staging.unlink_pair(w.index_path)
        none_ok = f"no block of checkpoint {m.id} could be verified ({len(errors)} failed; first: {errors[0].error})"
        return cold([none_ok], stats)
    try:
        reply = control.call(sock, "offer", index=str(w.index_path), requests=states, ttl=offer_ttl)
    except BaseException:
        staging.unlink_pair(w.index_path)  # not offered: still ours to delete
        raise
    offered = int(reply["offered"])
    for cid, rejected in (reply.get("rejected") or {}).items():
        problems.setdefault(cid, []).append(f"request state rejected by the worker: {rejected}")
    if m.canary is None or generate is None:
        stats["canary"] = {"checked": False, "recorded": m.canary is not None}
    else:
        t1 = time.monotonic()
        try:
            ok, got, why = canary_mod.check(m.canary, generate)
        except Exception as exc:  # a probe that cannot run is a failed probe
            ok, got, why = False, [], f"canary: probe failed: {type(exc).__name__}: {exc}"
        stats["canary"] = {
            "checked": True,
            "match": ok,
            "expected": list(m.canary.get("expected", [])),
            "got": got,
            "canary_s": time.monotonic() - t1,
        }
        if not ok:
            control.call(sock, "withdraw")  # fail closed: nothing of this checkpoint is served
            stats["withdrawn"] = offered
            return cold([str(why)], stats)
    stats["plan_s"] = time.monotonic() - t0
    return RestorePlan(True, [], _annotate(requests, problems), blocks_offered=offered, stats=stats)


def withdraw(sock: Socket) -> int:
    """End the worker's restore offer: no block or request state of it is used from the next step
    boundary on, and its page files are deleted; returns how many page files it held."""
    return int(control.call(sock, "withdraw").get("files", 0))


def sweep(sock: Socket) -> list[str]:
    """Ask the connector to delete capture page files no capture in flight owns (a killed agent's)."""
    return list(control.call(sock, "sweep").get("removed", []))


def sweep_restore_dirs() -> list[str]:
    """Delete this user's restore staging directories whose agent process is gone (a killed agent
    leaves its verified pages — users' KV — in ``/dev/shm``)."""
    return staging.sweep_dead(RESTORE_TAG)


def _shard_reasons(m: Manifest) -> list[str]:
    """Why the checkpoint's pages are not whole (a rank's part missing or inconsistent), naming the rank."""
    layout = m.layout
    recs = layout.get("shards")
    if recs is None:  # written before tensor parallelism was carried: one rank, whole pages
        return []
    try:
        total = int(layout["num_kv_heads"])
        tp = int(layout.get("tensor_parallel_size", len(recs)))
        shards.check_cover(recs, total, tp)
        head_axis = int(layout.get("head_axis", 0))
        if int(layout["page_shape"][1 + head_axis]) != total:
            raise shards.ShardError(f"stored pages hold {layout['page_shape'][1 + head_axis]} of {total} KV heads")
    except (shards.ShardError, KeyError, TypeError, ValueError, IndexError) as exc:
        return [f"tensor parallel: {exc}"]
    return []


def stats(sock: Socket) -> dict[str, Any]:
    """The connector's counters: tokens loaded per restored request, current step."""
    return control.call(sock, "stats")


def _around(sock: Socket, pending: str, call: Callable[[], Any], start: Callable[[], None], timeout: float) -> Any:
    """Run ``call`` (a blocking control call that registers a waiter) in a thread; once the
    connector counts it under ``pending``, run ``start``; return what ``call`` returned."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, name="gpuckpt-around", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    # the connector counts pending waiters: a condition, polled (no event crosses the socket)
    while t.is_alive() and int(stats(sock).get(pending, 0)) < 1:
        if time.monotonic() > deadline:
            raise control.ControlError(f"the connector did not register the waiter within {timeout:.0f} s")
        time.sleep(0.02)
    if errors:
        raise errors[0]
    start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


def checkpoint_around(
    sock: Socket,
    start: Callable[[], None],
    repo: Repository,
    worker_id: str,
    *,
    when: dict[str, int],
    timeout: float = 60.0,
    **kw: Any,
) -> Manifest:
    """Checkpoint traffic the caller makes: register a capture at condition ``when``, *then* call
    ``start()`` (which sends the requests), and return the checkpoint.

    The capture is pending in the connector before any of the traffic
    exists, so a condition the traffic meets only for a moment (every request
    live with k outputs) cannot pass before the capture is asked for, however
    busy the host — for tests, demos and benchmarks. Pair it with
    :func:`hold` so that the requests start at one step boundary.
    """
    m = _around(
        sock,
        "captures_pending",
        lambda: checkpoint(sock, repo, worker_id, when=when, timeout=timeout, **kw),
        start,
        timeout,
    )
    assert isinstance(m, Manifest)
    return m


def wait_around(
    sock: Socket, start: Callable[[], None], *, live: int, min_outputs: int = 0, timeout: float = 120.0
) -> dict[str, Any]:
    """:func:`wait_until`, registered before ``start()`` sends the traffic (see :func:`checkpoint_around`)."""
    r = _around(
        sock,
        "waits_pending",
        lambda: wait_until(sock, live=live, min_outputs=min_outputs, timeout=timeout),
        start,
        timeout,
    )
    assert isinstance(r, dict)
    return r


def hold(sock: Socket, requests: int, *, timeout: float = 60.0) -> None:
    """Hold new requests in the engine's queue until ``requests`` have arrived (or ``timeout`` s
    passed), then let them start at one step boundary."""
    control.call(sock, "hold", requests=requests, timeout=timeout)


def wait_until(sock: Socket, *, live: int, min_outputs: int = 0, timeout: float = 120.0) -> dict[str, Any]:
    """Block until a step boundary where ``live`` unfinished requests have ``min_outputs`` outputs each.

    The condition is judged by the connector on the engine's scheduler
    thread at every step, so it cannot be missed between two polls (requests
    that come and go between them); returns the step, live count and each
    request's outputs at that boundary.
    """
    when = {"live": live, "min_outputs": min_outputs}
    return control.call(sock, "wait", io_timeout=timeout + 5, timeout=timeout, when=when)


# -- offline LLM helpers -------------------------------------------------------------


def submit(llm: Any, requests: list[Resubmission]) -> None:
    """Add resubmissions to an offline ``vllm.LLM`` under their original request ids."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    for r in requests:
        prompt = TokensPrompt(prompt_token_ids=list(r.token_ids))
        if r.cache_salt is not None:
            prompt["cache_salt"] = r.cache_salt
        sampling = dict(r.sampling)
        if sampling.get("logit_bias"):  # JSON keys are strings; the offline API takes token ids
            sampling["logit_bias"] = {int(k): float(v) for k, v in sampling["logit_bias"].items()}
        if sampling.get("structured_outputs") is not None:
            sampling["structured_outputs"] = StructuredOutputsParams(**sampling["structured_outputs"])
        llm.llm_engine.add_request(r.request_id, prompt, SamplingParams(**sampling), priority=r.priority)
