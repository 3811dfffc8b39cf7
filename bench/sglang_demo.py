"""`make demo ENGINE=sglang`: checkpoint a live SGLang server, kill it, restore into a fresh one.

The same job as `make demo` (bench/vllm_demo.py), through the same agent-side
code (:mod:`agent.session`), on SGLang 0.5.23's CPU build with
gpuckpt's cache linker (its own ``--enable-unified-cache-external-linker``
flags, no patch to SGLang):

1. Generates a small random-weight Llama (cached in ``--workdir``) and starts
   server A. Four conversations share a system prompt; their first turns
   finish; three send a second turn and, while those are still generating,
   the demo checkpoints the server and SIGKILLs its process group.
2. Server B restores the checkpoint (compatibility rules, verified pages,
   canary probe) and the in-flight requests are resubmitted under their
   original rids; the fourth conversation sends its next turn.
3. Server C cold-starts: it replays the same ledger, recomputing every
   token, then runs the second turns uninterrupted from their prompts (the
   reference the restored requests must match token for token).

On this CPU the servers run with the test stand-ins of ``tests/sglang/standin``
(no ``sgl-kernel`` wheel exists for it; a GPU host uses the real one).
"""

from __future__ import annotations

import argparse
import contextlib
import os
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

from vllm_common import free_port, make_model

from agent import session
from agent.engines import canary
from agent.engines.sglang.serve import CPU_ARGS, Completion
from agent.testing import SglangProcess
from ckpt import Repository, host_facts

ROOT = Path(__file__).resolve().parents[1]
#: test-only stand-ins a CPU host needs (README: SGLang on a CPU)
STANDIN = ROOT / "tests" / "sglang" / "standin"
console = Console(width=max(shutil.get_terminal_size((120, 24)).columns, 120))
VOCAB = 2048
SYSTEM_TOKENS = 256
TURN2_TOKENS = 400  # the second turns' budget: long enough to be cut mid-decode
PAGE_SIZE = 16
#: a CPU server's flags, with room for the demo's conversations
SERVER_ARGS = [*CPU_ARGS, "--page-size", str(PAGE_SIZE)]
SERVER_ARGS[SERVER_ARGS.index("--max-total-tokens") + 1] = "16384"


