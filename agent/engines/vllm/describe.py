"""The worker's description from vLLM's configuration: pins, page format, namespace.

Runs in the scheduler half (EngineCore) when the agent first asks
(``describe``); the facts only the ranks know arrive as their reports
(:class:`.meta.GpuckptWorkerMeta`). No state: functions of vLLM's config
objects, unit-tested against vLLM's real spec classes
(``tests/test_vllm_describe.py``).
"""

from __future__ import annotations

import os
from typing import Any

import vllm
from vllm.platforms import current_platform
from vllm.v1.core.kv_cache_utils import get_none_hash_seed

from agent.engines.vllm.groups import LEGACY_SIGNATURE, kv_groups, not_carried, signature
from ckpt import ABSENT, fingerprint
from ckpt.pins import GPU_FACTS

__all__ = ["attention_backend_name", "describe", "page_format"]


def page_format(
    *,
    device: str,
    backend: str | None,
    kv_cache_layout: str | None,
    spec: Any,
    kernel_block_size: int | None,
    isa: str | None = None,
) -> str | None:
    """The byte format of one KV head's slice of a page, TP-independent; ``None`` when not known.

    What decides how a head's bytes are read (vLLM 0.33, ``../shared`` notes
    "KV cache layout on GPU"): device, attention backend, the global
    ``KVCacheLayout`` (LBHNC / LBNHC / …), the content of one token of one
    head slot (``head_size + head_size_v``, or MLA's latent), the head slots
    per KV head (NVFP4 doubles them), the kernel block size and the KV
    quantization mode, plus the CPU backend's instruction set (its in-page
    order of K depends on it). The number of heads is not part of it: a
    stored page holds all of them (:mod:`.shards`), and ``num_kv_heads`` is a
    pin of its own.
    """
    if backend is None or kv_cache_layout is None:
        return None
    hk = int(getattr(spec, "head_size", 0))
    hv = getattr(spec, "head_size_v", None)
    mla = type(spec).__name__.startswith("MLA") or "MLA" in backend
    content = f"latent{hk}" if mla else f"k{hk}+v{hv if hv is not None else hk}"
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    heads = int(getattr(spec, "num_kv_heads", 1) or 1)
    slots = getattr(spec, "num_head_slots", None)
    per_head = int(slots) // heads if slots else 1
    parts = [device, backend, kv_cache_layout, content, f"slots{per_head}", f"kb{kernel_block_size}", f"q{quant}"]
    if isa:
        parts.append(isa)
    return ":".join(parts)


