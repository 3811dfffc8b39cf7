"""What loading gpuckpt costs a vLLM worker that is not being checkpointed: decode throughput and
KV capacity with the connector ÷ without, same machine, same run, alternated rounds.

Each run is a fresh offline engine (its own process: nothing warm carries over) on a tiny
random-weight model — a dense Llama and a Gemma-3-style sliding-window one (two KV cache groups
under vLLM's hybrid KV cache manager) — serving 16 greedy requests × 256 tokens (EOS ignored)
after a warm-up batch; the figures are generated tokens per second over the timed batch, the
extra time per engine step (batch wall time ÷ steps, with − without) and the KV blocks vLLM
allocated. Rounds alternate the two configurations so drift in the machine's load falls on both;
the summary is the median ratio over the rounds.

``python bench/vllm_step_overhead.py [--rounds 3] [--requests 16] [--tokens 256] [--models dense,sliding]``
(``make bench-overhead``). Prints one line per run and the ratios (targets: throughput ≥ 0.98,
capacity 1.00); exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from vllm_common import WORKER_ENV, make_model, make_sliding_model  # noqa: E402


def run_one(model: str, connector: bool, requests: int, tokens: int, sock: str) -> dict[str, float]:
    """One engine, one timed batch (in this process)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict[str, object] = {}
    if connector:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="GpuckptConnector",
            kv_role="kv_both",
            kv_connector_module_path="agent.engines.vllm.connector",
            kv_connector_extra_config={"control_socket": sock},
            kv_load_failure_policy="recompute",
        )
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=32,
        max_model_len=1024,
        max_num_seqs=requests,
        seed=0,
        **kw,
    )
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 17, 23 + i, 42] * 8} for i in range(requests)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    # every request decodes in lockstep: one prefill step, then one step per further token
    steps = tokens
    cfg = llm.llm_engine.vllm_config
    return {
        "tokens_per_s": generated / dt,
        "ms_per_step": dt * 1000 / steps,
        "wall_s": dt,
        "num_gpu_blocks": float(cfg.cache_config.num_gpu_blocks or 0),
        "hybrid_manager_off": float(bool(cfg.scheduler_config.disable_hybrid_kv_cache_manager)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="dense,sliding", help="comma-separated: dense, sliding")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--child", choices=["with", "without"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        with tempfile.TemporaryDirectory(prefix="gpo-", dir="/tmp") as d:
            r = run_one(a.model, a.child == "with", a.requests, a.tokens, os.path.join(d, "c.sock"))
        print("RESULT " + json.dumps(r), flush=True)
        return
    root = Path(os.environ.get("GPUCKPT_BENCH_MODELS", Path(tempfile.gettempdir()) / "gpuckpt-bench-models"))
    models = {
        "dense": lambda: make_model(root, layers=2, hidden=256, heads=4, kv_heads=2, vocab=512, dtype="float32"),
        "sliding": lambda: make_sliding_model(root),
    }
    env = {**os.environ, **WORKER_ENV, "PYTHONPATH": str(HERE.parent)}
    summary = []
    for name in a.models.split(","):
        model = models[name]()
        results: dict[str, list[dict[str, float]]] = {"with": [], "without": []}
        for rnd in range(a.rounds):
            order = ["without", "with"] if rnd % 2 == 0 else ["with", "without"]
            for cfg in order:
                cmd = [sys.executable, __file__, "--child", cfg, "--model", str(model)]
                cmd += ["--requests", str(a.requests), "--tokens", str(a.tokens)]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
                line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    sys.exit(f"the {name} {cfg} run failed:\n{out.stderr[-3000:]}")
                r = json.loads(line.removeprefix("RESULT "))
                results[cfg].append(r)
                print(
                    f"{name} round {rnd + 1} {cfg:>7} gpuckpt: {r['tokens_per_s']:8.1f} tok/s  "
                    f"{r['ms_per_step']:6.2f} ms/step  {r['num_gpu_blocks']:.0f} KV blocks"
                    + ("  (hybrid KV cache manager OFF)" if r["hybrid_manager_off"] else ""),
                    flush=True,
                )
        pairs = list(zip(results["with"], results["without"], strict=True))
        ratios = [w["tokens_per_s"] / wo["tokens_per_s"] for w, wo in pairs]
        extra = [w["ms_per_step"] - wo["ms_per_step"] for w, wo in pairs]
        cap = results["with"][0]["num_gpu_blocks"] / results["without"][0]["num_gpu_blocks"]
        summary.append(
            f"{name}: decode throughput with ÷ without = {statistics.median(ratios):.3f} (rounds: "
            + ", ".join(f"{x:.3f}" for x in ratios)
            + f"); {statistics.median(extra):+.2f} ms per engine step; KV capacity with ÷ without = {cap:.2f}"
        )
    print()
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
