"""The page formats ``describe`` names on CUDA, from vLLM's own classes (no GPU needed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from agent.engines.vllm.describe import page_format  # noqa: E402
from ckpt import Pins, WorkerFacts, decide  # noqa: E402
from tests.harness.repo import sample_pins  # noqa: E402

# vLLM's Python classes only: run against every supported vLLM release (make test)
pytestmark = pytest.mark.vllm_classes


def dense(heads: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=128, dtype=torch.bfloat16)


def mla() -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)


CASES = {
    "flash_attn": (AttentionBackendEnum.FLASH_ATTN.name, KVCacheLayout.LBNHC.name, dense(8), 16),
    "flashinfer_hnd": (AttentionBackendEnum.FLASHINFER.name, KVCacheLayout.LBHNC.name, dense(8), 16),
    "flashmla": (AttentionBackendEnum.FLASHMLA.name, KVCacheLayout.LBNHC.name, mla(), 64),
}


def fmt(backend: str, layout: str, spec: object, kb: int) -> str | None:
    return page_format(device="cuda", backend=backend, kv_cache_layout=layout, spec=spec, kernel_block_size=kb)


def test_gpu_backends_get_named_distinct_page_formats() -> None:
    formats = {name: fmt(*case) for name, case in CASES.items()}
    assert all(formats.values()), formats
    assert len(set(formats.values())) == len(formats), formats
    assert formats["flash_attn"] == "cuda:FLASH_ATTN:LBNHC:k128+v128:slots1:kb16:qNONE"
    assert formats["flashinfer_hnd"] == "cuda:FLASHINFER:LBHNC:k128+v128:slots1:kb16:qNONE"
    assert formats["flashmla"].startswith("cuda:FLASHMLA:LBNHC:latent576:")


def test_the_page_format_does_not_depend_on_the_tensor_parallel_share() -> None:
    # A TP=2 rank of an 8-KV-head model holds 4 heads: the per-head format is the same.
    assert fmt("FLASH_ATTN", "LBNHC", dense(4), 16) == fmt("FLASH_ATTN", "LBNHC", dense(8), 16)


def test_an_unknown_backend_or_layout_is_unknown() -> None:
    assert fmt(None, "LBNHC", dense(8), 16) is None  # type: ignore[arg-type]
    assert fmt("FLASH_ATTN", None, dense(8), 16) is None  # type: ignore[arg-type]


def facts(name: str, tp: int = 1) -> WorkerFacts:
    backend, layout, spec, kb = CASES[name]
    return WorkerFacts(
        engine="vllm",
        engine_version="0.33.0",
        attention_backend=backend,
        kv_layout=fmt(backend, layout, spec, kb),
        block_size=spec.block_size,
        kv_dtype="bfloat16",
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        model_runner="v2",
        tensor_parallel_size=tp,
        pipeline_parallel_size=1,
        rank=0,
        model="m",
        model_revision="r",
        model_digest="sha256:" + "a" * 64,
        tokenizer_digest="sha256:" + "b" * 64,
        prefix_hash_algo="sha256",
        prefix_hash_seed="0",
    )


def test_the_strict_policy_accepts_a_matching_gpu_worker_and_refuses_another_backend() -> None:
    h = sample_pins().host
    assert decide(Pins(host=h, worker=facts("flash_attn")), Pins(host=h, worker=facts("flash_attn", tp=2))).warm
    d = decide(Pins(host=h, worker=facts("flash_attn")), Pins(host=h, worker=facts("flashinfer_hnd")))
    assert not d.warm
    assert [r.split(":")[0] for r in d.reasons] == ["attention_backend", "kv_layout"]
    assert "FLASH_ATTN" in d.reasons[0]
    assert "FLASHINFER" in d.reasons[0]
