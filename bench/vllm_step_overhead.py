"""What loading gpuckpt costs a vLLM worker that is not being checkpointed: decode throughput and
KV capacity with the connector ÷ without, same machine, same run.

Two comparisons, each on a tiny random-weight model — a dense Llama and a Gemma-3-style
sliding-window one (two KV cache groups under vLLM's hybrid KV cache manager) — serving 16 greedy
requests × 256 tokens (EOS ignored) after a warm-up batch:

- **One engine, switched** (the headline figure): one engine built with gpuckpt's connector is
  switched between batches to no connector, a connector that does nothing
  (:mod:`noop_connector`: vLLM's own cost of any connector) and gpuckpt's
  (:mod:`connector_switch`), ``--switched-rounds`` rounds in alternating order. The same process
  and memory layout throughout, so the ratio is what each step pays, with none of the
  process-to-process noise below; the EngineCore runs in the benchmark's process, the worker in
  its own (vLLM's ``mp`` executor). Switched off, the engine must make exactly the calls of a
  fresh engine without a connector: the summary checks the count against one.
- **Fresh engines**: each run a fresh offline engine (its own process group: nothing warm carries
  over), ``--batches`` timed batches, the fastest counting (timeit's rule: whatever else the host
  runs only ever adds time), ``--rounds`` rounds alternating the configurations. This one also
  sees what a connector costs a process apart from its steps (its imports, its threads) and the
  KV blocks vLLM allocates. But a fresh engine's memory layout alone moves its step time by
  several per cent, far more than gpuckpt's few microseconds a step, so one round's ratio says
  little: the summary is the median of the rounds' ratios with a bootstrap 95 % interval, the
  function calls a step (counted: the same on every run) and the connector's own time, every hook
  timed in place. ``--noop`` adds the no-op connector here too.

``python bench/vllm_step_overhead.py [--switched-rounds 40] [--rounds 10] [--batches 3] [--noop]
[--models dense,sliding]`` (``make bench-overhead``). Prints one line per round and the ratios
(targets: throughput ≥ 0.98, capacity 1.00); exits 0. The fresh engines' figure moves between
runs on a shared host by more than a run's interval: ``--pool LOG [LOG ...]`` reads saved runs'
round lines back and prints the median and interval of every round of them together.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from vllm_common import WORKER_ENV, make_model, make_sliding_model  # noqa: E402


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its engine processes: less sensitive than
    wall time to what else the machine runs (a shared 2-core host)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


HOOKS = (
    "build_connector_meta",
    "update_connector_output",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "request_finished_all_groups",
    "has_pending_push_work",
    "on_new_request",
    "bind_connector_metadata",
    "clear_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
)


def _timed(
    fn: Callable[..., object], name: str, spent: dict[str, float], calls: dict[str, int]
) -> Callable[..., object]:
    def timed(*args: object, **kwargs: object) -> object:
        t = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.thread_time() - t
            calls[name] = calls.get(name, 0) + 1

    return timed


def timer_cost() -> float:
    """Seconds the timer itself adds to one timed call (what a timed empty function measures)."""
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    empty = _timed(lambda: None, "empty", spent, calls)
    for _ in range(20_000):
        empty()
    return spent["empty"] / calls["empty"]


def time_hooks() -> tuple[dict[str, float], dict[str, int]]:
    """Wrap every hook of gpuckpt's connector with a timer (the engine must run in this process:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); returns the running totals in seconds and the calls, by
    hook. The timer is the calling thread's CPU time: wall time would also count another thread
    holding the GIL while a hook waits for it (vLLM's own threads, other processes on a shared
    host) — tens of microseconds a step that are not the hook's. What the timer itself costs is
    taken off (:func:`timer_cost`): about a microsecond a call, and vLLM calls two hooks a layer."""
    from agent.engines.vllm import connector

    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    for name in HOOKS:
        setattr(connector.GpuckptConnector, name, _timed(getattr(connector.GpuckptConnector, name), name, spent, calls))
    return spent, calls


#: the measured configurations: no connector; a connector that does nothing (what vLLM's own
#: connector machinery costs, :mod:`noop_connector`); gpuckpt's
CONFIGS = ("without", "noop", "with")


def hook_figures(spent: dict[str, float], calls: dict[str, int], steps: int) -> dict[str, float]:
    """µs a step by hook, the timer's own cost taken off, and their sum."""
    cost = timer_cost()
    own = {k: max(0.0, v - calls.get(k, 0) * cost) * 1e6 / steps for k, v in spent.items()}
    return {"hooks_us_per_step": sum(own.values()), **{f"hook_us:{k}": v for k, v in own.items()}}


