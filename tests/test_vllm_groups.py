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
    plan_hit,
    signature,
)

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


def test_a_state_space_group_is_named_and_nothing_is_carried() -> None:
    """A hybrid SSM model (Jamba, Nemotron-H, Qwen3-Next's Gated DeltaNet) starts with the
    allocator on; its KV is not carried — a request needs every group — and the reason names the
    group."""
    mamba = MambaSpec(block_size=BS, shapes=((4, 64), (8, 16)), dtypes=(torch.float32, torch.float32))
    groups = kv_groups(config(full(), mamba), BS)
    assert carried(groups) == []
    why = not_carried(groups)
    assert why is not None
    assert why.startswith("KV cache group 1 (MambaSpec, 2 layers): MambaSpec: state-space")


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
