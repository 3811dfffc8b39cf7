"""Host buffers on this CPU-only machine: the same code path the GPU takes,
with ordinary buffers and synchronous copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt import Namespace, Pins, Repository, WorkerFacts
from ckpt.errors import ConfigError
from ckpt.hostbuffers import HostBuffers


def pages(n: int) -> list[tuple[bytes, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(i.to_bytes(4, "little"), torch.randn(2, 4, 16, 32, generator=g).to(torch.bfloat16)) for i in range(n)]


def test_copy_yields_exact_copies_in_order_and_reuses_buffers() -> None:
    src = pages(10)
    st = HostBuffers(buffer_bytes=2 * 4 * 16 * 32 * 2, count=3)
    seen = []
    for block in st.copy(src, lookahead=2):
        key, t = src[len(seen)]
        assert block.key == key
        assert block.dtype == "bfloat16"
        assert block.shape == tuple(t.shape)
        assert bytes(block.data) == t.view(torch.uint8).numpy().tobytes()
        seen.append(block.key)
        assert block.release is not None
        block.release()
        block.release()  # idempotent
    assert len(seen) == 10
    assert st.free_buffers == 3
    assert st.stats.blocks == 10


def test_page_larger_than_buffer_is_refused() -> None:
    st = HostBuffers(buffer_bytes=16, count=1)
    with pytest.raises(ConfigError, match="exceeds the staging buffer"):
        list(st.copy([(b"k", torch.zeros(100, dtype=torch.float16))]))


def test_save_from_host_buffers_releases_every_buffer_and_round_trips(tmp_path: Path) -> None:
    """A pool far smaller than the checkpoint: the save must release buffers as
    it goes (or it would deadlock), and dedup-skipped blocks release too."""
    src = pages(40)
    repo = Repository.open(str(tmp_path / "r"), create=True)
    ns = Namespace({"engine": "t"})
    pins = Pins(host=repo_host(), worker=WorkerFacts(engine="t"))
    st = HostBuffers(buffer_bytes=2 * 4 * 16 * 32 * 2, count=4)
    m = repo.save(st.copy(src + src[:5]), worker_id="w", namespace=ns, pins=pins)
    assert st.free_buffers == 4
    assert m.sizes.blocks == 45
    assert m.sizes.new_blocks == 40
    got = {b.key: bytes(b.data) for b in repo.load(m.id)}
    assert got == {k: t.view(torch.uint8).numpy().tobytes() for k, t in src}


def repo_host():  # type: ignore[no-untyped-def]
    from ckpt import host_facts

    return host_facts()
