"""A save whose block source fails leaves nothing visible and cleans up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt import Block, Namespace, Pins, Repository, SaveOptions, WorkerFacts
from ckpt.lock import list_locks
from ckpt.pins import HostFacts

NS = Namespace({"engine": "t"})
PINS = Pins(host=HostFacts(), worker=WorkerFacts())


class SourceBroke(Exception):
    pass


def source(n: int, fail_at: int, exc: BaseException) -> Iterator[Block]:
    g = torch.Generator().manual_seed(3)
    for i in range(n):
        if i == fail_at:
            raise exc
        yield Block.from_tensor(f"b{i}".encode(), torch.randn(2, 4, 16, 64, generator=g).to(torch.bfloat16))


@pytest.mark.parametrize("exc", [SourceBroke("engine went away"), KeyboardInterrupt()])
def test_failing_block_source_leaves_nothing(tmp_path: Path, exc: BaseException) -> None:
    repo = Repository.open(str(tmp_path / "r"), create=True)
    prev = repo.save(source(4, -1, exc), worker_id="w", namespace=NS, pins=PINS)
    with pytest.raises(type(exc)):
        # Small packs so several were uploaded before the source failed.
        repo.save(
            source(200, 150, exc),
            worker_id="w",
            namespace=NS,
            pins=PINS,
            options=SaveOptions(pack_size=64 * 1024, max_memory=1 << 20),
        )
    assert [c.id for c in repo.list()] == [prev.id]
    assert list_locks(repo.store) == []
    # The failed save removed the packs it wrote: only the first save's remain.
    packs = {o.name.rsplit("/", 1)[-1] for o in repo.store.list("packs/")}
    assert packs == {b.pack for b in prev.blocks}
    assert len(list(repo.load(prev.id))) == 4
