"""KV cache groups (vLLM's hybrid allocator) as the connector carries them, against vLLM's real
spec classes: which groups are carried and why not, the pinned signature, page keys per group,
and the external hit every group must cover (``plan_hit``)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from agent.engines.vllm.groups import (
    GroupRule,
    carried,
    group_key,
    kv_groups,
    not_carried,
    page_heads,
    plan_hit,
    signature,
)
from ckpt import compat

# vLLM's Python classes only: run against every supported vLLM release (make test)
pytestmark = pytest.mark.vllm_classes

BS = 16


def full(**kw: object) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, **kw)  # type: ignore[arg-type]


def sliding(window: int = 64) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=window)


def config(*specs: object, layers: int = 2) -> KVCacheConfig:
    groups = [
        KVCacheGroupSpec([f"model.layers.{i * layers + j}.attn" for j in range(layers)], s)  # type: ignore[arg-type]
        for i, s in enumerate(specs)
    ]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def test_gemma3_style_groups_are_carried_and_pinned_group_by_group() -> None:
    groups = kv_groups(config(sliding(1024), full()), BS)
    assert carried(groups) == groups
    assert not_carried(groups) is None
    assert signature(groups) == "g0=sliding_window:1024/2;g1=full/2"


def test_one_full_attention_group_keeps_the_legacy_signature() -> None:
    """A dense model's checkpoints stay restorable across the change (a missing fact is "full")."""
    assert signature(kv_groups(config(full()), BS)) == "full"


def test_mla_and_chunked_local_attention_are_carried() -> None:
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    assert signature(kv_groups(config(mla), BS)) == "full"
    chunked = ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, attention_chunk_size=128
    )
    groups = kv_groups(config(chunked, full()), BS)
    assert not_carried(groups) is None
    assert signature(groups) == "g0=chunked_local:128/2;g1=full/2"