def sglang_python() -> str:
    py = os.environ.get("GPUCKPT_SGLANG_PYTHON") or str(ROOT / ".venv-sglang" / "bin" / "python")
    if not os.access(py, os.X_OK):
        sys.exit(f"no SGLang interpreter at {py}: run `make sglang-venv` (or set GPUCKPT_SGLANG_PYTHON)")
    return py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=".demo", help="model cache, repository, logs (default: .demo)")
    ap.add_argument("--repo", default=None, help="repository URL (default: <workdir>/repo-sglang, a local directory)")
    a = ap.parse_args()
    work = Path(a.workdir).resolve()
    run = work / time.strftime("sglang-%Y%m%dT%H%M%S")
    run.mkdir(parents=True, mode=0o700)
    repo_url = a.repo or str(work / "repo-sglang")
    python = sglang_python()
    t_all = time.monotonic()

    with console.status("generating a small random Llama (4 layers, fp32)…"):
        model = str(
            make_model(work / "models", layers=4, hidden=512, heads=8, kv_heads=4, vocab=VOCAB, dtype="float32")
        )
    repo = Repository.open(repo_url, create=True)
    host_facts()
    console.print(f"model [bold]{model}[/]\nrepository [bold]{repo_url}[/]\nlogs {run}")

    rng = random.Random(2026)
    system = toks(rng, SYSTEM_TOKENS)
    convs = {f"conv{i}": system + toks(rng, 300 + 150 * i) for i in range(4)}
    greedy = {"temperature": 0.0, "ignore_eos": True}

    def server(name: str) -> SglangProcess:
        s = SglangProcess(
            model,
            str(run / f"{name}.sock"),
            port=free_port(),
            log_path=str(run / f"{name}.log"),
            python=python,
            staging_dir=str(run / f"stage-{name}"),
            extra_args=SERVER_ARGS,
            pythonpath=[str(STANDIN), str(ROOT)],
        )
        with console.status(f"starting SGLang server {name} (CPU)…"):
            secs = s.wait_ready(600)
        console.print(f"server {name} ready in {secs:.0f} s ({s.url})")
        return s

    # -- 1. the server that gets preempted ------------------------------------------
    a_s = server("A")
    try:
        turn1 = {k: a_s.client.complete(p, {**greedy, "max_new_tokens": 32}, rid=f"{k}-t1") for k, p in convs.items()}
        hist = {k: convs[k] + turn1[k].token_ids for k in convs}
        turn2 = {k: hist[k] + toks(rng, 24) for k in ("conv0", "conv1", "conv2")}
        probe = canary.record(a_s.client.generate)
        console.print("first turns done; three second turns are generating…")
        threads = [
            threading.Thread(
                target=_quiet,
                args=(a_s.client.complete, p, {**greedy, "max_new_tokens": TURN2_TOKENS}, f"{k}-t2"),
                daemon=True,
            )
            for k, p in turn2.items()
        ]

        def start() -> None:
            for t in threads:
                t.start()

        # the capture is pending before the turns are sent: a busy host cannot let the moment pass
        taken = session.checkpoint_around(
            a_s.control_socket,
            start,
            repo,
            "demo-sglang",
            canary=probe,
            when={"live": len(turn2), "min_outputs": 40},
            timeout=300,
        )
        m, st = taken.manifest, dict[str, Any](taken.stats)
    finally:
        a_s.kill()
    assert m.ledger is not None
    before = {e["rid"]: len(e["output_token_ids"]) for e in m.ledger.data["requests"]}
    console.print(
        f"checkpoint [bold]{m.id}[/]: {st['pages']} KV pages, {len(before)} in-flight requests, "
        f"{m.sizes.stored_bytes / 2**20:.1f} MiB stored ({m.sizes.raw_bytes / 2**20:.1f} MiB of KV); "
        f"the scheduler paused {st['copy_s'] * 1000:.0f} ms to copy the pages"
    )
    console.print("[red]server A killed (SIGKILL to its process group) with the second turns still generating[/]")

    # -- 2. a fresh server restores -------------------------------------------------------
    b_s = server("B")
    try:
        t0 = time.monotonic()
        plan = session.restore(
            repo, m.id, b_s.control_socket, staging_dir=str(run / "stage-B"), generate=b_s.client.generate
        )
        plan_s = time.monotonic() - t0
        warm_out = b_s.client.submit(plan.requests, stream=True)
        warm_first = max(c.first_token_s or 0.0 for c in warm_out.values())
        nxt = hist["conv3"] + toks(random.Random(5), 24)
        warm_next = b_s.client.complete(nxt, {**greedy, "max_new_tokens": 8}, rid="conv3-t2")
    finally:
        b_s.kill()
    why = "all pins match; canary probe matched" if plan.warm else "; ".join(plan.reasons)
    console.print(f"restore: [bold]{'warm' if plan.warm else 'cold'}[/] ({why}); plan {plan_s:.2f} s")

    # -- 3. the same without gpuckpt: a cold start replays the ledger ----------------------
    c_s = server("C")
    try:
        cold_out = c_s.client.submit(plan.requests, stream=True)
        cold_first = max(c.first_token_s or 0.0 for c in cold_out.values())
        cold_next = c_s.client.complete(nxt, {**greedy, "max_new_tokens": 8}, rid="conv3-t2")
        reference = {
            k: c_s.client.complete(p, {**greedy, "max_new_tokens": TURN2_TOKENS}, rid=f"{k}-ref")
            for k, p in turn2.items()
        }
    finally:
        c_s.kill()

    # -- 4. the table ------------------------------------------------------------------------
    table = Table(title="SGLang in-flight requests after a SIGKILL: restored by gpuckpt vs a cold start")
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
        k = r.request_id.removesuffix("-t2")
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
            f"{plan_s + (w.first_token_s or 0):.2f} s",
            f"{c.first_token_s or 0:.2f} s",
        )
    table.add_row(
        "conv3, next turn", "-", "-", "-", str(_recomputed(warm_next, nxt)), str(_recomputed(cold_next, nxt)), "-", "-"
    )
    console.print(table)
    warm_resume = plan_s + warm_first
    console.print(
        f"time to resume all in-flight requests: [bold]{warm_resume:.2f} s[/] restored "
        f"(restore plan {plan_s:.2f} s + first tokens {warm_first:.2f} s) vs [bold]{cold_first:.2f} s[/] "
        f"cold start recomputing everything ({cold_first / max(warm_resume, 1e-9):.1f}x); "
        "server start time is the same for both and not counted"
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


def _quiet(fn: Any, prompt: list[int], sampling: dict[str, Any], rid: str) -> None:
    """Run a request whose server is about to be killed: its connection error is expected."""
    with contextlib.suppress(Exception):
        fn(prompt, sampling, rid=rid)


if __name__ == "__main__":
    main()
