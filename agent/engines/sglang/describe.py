"""The SGLang server's description: pins, page format, namespace (no state)."""

from __future__ import annotations

import os
from typing import Any

import sglang
import torch

from agent.engines.shards import Heads, local_heads
from ckpt import ABSENT, fingerprint
from ckpt.pins import GPU_FACTS

__all__ = ["HASH_SCHEME", "describe"]

#: The page-hash scheme of SGLang's storage keys (recorded in the namespace and the pins).
HASH_SCHEME = "sglang-storage-sha256/sglang-cache-namespace-v1"


def describe(
    server_args: Any,
    k: list[torch.Tensor],
    page_size: int,
    tp: int,
    pp: int,
    heads_of_rank: Heads | None = None,
    not_carried: str | None = None,
) -> dict[str, Any]:
    """The server's pins, layout and namespace fields (see :class:`agent.engines.base.WorkerDescription`).

    Described by rank 0 for every rank: ``num_kv_heads`` is the model's total (a stored page holds
    every head, whatever TP size took it: :mod:`agent.engines.shards`), so the namespace and the
    pins are the same at every TP size; ``tensor_parallel_size`` is recorded, not compared.
    ``not_carried``: why the linker refuses this server's KV (a restore into it replays cold,
    naming it)."""
    model = str(getattr(server_args, "model_path", "") or "")
    tok = str(getattr(server_args, "tokenizer_path", None) or model)
    model_digest = fingerprint.model_digest(model) if os.path.isdir(model) else None
    tokenizer_digest = fingerprint.tokenizer_digest(tok) if os.path.isdir(tok) else None
    backend = getattr(server_args, "attention_backend", None)
    device = str(k[0].device.type) if k else str(getattr(server_args, "device", None))
    heads = (heads_of_rank.total if heads_of_rank is not None else int(k[0].shape[1])) if k else None
    head_dim = int(k[0].shape[2]) if k else None
    dtype = str(k[0].dtype).removeprefix("torch.") if k else None
    layout = f"sglang:{device}:{backend}:mha:[slot,kv_heads,head_dim]:k{head_dim}+v{head_dim}" if k else None
    revision = getattr(server_args, "revision", None)
    facts = {
        "engine": "sglang",
        "engine_version": str(sglang.__version__),
        "attention_backend": backend,
        "kv_layout": layout,
        "block_size": page_size,
        "kv_dtype": dtype,
        "num_kv_heads": heads,
        "head_size": head_dim,
        # the scheduler loop: with overlap scheduling a step boundary sees outputs one step behind
        "model_runner": "overlap" if not getattr(server_args, "disable_overlap_schedule", False) else "normal",
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "rank": 0,
        "model": model,
        "model_revision": revision if revision or not os.path.isdir(model) else ABSENT,
        "model_digest": model_digest,
        "tokenizer_digest": tokenizer_digest,
        "prefix_hash_algo": HASH_SCHEME.split("/")[0],
        "prefix_hash_seed": HASH_SCHEME.split("/")[1],
    }
    # the accelerator as this process sees it: on Kubernetes only the worker's container has the GPU
    # (agent.session.worker.host_pins fills the agent's unknowns from it), and the torch that writes
    # the KV cache (the agent's own is only its image's)
    host = fingerprint.host_facts(use_cuda=False).model_dump(include={*GPU_FACTS, "torch_version"})
    layout_doc = {
        "host": host,
        "device": device,
        "attention_backend": backend,
        "page_size": page_size,
        "block_size": page_size,
        "num_kv_heads": heads,
        "head_size": head_dim,
        "dtype": dtype,
        "layers": len(k),
        "tensor_parallel_size": tp,
        "page": "one page across all layers, layer-major: [layers, 2 (K, V), page_size, kv_heads, head_dim]",
    }
    if heads_of_rank is not None and heads is not None and not not_carried:
        # which rank holds which heads (SGLang's rule, the one agent.engines.shards states)
        layout_doc["ranks"] = [
            {"rank": r, "kv_heads": [local_heads(r, tp, heads, heads_of_rank.count).start, heads_of_rank.count]}
            for r in range(tp)
        ]
    if not_carried:
        layout_doc["kv_not_carried"] = not_carried
    ns = {
        "engine": "sglang",
        "model": model_digest or f"path:{model}",
        "layout": layout or "unknown",
        "kv": f"{dtype}/ps{page_size}/h{heads}x{head_dim}/l{len(k)}",
        "hash": HASH_SCHEME,
    }
    return {"facts": facts, "layout": layout_doc, "namespace": ns}