def describe(vllm_config: Any, kv_cache_config: Any, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The worker's pins, layout and namespace fields, as JSON (see :class:`agent.engines.base.WorkerDescription`).

    Facts that only the ranks know (the attention backend their layers run,
    the kernel block size, each rank's device and heads) come from
    ``reports``, one per rank, which the ranks send in their per-step
    metadata (:class:`.GpuckptWorkerMeta`); without every rank's the backend
    is unknown and the strict policy refuses a warm restore.
    """

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    groups = kv_groups(kv_cache_config, cc.block_size)
    # the first carried group's spec describes a page (every carried group's reads the same, see
    # .groups); a physical page holds as many layer slots as the largest group has layers
    group = next((g for g, d in zip(kv_cache_config.kv_cache_groups, groups, strict=True) if d.layout), None)
    group = group or kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    slots = max(d.layers for d in groups)
    sig = signature(groups)
    model_dtype = str(mc.dtype).removeprefix("torch.")
    kv_dtype = model_dtype if cc.cache_dtype == "auto" else str(cc.cache_dtype)
    device = "cpu" if current_platform.is_cpu() else str(current_platform.device_type)
    tp = int(pc.tensor_parallel_size)
    backends = {r.get("backend") for r in reports}
    backend = backends.pop() if len(backends) == 1 and len(reports) == tp else None
    kernel_blocks = {r.get("kernel_block_size") for r in reports}
    kernel_block = kernel_blocks.pop() if len(kernel_blocks) == 1 else None
    isa: str | None = None
    if device == "cpu":
        # late: the CPU attention backend's module exists only in vLLM's CPU build
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(mc.dtype, cc.block_size, spec.head_size, cc.cache_dtype)
        backend = backend or "CPU_ATTN"
    layout_name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(cc, "kv_cache_layout", None)
    layout = page_format(
        device=device,
        backend=backend,
        kv_cache_layout=str(layout_name) if layout_name else None,
        spec=spec,
        kernel_block_size=kernel_block or cc.block_size,
        isa=isa,
    )
    total_heads = 1 if getattr(mc, "use_mla", False) else int(mc.get_total_num_kv_heads())
    model_digest = tokenizer_digest = None
    if os.path.isdir(mc.model):
        model_digest = fingerprint.model_digest(mc.model)
        tok = mc.tokenizer if mc.tokenizer and os.path.isdir(mc.tokenizer) else mc.model
        tokenizer_digest = fingerprint.tokenizer_digest(tok)
    model_runner = "v2" if getattr(vllm_config, "use_v2_model_runner", False) else "v1"
    facts = {
        "engine": "vllm",
        "engine_version": vllm.__version__,
        "attention_backend": backend,
        "kv_layout": layout,
        "block_size": cc.block_size,
        "kv_dtype": kv_dtype,
        "num_kv_heads": total_heads,
        "head_size": int(spec.head_size),
        "model_runner": model_runner,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pc.pipeline_parallel_size,
        "rank": 0,
        "model": str(mc.model),
        # A local directory has no revision: its digest is its identity.
        "model_revision": mc.revision if mc.revision or not os.path.isdir(mc.model) else ABSENT,
        "model_digest": model_digest,
        "tokenizer_digest": tokenizer_digest,
        "prefix_hash_algo": str(cc.prefix_caching_hash_algo),
        "prefix_hash_seed": get_none_hash_seed(),
        "kv_groups": sig,
    }
    # the accelerator as this process sees it: on Kubernetes only the worker's container has the GPU
    # (agent.session.worker.host_pins fills the agent's unknowns from it)
    host = fingerprint.host_facts(use_cuda=False).model_dump(include=set(GPU_FACTS))
    layout_doc = {
        "host": host,
        "device": device,
        "isa": isa,
        "attention_backend": backend,
        "kv_cache_layout": str(layout_name) if layout_name else None,
        "block_size": cc.block_size,
        "kernel_block_size": kernel_block,
        "num_kv_heads": total_heads,
        "head_size": spec.head_size,
        "dtype": kv_dtype,
        "layers": sorted(group.layer_names),
        "kv_groups": [g.to_json() for g in groups],
        "kv_not_carried": not_carried(groups),
        "tensor_parallel_size": tp,
        "model_runner": model_runner,
        "async_scheduling": bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)),
        "ranks": reports,
        "page": (
            "one block id across all layer slots (a slot: one layer of each KV cache group), "
            "layer-major, each layer's page whole with all KV heads"
        ),
    }
    ns = {
        "engine": "vllm",
        "model": model_digest or f"path:{mc.model}",
        "layout": layout or "unknown",
        "kv": f"{kv_dtype}/bs{cc.block_size}/h{total_heads}x{spec.head_size}/l{slots}"
        + ("" if sig == LEGACY_SIGNATURE else f"/{sig}"),
        "hash": f"{facts['prefix_hash_algo']}/{facts['prefix_hash_seed']}",
    }
    return {"facts": facts, "layout": layout_doc, "namespace": ns}


def attention_backend_name(vllm_config: Any) -> str | None:
    """The backend the worker's attention layers run (one name), from vLLM's forward context."""
    names = set()
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    for layer in ctx.values():
        b = getattr(layer, "attn_backend", None) or getattr(layer, "backend", None)
        if b is None:
            continue
        name = b.get_name() if hasattr(b, "get_name") else getattr(b, "name", None)
        if name:
            names.add(str(name))
    return names.pop() if len(names) == 1 else None
