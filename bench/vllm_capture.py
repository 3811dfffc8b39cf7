"""Capture and restore at scale: what a checkpoint costs the worker as its prefix cache grows, and how
soon a restored worker's in-flight requests resume, in one run.

A ``vllm serve`` worker (CPU build, a random-weight fp32 Llama) has its
prefix cache filled with ``--prompts`` 1,024-token prompts (1×), two
requests decoding throughout; then:

1. a first checkpoint (nothing is durable yet: every page is copied, the
   cached full blocks streamed in chunks after the consistent point, within
   the staging bound ``--staging-mib``);
2. 10 % more prompts and a second checkpoint (incremental: only pages the
   repository does not hold are copied);
3. the same state captured with ``full`` (every page copied), for reference;
4. 10 % more prompts, then a pre-copy (the worker copies ``--precopy-kib``
   per step, the agent stores the blocks), the live requests' decode rate
   taken during it and over as long before and after it;
5. a checkpoint after the pre-copy.

The same again with 8× the prompts. Printed per checkpoint: pages copied
(and referenced without a copy), bytes, the worker's pause at the
consistent point (the step that copies what may change after it), the
largest per-step copy after it, the staging peak (the connector's count and
the staging directory's size sampled from outside) and the capture and
save times.

Then the restore (``--no-restore`` skips it): a worker with ``--restore-live`` requests
decoding and a prefix cache 8× their KV is checkpointed into SeaweedFS
(S3 on loopback) and SIGKILLed; a fresh worker restores, in-flight pages
first, and the time from the restore's start to the first resumed token is
set against the time to fetch and verify the whole checkpoint from the
same bucket.

Ratios come from this run; the host is noisy, absolute times are not the
point.
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

import contextlib

from vllm_common import WORKER_ENV, free_port, kv_bytes_per_token, make_model, worker_args

from agent import session
from agent.testing import ServeProcess
from ckpt import Repository

SPEC: dict[str, Any] = {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 4, "vocab": 4096, "dtype": "float32"}
PROMPT = 1024
MiB = 1 << 20


def checkpoint(w: ServeProcess, repo: Repository, bound: int, per_step: int, *, full: bool = False) -> dict[str, Any]:
    sampler = StagingSampler(Path(w.staging_dir or "."))
    with sampler:
        if full:
            # the reference: a capture that copies every page (read to its end, not saved)
            cap = session.capture(w.control_socket, 300, full=True, max_staging=bound, copy_per_step=per_step)
            try:
                for _ in cap.pages:
                    pass
                st = dict(cap.stats)
            finally:
                cap.close()
        else:
            t0 = time.monotonic()
            taken = session.checkpoint(
                w.control_socket, repo, "bench", timeout=300, max_staging=bound, copy_per_step=per_step
            )
            st = dict(taken.stats)
            st["total_s"] = time.monotonic() - t0
    st["sampled_peak_bytes"] = sampler.peak
    return st


class StagingSampler:
    """The size of the capture page files in a staging directory, sampled every 20 ms from outside
    (more often, this thread's own Python would take the interpreter from the save it measures)."""

    def __init__(self, d: Path) -> None:
        self.dir, self.peak = d, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            n = 0
            with contextlib.suppress(FileNotFoundError), os.scandir(self.dir) as it:
                for e in it:
                    if e.name.startswith("capture-") and e.name.endswith(".bin"):
                        with contextlib.suppress(FileNotFoundError):
                            n += e.stat().st_size
            self.peak = max(self.peak, n)
            time.sleep(0.02)

    def __enter__(self) -> StagingSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def steps(sock: str) -> int:
    """The engine's step count (every step decodes a token of each live request here)."""
    return int(session.stats(sock)["step"])


def rate(sock: str, seconds: float = 0.0, during: Any = None) -> tuple[float, Any]:
    """Engine steps per second with the two requests decoding (tokens per second ÷ 2), over
    ``seconds`` or while ``during()`` runs."""
    a, t0 = steps(sock), time.monotonic()
    result = None
    if during is not None:
        result = during()
    else:
        time.sleep(seconds)
    b, t1 = steps(sock), time.monotonic()
    return (b - a) / (t1 - t0), (result, t1 - t0)


def start_worker(model: Path, tmp: Path, tag: str, max_len: int, block_size: int = 32) -> ServeProcess:
    w = ServeProcess(
        str(model),
        str(tmp / f"{tag}.sock"),
        port=free_port(),
        log_path=str(tmp / f"{tag}.log"),
        staging_dir=str(tmp / f"stage-{tag}"),
        args=worker_args(max_model_len=max_len, block_size=block_size),
        env=WORKER_ENV,
    )
    w.wait_ready()
    return w


def run_scale(model: Path, tmp: Path, prompts: int, rng: random.Random, a: argparse.Namespace) -> dict[str, Any]:
    tag = f"x{prompts}"
    repo = Repository.open(str(tmp / f"repo-{tag}"), create=True)
    bound, per_step = a.staging_mib * MiB, a.copy_mib * MiB
    out: dict[str, Any] = {"prompts": prompts, "bound": bound}
    w = start_worker(model, tmp, tag, PROMPT + 4096)
    try:

        def fill(n: int) -> None:
            for _ in range(n):
                p = [rng.randrange(3, SPEC["vocab"]) for _ in range(PROMPT)]
                w.client.complete(p, {"temperature": 0.0, "max_tokens": 1}, stream=False)

        fill(prompts)
        dec = Decoders(w, rng)
        out["first"] = checkpoint(w, repo, bound, per_step)
        # 10 % new blocks: the decoders stop while the prompts are added (their outputs would be new
        # blocks too, at ~400 tokens/s more than the prompts), and two fresh ones decode through it
        dec.pause()
        fill(max(1, prompts // 10))
        dec.resume()
        out["incremental"] = checkpoint(w, repo, bound, per_step)
        out["new_blocks"] = new_blocks(repo)
        out["full"] = checkpoint(w, repo, bound, per_step, full=True)
        out["kv_bytes"] = out["full"]["bytes"]
        fill(max(1, prompts // 10))

        def pre() -> dict[str, Any]:
            return dict(
                session.precopy(
                    w.control_socket, repo, timeout=300, copy_per_step=a.precopy_kib * 1024, trust_domain="bench"
                )
            )

        with_pre, (pc, secs) = rate(w.control_socket, during=pre)
        before, _ = rate(w.control_socket, seconds=max(secs, 2.0))
        after, _ = rate(w.control_socket, seconds=max(secs, 2.0))
        out["precopy"] = {**pc, "tok_s": with_pre, "baseline_tok_s": (before + after) / 2, "seconds": secs}
        out["after_precopy"] = checkpoint(w, repo, bound, per_step)
    finally:
        w.kill()
    return out


class Decoders:
    """Two requests decoding through every checkpoint (3,000 tokens each, then two more).

    :meth:`pause` ends them — their streams are closed, so the server aborts
    them — and starts none until :meth:`resume`, which waits until two fresh
    ones are decoding.
    """

    class _Stop(Exception):
        pass

    def __init__(self, w: ServeProcess, rng: random.Random, n: int = 2) -> None:
        self.w, self.rng, self.n = w, rng, n
        self._run_ok = threading.Event()
        self._run_ok.set()
        self._epoch = 0
        for _ in range(n):
            threading.Thread(target=self._decode, daemon=True).start()
        self._wait_live()

    def _wait_live(self) -> None:
        session.wait_until(self.w.control_socket, live=self.n, min_outputs=8, timeout=300)

    def _decode(self) -> None:
        while True:
            self._run_ok.wait()
            epoch = self._epoch

            def check(_toks: list[int], epoch: int = epoch) -> None:
                if self._epoch != epoch:
                    raise Decoders._Stop

            p = [self.rng.randrange(3, SPEC["vocab"]) for _ in range(64)]
            sampling = {"temperature": 0.0, "max_tokens": 3000, "ignore_eos": True}
            try:
                self.w.client.complete(p, sampling, on_tokens=check)
            except Decoders._Stop:
                continue
            except Exception:  # the worker is killed under it at the end
                return

    def pause(self) -> None:
        self._run_ok.clear()
        self._epoch += 1
        deadline = time.monotonic() + 300
        while session.stats(self.w.control_socket)["live"] and time.monotonic() < deadline:
            time.sleep(0.01)  # the streams close at their next token: the server aborts them

    def resume(self) -> None:
        self._run_ok.set()
        self._wait_live()


def new_blocks(repo: Repository) -> dict[str, int]:
    """Blocks of the newest checkpoint that the one before it did not have, and that one's count."""
    a, b = (repo.manifest(c.id) for c in repo.list()[-2:])
    before = {r.key for r in a.blocks}
    return {"new": sum(1 for r in b.blocks if r.key not in before), "before": len(before)}


def run_restore(model: Path, tmp: Path, rng: random.Random, a: argparse.Namespace) -> dict[str, Any]:
    from tests.harness.seaweed import SeaweedServer

    server = SeaweedServer(tmp / "seaweed")
    server.start()
    try:
        os.environ.update(
            AWS_ACCESS_KEY_ID=server.access_key, AWS_SECRET_ACCESS_KEY=server.secret_key, AWS_REGION="us-east-1"
        )
        url = f"s3://{server.make_bucket('bench')}/repo?endpoint={server.endpoint}"
        repo = Repository.open(url, create=True)
        n_live, live_len = a.restore_live, a.restore_prompt
        live = {f"live{i}": [rng.randrange(3, SPEC["vocab"]) for _ in range(live_len)] for i in range(n_live)}
        sampling = {"temperature": 0.0, "max_tokens": 200, "ignore_eos": True}
        max_len = max(PROMPT, live_len) + 512
        w = start_worker(model, tmp, "ra", max_len, a.restore_block_size)
        try:
            for _ in range(8 * n_live * live_len // PROMPT):  # prefix cache 8x the in-flight requests' prompts
                p = [rng.randrange(3, SPEC["vocab"]) for _ in range(PROMPT)]
                w.client.complete(p, {"temperature": 0.0, "max_tokens": 1}, stream=False)
            probe = None
            from agent.engines import canary

            probe = canary.record(w.client.generate)
            threads = [
                threading.Thread(
                    target=lambda k=k: w.client.complete(live[k], sampling, request_id=k, stream=False), daemon=True
                )
                for k in live
            ]
            session.hold(w.control_socket, len(live), timeout=300)

            def go() -> None:
                for t in threads:
                    t.start()

            when = {"live": len(live), "min_outputs": 20}
            taken = session.checkpoint_around(
                w.control_socket, go, repo, "bench-r", canary=probe, when=when, timeout=300
            )
            m = taken.manifest
        finally:
            w.kill()

        def full_fetch() -> tuple[float, int]:
            fresh = Repository.open(url)
            t1 = time.monotonic()
            n = sum(1 for _ in fresh.load(m.id))
            return time.monotonic() - t1, n

        # the whole fetch before and after the restores, the faster counting (the ratio's worse case)
        t_full, n = full_fetch()
        out: dict[str, Any] = {"blocks": len(m.blocks), "loaded": n, "modes": {}}
        runs = [(i, mode) for i in range(a.restore_runs) for mode in a.release.split(",")]
        for i, mode in runs:  # the modes alternate, so neither gets the quieter minutes
            b = start_worker(model, tmp, f"rb-{mode}-{i}", max_len, a.restore_block_size)
            # the restore's page files where a restore puts them by default: shared memory
            shm = Path("/dev/shm")
            stage = Path(tempfile.mkdtemp(prefix="gpuckpt-bench-restore-", dir=shm if shm.is_dir() else tmp))
            try:
                repo = Repository.open(url)
                t0 = time.monotonic()
                plan = session.restore(
                    repo, m.id, b.control_socket, staging_dir=str(stage), generate=b.client.generate, release=mode
                )
                t_plan = time.monotonic() - t0
                res = b.client.submit(plan.requests)
                firsts = [c.first_token_s for c in res.values() if c.first_token_s is not None]
                first, median, last = min(firsts), statistics.median(firsts), max(firsts)
                plan.wait_offered(600)
                rest: dict[str, Any] = dict(plan.rest.stats) if plan.rest is not None else {}
                cached = {
                    k: (c.cached_tokens, len(r.token_ids))
                    for r in plan.requests
                    for k, c in [(r.request_id, res[r.request_id])]
                }
            finally:
                b.kill()
                shutil.rmtree(stage, ignore_errors=True)
            out["modes"].setdefault(mode, []).append(
                {
                    "first_blocks": int(plan.stats.get("first_blocks") or 0) + int(rest.get("inflight_blocks", 0)),
                    "inflight_s": rest.get("inflight_s"),
                    "release": plan.stats.get("release"),
                    "warm": plan.warm,
                    "plan_s": t_plan,
                    "phases": dict(plan.stats.get("phases") or {})
                    | {"canary_s": (plan.stats.get("canary") or {}).get("canary_s"), "submit_to_first_s": first},
                    "first_token_s": t_plan + first,
                    "median_first_token_s": t_plan + median,
                    "every_first_token_s": t_plan + last,
                    "cached": cached,
                    "offered_total": plan.offered_total,
                }
            )
        out["full_fetch_s"] = min(t_full, full_fetch()[0])
        return out
    finally:
        server.close()


def row(name: str, st: dict[str, Any]) -> str:
    return (
        f"  {name:<14} copied {st['pages']:>6} pages ({st['bytes'] / MiB:7.1f} MiB), "
        f"referenced {st.get('skipped_pages', 0):>6}; pause {st['copy_s'] * 1000:6.1f} ms "
        f"(then at most {st.get('max_chunk_copy_s', 0) * 1000:5.1f} ms a step, {st.get('chunks', 1)} chunks); "
        f"staged peak {st.get('staged_peak_bytes', 0) / MiB:5.1f} MiB (sampled {st['sampled_peak_bytes'] / MiB:5.1f}); "
        f"capture {st.get('stream_s', st['capture_s']):.2f} s"
        + (f", save {st['save_s']:.2f} s" if "save_s" in st else "")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16, help="1,024-token prompts in the prefix cache at 1x")
    ap.add_argument("--scales", default="1,8", help="multiples of --prompts to run")
    ap.add_argument("--staging-mib", type=int, default=64, help="a capture's staging bound")
    ap.add_argument("--copy-mib", type=int, default=4, help="bytes copied per step after the consistent point")
    ap.add_argument("--precopy-kib", type=int, default=512, help="bytes a pre-copy copies per step")
    ap.add_argument("--no-restore", action="store_true")
    ap.add_argument("--restore-live", type=int, default=16, help="in-flight requests at the restore's checkpoint")
    ap.add_argument("--restore-prompt", type=int, default=2048, help="their prompts' length in tokens")
    ap.add_argument(
        "--restore-block-size", type=int, default=32, help="tokens per page in the restore's workers (32: 64 KiB pages)"
    )
    ap.add_argument("--restore-runs", type=int, default=3, help="restores per release mode")
    ap.add_argument("--release", default="each,together", help="the restores' release modes")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="gpuckpt-bench-capture-") as d:
        tmp = Path(d)
        model = make_model(tmp, **SPEC)
        per_token = kv_bytes_per_token(SPEC["layers"], SPEC["kv_heads"], SPEC["hidden"] // SPEC["heads"], "float32")
        scales = [int(s) for s in args.scales.split(",") if s.strip()]
        results = [run_scale(model, tmp, args.prompts * s, rng, args) for s in scales]
        restored = None if args.no_restore else run_restore(model, tmp, rng, args)
    if args.json:
        print(json.dumps({"scales": results, "restore": restored}, indent=2, default=str))
        return
    print(
        f"KV per token: {per_token} bytes; prompts of {PROMPT} tokens; two requests decoding; "
        f"staging bound {args.staging_mib} MiB, {args.copy_mib} MiB a step after the consistent point"
    )
    for r in results:
        print(f"prefix cache: {r['prompts']} prompts ({r['kv_bytes'] / MiB:.0f} MiB of KV)")
        for name in ("first", "incremental", "full", "after_precopy"):
            print(row(name, r[name]))
        inc, full, pc, nb = r["incremental"], r["full"], r["precopy"], r["new_blocks"]
        print(
            f"  {nb['new'] / nb['before']:.1%} new blocks ({nb['new']} of {nb['before']}): the incremental "
            f"checkpoint copies {inc['bytes'] / r['first']['bytes']:.3f} of the first's bytes "
            f"({inc['bytes'] / full['bytes']:.3f} of a full capture's)"
        )
        print(
            f"  pre-copy: {pc['new_raw_bytes'] / MiB:.1f} MiB stored in {pc['seconds']:.1f} s; decode "
            f"{pc['tok_s']:.1f} steps/s against {pc['baseline_tok_s']:.1f} without: "
            f"{pc['tok_s'] / pc['baseline_tok_s']:.2f}; the next checkpoint copied "
            f"{r['after_precopy']['bytes'] / MiB:.1f} MiB"
        )
    if len(results) >= 2:
        a, b = results[0], results[-1]
        scale = b["prompts"] // a["prompts"]
        kinds = ("first", "incremental", "full", "after_precopy")

        def pause(r: dict[str, Any]) -> float:  # the median of the run's four captures: a few ms, noisy
            return float(statistics.median(r[k]["copy_s"] for k in kinds))

        print(
            f"pause at {scale}x KV / at 1x: {pause(b) / pause(a):.2f} (medians of four captures, "
            f"{pause(b) * 1000:.1f} / {pause(a) * 1000:.1f} ms); first checkpoints: "
            f"{b['first']['copy_s'] / a['first']['copy_s']:.2f}"
        )
        peak = max(b["first"]["staged_peak_bytes"], b["first"]["sampled_peak_bytes"])
        within = all(
            max(r[k]["staged_peak_bytes"], r[k]["sampled_peak_bytes"]) <= r["bound"] for r in results for k in kinds
        )
        print(
            f"peak staging at {scale}x / KV: {peak / b['kv_bytes']:.3f} (bound {b['bound'] / b['kv_bytes']:.3f}; "
            f"never above the bound: {within})"
        )
        inc, nb = b["incremental"]["bytes"] / b["first"]["bytes"], b["new_blocks"]
        print(
            f"bytes of a checkpoint with {nb['new'] / nb['before']:.1%} new blocks / the first's at {scale}x: {inc:.3f}"
        )
        thr = b["precopy"]["tok_s"] / b["precopy"]["baseline_tok_s"]
        print(f"decode throughput with pre-copy / without at {scale}x: {thr:.2f}")
    if restored is not None:
        full = restored["full_fetch_s"]
        print(
            f"restore from SeaweedFS, prefix cache 8x the in-flight KV ({restored['blocks']} blocks): the whole "
            f"checkpoint fetched and verified in {full:.2f} s"
        )
        for mode, xs in restored["modes"].items():
            for x in xs:
                print(
                    f"  release {mode} ({x['release']}; {x['first_blocks']} in-flight blocks first): resumed after "
                    f"{x['first_token_s']:.2f} s (first) / {x['median_first_token_s']:.2f} s (median) / "
                    f"{x['every_first_token_s']:.2f} s (last): {x['first_token_s'] / full:.3f} / "
                    f"{x['median_first_token_s'] / full:.3f} / {x['every_first_token_s'] / full:.3f}"
                )
                ph = ", ".join(
                    f"{k.removesuffix('_s')} {v * 1000:.0f} ms" for k, v in x["phases"].items() if v is not None
                )
                cached = sum(c for c, _ in x["cached"].values()), sum(n for _, n in x["cached"].values())
                print(
                    f"    to the first token: {ph}; in-flight pages all offered {x['inflight_s'] or 0:.2f} s after "
                    f"the first part; cached {cached[0]} of {cached[1]} resubmitted prompt tokens"
                )
            med = {
                k: statistics.median(x[k] for x in xs) / full
                for k in ("first_token_s", "median_first_token_s", "every_first_token_s")
            }
            print(
                f"  release {mode}, medians of {len(xs)} runs, ÷ the whole fetch: first resumed token "
                f"{med['first_token_s']:.3f}, median request {med['median_first_token_s']:.3f}, last request "
                f"{med['every_first_token_s']:.3f}"
            )


if __name__ == "__main__":
    main()
