"""GPU check: the fingerprint through NVML and cuda-python on a real GPU, and
the save pipeline fed from CUDA memory through pinned host buffers on a side stream.

Prints the device→host copy alone (GB/s) and the save pipeline's throughput as
a ratio to it. With ``--vllm`` (vLLM's CUDA build installed), also checkpoints
a live worker on the default GPU backend (FLASH_ATTN on SM90) mid-decode,
SIGKILLs it and restores into a fresh one: warm, canary matched, every
continuation token-identical to the uninterrupted run, the named backend and
page format in the manifest; with two GPUs the same at TP=2, and TP=2 → TP=1.
Run on a host with a CUDA GPU:

    python bench/gpu_check.py [--mib 1024] [--vllm]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt import Namespace, Pins, Repository, WorkerFacts, host_facts
from ckpt.hostbuffers import HostBuffers

MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--block-mib", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="also checkpoint and restore a live vLLM worker")
    args = ap.parse_args()
    facts = host_facts()
    print("host facts:", json.dumps(facts.model_dump(mode="json"), indent=2))
    if not torch.cuda.is_available():
        print("no CUDA device: nothing more to check here")
        return 1
    n = args.mib // args.block_mib
    elems = args.block_mib * MiB // 2
    spread = torch.linspace(0.05, 3.0, 128, device="cuda")
    pages = [
        (i.to_bytes(8, "little"), (torch.randn(elems // 128, 128, device="cuda") * spread).to(torch.bfloat16))
        for i in range(n)
    ]
    torch.cuda.synchronize()
    st = HostBuffers(args.block_mib * MiB, count=32)

    # Device->host copy alone, through the same host buffers the save uses.
    t = time.perf_counter()
    for b in st.copy(pages, lookahead=16):
        assert b.release is not None
        b.release()
    copy_s = time.perf_counter() - t
    total = n * args.block_mib * MiB
    print(f"device->host copy alone (pinned, side stream): {total / copy_s / 1e9:.2f} GB/s")

    with tempfile.TemporaryDirectory() as d:
        repo = Repository.open(d, create=True)
        pins = Pins(host=facts, worker=WorkerFacts(engine="gpu-check"))
        t = time.perf_counter()
        m = repo.save(
            st.copy(pages, lookahead=16), worker_id="gpu", namespace=Namespace({"engine": "gpu-check"}), pins=pins
        )
        save_s = time.perf_counter() - t
        print(
            f"save pipeline from CUDA memory: {total / save_s / 1e9:.3f} GB/s = "
            f"{copy_s / save_s:.3f} x the copy alone; compression {m.sizes.raw_bytes / m.sizes.stored_bytes:.3f}x"
        )
        # Spot-check bytes of a few pages.
        want = {k: v.cpu().view(torch.uint8).numpy().tobytes() for k, v in pages[:4]}
        got = {b.key: bytes(b.data) for b in repo.load(m.id, keys=list(want))}
        print("round trip of sampled pages:", "ok" if got == want else "MISMATCH")
        ok = got == want
    ok = copier_check() and ok
    if args.vllm:
        ok = vllm_checks() and ok
    return 0 if ok else 1


def copier_check(layers: int = 32, blocks: int = 4096, chunk: int = 64) -> bool:
    """A capture's streamed chunks on this GPU: ``PageCopier.gather`` of ``chunk`` blocks at a time
    into pooled pinned buffers on the side stream (what the connector's worker half does each step
    after the consistent point), the bytes checked against the KV, and the throughput printed."""
    from agent.engines.vllm.copier import PageCopier

    kv = [torch.randn(blocks, 2, 16, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(layers)]
    copier = PageCopier(kv)
    order = torch.randperm(blocks).tolist()
    torch.cuda.synchronize()
    t = time.perf_counter()
    ok = True
    for i in range(0, blocks, chunk):
        ids = order[i : i + chunk]
        g = copier.gather(ids)
        for j, page in enumerate(g.pages()):
            if j == 0 and i % (chunk * 16) == 0:  # spot-check one page per 16 chunks
                want = torch.stack([t_[ids[0]] for t_ in kv]).cpu().view(torch.uint8).numpy().tobytes()
                ok = ok and bytes(page) == want
        g.release()
    secs = time.perf_counter() - t
    total = blocks * layers * kv[0][0].numel() * 2
    print(
        f"streamed capture chunks ({chunk} blocks of {layers} layers, pooled pinned buffers): "
        f"{total / secs / 1e9:.2f} GB/s, pool {len(copier._pool)} buffers, bytes {'ok' if ok else 'MISMATCH'}"
    )
    return ok


def vllm_checks() -> bool:
    """Warm restore of a live worker on this GPU (TP=1; TP=2 and TP=2 → TP=1 with two GPUs)."""
    import importlib

    import vllm  # noqa: F401  (fails early where vLLM is missing)

    # The test suite's worker script is the one to run here; imported by name
    # so that mypy's strict check of bench/ does not follow into the tests.
    harness = importlib.import_module("tests.vllm.conftest")
    run_worker = harness.run_worker

    ok = True
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = harness.write_tiny_llama(tmp / "model", dtype="bfloat16")
        base: dict[str, Any] = {
            "model": str(model),
            "repo": str(tmp / "repo"),
            "dtype": "bfloat16",
            "block_size": 16,
            "gpu_memory_utilization": 0.2,
            "max_tokens": 160,
        }
        tps = [1, 2] if torch.cuda.device_count() >= 2 else [1]
        for tp in tps:
            a = run_worker(
                {
                    **base,
                    "mode": "checkpoint",
                    "tp": tp,
                    "socket": str(tmp / f"a{tp}.sock"),
                    "staging": str(tmp / f"sa{tp}"),
                },
                tmp,
                kill_after_result=True,
            )
            m = Repository.open(base["repo"]).manifest(a["checkpoint"])
            print(
                f"TP={tp} checkpoint: backend {m.pins.worker.attention_backend}, "
                f"page format {m.pins.worker.kv_layout}, "
                f"shards {[s['kv_heads'] for s in m.layout['shards']]}"
            )
            for into in sorted({tp, 1}):
                b = run_worker(
                    {
                        **base,
                        "mode": "restore",
                        "tp": into,
                        "checkpoint": a["checkpoint"],
                        "turn1": a["turn1"],
                        "socket": str(tmp / f"b{tp}{into}.sock"),
                        "staging": str(tmp / f"sb{tp}{into}"),
                    },
                    tmp,
                )
                same = all(b["restored"][r]["full"] == ref for r, ref in a["reference"].items())
                cached = all(v["num_cached_tokens"] == v["prompt_len"] - 1 for v in b["restored"].values())
                print(
                    f"  restore TP={tp} -> TP={into}: warm={b['warm']} {b['reasons']} canary="
                    f"{b['restore_stats'].get('canary', {}).get('match')} token-identical={same} "
                    f"one-token-recompute={cached}"
                )
                ok = ok and b["warm"] and same and cached
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
