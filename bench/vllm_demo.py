"""`make demo`: checkpoint a live ``vllm serve`` worker, kill it, restore into a fresh one.

1. Generates a small random-weight Llama (cached in ``--workdir``) and starts
   a ``vllm serve`` worker (vLLM's CPU build) with gpuckpt's connector.
2. Four conversations share a system prompt. Their first turns finish; then
   three of them send a second turn and, while those are still generating,
   the demo checkpoints the worker into the local repository and SIGKILLs
   its whole process group (a preemption).
3. A fresh worker starts, restores the checkpoint (compatibility rules,
   verified blocks, canary probe), and the ledger's in-flight requests are
   resubmitted under their original ids; the fourth conversation sends its
   next turn.
4. For comparison, another fresh worker cold-starts: it replays the same
   ledger, recomputing every token, and then runs the second turns again
   from their prompts, uninterrupted: the reference the restored requests
   must match token for token.

The table shows, per conversation, the tokens generated before the kill,
whether the restored continuation matches the uninterrupted run, the
tokens each request recomputed (warm vs cold, from the server's cached-token
counts), and the time to resume.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


from vllm_common import WORKER_ENV, free_port, make_model, worker_args

from agent import session
from agent.engines import canary
from agent.engines.serving import Completion
from agent.testing import ServeProcess
from ckpt import Repository, host_facts

# Wide enough for the table even when make's output is not a terminal.
console = Console(width=max(shutil.get_terminal_size((120, 24)).columns, 120))
VOCAB = 2048
SYSTEM_TOKENS = 256
MAX_MODEL_LEN = 4096
TURN2_TOKENS = 600  # the second turns' budget: long enough to be cut mid-decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=".demo", help="model cache, repository, logs (default: .demo)")
    ap.add_argument("--repo", default=None, help="repository URL (default: <workdir>/repo, a local directory)")
    a = ap.parse_args()
    work = Path(a.workdir).resolve()
    run = work / time.strftime("run-%Y%m%dT%H%M%S")
    run.mkdir(parents=True, mode=0o700)
    repo_url = a.repo or str(work / "repo")
    t_all = time.monotonic()

    with console.status("generating a small random Llama (4 layers, fp32)…"):
        model = str(
            make_model(work / "models", layers=4, hidden=512, heads=8, kv_heads=4, vocab=VOCAB, dtype="float32")
        )
    repo = Repository.open(repo_url, create=True)
    host_facts()  # probed once at start (as the agent does): the first probe imports torch, ~2 s
    console.print(f"model [bold]{model}[/]\nrepository [bold]{repo_url}[/]\nlogs {run}")

    rng = random.Random(2026)
    system = toks(rng, SYSTEM_TOKENS)
    convs = {f"conv{i}": system + toks(rng, 500 + 250 * i) for i in range(4)}
    greedy = {"temperature": 0.0, "ignore_eos": True}

    def worker(name: str) -> ServeProcess:
        w = ServeProcess(
            model,
            str(run / f"{name}.sock"),
            port=free_port(),
            log_path=str(run / f"{name}.log"),
            staging_dir=str(run / f"stage-{name}"),
            args=worker_args(max_model_len=MAX_MODEL_LEN),
            env=WORKER_ENV,
        )
        with console.status(f"starting vLLM worker {name} (vllm serve, CPU)…"):
            s = w.wait_ready()
        console.print(f"worker {name} ready in {s:.0f} s ({w.url})")
        return w

    # -- 1. the worker that gets preempted ------------------------------------------
    a_w = worker("A")
    try:
        turn1 = {
            k: a_w.client.complete(p, {**greedy, "max_tokens": 48}, request_id=f"{k}-t1") for k, p in convs.items()
        }
        hist = {k: convs[k] + turn1[k].token_ids for k in convs}
        turn2 = {k: hist[k] + toks(rng, 24) for k in ("conv0", "conv1", "conv2")}
        t_canary = time.monotonic()
        probe = canary.record(a_w.client.generate)  # before the traffic: nothing runs between condition and capture
        canary_s = time.monotonic() - t_canary
        console.print("first turns done; three second turns are generating…")
        threads = [
            threading.Thread(
                target=_quiet,
                args=(a_w.client.complete, p, {**greedy, "max_tokens": TURN2_TOKENS}, f"{k}-t2"),
                daemon=True,  # abandoned with worker A: the demo must not wait on them to exit
            )
            for k, p in turn2.items()
        ]

        def start() -> None:
            for t in threads:
                t.start()

        when = {"live": len(turn2), "min_outputs": 60}
        # captured at a step boundary where every second turn still runs, as the engine judges
        # it; the capture is pending before the turns are sent, so a busy host cannot miss it
        session.hold(a_w.control_socket, len(turn2), timeout=240)
        taken = session.checkpoint_around(
            a_w.control_socket, start, repo, "demo-worker", canary=probe, when=when, timeout=240
        )
        m, st = taken.manifest, dict[str, Any](taken.stats)
        st["canary_s"] = canary_s
        # from the step boundary on: the capture's wait for the turns to get there is not its cost
        ckpt_s = st["capture_s"] - st["wait_s"] + st["save_s"]
    finally:
        a_w.kill()  # SIGKILL to the process group, mid-decode
    assert m.ledger is not None
    before = {e["client_request_id"]: len(e["output_token_ids"]) for e in m.ledger.data["requests"]}
    console.print(
        f"checkpoint [bold]{m.id}[/]: {st['pages']} KV blocks, {len(before)} in-flight requests, "
        f"{m.sizes.stored_bytes / 2**20:.1f} MiB stored ({m.sizes.raw_bytes / 2**20:.1f} MiB of KV) "
        f"in {ckpt_s:.2f} s (canary {st['canary_s']:.2f} s, capture {st['capture_s'] - st['wait_s']:.2f} s, "
        f"save {st['save_s']:.2f} s); the engine paused {st['copy_s'] * 1000:.0f} ms to copy the pages"
    )
    console.print("[red]worker A killed (SIGKILL to its process group) with the second turns still generating[/]")

    # -- 2. a fresh worker restores ----------------------------------------------------
    b_w = worker("B")
    try:
        t0 = time.monotonic()
        plan = session.restore(
            repo, m.id, b_w.control_socket, staging_dir=str(run / "stage-B"), generate=b_w.client.generate
        )
        plan_s = time.monotonic() - t0
        warm_out = b_w.client.submit(plan.requests)
        warm_first = max(c.first_token_s or 0.0 for c in warm_out.values())
        warm_resume = plan_s + warm_first
        nxt = hist["conv3"] + toks(random.Random(5), 24)
        warm_next = b_w.client.complete(nxt, {**greedy, "max_tokens": 8}, request_id="conv3-t2")
    finally:
        b_w.kill()
    why = "all pins match; canary probe matched" if plan.warm else "; ".join(plan.reasons)
    console.print(f"restore: [bold]{'warm' if plan.warm else 'cold'}[/] ({why}); plan {plan_s:.2f} s")

    # -- 3. the same without gpuckpt: a cold start replays the ledger --------------------
    c_w = worker("C")
    try:
        cold_out = c_w.client.submit(plan.requests)
        cold_resume = max(c.first_token_s or 0.0 for c in cold_out.values())
        cold_next = c_w.client.complete(nxt, {**greedy, "max_tokens": 8}, request_id="conv3-t2")
        reference = {
            k: c_w.client.complete(p, {**greedy, "max_tokens": TURN2_TOKENS}, request_id=f"{k}-ref")
            for k, p in turn2.items()
        }
    finally:
        c_w.kill()

    # -- 4. the table ------------------------------------------------------------------------
    table = Table(title="In-flight requests after a SIGKILL: restored by gpuckpt vs a cold start")
    for col in (
        "conversation",
        "tokens before kill",
        "tokens after restore",
        "= uninterrupted run",
        "recomputed, gpuckpt",
        "recomputed, cold",
        "resumed in, gpuckpt",
        "resumed in, cold",
    ):
        table.add_column(col, justify="right" if col != "conversation" else "left")
    ok = True
    for r in sorted(plan.requests, key=lambda r: r.request_id):
        k = r.request_id.removeprefix("cmpl-").removesuffix("-t2-0")
        w, c = warm_out[r.request_id], cold_out[r.request_id]
        same = r.output_token_ids + w.token_ids == reference[k].token_ids
        ok &= same
        table.add_row(
            k,
            str(len(r.output_token_ids)),
            str(len(w.token_ids)),
            "[green]yes[/]" if same else "[red]NO[/]",
            str(_recomputed(w, r.token_ids)),
            str(_recomputed(c, r.token_ids)),
            f"{(plan_s + (w.first_token_s or 0)):.2f} s",
            f"{c.first_token_s or 0:.2f} s",
        )
    table.add_row(
        "conv3, next turn",
        "-",
        "-",
        "-",
        str(_recomputed(warm_next, nxt)),
        str(_recomputed(cold_next, nxt)),
        "-",
        "-",
    )
    console.print(table)
    console.print(
        f"time to resume all in-flight requests: [bold]{warm_resume:.2f} s[/] restored "
        f"(restore plan {plan_s:.2f} s + first tokens {warm_first:.2f} s) vs [bold]{cold_resume:.2f} s[/] "
        f"cold start recomputing everything ({cold_resume / max(warm_resume, 1e-9):.1f}x); "
        "engine start time is the same for both and not counted"
    )
    console.print(f"demo finished in {time.monotonic() - t_all:.0f} s")
    if not ok or not plan.warm:
        console.print("[red]the restore did not reproduce the uninterrupted run[/]")
        sys.exit(1)


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _recomputed(c: Completion, prompt: list[int]) -> int:
    """Prompt tokens the server computed rather than took from its cache."""
    return len(prompt) - (c.cached_tokens or 0)


def _quiet(fn: Any, *args: Any) -> None:
    """Run a request whose worker is about to be killed: its connection error is expected."""
    with contextlib.suppress(Exception):
        fn(*args[:2], request_id=args[2], stream=False)


if __name__ == "__main__":
    main()
