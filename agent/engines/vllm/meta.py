"""What crosses between the connector's two halves, once per step, in each direction.

vLLM gives a connector exactly two channels between its scheduler half (in
EngineCore) and its worker halves (one per rank): :class:`GpuckptMeta`,
built by the scheduler half for each step and bound to every rank before its
forward, and :class:`GpuckptWorkerMeta`, built by each rank after the step
and folded across the ranks (:meth:`GpuckptWorkerMeta.aggregate`) before the
scheduler half reads it. Nothing else — no file, no socket — carries state
between them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from agent.engines.vllm.capture import CopyJob

__all__ = ["IDLE", "GpuckptMeta", "GpuckptWorkerMeta", "tail_identified", "tail_key"]


def tail_key(parent: bytes, tokens: list[int] | tuple[int, ...], cache_salt: str | None, lora: str | None) -> bytes:
    """Content key of a partial block: its parent's block hash (``b""`` for the
    first block) and the tokens whose KV it holds. Salt and LoRA are included
    because vLLM puts them in the first block's hash only."""
    h = hashlib.sha256(b"gpuckpt-vllm-tail\x00")
    h.update(parent)
    h.update(b"\x00" + (cache_salt or "").encode() + b"\x00" + (lora or "").encode() + b"\x00")
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens))
    return h.digest()


def tail_identified(request: Any, start: int, end: int) -> bool:
    """Whether tokens ``[start, end)`` of a vLLM ``Request`` are what their ids say, so that a tail
    key (:func:`tail_key`: the parent's hash and the ids) names their KV. Not where a prompt
    embedding or a multimodal item (an image's placeholder tokens) stands: those ids are the
    same for every embedding or image, and vLLM's block hashes tell them apart by an extra key
    (the item's identity) that a tail key does not have. Such a partial block is neither
    captured nor offered; its tokens recompute."""
    if getattr(request, "prompt_embeds", None) is not None and start < int(request.num_prompt_tokens):
        return False
    for f in getattr(request, "mm_features", None) or ():
        pos = f.mm_position
        if int(pos.offset) < end and start < int(pos.offset) + int(pos.length):
            return False
    return True


@dataclass
class GpuckptMeta(KVConnectorMetadata):
    """Scheduler → worker, one per step.

    ``loads``: ``(block id, page file index path, key hex)`` to copy into the
    KV cache before this step's forward. ``request_loads``: ``(request id,
    loads)`` for a worker with several KV cache groups, whose hits load
    asynchronously: each request is reported received once its pages are in
    (``get_finished``), or failed (``failed_recving``) if one is not;
    ``failed_requests``: requests to report failed without a load. ``capture``: a chunk of a capture to
    copy out after the forward (:class:`.CopyJob`).
    ``tails``: ``(key hex, block id, request id)`` partial tails of finished
    requests to copy into the worker's tail store (then report the request
    finished sending); ``tail_drop``: keys (hex) to drop from it.
    ``generators``: ``(request id, base64 state)`` to set before the request's
    first sample; ``priors``: ``(request id, earlier outputs)`` for the
    sampler's view. ``fail_loads``: block ids to report as load errors.
    ``close_files``: page files of an ended offer (withdrawn, expired): close
    their mappings (the scheduler half deleted them). ``ranks_known``: every
    rank's report is in (the ranks stop sending it). ``idle``: all of that is
    empty and every rank's report is in — the step has nothing of gpuckpt's
    (the worker half returns at once).
    """

    loads: list[tuple[int, str, str]] = field(default_factory=list)
    request_loads: list[tuple[str, list[tuple[int, str, str]]]] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    capture: CopyJob | None = None
    tails: list[tuple[str, int, str]] = field(default_factory=list)
    tail_drop: list[str] = field(default_factory=list)
    generators: list[tuple[str, str]] = field(default_factory=list)
    priors: list[tuple[str, list[int]]] = field(default_factory=list)
    fail_loads: list[int] = field(default_factory=list)
    close_files: list[str] = field(default_factory=list)
    ranks_known: bool = False
    idle: bool = False

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The idle step's metadata (:data:`IDLE`) crosses to the workers as its name, not its
        # value: vLLM pickles every step's metadata into the workers' queue, and a name is a few
        # bytes to write and one lookup to read, where the value is ten fields and eight fresh
        # lists on every rank — the per-step cost of gpuckpt while nothing is checkpointed.
        if self is IDLE:
            return "IDLE"
        return super().__reduce_ex__(protocol)


#: What every step carries while gpuckpt has nothing to do (:meth:`.SchedulerHalf.build_connector_meta`):
#: one shared object that nothing mutates, unpickled on the workers as this same object.
IDLE = GpuckptMeta(ranks_known=True, idle=True)


@dataclass
class GpuckptWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler, one per step, folded across the ranks.

    ``done``: each rank's capture chunks finished this step,
    ``"<seq>.<chunk>" → {rank → {"index", "error", "copy_s", "bytes", …}}``.
    ``reports``: rank → that rank's self-description (device, attention
    backend, kernel block size, heads, page shape), sent with every step's
    metadata until the scheduler half says it has every rank's
    (``GpuckptMeta.ranks_known``): a step's metadata can be dropped (a warm-up
    run), a report must not be.
    """

    done: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge another rank's metadata (vLLM folds the ranks in rank order); nothing is dropped."""
        if not isinstance(other, GpuckptWorkerMeta):
            return self
        merged = {seq: dict(parts) for seq, parts in self.done.items()}
        for seq, parts in other.done.items():
            merged.setdefault(seq, {}).update(parts)
        return GpuckptWorkerMeta(merged, {**self.reports, **other.reports})
