"""Time to first token of sessions restored by gpuckpt, against the limit, a
recompute and vLLM's own ``ExampleConnector``, in one run.

For each model and each prompt length, ``--sessions`` sessions (unrelated
random prompts) send their prompt concurrently (streamed, 2 new tokens) to a
``vllm serve`` worker (CPU build) and the time to each first token is taken:

(c) recompute   a fresh worker computes every prompt token (a cold start that
                replays the sessions);
(b) resident    the same worker again: the KV is in its prefix cache, the limit;
(a) restored    a fresh worker after ``agent.session.restore`` of a checkpoint of (b)'s
                worker, from the local repository or from SeaweedFS (S3 on
                loopback); the restore's own time (download, verify,
                decode, stage) is shown beside it;
(d) example     a fresh worker with vLLM's ``ExampleConnector`` loading what an
                earlier worker saved to local disk (the peer).

Local files are dropped from the page cache (``posix_fadvise(DONTNEED)``)
before (a) and (d) read them, so both read from disk. Also printed: the
bytes each stores per token, and the worker's pause while a checkpoint is
captured (the step that copies the pages) and the whole capture call.

With ``--engines vllm,sglang`` (the default) the same models and prompts go
through an SGLang 0.5.23 server (CPU build, gpuckpt's cache linker) as
well: recompute, resident and restored (a fresh server after a restore of a
checkpoint of the resident one; SGLang has no ExampleConnector peer), timed
to the first streamed token of its native ``/generate``, and printed as
restored ÷ recompute and ÷ resident with the bytes stored per token.

Ratios (restored ÷ resident, restored ÷ example) come from the same run;
the host is noisy, absolute times are not the point.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_common import WORKER_ENV, free_port, kv_bytes_per_token, make_model, worker_args

from agent import session
from agent.engines.serving import Completion
from agent.testing import ServeProcess
from ckpt import Repository, host_facts

MODELS = {
    # Like the reference: 2 layers, 88M parameters, 4 KV heads x 64, bf16: 2 KiB of KV per token.
    "small": {"layers": 2, "hidden": 1024, "heads": 16, "kv_heads": 4, "vocab": 32000, "dtype": "bfloat16"},
    # 8 layers of the same width: 4x the KV per token next to the same embedding cost.
    "large": {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 4, "vocab": 32000, "dtype": "bfloat16"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="small,large")
    ap.add_argument("--lengths", default="1024,4096", help="prompt lengths in tokens")
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--no-s3", action="store_true", help="skip the SeaweedFS repository")
    ap.add_argument("--workdir", default=".demo", help="model cache (default: .demo)")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    ap.add_argument("--engines", default="vllm,sglang", help="engines to run (vllm, sglang)")
    a = ap.parse_args()
    engines = a.engines.split(",")
    lengths = [int(x) for x in a.lengths.split(",")]
    host_facts()  # probed once up front, as the agent does (the first probe imports torch)
    work = Path(a.workdir).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="gpuckpt-vllm-bench-"))
    os.chmod(tmp, 0o700)
    server = None
    results: list[dict[str, Any]] = []
    try:
        repos: dict[str, str] = {"local": str(tmp / "repo")}
        if not a.no_s3:
            from tests.harness.seaweed import SeaweedServer

            server = SeaweedServer(tmp / "seaweed")
            server.start()
            os.environ.update(
                AWS_ACCESS_KEY_ID=server.access_key,
                AWS_SECRET_ACCESS_KEY=server.secret_key,
                AWS_REGION="us-east-1",
            )
            repos["seaweedfs"] = f"s3://{server.make_bucket('bench')}/repo?endpoint={server.endpoint}"
        for name in a.models.split(","):
            if "vllm" in engines:
                results.append(bench_model(name, MODELS[name], work, tmp / name, repos, lengths, a.sessions))
                report(results[-1])
            if "sglang" in engines:
                from sglang_restore import bench_sglang, report_sglang

                results.append(
                    bench_sglang(name, MODELS[name], work, tmp / f"{name}-sglang", repos, lengths, a.sessions)
                )
                report_sglang(results[-1])
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        print(f"failed; workers' logs kept in {tmp}", file=sys.stderr)
        raise
    finally:
        if server is not None:
            server.close()
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=1))


def bench_model(
    name: str, spec: dict[str, Any], work: Path, tmp: Path, repos: dict[str, str], lengths: list[int], sessions: int
) -> dict[str, Any]:
    tmp.mkdir(parents=True, mode=0o700)
    model = str(make_model(work / "models", **spec))
    max_len = max(lengths) + 64
    rng = random.Random(1)
    prompts = {n: [[rng.randrange(3, spec["vocab"]) for _ in range(n)] for _ in range(sessions)] for n in lengths}
    out: dict[str, Any] = {
        "model": name,
        "spec": spec,
        "sessions": sessions,
        "kv_bytes_per_token": kv_bytes_per_token(
            spec["layers"], spec["kv_heads"], spec["hidden"] // spec["heads"], spec["dtype"]
        ),
        "ttft": {},
    }
    n_workers = [0]

    def worker(kv_config: dict[str, Any] | None = None) -> ServeProcess:
        n_workers[0] += 1
        tag = f"w{n_workers[0]}"
        w = ServeProcess(
            model,
            str(tmp / f"{tag}.sock"),
            port=free_port(),
            log_path=str(tmp / f"{tag}.log"),
            staging_dir=str(tmp / f"stage-{tag}"),
            args=worker_args(max_model_len=max_len, dtype=spec["dtype"]),
            env=WORKER_ENV,
            kv_config=kv_config,
        )
        w.wait_ready()
        # One short unrelated request first: a fresh engine's first forward pays one-off set-up costs.
        w.client.complete([rng.randrange(3, spec["vocab"]) for _ in range(40)], {"temperature": 0.0, "max_tokens": 2})
        print(f"[{name}] worker {tag} ready ({'ExampleConnector' if kv_config else 'gpuckpt'})", flush=True)
        return w

    def measure(w: ServeProcess, label: str) -> None:
        for n in lengths:
            out["ttft"].setdefault(str(n), {})[label] = ttfts(w, prompts[n])
            print(f"[{name}] {label} {n}: {out['ttft'][str(n)][label]}", flush=True)

    # (c) and (b), then checkpoints into each repository.
    with worker() as w:
        measure(w, "recompute")
        measure(w, "resident")
        out["checkpoint"] = {}
        for store, url in repos.items():
            repo = Repository.open(url, create=True)
            taken = session.checkpoint(w.control_socket, repo, f"bench-{name}", generate=w.client.generate)
            m, st = taken.manifest, dict[str, Any](taken.stats)
            tokens = st["pages"] * 32
            out["checkpoint"][store] = {
                "id": m.id,
                "pages": st["pages"],
                "pause_ms": st["copy_s"] * 1000,  # the engine step that copies the pages
                "capture_ms": st["capture_s"] * 1000,  # the whole capture call, socket to reply
                "save_s": st["save_s"],
                "stored_bytes": m.sizes.stored_bytes,
                "bytes_per_token": m.sizes.stored_bytes / tokens,
            }
    # (a) a fresh worker per repository.
    out["restore"] = {}
    for store, url in repos.items():
        repo = Repository.open(url)
        if store == "local":
            drop_page_cache(Path(url))
        with worker() as w:
            t0 = time.monotonic()
            plan = session.restore(
                repo,
                out["checkpoint"][store]["id"],
                w.control_socket,
                staging_dir=str(tmp / "stage-r"),
                generate=w.client.generate,
                # returning conversations, not in-flight requests: the whole checkpoint offered before
                # they arrive (a streaming restore offers the rest behind the in-flight part)
                wait=True,
            )
            out["restore"][store] = {"warm": plan.warm, "reasons": plan.reasons, "restore_s": time.monotonic() - t0}
            measure(w, f"restored/{store}")
    # (d) vLLM's ExampleConnector: one worker saves while it computes, a fresh one loads.
    shared = tmp / "example-kv"
    shared.mkdir(mode=0o700)
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(shared)},
    }
    with worker(example) as w:
        # One prompt at a time: ExampleConnector saves a prompt's KV per forward
        # chunk under one name, so a prompt split across steps (chunked prefill
        # of concurrent prompts) leaves only its last chunk on disk, and loading
        # that crashes the engine (a shape mismatch in vLLM 0.32).
        for n in lengths:
            for p in prompts[n]:
                ttfts(w, [p])
    # It stores whole blocks of each prompt but its last token, like a checkpoint.
    out["example_bytes_per_token"] = du(shared) / sum((n - 1) // 32 * 32 * sessions for n in lengths)
    drop_page_cache(shared)
    with worker(example) as w:
        measure(w, "example")
    return out


def ttfts(w: ServeProcess, prompts: list[list[int]]) -> dict[str, float]:
    """Send ``prompts`` at once (streamed, 2 new tokens); mean and max time to first token."""
    res: dict[int, Completion] = {}

    def one(i: int) -> None:
        res[i] = w.client.complete(prompts[i], {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    firsts = [res[i].first_token_s or 0.0 for i in range(len(prompts))]
    cached = [res[i].cached_tokens or 0 for i in range(len(prompts))]
    return {"mean_s": statistics.fmean(firsts), "max_s": max(firsts), "cached_tokens": min(cached)}


def drop_page_cache(root: Path) -> None:
    """Evict ``root``'s files from the page cache, so the next read goes to disk."""
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def du(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def report(r: dict[str, Any]) -> None:
    print()
    print(
        f"model {r['model']}: {r['spec']['layers']} layers, {r['spec']['dtype']}, "
        f"{r['kv_bytes_per_token']} B of KV per token, {r['sessions']} concurrent sessions"
    )
    stores = list(r["restore"])
    head = f"{'prompt':>7} {'recompute':>10} {'resident':>9} " + " ".join(f"{'restored/' + s:>18}" for s in stores)
    head += f" {'example':>9} " + " ".join(f"{'rest/res ' + s[:5]:>15} {'rest/ex ' + s[:5]:>14}" for s in stores)
    print("mean time to first token (s)")
    print(head)
    for n, row in r["ttft"].items():
        line = f"{n:>7} {row['recompute']['mean_s']:>10.3f} {row['resident']['mean_s']:>9.3f} "
        line += " ".join(f"{row['restored/' + s]['mean_s']:>18.3f}" for s in stores)
        line += f" {row['example']['mean_s']:>9.3f} "
        line += " ".join(
            f"{row['restored/' + s]['mean_s'] / row['resident']['mean_s']:>15.2f}"
            f" {row['restored/' + s]['mean_s'] / row['example']['mean_s']:>14.2f}"
            for s in stores
        )
        print(line)
    for s in stores:
        c, rs = r["checkpoint"][s], r["restore"][s]
        print(
            f"{s}: {c['bytes_per_token']:.0f} B stored per token "
            f"(ExampleConnector {r['example_bytes_per_token']:.0f}); "
            f"checkpoint of {c['pages']} blocks: engine paused {c['pause_ms']:.1f} ms, capture call "
            f"{c['capture_ms']:.0f} ms, save {c['save_s']:.2f} s; restore ({'warm' if rs['warm'] else 'COLD'}) "
            f"{rs['restore_s']:.2f} s before the first request"
        )
    print(flush=True)


if __name__ == "__main__":
    main()
