"""Save and load pipeline throughput, each as a ratio to its slowest stage alone.

Everything is measured in one run, on the same data, so the ratios hold on a
noisy machine where absolute numbers do not. Throughput is always expressed
in *raw KV bytes per second*: a stage that handles compressed bytes (store
write/read, decryption of compressed blobs) is credited with the raw bytes
those stand for. Each stage alone runs with the parallelism the pipeline
gives it (encoders: ``workers`` threads; store: ``upload_workers``), so a
ratio of 1.0 means the pipeline runs exactly at its bottleneck.

Data: Gaussian bf16 with a per-channel spread (a spread of 0.05-3 across the
head dimension), which compresses within 1% of real attention K/V; uniform
random bytes would not compress at all and would flatter the codec stage.

    python bench/pipeline.py [--mib 256] [--block-kib 256] [--no-s3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt import Block, Keyring, Namespace, Pins, Repository, SaveOptions, WorkerFacts, host_facts
from ckpt import checksum as cks
from ckpt.codecs import CodecContext, Pipeline
from ckpt.pack import PackWriter
from ckpt.save import choose_pipeline
from ckpt.store.base import Store

MiB = 1 << 20


def make_blocks(total: int, block_bytes: int, seed: int = 0) -> list[Block]:
    """Realistic KV pages: [2 (K,V), heads, tokens, head_dim] bf16."""
    head_dim = 128
    heads = 8
    tokens = max(1, block_bytes // (2 * heads * head_dim * 2))
    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(0.05, 3.0, head_dim)
    out = []
    n = max(1, total // (2 * heads * tokens * head_dim * 2))
    for i in range(n):
        t = (torch.randn(2, heads, tokens, head_dim, generator=g) * spread).to(torch.bfloat16)
        out.append(Block.from_tensor(i.to_bytes(8, "little") + b"bench", t))
    return out


def timed(fn: Callable[[], Any], repeat: int = 3) -> float:
    """Best of ``repeat`` runs, in seconds (the first also warms caches)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def pmap(workers: int, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(fn, items))


class Bench:
    def __init__(self, blocks: list[Block], opts: SaveOptions, keyring: Keyring | None) -> None:
        self.blocks = blocks
        self.opts = opts
        self.keyring = keyring
        self.raw = sum(b.nbytes for b in blocks)
        self.rows: list[dict[str, Any]] = []
        kid = keyring.key_id if keyring else None
        self.codec = Pipeline(choose_pipeline("bfloat16", opts, None))
        self.full = Pipeline(choose_pipeline("bfloat16", opts, kid))
        self.ctx = CodecContext(keyring, b"0" * 64, "pack", "blob")
        self.encoded = [self.codec.encode(b.data, self.ctx) for b in blocks]
        self.stored = [self.full.encode(b.data, self.ctx) for b in blocks]
        self.stored_bytes = sum(memoryview(s).nbytes for s in self.stored)
        self.ratio = self.raw / sum(memoryview(e).nbytes for e in self.encoded)

    def rate(self, seconds: float) -> float:
        return self.raw / seconds / 1e6  # raw MB/s

    # -- save-side stages ------------------------------------------------------------

    def save_stages(self, store_factory: Callable[[], Store]) -> dict[str, float]:
        w = self.opts.workers
        staging = [np.empty(b.nbytes, np.uint8) for b in self.blocks]
        stages = {
            # On a GPU this is the device->host copy into pinned staging; here
            # the host-to-host copy of the same bytes.
            "copy": timed(lambda: self.copy_into(staging)),
            "checksum": timed(lambda: pmap(w, lambda b: cks.checksum(b.data), self.blocks)),
            "codec": timed(lambda: pmap(w, lambda b: self.codec.encode(b.data, self.ctx), self.blocks)),
        }
        if self.keyring is not None:
            kr = self.keyring
            stages["encrypt"] = timed(lambda: pmap(w, lambda e: kr.seal(e, b"aad"), self.encoded))
        stages["store write"] = self.store_write(store_factory)
        return {k: self.rate(v) for k, v in stages.items()}

    def copy_into(self, staging: list[np.ndarray[Any, Any]]) -> None:
        for s, b in zip(staging, self.blocks, strict=True):
            np.copyto(s, np.frombuffer(b.data, np.uint8))

    def packs(self) -> list[memoryview]:
        out = []
        pw = PackWriter(os.urandom(16).hex())
        for i, s in enumerate(self.stored):
            pw.add(f"{i:064x}", s, 0, "", "", "[]")
            if pw.size >= self.opts.pack_size:
                out.append(pw.finish(None))
                pw = PackWriter(os.urandom(16).hex())
        if pw.entries:
            out.append(pw.finish(None))
        return out

    def store_write(self, store_factory: Callable[[], Store]) -> float:
        packs = self.packs()
        best = float("inf")
        for _ in range(3):
            store = store_factory()
            t = time.perf_counter()
            pmap(self.opts.upload_workers, _putter(store), list(enumerate(packs)))
            best = min(best, time.perf_counter() - t)
        return best

    # -- load-side stages ---------------------------------------------------------------

    def load_stages(self, repo: Repository, manifest_id: str) -> dict[str, float]:
        m = repo.manifest(manifest_id)
        from ckpt.load import plan_ranges
        from ckpt.pack import pack_name

        ranges = plan_ranges(m.blocks)
        w = 8
        stages = {
            "store read": timed(
                lambda: pmap(w, lambda r: repo.store.get(pack_name(r.pack), r.start, r.end - r.start), ranges)
            ),
            "checksum": timed(lambda: pmap(self.opts.workers, lambda s: cks.checksum(s), self.stored)),
        }
        if self.keyring is not None:
            kr = self.keyring
            sealed = [kr.seal(e, b"aad") for e in self.encoded]
            stages["decrypt"] = timed(lambda: pmap(self.opts.workers, lambda s: kr.open(s, b"aad", obj="x"), sealed))
        n = self.blocks[0].nbytes
        stages["codec"] = timed(
            lambda: pmap(self.opts.workers, lambda e: self.codec.decode(e, self.ctx, n), self.encoded)
        )
        return {k: self.rate(v) for k, v in stages.items()}


