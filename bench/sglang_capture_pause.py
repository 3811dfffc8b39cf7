"""SGLang with gpuckpt's linker: the scheduler's longest pause during a capture at 1× and 8× the KV,
and what the linker costs a server that is not being checkpointed — from one run.

Two SGLang 0.5.23 CPU servers of the same flags (a tiny random-weight fp32 Llama: 2 layers, 2 KV
heads of 64, 16 KiB pages of 16 tokens; ``--sleep-on-idle`` so that the idle one leaves the
cores to the measured one), one with the linker and one without.

- **Pause.** The linker's server's prefix cache is filled with distinct 512-token prompts to
  ``--pages`` pages (1×), then to 8×. At each scale one request decodes throughout (streamed, a
  token per scheduler step) and the agent's reader takes a capture and reads every chunk: the
  longest gap between two of its tokens while the capture runs is the scheduler's longest
  pause. Each capture is taken twice: streamed (the linker's default 16 MiB a step) and as one
  chunk (``copy_per_step`` and the staging bound larger than the KV: what the linker did before
  #24), and the linker's own figures are printed beside it (planning, chunk 0's copy, the
  largest later chunk's copy). The same decoder without a capture gives the baseline gap.
- **Idle cost.** Both servers' caches filled alike (8×), then alternated rounds (without, with,
  with, without, …) of 16 greedy requests × 256 tokens: decode throughput with the linker ÷
  without (medians: a shared host's stalls fall on one round, not the figure), and the linker's
  own time in its hooks per scheduler step (its counters). Nothing is being checkpointed.

``--model-kind gemma3|mistral`` runs the same on a tiny sliding-window model instead of the Llama
(``gemma3``: bench/vllm_common.py's Gemma-3-style model, the vLLM overhead bench's sliding one;
``mistral``: tests/harness/models.py's, every layer sliding, 4,096 positions). Both servers' KV
capacity as SGLang reports it (``/server_info``: the pool's tokens, and its SWA pool's when it
has one) is printed with its ratio; the pause part is skipped, saying why, when the linker
reports the model's KV as not carried (``kv_not_carried``).

``python bench/sglang_capture_pause.py [--pages 1024] [--rounds 4] [--model-kind dense]``
(``make bench-sglang-pause``). Prints one line per measurement, then the ratios; exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_demo import STANDIN, sglang_python
from vllm_common import free_port, make_model, make_sliding_model

from agent import session
from agent.engines.sglang.serve import CPU_ARGS, SglangClient
from agent.testing import SglangProcess, WorkerProcess
from tests.harness.models import write_tiny_sliding

ROOT = Path(__file__).resolve().parents[1]
PAGE = 16
PROMPT = 512  # tokens per filling prompt: 32 pages
VOCAB = 512
GREEDY = {"temperature": 0.0, "ignore_eos": True}


class Decoder:
    """One streamed greedy request: the arrival time of each token (a token per scheduler step)."""

    def __init__(self, url: str, prompt: list[int], tokens: int) -> None:
        self.times: list[float] = []
        self.error: str | None = None
        self._stop = threading.Event()
        body = {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": tokens}, "stream": True}
        self._t = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._t.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        with httpx.Client(timeout=600) as c, c.stream("POST", url + "/generate", json=body) as r:
            if r.status_code != 200:
                self.error = r.read().decode(errors="replace")[:300]
                return
            for line in r.iter_lines():
                if self._stop.is_set():
                    return  # closing the connection aborts the request
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    self.times.append(time.monotonic())

    def wait_tokens(self, n: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < n:
            if self.error is not None:
                raise RuntimeError(f"the decoder's request failed: {self.error}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the decoder produced {len(self.times)} tokens, not {n}")
            time.sleep(0.05)

    def longest_gap(self, t0: float, t1: float) -> float:
        """The longest gap between two tokens, of those arriving in ``[t0, t1]`` and the first after."""
        ts = [t for t in self.times if t >= t0]
        after = [t for t in ts if t > t1][:1]
        ts = [t for t in ts if t <= t1] + after
        return max((b - a for a, b in itertools.pairwise(ts)), default=0.0)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(30)


def fill(client: SglangClient, rng: random.Random, requests: int) -> None:
    """``requests`` distinct prompts through the server (each leaves its pages in the prefix cache)."""
    prompts = [[rng.randrange(3, VOCAB) for _ in range(PROMPT)] for _ in range(requests)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: client.complete(p, {**GREEDY, "max_new_tokens": 1}), prompts))


def capture_pause(s: SglangProcess, rng: random.Random, *, one_chunk: bool, tokens: int = 8000) -> dict[str, Any]:
    """A capture read to its end while a request decodes (40 prompt tokens, then ``tokens``, within
    the model's context): the longest gap between its tokens."""
    dec = Decoder(s.url, [rng.randrange(3, VOCAB) for _ in range(40)], tokens)
    try:
        dec.wait_tokens(20)
        t0 = time.monotonic()
        time.sleep(2.0)
        base = dec.longest_gap(t0, time.monotonic())
        big = 8 << 30
        t0 = time.monotonic()
        cap = session.capture(
            s.control_socket,
            timeout=300,
            full=True,
            copy_per_step=big if one_chunk else None,
            max_staging=2 * big if one_chunk else None,
        )
        pages = 0
        try:
            for _ in cap.pages:
                pages += 1
        finally:
            cap.close()
        t1 = time.monotonic()
        dec.wait_tokens(len(dec.times) + 2)  # the token after the last chunk
        st = cap.stats
        plan = session.stats(s.control_socket).get("last_plan") or {}
        return {
            "pages": pages,
            "chunks": st.get("chunks"),
            "longest_gap_ms": 1e3 * dec.longest_gap(t0, t1),
            "baseline_gap_ms": 1e3 * base,
            "plan_ms": 1e3 * float(st.get("plan_s", 0.0)),
            # the planning's phases (the live requests, the tree walk, the locks: one per node)
            "plan_parts_ms": {k: 1e3 * float(v) for k, v in plan.items() if k.endswith("_s") and k != "plan_s"},
            "chunk0_copy_ms": 1e3 * float(st.get("copy_s", 0.0)),
            "max_chunk_copy_ms": 1e3 * float(st.get("max_chunk_copy_s", 0.0)),
            "capture_s": t1 - t0,
            # what the capture itself holds the scheduler thread for in one step: the consistent
            # point (planning + chunk 0's copy), or a later chunk's copy
            "linker_hold_ms": 1e3
            * max(float(st.get("plan_s", 0.0)) + float(st.get("copy_s", 0.0)), float(st.get("max_chunk_copy_s", 0.0))),
        }
    finally:
        dec.stop()


def throughput(client: SglangClient, rng: random.Random, requests: int, tokens: int) -> float:
    """Generated tokens per second of one batch of greedy requests."""
    prompts = [[rng.randrange(3, VOCAB) for _ in range(32)] for _ in range(requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(requests) as pool:
        outs = list(pool.map(lambda p: client.complete(p, {**GREEDY, "max_new_tokens": tokens}), prompts))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def model_for(kind: str, root: Path) -> Path:
    """The benchmark's model of ``kind``: the dense Llama or a sliding-window one."""
    if kind == "dense":
        return make_model(root, layers=2, hidden=256, heads=4, kv_heads=2, vocab=VOCAB, dtype="float32")
    if kind == "gemma3":
        return make_sliding_model(root)
    path = root / "mistral-2L-256h-sw64"
    return path if (path / "config.json").exists() else write_tiny_sliding(path, kind="mistral")


def capacity(url: str) -> dict[str, Any]:
    """The KV capacity SGLang reports (``/server_info``): the pool's tokens and, with a hybrid SWA
    pool, the SWA pool's; whether its hybrid SWA memory is on."""
    info = httpx.get(url + "/server_info", timeout=60).json()
    mem = (info.get("internal_states") or [{}])[0].get("memory_usage") or {}
    return {
        "max_total_num_tokens": info.get("max_total_num_tokens"),
        "token_capacity": mem.get("token_capacity"),
        "token_capacity_swa": mem.get("token_capacity_swa"),
        "kvcache_gb": mem.get("kvcache"),
        "disable_hybrid_swa_memory": info.get("disable_hybrid_swa_memory"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=1024, help="the 1× prefix cache, in pages of 16 tokens")
    ap.add_argument("--rounds", type=int, default=4, help="alternated throughput rounds")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--model-kind", choices=("dense", "gemma3", "mistral"), default="dense", help="the model")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpsgp-"))
    model = str(model_for(a.model_kind, work / "models"))
    cfg = json.loads((Path(model) / "config.json").read_text())
    layers, kv_heads = int(cfg["num_hidden_layers"]), int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    decode_tokens = min(8000, int(cfg["max_position_embeddings"]) - 64)  # the decoder's, within the context
    per_request = PROMPT // PAGE
    fills = [max(1, a.pages // per_request), max(1, 8 * a.pages // per_request)]
    args = [*CPU_ARGS, "--page-size", str(PAGE), "--sleep-on-idle"]
    args[args.index("--max-total-tokens") + 1] = str(9 * a.pages * PAGE + 16 * 1024)
    # the pool is --max-total-tokens; a larger share only keeps the start from failing on a host
    # whose free memory moves while SGLang profiles it
    args[args.index("--mem-fraction-static") + 1] = "0.3"
    python = sglang_python()
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": f"{STANDIN}{os.pathsep}{ROOT}"}
    with_linker = SglangProcess(
        model,
        str(work / "w.sock"),
        port=free_port(),
        log_path=str(work / "with.log"),
        python=python,
        staging_dir=str(work / "stage"),
        extra_args=args,
        pythonpath=[str(STANDIN), str(ROOT)],
    )
    port = free_port()
    launch = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1"]
    plain = WorkerProcess(
        [*launch, "--port", str(port), *args],
        url=f"http://127.0.0.1:{port}",
        control_socket=str(work / "none.sock"),
        log_path=str(work / "without.log"),
        client=SglangClient(f"http://127.0.0.1:{port}"),
        env=env,
        needs_socket=False,
    )
    out: dict[str, Any] = {
        "model_kind": a.model_kind,
        "pages_1x": a.pages,
        "page_bytes": layers * 2 * PAGE * kv_heads * head_dim * 4,
        "pause": {},
        "throughput": {},
    }
    try:
        for s in (with_linker, plain):
            s.wait_ready(900)
        print(f"servers ready ({a.model_kind} model {model}); logs in {work}", flush=True)
        out["capacity"] = {"with": capacity(with_linker.url), "without": capacity(plain.url)}
        for label in ("without", "with"):
            print(f"KV capacity {label} the linker: {json.dumps(out['capacity'][label])}", flush=True)
        layout = session.describe(with_linker.control_socket).layout
        not_carried = layout.get("kv_not_carried")
        out["kv_not_carried"] = not_carried
        rng = random.Random(7)
        filled = 0
        for scale, n in zip(("1x", "8x"), fills, strict=True):
            fill(with_linker.client, rng, n - filled)
            filled = n
            if not_carried:
                continue
            for mode in ("streamed", "one chunk"):
                r = capture_pause(with_linker, rng, one_chunk=mode == "one chunk", tokens=decode_tokens)
                out["pause"].setdefault(scale, {})[mode] = r
                print(f"pause {scale} {mode}: {json.dumps(r)}", flush=True)
        if not_carried:
            print(f"pause: skipped, the linker does not carry this model's KV: {not_carried}", flush=True)
        fill(plain.client, random.Random(7), filled)  # the same cache on both
        for s in (plain, with_linker):
            throughput(s.client, rng, 2, 16)  # warm-up
        order = [("without", plain), ("with", with_linker)]
        for i in range(a.rounds):
            for label, s in order if i % 2 == 0 else order[::-1]:
                before = session.stats(with_linker.control_socket)
                tps = throughput(s.client, rng, a.requests, a.tokens)
                out["throughput"].setdefault(label, []).append(tps)
                print(f"throughput round {i + 1} {label} linker: {tps:.1f} tokens/s", flush=True)
                if label == "with":  # the linker's own time in its hooks over the batch's steps
                    after = session.stats(with_linker.control_socket)
                    steps = int(after["step"]) - int(before["step"])
                    hook = float(after["hook_s"]) - float(before["hook_s"])
                    out.setdefault("hook_us_per_step", []).append(1e6 * hook / max(1, steps))
                    print(f"  linker hooks: {1e6 * hook / max(1, steps):.2f} µs a step over {steps} steps", flush=True)
    finally:
        with_linker.kill()
        plain.kill()
    cap = out["capacity"]
    for key in ("token_capacity", "token_capacity_swa"):
        w, wo = cap["with"][key], cap["without"][key]
        if w is not None and wo:
            out[f"{key}_ratio"] = w / wo
            print(f"KV capacity ({key}) with the linker ÷ without: {w} / {wo} = {w / wo:.2f}", flush=True)
    p = out["pause"]
    for mode in ("streamed", "one chunk") if p else ():
        r = p["8x"][mode]["longest_gap_ms"] / max(1e-9, p["1x"][mode]["longest_gap_ms"])
        h = p["8x"][mode]["linker_hold_ms"] / max(1e-9, p["1x"][mode]["linker_hold_ms"])
        out[f"pause_ratio_{mode.replace(' ', '_')}"] = r
        out[f"hold_ratio_{mode.replace(' ', '_')}"] = h
        print(f"longest scheduler pause during a capture (token gap), 8× ÷ 1× KV ({mode}): {r:.2f}", flush=True)
        print(f"longest step the capture itself holds the scheduler, 8× ÷ 1× KV ({mode}): {h:.2f}", flush=True)
    ratio = statistics.median(out["throughput"]["with"]) / statistics.median(out["throughput"]["without"])
    out["throughput_ratio"] = ratio
    print(f"decode throughput with the linker ÷ without (idle: nothing checkpointed; medians): {ratio:.3f}", flush=True)
    hook = statistics.median(out["hook_us_per_step"])
    print(f"the linker's own time per scheduler step (its hooks, idle, 8× cache): {hook:.2f} µs", flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