def build_engine(model: str, config: str, requests: int, sock: str, backend: str | None = None) -> Any:
    """One offline engine (``config``: one of :data:`CONFIGS`) on ``model``, warmed up; with
    gpuckpt, its control socket at ``sock``. ``backend``: vLLM's executor (``mp`` keeps the worker
    in its own process even when the EngineCore runs in this one)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict[str, object] = {} if backend is None else {"distributed_executor_backend": backend}
    if config == "with":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="GpuckptConnector",
            kv_role="kv_both",
            kv_connector_module_path="agent.engines.vllm.connector",
            kv_connector_extra_config={"control_socket": sock},
            kv_load_failure_policy="recompute",
        )
    elif config == "noop":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NoopConnector", kv_role="kv_both", kv_connector_module_path="noop_connector"
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
    llm.generate(batch(requests)[:2], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return llm


def batch(requests: int) -> list[dict[str, list[int]]]:
    """The measured batch's prompts: ``requests`` distinct 32-token prompts."""
    return [{"prompt_token_ids": [5 + i, 17, 23 + i, 42] * 8} for i in range(requests)]


def settle(sock: str) -> float:
    """Wait for gpuckpt's description of the worker, worked out once in a thread beside the
    engine's start (a restore at start asks for it first): the steady state begins once it is
    done. Returns the seconds waited."""
    from agent import session

    t = time.perf_counter()
    session.describe(sock)
    return time.perf_counter() - t


def run_one(
    model: str,
    config: str,
    requests: int,
    tokens: int,
    sock: str,
    hooks: bool = False,
    n_batches: int = 1,
    count: bool = False,
) -> dict[str, Any]:
    """One engine (``config``: one of :data:`CONFIGS`), its timed batches (in this process);
    ``count``: the Python calls of the one timed batch counted instead (:class:`CallCount`)."""
    from vllm import SamplingParams

    spent, calls = time_hooks() if hooks else (None, {})
    llm = build_engine(model, config, requests, sock)
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = batch(requests)
    settle_s = settle(sock) if config == "with" and not hooks and not count else 0.0
    if spent is not None:
        spent.clear()
        calls.clear()
    batches = []
    counted = CallCount()
    for _ in range(max(1, n_batches)):
        c0, t0 = cpu_seconds(), time.perf_counter()
        if count:
            sys.setprofile(counted)
        try:
            outs = llm.generate(prompts, sp, use_tqdm=False)
        finally:
            sys.setprofile(None)
        batches.append((time.perf_counter() - t0, cpu_seconds() - c0))
    # the batch least disturbed by anything else on the host (timeit's rule: interference only
    # ever adds time); the others are reported beside it
    dt, cpu = min(batches)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    # every request decodes in lockstep: one prefill step, then one step per further token
    steps = tokens
    cfg = llm.llm_engine.vllm_config
    return {
        **(hook_figures(spent, calls, steps * len(batches)) if spent is not None else {}),
        **({f"calls:{k}": v / steps for k, v in counted.by_kind.items()} if count else {}),
        "tokens_per_s": generated / dt,
        "tokens_per_cpu_s": generated / cpu,
        "ms_per_step": dt * 1000 / steps,
        "wall_s": dt,
        "batch_ms_per_step": [b[0] * 1000 / steps for b in batches],
        "settle_s": settle_s,
        "num_gpu_blocks": float(cfg.cache_config.num_gpu_blocks or 0),
        "hybrid_manager_off": float(bool(cfg.scheduler_config.disable_hybrid_kv_cache_manager)),
    }


