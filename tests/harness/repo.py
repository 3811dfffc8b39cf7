"""Builders for repository-level tests (blocks, pins, namespaces, repositories) and raw looks
at and damage to what a repository stored.

Kept small and dependency-free beyond ckpt and torch so any test file can
``from tests.harness.repo import ...``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from ckpt import Block, HostFacts, Keyring, LoadedBlock, Namespace, Pins, Repository, WorkerFacts
from ckpt.index import decode_index
from ckpt.pack import pack_name
from ckpt.store.base import Store

#: The namespace most tests save into.
NS = Namespace({"engine": "test", "model": "sha256:" + "ab" * 32, "layout": "nhd-16"})

#: A namespace and pins of no engine (every fact unknown): gc's and retention's tests.
BARE_NS = Namespace({"model": "gc-test"})
BARE_PINS = Pins(host=HostFacts(), worker=WorkerFacts())

#: A worker's facts as a document (every field set): a model ``tiny`` on an ``engine`` ``test``.
WORKER_FACTS = {
    "engine": "test",
    "engine_version": "1.0",
    "attention_backend": "FLASH_ATTN",
    "kv_layout": "[2,num_blocks,16,4,8]",
    "block_size": 16,
    "kv_dtype": "float16",
    "num_kv_heads": 4,
    "head_size": 8,
    "model_runner": "v1",
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "rank": 0,
    "model": "tiny",
    "model_revision": "r1",
    "model_digest": "sha256:" + "ab" * 32,
    "tokenizer_digest": "absent",
    "prefix_hash_algo": "sha256",
    "prefix_hash_seed": "0",
}

#: The dtypes a KV cache comes in that the tests cover.
KV_DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float32")

#: float8_e4m3fn's largest finite value: casting anything larger gives NaN.
FP8_MAX = 448.0


def key(i: int) -> bytes:
    """A content key for block ``i`` (the shape of a prefix-hash value)."""
    return b"k" + i.to_bytes(8, "big")


def make_tensor(dtype: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """KV-like data: Gaussian with a per-channel spread (the last dim), cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float32)
    if shape and shape[-1] > 0:
        t = t * torch.linspace(0.05, 3.0, shape[-1])
    if dtype.startswith("float8"):
        t = t.clamp(-FP8_MAX, FP8_MAX)
    return t.to(getattr(torch, dtype)).contiguous()


def make_block(key_int: int, dtype: str, shape: tuple[int, ...], seed: int) -> Block:
    """A block of :func:`make_tensor` data under content key :func:`key` ``(key_int)``."""
    return Block.from_tensor(key(key_int), make_tensor(dtype, shape, seed))


def block_bytes(b: Block | LoadedBlock) -> bytes:
    return bytes(memoryview(b.data).cast("B"))


def block_tensor(b: Block) -> torch.Tensor:
    """The tensor a saved block holds (a copy, from its bytes)."""
    dt = getattr(torch, b.dtype)
    raw = bytearray(block_bytes(b))
    if not raw:
        return torch.empty(b.shape, dtype=dt)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dt).reshape(b.shape)


def sample_pins() -> Pins:
    return Pins(
        host=HostFacts(
            gpu_product="absent",
            gpu_compute_capability="absent",
            gpu_count=0,
            driver_version="absent",
            cuda_driver_version="absent",
            cuda_runtime_version="absent",
            cpu_isa="x86-64-v3",
            cpu_arch="x86_64",
            torch_version=torch.__version__,
        ),
        worker=WorkerFacts(
            engine="test",
            engine_version="0",
            kv_layout="[blocks,heads,16,64]",
            block_size=16,
            kv_dtype="bfloat16",
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            rank=0,
            model_digest="sha256:" + "ab" * 32,
            prefix_hash_algo="sha256",
        ),
    )


def repo_factory(
    target: str | Store, key: Keyring | None = None, *, create: bool = True, pack_size: int = 32 << 20
) -> Repository:
    """Open (creating by default) a repository over a URL, path or store, with or without a key."""
    return Repository.open(target, key=key, create=create, pack_size=pack_size)


def store_sizes(store: Store) -> dict[str, int]:
    """Every object in the store and its size (to measure what an operation added)."""
    return {o.name: o.size for o in store.list("")}


def added_bytes(before: dict[str, int], after: dict[str, int]) -> int:
    """Bytes of objects new or changed between two :func:`store_sizes` snapshots."""
    return sum(size for name, size in after.items() if before.get(name) != size)


def by_key(blocks: Iterable[Block | LoadedBlock]) -> dict[bytes, Block | LoadedBlock]:
    return {b.key: b for b in blocks}


def pack_ids(store: Store) -> set[str]:
    """The ids of the packs the store holds (read straight from the store)."""
    return {o.name.rsplit("/", 1)[-1] for o in store.list("packs/")}


def indexed_packs(store: Store) -> set[str]:
    """Every pack any index document names (read straight from the store)."""
    out = set()
    for o in store.list("index/"):
        out |= {p.id for p in decode_index(o.name, store.get(o.name), None)}
    return out


def corrupt_blocks(path: Path, ref: str, every: int) -> int:
    """Flip one byte in the middle of every ``every``-th stored block of checkpoint ``ref`` in the
    local repository at ``path``; returns the blocks hit."""
    m = Repository.open(str(path)).manifest(ref)
    blobs = {b.blob: b for i, b in enumerate(m.blocks) if i % every == 1}  # a shared blob is flipped once
    for b in blobs.values():
        with open(path / pack_name(b.pack), "r+b") as f:
            f.seek(b.offset + b.length // 2)
            byte = f.read(1)
            f.seek(b.offset + b.length // 2)
            f.write(bytes([byte[0] ^ 0x40]))
    return sum(b.blob in blobs for b in m.blocks)  # blocks that now fail verification
