"""What a checkpoint copies and costs the worker, as the prefix cache grows: full against
incremental capture, in one run.

A ``vllm serve`` worker (CPU build, a random-weight fp32 Llama with 2 KiB of KV
per token) has its prefix cache filled with ``--prompts`` 1,024-token prompts
(1×), two requests decoding; then:

1. a first checkpoint (nothing is durable yet: every page is copied);
2. 10 % more prompts, and a second checkpoint (incremental: only pages the
   repository does not hold are copied);
3. the same second state captured with ``full`` (every page copied), the
   baseline the incremental one is measured against.

The same again with 8× the prompts. Printed per checkpoint: pages copied
(and referenced without a copy), bytes copied into host staging, the
worker's pause (the step that copies), the capture call and the save.
Ratios come from this run; the host is noisy, absolute times are not the
point.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_common import WORKER_ENV, free_port, kv_bytes_per_token, make_model, worker_args

from agent.engines.vllm import driver
from agent.engines.vllm.serve import ServeProcess
from ckpt import Repository

SPEC: dict[str, Any] = {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 4, "vocab": 4096, "dtype": "float32"}
PROMPT = 1024


def checkpoint(w: ServeProcess, repo: Repository, *, full: bool = False) -> dict[str, Any]:
    if full:
        # the baseline: a capture that copies every page, saved like any other
        cap = driver.capture(w.control_socket, 120, full=True)
        try:
            stats = dict(cap.stats)
        finally:
            cap.close()
        return stats
    t0 = time.monotonic()
    driver.checkpoint(w.control_socket, repo, "bench", timeout=120)
    st = driver.last_checkpoint_stats()
    st["total_s"] = time.monotonic() - t0
    return st


def run_scale(model: Path, tmp: Path, prompts: int, rng: random.Random) -> dict[str, Any]:
    tag = f"x{prompts}"
    repo = Repository.open(str(tmp / f"repo-{tag}"), create=True)
    max_len = PROMPT + 4096
    w = ServeProcess(
        str(model),
        str(tmp / f"{tag}.sock"),
        port=free_port(),
        log_path=str(tmp / f"{tag}.log"),
        staging_dir=str(tmp / f"stage-{tag}"),
        args=worker_args(max_model_len=max_len),
        env=WORKER_ENV,
    )
    out: dict[str, Any] = {"prompts": prompts}
    try:
        w.wait_ready()

        def fill(n: int) -> None:
            for _ in range(n):
                p = [rng.randrange(3, SPEC["vocab"]) for _ in range(PROMPT)]
                w.client.complete(p, {"temperature": 0.0, "max_tokens": 1}, stream=False)

        fill(prompts)
        # two requests decoding through every checkpoint
        stop = threading.Event()

        def decode() -> None:
            while not stop.is_set():
                p = [rng.randrange(3, SPEC["vocab"]) for _ in range(64)]
                try:
                    w.client.complete(p, {"temperature": 0.0, "max_tokens": 3000, "ignore_eos": True}, stream=False)
                except Exception:  # the worker is killed under it at the end
                    return

        threads = [threading.Thread(target=decode, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        driver.wait_until(w.control_socket, live=2, min_outputs=8, timeout=300)
        out["first"] = checkpoint(w, repo)
        fill(max(1, prompts // 10))
        out["incremental"] = checkpoint(w, repo)
        out["full"] = checkpoint(w, repo, full=True)
        stop.set()
    finally:
        w.kill()
    return out


def row(name: str, st: dict[str, Any]) -> str:
    return (
        f"  {name:<12} copied {st['pages']:>6} pages ({st['bytes'] / 2**20:8.1f} MiB), "
        f"referenced {st.get('skipped_pages', 0):>6}; pause {st['copy_s'] * 1000:7.1f} ms, "
        f"capture {st['capture_s']:.2f} s" + (f", save {st['save_s']:.2f} s" if "save_s" in st else "")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16, help="1,024-token prompts in the prefix cache at 1x")
    ap.add_argument("--scales", default="1,8", help="multiples of --prompts to run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="gpuckpt-bench-capture-") as d:
        tmp = Path(d)
        model = make_model(tmp, **SPEC)
        per_token = kv_bytes_per_token(SPEC["layers"], SPEC["kv_heads"], SPEC["hidden"] // SPEC["heads"], "float32")
        results = [run_scale(model, tmp, args.prompts * int(s), rng) for s in args.scales.split(",")]
    if args.json:
        print(json.dumps(results, indent=2, default=str))
        return
    print(f"KV per token: {per_token} bytes; prompts of {PROMPT} tokens; two requests decoding")
    for r in results:
        print(f"prefix cache: {r['prompts']} prompts")
        for name in ("first", "incremental", "full"):
            print(row(name, r[name]))
        inc, full = r["incremental"], r["full"]
        print(
            f"  10 % new: incremental copies {inc['bytes'] / full['bytes']:.3f} of a full capture's bytes, "
            f"{inc['bytes'] / r['first']['bytes']:.3f} of the first's; pause {inc['copy_s'] / full['copy_s']:.2f}x"
        )
    if len(results) >= 2:
        a, b = results[0], results[-1]
        scale = b["prompts"] // a["prompts"]
        first = b["first"]["copy_s"] / a["first"]["copy_s"]
        inc = b["incremental"]["copy_s"] / a["incremental"]["copy_s"]
        print(f"pause at {scale}x KV / at 1x: first {first:.2f}, incremental {inc:.2f}")


if __name__ == "__main__":
    main()
