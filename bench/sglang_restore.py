"""SGLang's rows of bench/vllm_restore.py: time to first token of sessions restored by gpuckpt
into a fresh SGLang server, against a recompute and the resident prefix cache, from one run.

Run through ``bench/vllm_restore.py --engines sglang`` (or both engines, the default), which
shares the models, prompts and repositories with the vLLM rows.
"""

from __future__ import annotations

import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_demo import SERVER_ARGS, STANDIN, sglang_python
from vllm_common import free_port, kv_bytes_per_token, make_model

from agent import session
from agent.engines.sglang.serve import Completion
from agent.testing import SglangProcess
from ckpt import Repository

ROOT = Path(__file__).resolve().parents[1]
PAGE_SIZE = 16


def bench_sglang(
    name: str, spec: dict[str, Any], work: Path, tmp: Path, repos: dict[str, str], lengths: list[int], sessions: int
) -> dict[str, Any]:
    """recompute, resident, and restored from each repository, on SGLang servers of the same flags."""
    tmp.mkdir(parents=True, mode=0o700)
    model = str(make_model(work / "models", **spec))
    rng = random.Random(1)  # the same prompts as the vLLM rows
    prompts = {n: [[rng.randrange(3, spec["vocab"]) for _ in range(n)] for _ in range(sessions)] for n in lengths}
    python = sglang_python()
    args = list(SERVER_ARGS)
    args[args.index("--max-total-tokens") + 1] = str(max(32768, 2 * sessions * max(lengths)))
    args[args.index("--dtype") + 1] = spec["dtype"]
    out: dict[str, Any] = {
        "engine": "sglang",
        "model": name,
        "spec": spec,
        "sessions": sessions,
        "kv_bytes_per_token": kv_bytes_per_token(
            spec["layers"], spec["kv_heads"], spec["hidden"] // spec["heads"], spec["dtype"]
        ),
        "ttft": {},
    }
    n_servers = [0]

    def server() -> SglangProcess:
        n_servers[0] += 1
        tag = f"s{n_servers[0]}"
        s = SglangProcess(
            model,
            str(tmp / f"{tag}.sock"),
            port=free_port(),
            log_path=str(tmp / f"{tag}.log"),
            python=python,
            staging_dir=str(tmp / f"stage-{tag}"),
            extra_args=args,
            pythonpath=[str(STANDIN), str(ROOT)],
        )
        s.wait_ready(900)
        # one short unrelated request first: a fresh server's first forward pays one-off set-up costs
        s.client.complete([rng.randrange(3, spec["vocab"]) for _ in range(40)], {"max_new_tokens": 1})
        print(f"[sglang {name}] server {tag} ready", flush=True)
        return s

    def measure(s: SglangProcess, label: str) -> None:
        for n in lengths:
            out["ttft"].setdefault(str(n), {})[label] = ttfts(s, prompts[n])
            print(f"[sglang {name}] {label} {n}: {out['ttft'][str(n)][label]}", flush=True)

    with server() as s:
        measure(s, "recompute")
        measure(s, "resident")
        out["checkpoint"] = {}
        for store, url in repos.items():
            repo = Repository.open(url, create=True)
            taken = session.checkpoint(s.control_socket, repo, f"bench-sglang-{name}", generate=s.client.generate)
            m, st = taken.manifest, dict[str, Any](taken.stats)
            tokens = st["pages"] * PAGE_SIZE
            out["checkpoint"][store] = {
                "id": m.id,
                "pages": st["pages"],
                "pause_ms": st["copy_s"] * 1000,
                "save_s": st["save_s"],
                "stored_bytes": m.sizes.stored_bytes,
                "bytes_per_token": m.sizes.stored_bytes / max(1, tokens),
            }
    out["restore"] = {}
    for store, url in repos.items():
        repo = Repository.open(url)
        with server() as s:
            t0 = time.monotonic()
            plan = session.restore(
                repo,
                out["checkpoint"][store]["id"],
                s.control_socket,
                staging_dir=str(tmp / "stage-r"),
                generate=s.client.generate,
                wait=True,  # returning conversations: the whole checkpoint offered before they arrive
            )
            out["restore"][store] = {"warm": plan.warm, "reasons": plan.reasons, "restore_s": time.monotonic() - t0}
            measure(s, f"restored/{store}")
    return out


def ttfts(s: SglangProcess, prompts: list[list[int]]) -> dict[str, float]:
    """Send ``prompts`` at once (streamed, 2 new tokens); mean and max time to first token."""
    res: dict[int, Completion] = {}

    def one(i: int) -> None:
        res[i] = s.client.complete(
            prompts[i], {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}, stream=True
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    firsts = [res[i].first_token_s or 0.0 for i in range(len(prompts))]
    cached = [res[i].cached_tokens or 0 for i in range(len(prompts))]
    return {"mean_s": statistics.fmean(firsts), "max_s": max(firsts), "cached_tokens": min(cached)}


def report_sglang(r: dict[str, Any]) -> None:
    print()
    print(
        f"SGLang, model {r['model']}: {r['spec']['layers']} layers, {r['spec']['dtype']}, "
        f"{r['kv_bytes_per_token']} B of KV per token, {r['sessions']} concurrent sessions"
    )
    stores = list(r["restore"])
    head = f"{'prompt':>7} {'recompute':>10} {'resident':>9} " + " ".join(f"{'restored/' + s:>18}" for s in stores)
    head += " " + " ".join(f"{'rest/rec ' + s[:5]:>15} {'rest/res ' + s[:5]:>15}" for s in stores)
    print("mean time to first token (s)")
    print(head)
    for n, row in r["ttft"].items():
        line = f"{n:>7} {row['recompute']['mean_s']:>10.3f} {row['resident']['mean_s']:>9.3f} "
        line += " ".join(f"{row['restored/' + s]['mean_s']:>18.3f}" for s in stores)
        line += " " + " ".join(
            f"{row['restored/' + s]['mean_s'] / row['recompute']['mean_s']:>15.2f}"
            f" {row['restored/' + s]['mean_s'] / row['resident']['mean_s']:>15.2f}"
            for s in stores
        )
        print(line)
    for s in stores:
        c, rs = r["checkpoint"][s], r["restore"][s]
        print(
            f"{s}: {c['bytes_per_token']:.0f} B stored per token; checkpoint of {c['pages']} pages: "
            f"scheduler paused {c['pause_ms']:.1f} ms, save {c['save_s']:.2f} s; "
            f"restore ({'warm' if rs['warm'] else 'COLD'}) {rs['restore_s']:.2f} s before the first request"
        )
    print(flush=True)
