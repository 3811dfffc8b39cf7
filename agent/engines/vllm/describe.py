"""The worker's description from vLLM's configuration: pins, page format, namespace.

Runs in the scheduler half (EngineCore) when the agent first asks
(``describe``); the facts only the ranks know arrive as their reports
(:class:`.meta.GpuckptWorkerMeta`). No state: functions of vLLM's config
objects, unit-tested against vLLM's real spec classes
(``tests/test_vllm_describe.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import vllm
from vllm.platforms import current_platform
from vllm.v1.core.kv_cache_utils import get_none_hash_seed
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from agent.engines.vllm import internals
from agent.engines.vllm.groups import LEGACY_SIGNATURE, not_carried, page_heads, signature, worker_groups
from agent.engines.vllm.ledger import grammar_settings, speculative_method
from ckpt import ABSENT, fingerprint
from ckpt.pins import GPU_FACTS

__all__ = ["attention_backend_name", "describe", "kv_scales", "kv_scales_digest", "page_format"]


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
    pin of its own. A packed content (``state_content_bytes``: DeepSeek's
    ``fp8_ds_mla``, 656 bytes a token with its scales inside) adds its bytes,
    ``latent576@656B``: its element count no longer says its size
    (docs/design/vllm-gpu-kv-formats.md).
    """
    if backend is None or kv_cache_layout is None:
        return None
    hk = int(getattr(spec, "head_size", 0))
    hv = getattr(spec, "head_size_v", None)
    mla = type(spec).__name__.startswith("MLA") or "MLA" in backend
    content = f"latent{hk}" if mla else f"k{hk}+v{hv if hv is not None else hk}"
    packed = getattr(spec, "state_content_bytes", None)
    if packed:
        content += f"@{int(packed)}B"
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
    groups = worker_groups(vllm_config, kv_cache_config)
    # the first carried group's spec describes a page (every carried group's reads the same, see
    # .groups); a physical page holds as many layer slots as the largest group has layers
    group = next((g for g, d in zip(kv_cache_config.kv_cache_groups, groups, strict=True) if d.layout), None)
    group = group or kv_cache_config.kv_cache_groups[0]
    spec = _layer_spec(group.kv_cache_spec)
    slots = max(d.layers for d in groups)
    sig = signature(groups)
    model_dtype = str(mc.dtype).removeprefix("torch.")
    # the layers' own KV dtype where the spec names it: an MLA worker's layers may serve "fp8" (or
    # "auto") as fp8_ds_mla and say so only in their spec, not in this process's cache_config
    cache_dtype = str(getattr(spec, "cache_dtype_str", None) or cc.cache_dtype)
    kv_dtype = model_dtype if cache_dtype == "auto" else cache_dtype
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
    # (an attention-free model, pure Mamba, reports 0 KV heads: the pin takes 1, its pages hold none)
    total_heads = 1 if getattr(mc, "use_mla", False) else max(1, int(mc.get_total_num_kv_heads()))
    head_slots = page_heads(kv_cache_config, tp, total_heads)
    model_digest = tokenizer_digest = None
    if os.path.isdir(mc.model):
        model_digest = fingerprint.model_digest(mc.model)
        tok = mc.tokenizer if mc.tokenizer and os.path.isdir(mc.tokenizer) else mc.model
        tokenizer_digest = fingerprint.tokenizer_digest(tok)
    model_runner = internals.model_runner(vllm_config)
    scales = kv_scales_digest(reports, tp, kv_dtype)
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
    # (agent.session.worker.host_pins fills the agent's unknowns from it), and the torch that writes
    # the KV cache (the agent's own is only its image's)
    host = fingerprint.host_facts(use_cuda=False).model_dump(include={*GPU_FACTS, "torch_version"})
    layout_doc = {
        "host": host,
        "device": device,
        "isa": isa,
        "attention_backend": backend,
        "kv_cache_layout": str(layout_name) if layout_name else None,
        "block_size": cc.block_size,
        "kernel_block_size": kernel_block,
        "num_kv_heads": total_heads,
        # a stored page's head slots where they are not the model's heads: one per rank
        **({"page_heads": head_slots} if head_slots != total_heads else {}),
        "head_size": spec.head_size,
        "dtype": kv_dtype,
        "layers": sorted(group.layer_names),
        "kv_groups": [g.to_json() for g in groups],
        "kv_not_carried": not_carried(groups),
        "kv_scales": scales,
        "tensor_parallel_size": tp,
        "model_runner": model_runner,
        "async_scheduling": bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)),
        # what a restore onto this worker cannot keep exact (ledger.judged_on); not a pin: the KV is
        # the same with or without it
        "speculative": speculative_method(vllm_config),
        # what shapes the grammars it compiles: a structured request continues only under its own
        "structured_outputs": grammar_settings(vllm_config),
        "ranks": reports,
        "page": (
            "one block id across all layer slots (a slot: one layer of each KV cache group), "
            "layer-major, each layer's page whole with all KV heads (or one slot per rank: page_heads)"
        ),
    }
    ns = {
        "engine": "vllm",
        "model": model_digest or f"path:{mc.model}",
        "layout": layout or "unknown",
        "kv": f"{kv_dtype}/bs{cc.block_size}/h{total_heads}x{spec.head_size}/l{slots}"
        + ("" if sig == LEGACY_SIGNATURE else f"/{sig}")
        # pages of one slot per rank are another format than pages of the model's heads under
        # the same pins (an MLA + state hybrid's were carried as rank 0's alone before): their
        # blocks must never share a blob
        + (f"/slots{head_slots}" if head_slots != total_heads else ""),
        "hash": f"{facts['prefix_hash_algo']}/{facts['prefix_hash_seed']}",
    }
    if scales is not None:
        # a namespace field, not a pin: blocks are keyed by their tokens and a blob already stored
        # is not written again, so pages of differently scaled workers must never share a key
        ns["kv_scales"] = scales
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


