"""vLLM's KV cache groups as gpuckpt carries them (the hybrid KV cache manager, ``SupportsHMA``).

With the hybrid allocator on, vLLM splits the model's attention layers into
*groups* by kind — full attention, sliding window, chunked local attention,
state-space / linear-attention state — each with its own block table drawn
from one shared block pool. Layer ``i`` of every group aliases the same
physical slot (``KVCacheTensor.layers``): a block id belongs to one group at a
time, so *block ``b`` across the physical slots* is exactly that group's page.
The worker half therefore pages by physical slot and needs no group
knowledge; the scheduler half names each page by ``(group, block hash)``
(:func:`group_key`) and asks for each group only the blocks vLLM itself keeps
for it:

- **full attention** (and MLA): every block of the prefix;
- **sliding window / chunked local attention**: only the blocks the request
  still attends to — the manager's own ``get_num_skipped_tokens`` says which
  are skipped, and vLLM allocates null blocks for those, so a restored request
  holds exactly what the uninterrupted engine would have kept;
- **state-space / linear-attention state** (``MambaSpec``: Mamba, Gated
  DeltaNet), in vLLM's prefix-caching mode ``mamba_cache_mode='align'``: one
  *state block* per hit, the recurrent state after exactly the tokens the hit
  ends at. vLLM's map names the state at a block boundary by that block's
  hash; a live request's running state block (its last) is the state after
  exactly its computed tokens, carried as a partial tail. So a hit on such a
  group ends at a block boundary whose state is offered, or at the exact end
  of an offered tail (:func:`plan_hit`), and vLLM's manager, whose skip rule
  is "all but the last token", allocates that one block.

At tensor parallel size ``tp > 1`` a state block on each rank holds that
rank's share of the model's own state heads, which do not follow the
attention heads the stored pages are split by. Pages are still joined and
split along the attention view's head axis, which gives each rank back its own
bytes exactly when it restores onto the same ``tp``: so a state group at
``tp > 1`` is recorded with its size (``mamba@tp2``), and a checkpoint with
one restores warm onto the same tensor parallel size only — elsewhere the pins
differ, by name, and the ledger replays cold. Where ``tp`` is above the
model's KV heads, ranks hold replicas of an attention head but different
state, and a stored page keyed by heads would keep one replica's bytes: such a
worker's stored page has one head slot per rank instead (:func:`page_heads`,
recorded as the layout's ``page_heads``), every rank's bytes kept — Qwen3-Next
(2 KV heads) at TP 4 or 8.

A group gpuckpt cannot carry (state in ``mamba_cache_mode='none'``, which
keeps none for a later hit; cross-attention;
a group whose block size, page size or page layout differs from the others';
layers of mixed page sizes in one group) is *named*: the worker starts with
the allocator on as always, no page is captured or loaded (a request needs
every group's KV, so a partial set is worthless), and the ledger replays cold
— the restore report and ``describe`` say which group and why.

Keys: group 0's page keeps vLLM's block hash as its key (so a one-group
worker's keys are what they always were); group ``g > 0``'s key is a digest of
the hash and ``g`` of the same length.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agent.engines.vllm import internals

#: what an engine that does not report its groups has: one full-attention group
LEGACY_SIGNATURE = "full"
#: the kind of a state-space / linear-attention group (vLLM's ``MambaSpec``) gpuckpt carries
STATE = "mamba"


@dataclass(frozen=True)
class KvGroup:
    """One KV cache group of the worker, as the manifest records it."""

    index: int
    kind: str
    """``full``, ``sliding_window``, ``chunked_local``, ``mamba`` (:data:`STATE`), or vLLM's spec
    class name for others."""
    spec: str
    """vLLM's spec class, e.g. ``SlidingWindowSpec``, ``MLAAttentionSpec``, ``MambaSpec``."""
    layers: int
    block_size: int
    window: int | None
    """Tokens a sliding window or an attention chunk spans; ``None`` for the others."""
    layout: tuple[Any, ...]
    """(KV heads, head size, V head size, dtype) of one layer's page; ``()`` where not attention."""
    why_not: str | None = None
    """Why this group is not carried; ``None`` when it is."""
    page_bytes: int = 0
    """One layer's page (vLLM's ``page_size_bytes``, padding included); 0 where not known."""
    tp: int = 1
    """The tensor parallel size a state group's pages are split for (1 for every other kind)."""

    @property
    def carried(self) -> bool:
        return self.why_not is None

    @property
    def keeps_every_block(self) -> bool:
        """Whether a request holds every block of its prefix in this group (full attention), rather
        than a window's or one state block."""
        return self.window is None and self.kind != STATE

    def label(self) -> str:
        """``sliding_window:64`` — the kind with its window, as signatures and reports name it;
        ``mamba@tp2`` — a state group at tensor parallel size 2 (its pages restore onto that
        size only)."""
        if self.window:
            return f"{self.kind}:{self.window}"
        return f"{self.kind}@tp{self.tp}" if self.tp > 1 else self.kind

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.index,
            "kind": self.kind,
            "spec": self.spec,
            "layers": self.layers,
            "block_size": self.block_size,
            "window": self.window,
            "carried": self.carried,
            **({"tp": self.tp} if self.tp > 1 else {}),
            **({"why_not": self.why_not} if self.why_not else {}),
        }


