"""GPU check: the fingerprint through NVML and cuda-python on a real GPU, and
the save pipeline fed from CUDA memory through pinned staging on a side stream.

Prints the device→host copy alone (GB/s) and the save pipeline's throughput as
a ratio to it. Run on a host with a CUDA GPU:

    python bench/gpu_check.py [--mib 1024]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt import Namespace, Pins, Repository, WorkerFacts, host_facts
from ckpt.staging import HostStaging

MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--block-mib", type=int, default=2)
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
    st = HostStaging(args.block_mib * MiB, count=32)

    # Device->host copy alone, through the same staging path the save uses.
    t = time.perf_counter()
    for b in st.stage(pages, lookahead=16):
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
            st.stage(pages, lookahead=16), worker_id="gpu", namespace=Namespace({"engine": "gpu-check"}), pins=pins
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