def run_switched(model: str, rounds: int, requests: int, tokens: int, sock: str, count: bool = False) -> dict[str, Any]:
    """One engine built with gpuckpt's connector and switched between batches to each of
    :data:`CONFIGS` (:mod:`connector_switch`), ``rounds`` rounds in alternating order; the EngineCore
    runs in this process, the worker in its own (vLLM's ``mp`` executor, as a served worker has).
    Returns each configuration's ms a step, batch by batch; ``count``: one counted batch per
    configuration instead, the worker in this process too (``uni``) so that its calls count."""
    from connector_switch import EngineSwitch
    from vllm import SamplingParams

    llm = build_engine(model, "with", requests, sock, backend="uni" if count else "mp")
    settle(sock)
    switch = EngineSwitch(llm)
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = batch(requests)
    if count:
        calls: dict[str, float] = {}
        for cfg in CONFIGS:
            switch.use(cfg)
            llm.generate(prompts, sp, use_tqdm=False)  # the first batch after a switch is not counted
            counted = CallCount()
            sys.setprofile(counted)
            try:
                llm.generate(prompts, sp, use_tqdm=False)
            finally:
                sys.setprofile(None)
            calls[cfg] = counted.by_kind["total"] / tokens
        return {"calls": calls}
    ms: dict[str, list[float]] = {cfg: [] for cfg in CONFIGS}
    for rnd in range(rounds):
        for cfg in CONFIGS if rnd % 2 == 0 else reversed(CONFIGS):
            switch.use(cfg)
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            ms[cfg].append((time.perf_counter() - t0) * 1000 / tokens)
    return {"ms": ms}


LABEL = {"without": "no connector", "noop": "no-op connector", "with": "gpuckpt"}


class CallCount:
    """A ``sys.setprofile`` hook counting the Python and C function calls the engine's thread makes,
    by whose code: gpuckpt's (``agent/``, and the no-op connector's), vLLM's, the rest. Unlike a
    time, a count is the same on every run and every host: what a connector adds to each step,
    with none of the layout noise that swamps a few microseconds (the engine must run in this
    process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""

    def __init__(self) -> None:
        self.by_kind: dict[str, int] = {"gpuckpt": 0, "vllm": 0, "other": 0, "total": 0}
        self.kinds: dict[str, str] = {}

    def kind(self, filename: str) -> str:
        k = self.kinds.get(filename)
        if k is None:
            if "/agent/" in filename or filename.endswith("noop_connector.py"):
                k = "gpuckpt"
            elif "/vllm/" in filename:
                k = "vllm"
            else:
                k = "other"
            self.kinds[filename] = k
        return k

    def __call__(self, frame: Any, event: str, arg: object) -> None:
        # a C function's call counts for the code that calls it
        if event in ("call", "c_call"):
            self.by_kind[self.kind(frame.f_code.co_filename)] += 1
            self.by_kind["total"] += 1


def paired(results: dict[str, list[dict[str, Any]]], a: str, b: str, key: str = "tokens_per_s") -> list[float]:
    """Each round's ratio ``a ÷ b`` of ``key`` (the two engines of one round ran back to back)."""
    return [x[key] / y[key] for x, y in zip(results[a], results[b], strict=True)]


def median_ci(xs: list[float], level: float = 0.95, resamples: int = 10_000) -> tuple[float, float]:
    """A bootstrap percentile interval of the median of ``xs`` (fixed seed: the same rounds print
    the same interval). Each engine is a fresh process whose memory layout alone moves its step
    time by several per cent, so one round's ratio says little; the interval says what the rounds
    together pin down."""
    import random

    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    tail = (1 - level) / 2
    return meds[int(tail * resamples)], meds[min(resamples - 1, int((1 - tail) * resamples))]


#: one run's line per engine, as :func:`main` prints it (what ``--pool`` reads back)
ROUND_LINE = re.compile(r"^(\w+) round (\d+)\s+(.+?):\s+([\d.]+) tok/s")
#: one switched engine's round, as :func:`switched_figures` prints it, and its configurations in it
SWITCHED_LINE = re.compile(r"^(\w+) switched round (\d+): (.+) ms/step$")
SWITCHED_CONFIG = re.compile(r"(no connector|no-op connector|gpuckpt) ([\d.]+)")


