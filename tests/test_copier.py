"""PageCopier on CPU tensors: the same code runs on CUDA with pinned buffers and streams."""

from __future__ import annotations

import pytest
import torch

from agent.engines.vllm.copier import PageCopier, runs


def test_runs_coalesce_consecutive_ids_in_order() -> None:
    assert runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert runs([]) == []
    assert runs([3, 3]) == [(0, 3, 1), (1, 3, 1)]  # a repeated id is not a run


def kv_layers(n_layers: int = 3, blocks: int = 12, shape=(2, 2, 4, 8), dtype=torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn((blocks, *shape), generator=g).to(dtype) for _ in range(n_layers)]


def expected_page(layers: list[torch.Tensor], block: int) -> bytes:
    return b"".join(kv[block].contiguous().view(torch.uint8).numpy().tobytes() for kv in layers)


def test_gather_yields_each_block_of_every_layer_layer_major() -> None:
    layers = kv_layers()
    ids = [7, 8, 9, 1, 11, 0]
    g = PageCopier(layers).gather(ids)
    pages = [bytes(p) for p in g.pages()]
    assert pages == [expected_page(layers, b) for b in ids]


def test_gather_is_a_copy_the_engine_may_overwrite_afterwards() -> None:
    layers = kv_layers()
    want = expected_page(layers, 3)
    g = PageCopier(layers).gather([3])
    for kv in layers:
        kv[3].fill_(0)  # the next step reuses the block
    assert bytes(next(g.pages())) == want


def test_scatter_round_trips_into_other_blocks() -> None:
    src = kv_layers()
    dst = [torch.zeros_like(t) for t in src]
    ids = [2, 3, 4, 10]
    pages = [expected_page(src, b) for b in ids]
    targets = [5, 6, 7, 0]  # one run of three plus a stray block
    PageCopier(dst).scatter(targets, pages)
    for b, t in zip(ids, targets, strict=True):
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(s[b], d[t])
    untouched = [i for i in range(12) if i not in targets]
    assert all(not d[untouched].any() for d in dst)


def test_scatter_refuses_a_page_of_the_wrong_size() -> None:
    dst = kv_layers()
    with pytest.raises(ValueError, match="page of 10 bytes"):
        PageCopier(dst).scatter([1], [b"\0" * 10])


def test_single_page_for_a_finished_tail() -> None:
    layers = kv_layers(dtype=torch.float32)
    assert PageCopier(layers).page(5) == expected_page(layers, 5)


def test_kv_first_layouts_are_copied_as_two_block_first_views() -> None:
    # FlashAttention-style [2, num_blocks, ...]: the connector passes t[0] and t[1].
    t = torch.randn(2, 6, 4, 2, 8)
    views = [t[0], t[1]]
    g = PageCopier(views).gather([4, 5])
    pages = [bytes(p) for p in g.pages()]
    assert pages[0] == t[0][4].numpy().tobytes() + t[1][4].numpy().tobytes()
    dst = torch.zeros_like(t)
    PageCopier([dst[0], dst[1]]).scatter([1, 2], pages)
    assert torch.equal(dst[:, 1], t[:, 4])
    assert torch.equal(dst[:, 2], t[:, 5])
