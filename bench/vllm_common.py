"""Shared by the vLLM demo and benchmark: generated models and worker settings.

No model is downloadable here, so the scripts generate random-weight Llamas
with ``transformers`` (cached under the given directory by configuration).
Random weights produce meaningless text, but the KV cache, the scheduler and
the token-for-token comparisons are real.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

# vLLM's CPU build: 1 GiB of KV space is plenty for these models; thread binding
# off (the host is shared); a fixed hash seed so block hashes are reproducible.
WORKER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
    "VLLM_CPU_OMP_THREADS_BIND": "0",
    "PYTHONHASHSEED": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


def worker_args(*, max_model_len: int, dtype: str = "float32", block_size: int = 32) -> list[str]:
    return [
        "--skip-tokenizer-init",
        "--enforce-eager",  # no torch.compile: an engine starts in ~30 s instead of minutes
        "--dtype",
        dtype,
        "--block-size",
        str(block_size),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        "16",
        "--max-num-batched-tokens",
        str(max(max_model_len, 2048)),
        "--seed",
        "0",
    ]


def make_model(root: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, dtype: str) -> Path:
    """A random-weight Llama saved with ``transformers``; reused when already there."""
    spec: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 8192,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    path = root / f"llama-{layers}L-{hidden}h-{digest}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tmp = path.with_name(path.name + ".tmp")
    model = LlamaForCausalLM(LlamaConfig(**spec)).to(getattr(torch, dtype))
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path)
    return path


def make_sliding_model(
    root: Path, *, window: int = 64, layers: int = 4, hidden: int = 256, heads: int = 4, vocab: int = 512
) -> Path:
    """A random-weight Gemma-3-style model (sliding and global layers alternating, ``layers``
    layers, ``window``-token window) saved with ``transformers``; reused when already there."""
    size = "" if (hidden, heads, vocab) == (256, 4, 512) else f"-{heads}a-{vocab}v"
    path = root / f"gemma3-{layers}L-{hidden}h{size}-sw{window}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    tmp = path.with_name(path.name + ".tmp")
    Gemma3ForCausalLM(cfg).save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path)
    return path


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    return layers * 2 * kv_heads * head_dim * (4 if dtype == "float32" else 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
