"""The facts a checkpoint pins: the host it was taken on and the worker that held the KV.

A checkpoint records a :class:`Pins` in its manifest; the restore planner
(:mod:`ckpt.compat`) compares it with the pins of the host and worker about to
load it. Host facts are probed by :func:`ckpt.fingerprint.host_facts`; worker
facts are supplied by the engine adapter, which is the only party that knows
the engine's launch flags.

Every fact follows one three-way convention, so that "we could not tell" is
never confused with "there is none":

``None``
    UNKNOWN: the fact could not be determined (a probe failed, the adapter
    did not say). The compatibility rules give UNKNOWN for it, and the strict
    policy refuses a warm restore on UNKNOWN.
:data:`ABSENT` (the string ``"absent"``)
    Known not to exist: no GPU on this host, no CUDA driver installed. Two
    ABSENT values match each other; ABSENT against a value is a mismatch.
any other value
    The fact itself, compared by the rule named like the field.

The models are frozen, strict and forbid extra keys: a manifest written by a
newer gpuckpt with facts this reader does not know is rejected by the
manifest's own version check rather than silently ignored here.
``Pins.model_validate(pins.model_dump(mode="json")) == pins`` holds exactly.
"""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ABSENT", "GPU_FACTS", "FactValue", "HostFacts", "Pins", "WorkerFacts"]

ABSENT: Final = "absent"
"""The value of a fact that is known not to exist (as opposed to ``None``, unknown)."""

FactValue = str | int | None
"""The type of every fact value: a string, a count, or ``None`` for unknown."""

_NonNegative = Annotated[int, Field(ge=0)]
_Positive = Annotated[int, Field(ge=1)]

_MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True, strict=True)


class HostFacts(BaseModel):
    """Facts about the host, probed by :func:`ckpt.fingerprint.host_facts`.

    On a host with several GPUs, ``gpu_product`` and ``gpu_compute_capability``
    are the single common value when all GPUs agree, and a comma-joined sorted
    list of the distinct values when they do not (so a mixed host never
    matches a uniform one).
    """

    model_config = _MODEL_CONFIG

    gpu_product: str | None = None
    """NVML product name, e.g. ``"NVIDIA H100 80GB HBM3"``; ABSENT without a GPU."""
    gpu_compute_capability: str | None = None
    """``"major.minor"``, e.g. ``"9.0"``; ABSENT without a GPU."""
    gpu_count: _NonNegative | None = None
    """GPUs NVML sees on the host (not narrowed by ``CUDA_VISIBLE_DEVICES``); 0 without one."""
    driver_version: str | None = None
    """NVIDIA kernel driver version, e.g. ``"550.54.15"``; ABSENT without one."""
    cuda_driver_version: str | None = None
    """CUDA version the driver supports (``cuDriverGetVersion``), e.g. ``"12.4"``."""
    cuda_runtime_version: str | None = None
    """CUDA runtime of the engine's torch build, e.g. ``"12.4"``; ABSENT for a CPU build."""
    cpu_isa: str | None = None
    """Instruction-set level, see :func:`ckpt.fingerprint.cpu_isa_from_flags`."""
    cpu_arch: str | None = None
    """``platform.machine()``, e.g. ``"x86_64"``, ``"aarch64"``."""
    torch_version: str | None = None
    """``torch.__version__``, e.g. ``"2.4.0+cu124"``."""


class WorkerFacts(BaseModel):
    """Facts about the serving worker, supplied by the engine adapter.

    All default to ``None`` (unknown): an adapter that cannot tell a fact
    leaves it out, and the strict policy then refuses a warm restore rather
    than guessing.
    """

    model_config = _MODEL_CONFIG

    engine: str | None = None
    """Engine name, e.g. ``"vllm"``."""
    engine_version: str | None = None
    attention_backend: str | None = None
    """e.g. ``"FLASH_ATTN"``, ``"FLASHINFER"``."""
    kv_layout: str | None = None
    """The shape of one layer's KV tensor, e.g. ``"[num_blocks,kv_heads,block_size,hk+hv]"``."""
    block_size: _Positive | None = None
    """Tokens per KV block."""
    kv_dtype: str | None = None
    """e.g. ``"bfloat16"``, ``"fp8_e4m3"``."""
    num_kv_heads: _Positive | None = None
    """The model's KV heads in all (not one rank's share; MLA: 1)."""
    head_size: _Positive | None = None
    """Elements of one head's key per token."""
    model_runner: str | None = None
    """The engine's model runner, when it changes what request state means (vLLM: ``"v1"`` keeps a
    ``torch.Generator`` per seeded request, ``"v2"`` samples statelessly)."""
    tensor_parallel_size: _Positive | None = None
    """Recorded, not compared: stored pages hold every KV head and restore into any TP size."""
    pipeline_parallel_size: _Positive | None = None
    rank: _NonNegative | None = None
    """The rank that answered for the worker (recorded, not compared; each rank's part is in the layout)."""
    model: str | None = None
    """The path or name the engine was given. Advisory: ``model_digest`` proves identity."""
    model_revision: str | None = None
    model_digest: str | None = None
    """``"sha256:<hex>"`` from :func:`ckpt.fingerprint.model_digest`."""
    tokenizer_digest: str | None = None
    """``"sha256:<hex>"`` from :func:`ckpt.fingerprint.tokenizer_digest`, or ABSENT."""
    prefix_hash_algo: str | None = None
    """The engine's prefix-cache hash, e.g. ``"sha256"``, ``"sha256_cbor"``."""
    prefix_hash_seed: str | None = None
    """The seed of the prefix hash chain (vLLM: ``PYTHONHASHSEED`` / ``NONE_HASH``)."""
    kv_groups: str | None = None
    """The KV cache groups, group by group: ``full`` for one full-attention group (also what
    ``None`` means: every checkpoint before hybrid groups, and engines that do not report them),
    else e.g. ``g0=sliding_window:64/2;g1=full/2`` (kind, window, layers)."""


#: the host facts about its accelerator a worker may tell for the host it runs on (on Kubernetes
#: only the worker's container sees the GPU; see agent.session.worker.host_pins)
GPU_FACTS: tuple[str, ...] = (
    "gpu_product",
    "gpu_compute_capability",
    "gpu_count",
    "driver_version",
    "cuda_driver_version",
    "cuda_runtime_version",
)


class Pins(BaseModel):
    """Everything a checkpoint is pinned to: the host and the worker."""

    model_config = _MODEL_CONFIG

    host: HostFacts
    worker: WorkerFacts