def pool(logs: list[str]) -> list[str]:
    """The ratios of every round of the saved runs ``logs`` (this script's output) together, per
    model, per comparison (fresh engines or one switched engine) and per pair of configurations
    that ran in the same rounds: one line each."""
    ratios: dict[tuple[str, str, str], list[float]] = {}
    runs: dict[tuple[str, str, str], set[str]] = {}
    pairs = [("with", "without"), ("noop", "without"), ("with", "noop")]
    for log in logs:
        # (model, round) → configuration → throughput (any unit: only ratios within a round count)
        rounds: dict[tuple[str, int], dict[str, float]] = {}
        for line in Path(log).read_text().splitlines():
            if m := ROUND_LINE.match(line):
                rounds.setdefault((m[1], int(m[2])), {})[m[3].strip()] = float(m[4])
            elif m := SWITCHED_LINE.match(line):
                tput = {label: 1 / float(x) for label, x in SWITCHED_CONFIG.findall(m[3])}
                rounds[(f"{m[1]} (one engine, switched)", int(m[2]))] = tput
        if not rounds:  # not this script's output, or its round lines changed without the patterns
            sys.exit(f'{log}: no round lines ("<model> round <n> <configuration>: <x> tok/s") in it')
        for (model, _), tput in rounds.items():
            for a, b in pairs:
                if LABEL[a] in tput and LABEL[b] in tput:
                    key = (model, LABEL[a], LABEL[b])
                    ratios.setdefault(key, []).append(tput[LABEL[a]] / tput[LABEL[b]])
                    runs.setdefault(key, set()).add(log)
    out = []
    for key, xs in sorted(ratios.items()):
        lo, hi = median_ci(xs)
        model, a, b = key
        out.append(
            f"{model}: decode throughput {a} ÷ {b} = {statistics.median(xs):.3f} "
            f"(median of {len(xs)} rounds from {len(runs[key])} runs, 95 % CI {lo:.3f}–{hi:.3f})"
        )
    return out


def run_child(cmd: list[str], env: dict[str, str]) -> tuple[str, str]:
    """Run one measured engine in a process group of its own; read its output until the result
    line (vLLM's engine processes keep the pipes open after the client exits), then kill the group."""
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        lines = []
        try:
            assert p.stdout is not None
            for line in p.stdout:
                lines.append(line)
                if line.startswith("RESULT "):
                    break
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        err.seek(0)
        return "".join(lines), err.read()