def mamba(mode: str = "align", *, padded: int | None = None) -> MambaSpec:
    """A state group's spec as vLLM builds it for prefix caching: its page padded to an attention
    layer's (``full()``: 2 heads × 64 × bf16 × K/V × 16 tokens)."""
    return MambaSpec(
        block_size=BS,
        shapes=((4, 64), (8, 16)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode=mode,
        page_size_padded=full().page_size_bytes if padded is None else padded,
    )


def test_a_state_space_group_in_align_mode_is_carried() -> None:
    """Qwen3-Next's Gated DeltaNet, Jamba's or Nemotron-H's Mamba layers beside attention, with
    prefix caching on (vLLM's ``mamba_cache_mode='align'``)."""
    groups = kv_groups(config(full(), mamba()), BS)
    assert carried(groups) == groups
    assert not_carried(groups) is None
    assert signature(groups) == "g0=full/2;g1=mamba/2"
    assert [g.keeps_every_block for g in groups] == [True, False]


def test_a_state_space_group_at_tensor_parallel_size_2_is_carried_and_names_its_size() -> None:
    """Each rank holds its own attention heads (the model's 4 over 2 ranks): every rank gets its own
    state bytes back from pages split by those heads, at the same tensor parallel size — which
    the signature names, so that a worker of another size is refused by the pins."""
    groups = kv_groups(config(full(), mamba()), BS, tp=2, kv_heads=4)
    assert carried(groups) == groups
    assert signature(groups) == "g0=full/2;g1=mamba@tp2/2"
    unknown = kv_groups(config(full(), mamba()), BS, tp=2)  # the heads not given: not carried
    assert carried(unknown) == []
    assert "at tensor parallel size 2 the model's KV heads are not known" in str(not_carried(unknown))
    assert groups[1].to_json()["tp"] == 2
    assert "tp" not in groups[0].to_json()
    verdict, why = compat.kv_groups("g0=full/2;g1=mamba@tp2/2", "g0=full/2;g1=mamba/2")
    assert verdict is compat.Verdict.MISMATCH
    assert why == (
        "KV cache group 1 (mamba): its state is split between ranks by the model's own state heads "
        "and restores onto the same tensor parallel size only (checkpoint 2, here 1)"
    )
    assert compat.kv_groups("g0=full/2;g1=mamba@tp2/2", "g0=full/2;g1=mamba@tp2/2")[0] is compat.Verdict.MATCH
    verdict, why = compat.kv_groups("g0=full/2;g1=mamba@tp2/2", "g0=full/2;g1=mamba@tp4/2")
    assert "(checkpoint 2, here 4)" in why
    # a group that differs otherwise is named as before
    assert compat.kv_groups("g0=full/2;g1=mamba@tp2/2", "g0=full/2;g1=mamba@tp2/3")[1] == (
        "KV cache group 1: checkpoint mamba@tp2/2, here mamba@tp2/3"
    )


def test_a_state_space_group_above_the_model_s_kv_heads_is_carried_one_slot_per_rank() -> None:
    """Qwen3-Next (2 KV heads) at TP 4: ranks hold replicas of each attention head but different
    state, so a stored page has one head slot per rank (every rank's bytes kept), pinned to that
    size like any state group. Without a state group replicas stay stored once, by heads."""
    cfg = config(full(), mamba())
    groups = kv_groups(cfg, BS, tp=4, kv_heads=2)
    assert carried(groups) == groups
    assert signature(groups) == "g0=full/2;g1=mamba@tp4/2"
    assert page_heads(cfg, 4, 2) == 4
    assert page_heads(cfg, 2, 2) == 2  # each rank holds heads of its own: the model's heads
    assert page_heads(cfg, 1, 2) == 2
    assert page_heads(config(full(), sliding()), 4, 2) == 2  # attention only: replicas stored once
    assert page_heads(config(mamba()), 2, 1) == 2


@pytest.mark.parametrize(
    ("spec", "tp", "layers", "why"),
    [
        (lambda: mamba("none"), 1, 2, "mamba_cache_mode='none' keeps no state a later request can hit"),
        (lambda: mamba(padded=4096), 1, 2, "bytes) differs from another group's"),
        (mamba, 1, 3, "its layers fill 3 physical slots and attention layers only 2"),
    ],
)
def test_a_state_space_group_it_cannot_carry_is_named_and_nothing_is_carried(
    spec: object, tp: int, layers: int, why: str
) -> None:
    """The worker starts all the same (the allocator on); no group is carried — a request needs
    every group — and the reason names the group."""
    cfg = config(full(), spec())  # type: ignore[operator]
    if layers != 2:  # a state group with a layer in a slot no attention layer shares
        cfg.kv_cache_groups[1].layer_names.append("model.layers.9.linear_attn")
    groups = kv_groups(cfg, BS, tp=tp, kv_heads=2)
    assert carried(groups) == []
    got = not_carried(groups)
    assert got is not None
    assert why in got, got
    assert "KV cache group" in got


def test_a_state_space_model_without_attention_is_not_carried() -> None:
    """Pages are read through attention layers' views: an SSM-only model has none."""
    groups = kv_groups(config(mamba()), BS)
    assert carried(groups) == []
    assert "its layers fill 2 physical slots and attention layers only 0" in str(not_carried(groups))


def test_groups_whose_pages_read_differently_are_not_carried() -> None:
    other = SlidingWindowSpec(block_size=BS, num_kv_heads=4, head_size=64, dtype=torch.bfloat16, sliding_window=64)
    groups = kv_groups(config(other, full()), BS)
    assert carried(groups) == []
    why = not_carried(groups)
    assert why is not None
    assert "page layout" in why


def test_a_group_with_another_block_size_is_not_carried() -> None:
    groups = kv_groups(config(full()), 32)
    assert carried(groups) == []
    assert "block size 16 is not the worker's 32" in str(not_carried(groups))


def test_group_keys() -> None:
    h = hashlib.sha256(b"block").digest()
    assert group_key(h, 0) == h  # one group: the keys every earlier checkpoint has
    assert group_key(h, 1) != h
    assert len(group_key(h, 1)) == len(h)
    assert group_key(h, 1) != group_key(h, 2)


# --- plan_hit ---------------------------------------------------------------


def hashes(n: int) -> list[bytes]:
    return [hashlib.sha256(bytes([i])).digest() for i in range(n)]


def skip_for(window: int):  # vLLM's SlidingWindowManager.get_num_skipped_tokens
    return lambda end: max(0, end - window + 1)


def offer(hs: list[bytes], groups: dict[int, range]) -> set[bytes]:
    return {group_key(hs[p], g) for g, positions in groups.items() for p in positions}


def no_tail(i: int, length: int) -> None:
    return None


def test_a_full_group_needs_every_block() -> None:
    hs = hashes(8)
    have = offer(hs, {0: range(0, 5)})
    end, keys = plan_hit(
        n=8 * BS, start=0, bs=BS, hashes=hs, rules=[GroupRule(0, None)], have=have.__contains__, tail=no_tail
    )
    assert end == 5 * BS
    assert keys == hs[:5]


def test_a_sliding_group_needs_only_its_window() -> None:
    """Gemma-3-style: the full group has every block, the sliding one (window 32 = 2 blocks) only
    the last blocks; the hit ends where both hold what vLLM will allocate."""
    hs = hashes(10)
    rules = [GroupRule(0, skip_for(32)), GroupRule(1, None)]
    have = offer(hs, {0: range(6, 9), 1: range(0, 10)})
    n = 10 * BS + 5
    end, keys = plan_hit(n=n, start=0, bs=BS, hashes=hs, rules=rules, have=have.__contains__, tail=no_tail)
    # at end = 9 blocks the window (tokens 113..143) needs blocks 7 and 8: offered
    assert end == 9 * BS
    assert keys == hs[:9]
    # without block 8 of the sliding group the hit falls back to where its window is offered
    have.discard(group_key(hs[8], 0))
    end, _ = plan_hit(n=n, start=0, bs=BS, hashes=hs, rules=rules, have=have.__contains__, tail=no_tail)
    assert end == 8 * BS


def test_nothing_is_planned_that_a_group_lacks() -> None:
    hs = hashes(6)
    rules = [GroupRule(0, skip_for(32)), GroupRule(1, None)]
    have = offer(hs, {1: range(0, 6)})  # the sliding group has nothing
    end, keys = plan_hit(n=6 * BS, start=0, bs=BS, hashes=hs, rules=rules, have=have.__contains__, tail=no_tail)
    assert (end, keys) == (0, [])


def test_a_hit_leaves_a_token_to_compute_and_the_window_moves_with_it() -> None:
    """Capped at n - 1, the window starts one token earlier: the block before it is needed too."""
    hs = hashes(4)
    rules = [GroupRule(0, skip_for(32))]
    have = offer(hs, {0: range(2, 4)})
    end, _ = plan_hit(n=4 * BS, start=0, bs=BS, hashes=hs, rules=rules, have=have.__contains__, tail=no_tail)
    # end = 63: skipped 32 tokens → blocks 2, 3 suffice
    assert end == 4 * BS - 1
    rules = [GroupRule(0, skip_for(34))]  # a wider window reaches into block 1 at end = 63
    end, _ = plan_hit(n=4 * BS, start=0, bs=BS, hashes=hs, rules=rules, have=have.__contains__, tail=no_tail)
    assert end < 4 * BS - 1


def test_a_partial_tail_extends_the_hit_only_when_every_group_has_it() -> None:
    hs = hashes(3)
    tail_key = hashlib.sha256(b"tail").digest()
    rules = [GroupRule(0, skip_for(32)), GroupRule(1, None)]
    have = offer(hs, {0: range(1, 3), 1: range(0, 3)}) | {group_key(tail_key, 1)}

    def tail(i: int, length: int) -> bytes | None:
        return tail_key if (i, length) == (3, 7) else None

    n = 3 * BS + 10
    end, keys = plan_hit(n=n, start=0, bs=BS, hashes=hs, rules=rules, have=have.__contains__, tail=tail)
    assert end == 3 * BS  # the sliding group has no tail page: no tail
    have.add(group_key(tail_key, 0))
    end, keys = plan_hit(n=n, start=0, bs=BS, hashes=hs, rules=rules, have=have.__contains__, tail=tail)
    assert end == 3 * BS + 7
    assert keys == [*hs, tail_key]


@pytest.mark.parametrize("start", [BS, 2 * BS])
def test_the_hit_starts_after_the_local_one(start: int) -> None:
    hs = hashes(6)
    have = offer(hs, {0: range(start // BS, 6)})
    end, keys = plan_hit(
        n=6 * BS + 1, start=start, bs=BS, hashes=hs, rules=[GroupRule(0, None)], have=have.__contains__, tail=no_tail
    )
    assert end == 6 * BS
    assert keys == hs[start // BS : 6]


def state_rule(index: int) -> GroupRule:  # vLLM's MambaManager.get_num_skipped_tokens: all but the last token
    return GroupRule(index, lambda end: end - 1, state=True)


def test_a_state_group_hit_ends_where_its_state_was_taken() -> None:
    """A state block holds the state after exactly the tokens its key names: the hit ends at the
    block boundary whose state is offered, never between two (the attention group has more)."""
    hs = hashes(6)
    rules = [GroupRule(0, None), state_rule(1)]
    have = offer(hs, {0: range(0, 6), 1: [1, 3]})  # states after 2 and 4 blocks
    n = 6 * BS + 5
    end, keys = plan_hit(n=n, start=0, bs=BS, hashes=hs, rules=rules, have=have.__contains__, tail=no_tail)
    assert end == 4 * BS
    assert keys == hs[:4]
    # a prompt ending just past the boundary: the hit still ends at it, not at n - 1
    end, _ = plan_hit(n=4 * BS + 1, start=0, bs=BS, hashes=hs, rules=rules, have=have.__contains__, tail=no_tail)
    assert end == 4 * BS
    # a request of exactly four blocks cannot use the state after all four (nothing left to compute)
    end, _ = plan_hit(n=4 * BS, start=0, bs=BS, hashes=hs, rules=rules, have=have.__contains__, tail=no_tail)
    assert end == 2 * BS


def test_a_state_group_tail_is_used_only_at_its_exact_end() -> None:
    """A live request's running state, carried as a tail of ``length`` tokens: the hit ends exactly
    there when it leaves a token to compute; otherwise it falls back to a boundary."""
    hs = hashes(2)
    tk = hashlib.sha256(b"running state").digest()
    rules = [GroupRule(0, None), state_rule(1)]
    have = offer(hs, {0: range(0, 2), 1: [1]}) | {group_key(tk, 0), group_key(tk, 1)}

    def tail(i: int, length: int) -> bytes | None:
        return tk if (i, length) == (2, 9) else None

    end, keys = plan_hit(n=2 * BS + 10, start=0, bs=BS, hashes=hs, rules=rules, have=have.__contains__, tail=tail)
    assert end == 2 * BS + 9
    assert keys == [*hs, tk]
    # the same tail covering every token of a shorter request: not usable, the boundary is
    end, _ = plan_hit(n=2 * BS + 9, start=0, bs=BS, hashes=hs, rules=rules, have=have.__contains__, tail=tail)
    assert end == 2 * BS