def _putter(store: Store) -> Callable[[tuple[int, memoryview]], None]:
    def put(item: tuple[int, memoryview]) -> None:
        store.put(f"packs/{item[0]:04d}", item[1])

    return put


def run_case(
    label: str,
    store_factory: Callable[[], Store],
    repo_factory: Callable[[], Repository],
    blocks: list[Block],
    opts: SaveOptions,
    keyring: Keyring | None,
) -> dict[str, Any]:
    b = Bench(blocks, opts, keyring)
    save_st = b.save_stages(store_factory)
    pins = Pins(host=host_facts(), worker=WorkerFacts(engine="bench"))
    ns = Namespace({"engine": "bench", "model": "m"})

    # Each save goes to a fresh repository, so each is a full save (no dedup).
    t_save = float("inf")
    for _ in range(3):
        repo = repo_factory()
        t = time.perf_counter()
        mid = repo.save(blocks, worker_id="bench", namespace=ns, pins=pins, options=opts).id
        t_save = min(t_save, time.perf_counter() - t)
    load_st = b.load_stages(repo, mid)
    t_load = timed(lambda: sum(1 for _ in repo.load(mid)))
    save_rate, load_rate = b.rate(t_save), b.rate(t_load)
    slow_save = min(save_st, key=lambda k: save_st[k])
    slow_load = min(load_st, key=lambda k: load_st[k])
    return {
        "case": label,
        "raw_mib": b.raw / MiB,
        "compression_ratio": round(b.ratio, 4),
        "save_stages_mbps": {k: round(v, 1) for k, v in save_st.items()},
        "save_pipeline_mbps": round(save_rate, 1),
        "save_slowest_stage": slow_save,
        "save_ratio": round(save_rate / save_st[slow_save], 3),
        "load_stages_mbps": {k: round(v, 1) for k, v in load_st.items()},
        "load_pipeline_mbps": round(load_rate, 1),
        "load_slowest_stage": slow_load,
        "load_ratio": round(load_rate / load_st[slow_load], 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="raw KV bytes per run (MiB)")
    ap.add_argument("--block-kib", type=int, default=256, help="bytes per block (KiB)")
    ap.add_argument("--no-s3", action="store_true", help="skip SeaweedFS")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    blocks = make_blocks(args.mib * MiB, args.block_kib * 1024)
    opts = SaveOptions()
    keyring = Keyring(os.urandom(32))
    tmp = Path(tempfile.mkdtemp(prefix="gpuckpt-bench-"))
    results = []
    server = None
    try:
        from ckpt.store.local import LocalStore

        def local_store() -> Store:
            d = tmp / f"s{time.monotonic_ns()}"
            return LocalStore(d)

        def local_repo(key: Keyring | None) -> Callable[[], Repository]:
            def f() -> Repository:
                r = Repository.open(str(tmp / f"r{time.monotonic_ns()}"), key=key, create=True)
                return r

            return f

        for key, label in ((None, "local"), (keyring, "local+aes")):
            results.append(run_case(label, local_store, local_repo(key), blocks, opts, key))
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(exist_ok=True)

        if not args.no_s3:
            from ckpt.store.s3 import S3Store
            from tests.harness.seaweed import SeaweedServer

            server = srv = SeaweedServer(tmp / "seaweed")
            srv.start()
            os.environ.update(
                AWS_ACCESS_KEY_ID=server.access_key, AWS_SECRET_ACCESS_KEY=server.secret_key, AWS_REGION="us-east-1"
            )
            n = [0]

            def bucket() -> str:
                n[0] += 1
                return srv.make_bucket(f"bench{n[0]}")

            def s3_store() -> Store:
                return S3Store(bucket(), "p", endpoint_url=srv.endpoint)

            def s3_repo(key: Keyring | None) -> Callable[[], Repository]:
                def f() -> Repository:
                    r = Repository.open(f"s3://{bucket()}/repo?endpoint={srv.endpoint}", key=key, create=True)
                    return r

                return f

            for key, label in ((None, "seaweedfs"), (keyring, "seaweedfs+aes")):
                results.append(run_case(label, s3_store, s3_repo(key), blocks, opts, key))
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"\ngpuckpt pipeline benchmark: {args.mib} MiB of bf16 KV in {args.block_kib} KiB blocks, "
        f"{opts.workers} encoder threads, {opts.upload_workers} uploads, pack {opts.pack_size // MiB} MiB, "
        f"{os.cpu_count()} cores"
    )
    print(f"compression ratio (byteplane + zstd-1): {results[0]['compression_ratio']:.3f}x\n")
    for r in results:
        print(f"[{r['case']}]")
        st = ", ".join(f"{k} {v:.0f}" for k, v in r["save_stages_mbps"].items())
        print(f"  save stages (raw MB/s): {st}")
        print(
            f"  save pipeline {r['save_pipeline_mbps']:.0f} MB/s = "
            f"{r['save_ratio']:.2f} x slowest stage ({r['save_slowest_stage']})"
        )
        st = ", ".join(f"{k} {v:.0f}" for k, v in r["load_stages_mbps"].items())
        print(f"  load stages (raw MB/s): {st}")
        print(
            f"  load pipeline {r['load_pipeline_mbps']:.0f} MB/s = "
            f"{r['load_ratio']:.2f} x slowest stage ({r['load_slowest_stage']})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
