"""`make demo`: the checkpoint repository end to end, on the embedded defaults.

Two simulated workers share a system prompt. Each checkpoints its KV pages
twice (the second time after more decoding) to a local repository and to a
real S3 server (SeaweedFS on loopback); the demo then restores every
checkpoint, checks each page bit for bit, runs the compatibility rules
against this host, and shows what a corrupted pack does. The vLLM worker demo
replaces the simulated workers once the connector lands.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt import (
    Block,
    IntegrityError,
    Keyring,
    Namespace,
    Pins,
    Repository,
    WorkerFacts,
    decide,
    host_facts,
)

console = Console()
PAGE = (2, 8, 32, 128)  # K/V, kv heads, tokens per block, head size: 128 KiB of bf16
SPREAD = torch.linspace(0.05, 3.0, PAGE[-1])


WORKER = WorkerFacts(
    engine="demo",
    engine_version="0",
    attention_backend="none",
    kv_layout="[2,heads,tokens,head]",
    block_size=32,
    kv_dtype="bfloat16",
    tensor_parallel_size=1,
    pipeline_parallel_size=1,
    rank=0,
    model="tiny-random",
    model_revision="0",
    model_digest="sha256:" + "0" * 64,
    tokenizer_digest="absent",
    prefix_hash_algo="sha256",
    prefix_hash_seed="0",
)


def page(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(PAGE, generator=g) * SPREAD).to(torch.bfloat16)


def worker_blocks(worker: int, n_private: int, shared: int = 64) -> list[Block]:
    """A shared system prompt (same keys and pages on every worker), then private pages."""
    keys = [(b"system", i) for i in range(shared)] + [(f"w{worker}".encode(), i) for i in range(n_private)]
    return [Block.from_tensor(k + i.to_bytes(4, "little"), page(hash((k, i)) & 0xFFFFFFFF)) for k, i in keys]


def run(repo: Repository, label: str, table: Table) -> None:
    ns = Namespace({"engine": "demo", "model": "tiny-random", "layout": "2x8x32x128-bf16"})
    pins = Pins(host=host_facts(), worker=WORKER)
    saved = []
    for step, n_private in ((1, 192), (2, 224)):
        for w in (0, 1):
            blocks = worker_blocks(w, n_private)
            t = time.perf_counter()
            m = repo.save(blocks, worker_id=f"worker-{w}", namespace=ns, pins=pins)
            dt = time.perf_counter() - t
            saved.append((m, blocks))
            s = m.sizes
            table.add_row(
                label,
                f"worker-{w}",
                f"#{step}",
                str(s.blocks),
                f"{s.raw_bytes / 2**20:.1f}",
                f"{s.new_stored_bytes / 2**20:.1f}",
                f"{s.raw_bytes / max(1, s.stored_bytes):.2f}x",
                f"{dt * 1000:.0f}",
            )
    # Restore every checkpoint and compare bit for bit.
    for m, blocks in saved:
        want = {b.key: bytes(b.data) for b in blocks}
        t = time.perf_counter()
        got = {b.key: bytes(b.data) for b in repo.load(m.id)}
        assert got == want, f"{label}: restored pages differ for {m.id}"
    console.print(f"[green]{label}: all {len(saved)} checkpoints restored bit-exact[/green]")


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="gpuckpt-demo-"))
    table = Table(title="checkpoints (the second of each worker stores only what is new)")
    for col in ("repository", "worker", "ckpt", "blocks", "raw MiB", "new MiB stored", "compression", "save ms"):
        table.add_column(col, justify="right" if col not in ("repository", "worker") else "left")
    server = None
    try:
        key = Keyring(os.urandom(32))
        run(Repository.open(str(tmp / "local"), create=True), "local", table)
        run(Repository.open(str(tmp / "local-aes"), key=key, create=True), "local+aes", table)
        try:
            from tests.harness.seaweed import SeaweedServer

            server = SeaweedServer(tmp / "seaweed")
            server.start()
            os.environ.update(
                AWS_ACCESS_KEY_ID=server.access_key, AWS_SECRET_ACCESS_KEY=server.secret_key, AWS_REGION="us-east-1"
            )
            server.make_bucket("demo")
            run(Repository.open(f"s3://demo/ckpts?endpoint={server.endpoint}", key=key, create=True), "s3+aes", table)
        except FileNotFoundError as exc:
            console.print(f"[yellow]SeaweedFS not available ({exc}); S3 part skipped[/yellow]")
        console.print(table)

        repo = Repository.open(str(tmp / "local"))
        m = repo.manifest("worker-0:latest")
        current = Pins(host=host_facts(), worker=m.pins.worker)
        d = decide(m.pins, current)
        console.print(
            f"compatibility of {m.id} with this host: [bold]{'warm restore' if d.warm else 'cold start'}[/bold]"
        )
        other = Pins(host=host_facts(), worker=m.pins.worker.model_copy(update={"block_size": 16}))
        d2 = decide(m.pins, other)
        console.print("a worker launched with --block-size 16 instead: " + "; ".join(d2.reasons))

        # Corrupt one byte of a pack: the load refuses it and names the pack.
        pack = next(p for p in (tmp / "local" / "packs").rglob("*") if p.is_file())
        raw = bytearray(pack.read_bytes())
        raw[100] ^= 0xFF
        pack.write_bytes(raw)
        bad = 0
        for ref in ("worker-0:latest", "worker-1:latest"):
            try:
                for _ in repo.load(ref):
                    pass
            except IntegrityError as exc:
                bad += 1
                console.print(f"corrupted pack detected: [red]{exc}[/red]")
        report = repo.verify()
        console.print(f"verify: {len(report.problems)} problem(s) found in {report.checked_blobs} blobs")
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