def _layer_spec(spec: Any) -> Any:
    """One layer's spec of a group: a ``UniformTypeKVCacheSpecs`` group (layers of different page
    sizes, e.g. MLA with DeepSeek V3.2's indexer) holds one per layer; the first describes it."""
    per_layer = getattr(spec, "kv_cache_specs", None)
    return next(iter(per_layer.values())) if per_layer else spec


def _quantized(kv_cache_dtype: str) -> bool:
    try:
        return kv_cache_dtype != "auto" and bool(is_quantized_kv_cache(kv_cache_dtype))
    except (KeyError, ValueError):  # a dtype this vLLM does not know: say quantized, pin its scales
        return True


def kv_scales(vllm_config: Any) -> dict[str, list[Any]] | None:
    """This rank's KV quantization scales, ``{layer: [kv_cache_dtype, k scales, v scales]}``, or
    ``None`` when no attention layer quantizes its KV cache.

    A layer quantizing per tensor (fp8, fp8_e4m3, fp8_e5m2) keeps its scales outside the page, in
    ``_k_scale`` / ``_v_scale`` (one value, or one per local KV head under compressed-tensors'
    ``attn_head`` strategy), loaded from the model's weights, 1.0 when they have none: the page's
    bytes mean nothing without them. Per-token-head modes and ``fp8_ds_mla`` keep theirs in the
    page (their ``_k_scale`` is 1.0). Read from the layers in ``static_forward_context``, as
    :func:`attention_backend_name` is; layers without scales (an indexer's cache, SSM state) are
    left out."""
    out: dict[str, list[Any]] = {}
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    for name, layer in sorted(ctx.items()):
        dtype = getattr(layer, "kv_cache_dtype", None)
        k, v = getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)
        if not isinstance(dtype, str) or k is None or v is None:
            continue
        out[name] = [dtype, _values(k), _values(v)]
    if not any(_quantized(d) for d, _, _ in out.values()):
        return None
    return out


def _values(t: Any) -> list[float]:
    flat = t.detach().flatten().tolist() if hasattr(t, "detach") else [t]
    return [float(x) for x in flat]


def kv_scales_digest(reports: list[dict[str, Any]], tp: int, kv_dtype: str) -> str | None:
    """The worker's KV scales as one namespace value, the same at every TP size (except where pages
    hold one slot per rank, ``page_heads``: there ``kv_heads`` are slots, and the value is that TP
    size's, pinned to it anyway); ``None`` for the
    default (no rank quantizes, or every layer has the worker's KV dtype and scales of 1.0: what
    every checkpoint before this fact had — their namespace is unchanged); ``"unknown"`` until
    every rank has reported.

    Per-head scales are placed by the heads each rank holds (``kv_heads``) and a layer whose
    heads share one value keeps one: a TP=2 worker's pages restore into a TP=1 worker with the
    same scales, as pages do."""
    got = [r for r in reports if r.get("kv_scales")]
    if not got:
        return None
    if len(got) != tp:
        return "unknown"
    layers: dict[str, list[Any]] = {}
    for r in sorted(got, key=lambda r: int(r.get("rank", 0))):
        start, count = (r.get("kv_heads") or [0, 1])[:2]
        for name, (dtype, k, v) in r["kv_scales"].items():
            entry = layers.setdefault(name, [dtype, {}, {}])
            for vals, into in ((k, entry[1]), (v, entry[2])):
                for h in range(int(count)):
                    into[int(start) + h] = vals[h] if len(vals) > 1 and h < len(vals) else vals[0]
    canon = {}
    for name, (dtype, k, v) in sorted(layers.items()):
        ks, vs = ([d[h] for h in sorted(d)] for d in (k, v))
        canon[name] = [dtype, ks if len(set(ks)) > 1 else ks[:1], vs if len(set(vs)) > 1 else vs[:1]]
    if all(d == kv_dtype and k == [1.0] and v == [1.0] for d, k, v in canon.values()):
        return None
    blob = json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:16]
