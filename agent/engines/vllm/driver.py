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

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agent.engines.base import Capture, RestorePlan, Resubmission, WorkerDescription
from agent.engines.vllm import canary as canary_mod
from agent.engines.vllm import control, staging
from agent.engines.vllm.ledger import resubmissions
from ckpt import Block, BlockFailure, Ledger, Manifest, Pins, Policy, Repository, WorkerFacts, decide, host_facts
from ckpt.compat import STRICT
from ckpt.save import SaveProgress

Socket = str | os.PathLike[str]


def describe(sock: Socket) -> WorkerDescription:
    r = control.call(sock, "describe")
    return WorkerDescription(WorkerFacts.model_validate(r["facts"]), r["layout"], r["namespace"])


def capture(sock: Socket, timeout: float = 60.0) -> Capture:
    """Ask the connector for a snapshot at the next step boundary; the pages are
    read from the worker's page file, which ``close`` deletes."""
    t0 = time.monotonic()
    r = control.call(sock, "capture", io_timeout=timeout + 5, timeout=timeout)
    pf = staging.PageFile(r["index"])
    shape = tuple(pf.index.page_shape)

    def pages() -> Iterator[Block]:
        for key, view in pf.items():
            yield Block(key, view, pf.index.dtype, shape)

    def close() -> None:
        pf.close()
        pf.unlink()

    keys = ("step", "pages", "prefix_pages", "tail_pages", "requests", "plan_s", "wait_s", "copy_s", "bytes")
    stats = {k: r[k] for k in keys}
    stats["write_s"] = r.get("write_s", 0.0)  # the worker's page-file write, off the engine's step
    stats["capture_s"] = time.monotonic() - t0
    stats["page_shape"] = list(shape)
    stats["page_dtype"] = pf.index.dtype
    stats["layers"] = list(pf.index.layers)
    return Capture(pages(), Ledger.model_validate(r["ledger"]), stats, close)


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
    """
    if deadline is not None:
        timeout = max(0.1, min(timeout, deadline - time.monotonic()))
    desc = describe(sock)
    t_canary = time.monotonic()
    if canary is None and generate is not None:
        canary = canary_mod.record(generate)
    canary_s = time.monotonic() - t_canary
    cap = capture(sock, timeout)
    if on_captured is not None:
        on_captured(dict(cap.stats))
    try:
        t0 = time.monotonic()
        layout = {
            **desc.layout,
            "page_shape": cap.stats["page_shape"],
            "page_dtype": cap.stats["page_dtype"],
            "page_layers": cap.stats["layers"],
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
        )
        timings = {**cap.stats, "save_s": time.monotonic() - t0, "canary_s": canary_s}
    finally:
        cap.close()
    _LAST_STATS.clear()
    _LAST_STATS.update(timings)
    return m


#: Stats of the last :func:`checkpoint` in this process (pause, copy, save times).
_LAST_STATS: dict[str, Any] = {}


def last_checkpoint_stats() -> dict[str, Any]:
    return dict(_LAST_STATS)


def restore(
    repo: Repository,
    ref: str,
    sock: Socket,
    *,
    staging_dir: str | os.PathLike[str] | None = None,
    policy: Policy = STRICT,
    generate: canary_mod.Generate | None = None,
) -> RestorePlan:
    """Plan and prepare the restore of checkpoint ``ref`` into the worker behind ``sock``.

    Returns the requests to resubmit either way; ``warm`` says whether the
    worker was offered the checkpoint's blocks, ``reasons`` why not. With
    ``generate`` (greedy, on the new worker) and a canary in the manifest,
    the probe runs after the offer; on a mismatch the offer is withdrawn and
    the plan is cold.
    """
    t0 = time.monotonic()
    m = repo.manifest(ref)
    requests = resubmissions(m.ledger) if m.ledger is not None else []
    desc = describe(sock)
    decision = decide(m.pins, Pins(host=host_facts(), worker=desc.facts), policy)
    reasons = list(decision.reasons)
    if dict(m.namespace) != dict(desc.namespace_fields):
        reasons.append(f"namespace: checkpoint {m.namespace} != worker {dict(desc.namespace_fields)}")
    if reasons:
        return RestorePlan(False, reasons, requests, stats={"plan_s": time.monotonic() - t0})
    out = Path(staging_dir) if staging_dir else staging.default_dir(f"restore-{os.getpid()}")
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
    # Seeded requests' sampler states travel with the offer (applied at their first schedule).
    gens = {
        e["client_request_id"]: e["generator_state"]
        for e in (m.ledger.data.get("requests", []) if m.ledger is not None else [])
        if e.get("generator_state")
    }
    offered = control.call(sock, "offer", index=str(w.index_path), generators=gens)["offered"]
    stats: dict[str, Any] = {
        "blocks": len(idx.keys),
        "failed_blocks": len(errors),
        "failures": [f"{f.key.hex()[:16]}: {f.error}" for f in errors],
        "generators": len(gens),
    }
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
            stats["plan_s"] = time.monotonic() - t0
            stats["withdrawn"] = offered
            return RestorePlan(False, [str(why)], requests, stats=stats)
    stats["plan_s"] = time.monotonic() - t0
    return RestorePlan(True, [], requests, blocks_offered=offered, stats=stats)


def stats(sock: Socket) -> dict[str, Any]:
    """The connector's counters: tokens loaded per restored request, current step."""
    return control.call(sock, "stats")


def wait_for_steps(sock: Socket, *, live: int, steps: int, timeout: float = 120.0) -> dict[str, Any]:
    """Wait until the engine holds at least ``live`` requests, then ``steps`` more engine steps.

    Paces a caller by the engine rather than by its API's streams (the API
    server can lag the engine by hundreds of tokens on a busy host); returns
    the connector's last stats.
    """
    deadline = time.monotonic() + timeout
    start: int | None = None
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        st = stats(sock)
        if start is None and st["live"] >= live:
            start = int(st["step"])
        if start is not None and st["step"] >= start + steps:
            return st
        time.sleep(0.002)
    raise TimeoutError(f"the engine did not reach {live} live requests and {steps} steps in {timeout:.0f} s: {st}")


# -- offline LLM helpers -------------------------------------------------------------


def submit(llm: Any, requests: list[Resubmission]) -> None:
    """Add resubmissions to an offline ``vllm.LLM`` under their original request ids."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    for r in requests:
        prompt = TokensPrompt(prompt_token_ids=list(r.token_ids))
        if r.cache_salt is not None:
            prompt["cache_salt"] = r.cache_salt
        llm.llm_engine.add_request(r.request_id, prompt, SamplingParams(**r.sampling), priority=r.priority)