def child(model: Path, what: str, env: dict[str, str], args: list[str]) -> dict[str, Any]:
    """Run one measured child (``args`` after the model) and return its result; exit naming
    ``what`` with the child's stderr if it gave none."""
    cmd = [sys.executable, __file__, "--model", str(model), *args]
    stdout, stderr = run_child(cmd, env)
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"the {what} failed:\n{stderr[-3000:]}")
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def switched_figures(
    name: str, model: Path, in_process: dict[str, str], sizes: list[str], rounds: int, fresh: float
) -> list[str]:
    """The same-process comparison (:func:`run_switched`): its summary lines, after printing its
    rounds. Its call count is checked against ``fresh``, a fresh engine's without a connector:
    switched off, the engine must run vLLM's no-connector path."""
    # the EngineCore in the child's process (to switch its scheduler), the worker in its own
    r = child(
        model, f"{name} switched run", in_process, ["--child", "switched", *sizes, "--switched-rounds", str(rounds)]
    )
    ms: dict[str, list[float]] = r["ms"]
    for i in range(rounds):
        print(
            f"{name} switched round {i + 1}: " + "  ".join(f"{LABEL[c]} {ms[c][i]:.3f}" for c in CONFIGS) + " ms/step",
            flush=True,
        )
    calls = child(model, f"{name} switched call count", in_process, ["--child", "switched", "--count", *sizes])["calls"]

    def ratio(a: str, b: str) -> str:
        # throughput a ÷ b, round by round: b's time a step ÷ a's
        xs = [y / x for x, y in zip(ms[a], ms[b], strict=True)]
        lo, hi = median_ci(xs)
        return f"{statistics.median(xs):.3f} (95 % CI {lo:.3f}–{hi:.3f})"

    extra = statistics.median([(w - o) * 1000 for w, o in zip(ms["with"], ms["without"], strict=True)])
    # switched off, the engine must run vLLM's no-connector path call for call (what is left is the
    # previous batch's requests being removed: 16 here against a fresh engine's 2 of the warm-up)
    drift = calls["without"] / fresh - 1
    check = (
        f"within {abs(drift) * 100:.1f} %"
        if abs(drift) <= 0.01
        else f"OFF BY {drift * 100:+.1f} %: switched off, this is not vLLM's no-connector path; the figures are void"
    )
    return [
        f"{name}: decode throughput, one engine switched between configurations batch by batch "
        f"({rounds} rounds): gpuckpt ÷ none = {ratio('with', 'without')} (target ≥ 0.98); "
        f"no-op connector ÷ none = {ratio('noop', 'without')}; gpuckpt ÷ no-op = {ratio('with', 'noop')}; "
        f"{extra:+.0f} µs per engine step (median of rounds, gpuckpt − none, of a "
        f"{statistics.median(ms['without']):.2f} ms step)",
        f"{name}: function calls a step, the switched engine: none {calls['without']:.0f} (a fresh engine "
        f"without a connector: {fresh:.0f}, {check}), no-op {calls['noop']:.0f}, "
        f"gpuckpt {calls['with']:.0f}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="rounds of fresh engines, one per configuration")
    ap.add_argument(
        "--switched-rounds",
        type=int,
        default=40,
        help="rounds of one engine switched between the configurations batch by batch (0: none)",
    )
    ap.add_argument(
        "--noop", action="store_true", help="add a no-op connector (vLLM's own connector cost, apart from gpuckpt's)"
    )
    ap.add_argument(
        "--models", default="dense,sliding", help="comma-separated: dense, sliding, dense-8L, dense-mid, sliding-mid"
    )
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batches", type=int, default=3, help="timed batches per engine; the fastest counts")
    ap.add_argument("--pool", nargs="+", metavar="LOG", help="pool the rounds of saved runs' output; run nothing")
    ap.add_argument("--child", choices=[*CONFIGS, "hooks", "switched"], help=argparse.SUPPRESS)
    ap.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.pool:
        for line in pool(a.pool):
            print(line)
        return
    if a.child:
        with tempfile.TemporaryDirectory(prefix="gpo-", dir="/tmp") as d:
            config = "with" if a.child == "hooks" else a.child
            sock = os.path.join(d, "c.sock")
            n = 1 if a.count else a.batches
            if a.child == "switched":
                r = run_switched(a.model, a.switched_rounds, a.requests, a.tokens, sock, a.count)
            else:
                r = run_one(a.model, config, a.requests, a.tokens, sock, a.child == "hooks", n, a.count)
        print("RESULT " + json.dumps(r), flush=True)
        os._exit(0)  # vLLM's engine process can hold a clean exit up (multiprocessing's join at exit)
    root = Path(os.environ.get("GPUCKPT_BENCH_MODELS", Path(tempfile.gettempdir()) / "gpuckpt-bench-models"))
    models = {
        "dense": lambda: make_model(root, layers=2, hidden=256, heads=4, kv_heads=2, vocab=512, dtype="float32"),
        "sliding": lambda: make_sliding_model(root),
        # a step nearer a GPU's (10–30 ms for a real model there): the same per-step machinery,
        # divided by a forward of 8 layers and a 32k vocabulary
        "dense-8L": lambda: make_model(root, layers=8, hidden=768, heads=12, kv_heads=4, vocab=32000, dtype="float32"),
        # a 10–20 ms step with the per-layer machinery of 4 and 8 layers (a GPU's decode step with
        # full CUDA graphs runs none of it), less bound by the host's memory than dense-8L
        "dense-mid": lambda: make_model(root, layers=4, hidden=512, heads=8, kv_heads=2, vocab=16000, dtype="float32"),
        "sliding-mid": lambda: make_sliding_model(root, layers=8, hidden=512, heads=8, vocab=16000),
    }
    env = {**os.environ, **WORKER_ENV, "PYTHONPATH": f"{HERE.parent}{os.pathsep}{HERE}"}
    in_process = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    sizes = ["--requests", str(a.requests), "--tokens", str(a.tokens)]
    configs = CONFIGS if a.noop else ("without", "with")
    summary = []
    for name in a.models.split(","):
        model = models[name]()
        # what each configuration's engine thread calls a step, fresh engines: the same on every run
        # (the fresh rounds' figure, and the check of the switched engine against no connector)
        counts = {
            cfg: child(model, f"{name} {cfg} call count", in_process, ["--child", cfg, "--count", *sizes])
            for cfg in (configs if a.rounds else ("without",))
        }
        if a.switched_rounds > 0:
            fresh = counts["without"]["calls:total"]
            summary += switched_figures(name, model, in_process, sizes, a.switched_rounds, fresh)
        results: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        for rnd in range(a.rounds):
            order = list(configs) if rnd % 2 == 0 else list(reversed(configs))
            for cfg in order:
                r = child(model, f"{name} {cfg} run", env, ["--child", cfg, *sizes, "--batches", str(a.batches)])
                results[cfg].append(r)
                print(
                    f"{name} round {rnd + 1} {LABEL[cfg]:>18}: {r['tokens_per_s']:8.1f} tok/s  "
                    f"{r['ms_per_step']:6.2f} ms/step  {r['tokens_per_cpu_s']:8.1f} tok/CPU-s  "
                    f"{r['num_gpu_blocks']:.0f} KV blocks  (batches: "
                    + " ".join(f"{x:.2f}" for x in r["batch_ms_per_step"])
                    + " ms/step)"
                    + ("  (hybrid KV cache manager OFF)" if r["hybrid_manager_off"] else ""),
                    flush=True,
                )
        if not a.rounds:  # the switched engine's figures only
            continue
        ratios = paired(results, "with", "without")
        cpu_ratios = paired(results, "with", "without", "tokens_per_cpu_s")
        extra = [w["ms_per_step"] - o["ms_per_step"] for w, o in zip(results["with"], results["without"], strict=True)]
        cap = results["with"][0]["num_gpu_blocks"] / results["without"][0]["num_gpu_blocks"]
        # the connector's own time, every hook timed, the engine in one process (the steadiest figure)
        h = child(model, f"{name} hooks run", in_process, ["--child", "hooks", *sizes])
        top = sorted(((v, k.removeprefix("hook_us:")) for k, v in h.items() if k.startswith("hook_us:")), reverse=True)
        own = (
            f"gpuckpt's own hooks {h['hooks_us_per_step']:.1f} µs a step "
            f"({h['hooks_us_per_step'] / 10 / h['ms_per_step']:.2f} % of a {h['ms_per_step']:.2f} ms step; "
            + ", ".join(f"{k} {v:.1f}" for v, k in top[:4])
            + ")"
        )
        base = counts["without"]["calls:total"]
        calls_line = (
            f"{name}: function calls a step on the engine's thread (counted, the same every run): "
            + "; ".join(
                f"{LABEL[c]} {counts[c]['calls:total']:.0f} ({counts[c]['calls:total'] - base:+.0f}"
                + (f", of which in gpuckpt's code {counts[c]['calls:gpuckpt']:.0f}" if c == "with" else "")
                + ")"
                for c in configs
            )
        )
        lo, hi = median_ci(ratios)
        summary.append(
            f"{name}: decode throughput with ÷ without = {statistics.median(ratios):.3f} "
            f"(median of {len(ratios)} rounds, 95 % CI {lo:.3f}–{hi:.3f}; target ≥ 0.98; rounds: "
            + ", ".join(f"{x:.3f}" for x in ratios)
            + f"); tokens per CPU second with ÷ without = {statistics.median(cpu_ratios):.3f}; "
            f"{statistics.median(extra):+.3f} ms per engine step; {own}; KV capacity with ÷ without = {cap:.2f}"
        )
        summary.append(calls_line)
        if "noop" in configs:
            # vLLM's own cost of a connector (noop ÷ without), and gpuckpt's beyond it (with ÷ noop)
            vllm_share, own_share = paired(results, "noop", "without"), paired(results, "with", "noop")
            summary.append(
                f"{name}: of which vLLM's own connector machinery (a no-op connector ÷ without) = "
                f"{statistics.median(vllm_share):.3f} (95 % CI {'–'.join(f'{x:.3f}' for x in median_ci(vllm_share))}); "
                f"gpuckpt beyond it (gpuckpt ÷ the no-op connector) = {statistics.median(own_share):.3f} "
                f"(95 % CI {'–'.join(f'{x:.3f}' for x in median_ci(own_share))})"
            )
    print()
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