def _kind(spec: Any, tp: int, kv_heads: int | None) -> tuple[str, int | None, str | None]:
    """(kind, window, why not carried) of one group's spec (late imports: vLLM's own classes)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    name = type(spec).__name__
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        if getattr(spec, "attention_chunk_size", None):
            return "chunked_local", int(spec.attention_chunk_size), None
        return "full", None, None
    if type(spec) in (SlidingWindowSpec, SlidingWindowMLASpec):
        return "sliding_window", int(spec.sliding_window), None
    if type(spec) is ChunkedLocalAttentionSpec:
        return "chunked_local", int(spec.attention_chunk_size), None
    if type(spec) is MambaSpec:
        mode = getattr(spec, "mamba_cache_mode", "none")
        if mode != "align":
            # 'none': one state block per request, overwritten in place, never named in the prefix
            # cache — nothing a later hit could start from
            why = f"mamba_cache_mode={mode!r} keeps no state a later request can hit (prefix caching needs 'align')"
            return name, None, f"{name}: {why}"
        if int(getattr(spec, "num_speculative_blocks", 0) or 0):
            return name, None, f"{name}: state blocks of speculative decoding are not carried"
        if tp > 1 and kv_heads is None:
            # which head slots a stored page has (page_heads) depends on them
            why = f"at tensor parallel size {tp} the model's KV heads are not known"
            return name, None, f"{name}: {why}"
        return STATE, None, None
    if "Mamba" in name:
        return name, None, f"{name}: state-space / linear-attention state is not carried yet"
    if name == "UniformTypeKVCacheSpecs":
        return name, None, f"{name}: layers of different page sizes in one group (MLA with an indexer?)"
    return name, None, f"{name}: this kind of KV cache group is not carried yet"


def kv_groups(kv_cache_config: Any, block_size: int, *, tp: int = 1, kv_heads: int | None = None) -> list[KvGroup]:
    """The worker's groups (``tp``: its tensor parallel size; ``kv_heads``: the model's KV heads in
    all), each with why it is not carried (if so). When one group cannot be carried none is:
    :func:`carried` is then empty."""
    out = []
    transferable = internals.transfer_groups(kv_cache_config)
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind, window, why = _kind(spec, tp, kv_heads)
        if internals.host_resident(g):
            why = "host-resident KV (HiSparse's source pool, block ids of its own) is not carried"
        elif transferable is not None and i not in transferable:
            why = "vLLM keeps this group out of KV transfer (a replica of another group's KV)"
        layout: tuple[Any, ...] = ()
        if hasattr(spec, "head_size"):
            layout = (
                int(getattr(spec, "num_kv_heads", 0) or 0),
                int(spec.head_size),
                int(getattr(spec, "head_size_v", spec.head_size) or spec.head_size),
                str(getattr(spec, "dtype", "")).removeprefix("torch."),
            )
        bs = int(getattr(spec, "block_size", block_size) or block_size)
        if why is None and bs != block_size:
            why = f"its block size {bs} is not the worker's {block_size}"
        try:
            page = int(spec.page_size_bytes)
        except Exception:  # a spec that cannot size its page (not one vLLM builds a worker from)
            page = 0
        shards = tp if kind == STATE else 1
        out.append(KvGroup(i, kind, type(spec).__name__, len(g.layer_names), bs, window, layout, why, page, shards))
    # The worker half pages by physical slot through an attention layer's view (a state-space
    # layer shares its slot with one, vLLM pads their pages to one size): every carried attention
    # group's layer page must read the same, and every carried group's page be as long.
    layouts = {g.layout for g in out if g.carried and g.layout}
    pages = {g.page_bytes for g in out if g.carried and g.page_bytes}
    if len(layouts) > 1:
        out = [_refused(g, f"its page layout {g.layout} differs from another group's") if g.carried else g for g in out]
    elif len(pages) > 1:
        out = [
            _refused(g, f"its page ({g.page_bytes} bytes) differs from another group's") if g.carried else g
            for g in out
        ]
    elif any(g.carried and g.kind == STATE for g in out):
        # layer i of every group shares physical slot i: a slot no attention layer is in would
        # not be paged, and its state would be left out of every page
        slots = max(g.layers for g in out)
        paged = max((g.layers for g in out if g.layout), default=0)
        if paged < slots:
            why = (
                f"its layers fill {slots} physical slots and attention layers only {paged}; "
                "pages are read through an attention layer's view"
            )
            out = [_refused(g, why) if g.carried and g.kind == STATE else g for g in out]
    return out


def page_heads(kv_cache_config: Any, tp: int, kv_heads: int) -> int:
    """The head slots of a stored page: the model's ``kv_heads`` (each rank's heads at their place,
    replicas once: :mod:`agent.engines.shards`), or ``tp`` — one slot per rank — where a state
    group runs at a tensor parallel size above them: its ranks replicate attention heads but hold
    different state, which one replica's slot would lose. Every group's pages then cost ``tp /
    kv_heads`` times as much, and restore onto the same ``tp`` only (the ``kv_groups`` pin names
    it). Both halves and ``describe`` decide by this rule alone, from facts the pins compare."""
    from vllm.v1.kv_cache_interface import MambaSpec

    state = any(isinstance(g.kv_cache_spec, MambaSpec) for g in kv_cache_config.kv_cache_groups)
    return tp if state and tp > max(1, kv_heads) else kv_heads


def worker_groups(vllm_config: Any, kv_cache_config: Any) -> list[KvGroup]:
    """:func:`kv_groups` of the worker ``vllm_config`` describes (its block size, tensor parallel
    size and the model's KV heads): what the service carries and what ``describe`` pins, alike."""
    return kv_groups(
        kv_cache_config,
        int(vllm_config.cache_config.block_size),
        tp=int(vllm_config.parallel_config.tensor_parallel_size),
        kv_heads=int(vllm_config.model_config.get_total_num_kv_heads()),
    )


def _refused(g: KvGroup, why: str) -> KvGroup:
    return dataclasses.replace(g, why_not=why)


def carried(groups: list[KvGroup]) -> list[KvGroup]:
    """The groups whose pages are captured and loaded: all of them, or none when one is not."""
    return [] if any(not g.carried for g in groups) else list(groups)


def not_carried(groups: list[KvGroup]) -> str | None:
    """Why the worker's KV is not carried (naming the first group that cannot be), or ``None``."""
    for g in groups:
        if not g.carried:
            return f"KV cache group {g.index} ({g.label()}, {g.layers} layers): {g.why_not}"
    return None


def signature(groups: list[KvGroup]) -> str:
    """The groups as a pinned fact: ``full`` for one full-attention group (what every worker had
    before hybrid groups, and what an engine that does not report groups has), else
    ``g0=sliding_window:64/2;g1=full/2`` (kind, window, layers per group)."""
    if len(groups) == 1 and groups[0].kind == "full":
        return LEGACY_SIGNATURE
    return ";".join(f"g{g.index}={g.label()}/{g.layers}" for g in groups)


def group_key(base: bytes, group: int) -> bytes:
    """The page key of ``group``'s block whose vLLM hash (or gpuckpt tail key) is ``base``."""
    if group == 0:
        return base
    return hashlib.sha256(b"gpuckpt-kv-group\0" + group.to_bytes(4, "big") + base).digest()[: len(base)]


@dataclass(frozen=True)
class GroupRule:
    """How the scheduler half matches one carried group: ``skipped(end)`` is the group's manager's
    ``get_num_skipped_tokens`` (tokens before the window vLLM gives null blocks), ``None`` for a
    group that keeps every block. ``state``: the group's one block at the hit's end holds a
    recurrent state after exactly the tokens its key names (a block's: to the block's end; a
    tail's: to the tail's end), so a hit can end nowhere else (:data:`STATE`)."""

    index: int
    skipped: Callable[[int], int] | None
    state: bool = False


def plan_hit(
    *,
    n: int,
    start: int,
    bs: int,
    hashes: Sequence[bytes],
    rules: Sequence[GroupRule],
    have: Callable[[bytes], bool],
    tail: Callable[[int, int], bytes | None],
) -> tuple[int, list[bytes]]:
    """The external hit of a request of ``n`` tokens whose first ``start`` are local hits:
    ``(end, keys)`` — the tokens up to ``end`` load from offered pages, ``keys`` the base keys
    (:func:`group_key` of group 0) of the blocks from ``start // bs`` on.

    Every group must have every block vLLM will allocate for ``[start, end)``: a full-attention
    group all of them; a windowed group those from its window's start at ``end`` (its manager
    skips the rest, as vLLM's ``allocate_external_computed_blocks`` does). ``end`` leaves at least
    one token to compute. ``tail(i, length)`` is the key of a partial page of ``length`` tokens
    after ``i`` full blocks (a finished turn's tail), tried when the full blocks run out.

    With a state group (``GroupRule.state``) the hit ends exactly where a state was taken: at a
    block boundary, or at the end of the tail whose page holds it — never short of it.
    """
    s0 = start // bs
    exact_end = any(r.state for r in rules)
    nfull = min(n // bs, len(hashes))
    full = [r.index for r in rules if r.skipped is None]
    windowed = [r for r in rules if r.skipped is not None]
    run = s0
    while run < nfull and all(have(group_key(hashes[run], g)) for g in full):
        run += 1

    def fits(end: int, keys: list[bytes]) -> bool:
        for r in windowed:
            assert r.skipped is not None
            lo = max(s0, r.skipped(end) // bs)
            for p in range(lo, -(-end // bs)):
                if not have(group_key(keys[p - s0], r.index)):
                    return False
        return True

    base = [bytes(h) for h in hashes[s0:run]]
    if run * bs < n and (run > s0 or start % bs == 0):
        # (a state's tail must end before the last token: the hit leaves one to compute)
        for length in range(min(bs - 1, n - run * bs - exact_end), 0, -1):
            k = tail(run, length)
            if k is not None and all(have(group_key(k, r.index)) for r in rules):
                end = min(run * bs + length, n - 1)
                if end > start and fits(end, [*base, k]):
                    return end, [*base, k]
                break
    for cand in range(run, s0, -1):
        end = min(cand * bs, n - 1)
        if end <= start:
            break
        if exact_end and end != cand * bs:
            continue  # the state in block cand - 1 is after cand * bs tokens, not end
        if fits(end, base[: cand - s0]):
            return end, base[: cand - s0]
    return start, []
