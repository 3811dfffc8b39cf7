"""The vLLM connector's scheduler half on CPU, with vLLM's own scheduler and no engine process.

:class:`tests.harness.workers.VllmHalves` steps vLLM's real ``Scheduler`` with
the connector and its worker half on CPU tensors; only the forward is
missing (a toy runner samples token 7). What is checked here is what the
halves do with vLLM's state: the pages a capture copies are the request's own
blocks, the keys are vLLM's block hashes, an offered page lands in the blocks
vLLM allocates for a matching request, a hold holds, and the ranks' reports
arrive through the per-step metadata.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.engines import staging
from tests.harness.paths import short_dir
from tests.harness.waiting import wait_for

pytest.importorskip("vllm")

from tests.harness.workers import BLOCK, LAYERS, VllmHalves

# vLLM's Python classes only: run against every supported vLLM release (make test)
pytestmark = pytest.mark.vllm_classes


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.harness.models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def halves(model: Path) -> Iterator[VllmHalves]:
    d = short_dir("half-")
    h = VllmHalves(model, d / "c.sock", d / "stage")
    # every block of every layer holds its own id: a copied page says where it came from
    for t in h.caches.values():
        for b in range(t.shape[0]):
            t[b] = float(b)
    yield h
    h.close()
    shutil.rmtree(d, ignore_errors=True)


def page_of(h: VllmHalves, block: int) -> bytes:
    return b"".join(h.caches[name][block].numpy().tobytes() for name in LAYERS)


def captured_full_blocks(h: VllmHalves, cap: Any, req: Any) -> int:
    """Check that the capture's pages of ``req``'s two full blocks, under vLLM's block hashes, are
    the request's own blocks; cancel the capture; return how many pages it held."""
    pf = staging.PageFile(str(cap.get("index")), mapped=False)
    try:
        blocks = h.block_ids(req.request_id)
        for i, bh in enumerate(req.block_hashes[:2]):
            assert bytes(pf.page(bytes(bh))) == page_of(h, blocks[i]), f"block {i} is the request's own"
        return len(pf.index.keys)
    finally:
        pf.close()
        h.channel.cancel(cap.seq)


def test_the_ranks_report_through_the_step_metadata_not_a_file(halves: VllmHalves) -> None:
    layout = halves.channel.describe().layout
    assert [r["rank"] for r in layout["ranks"]] == [0]
    assert layout["ranks"][0]["page_shape"] == list(halves.worker.page_shape())
    assert not list(Path(halves.half.staging_dir).glob("worker-r*")), "no side channel"
    # the rank learns it from the next step's metadata (ranks_known): wait for that step, not race it
    wait_for(lambda: halves.worker.report is None, 30, "the rank to stop sending its report once the scheduler has it")


def test_a_capture_copies_a_live_requests_own_blocks_and_names_it_in_the_ledger(halves: VllmHalves) -> None:
    prompt = list(range(10, 50))  # 40 tokens: two full blocks and a tail
    req = halves.add_request("r1", prompt)
    halves.channel.wait(when={"live": 1, "min_outputs": 2}, timeout=30)
    cap = halves.channel.capture(timeout=30)
    ledger = cap.ledger
    assert ledger is not None
    [entry] = ledger["data"]["requests"]
    assert entry["request_id"] == "r1"
    assert entry["prompt_token_ids"] == prompt
    assert captured_full_blocks(halves, cap, req) == 3, "two full blocks and the partial tail"


def test_a_request_whose_input_the_ledger_cannot_carry_is_left_to_its_client(halves: VllmHalves) -> None:
    """A prompt given as embeddings: its token ids are placeholders (0), the same for every
    embedding. The capture files it apart in the ledger (no tokens; never resubmitted on another
    input) and keeps its full blocks under vLLM's own hashes, which hash the embeddings, but not
    its partial tail, whose key would be made of those placeholders."""
    embeds = torch.randn(40, 256)  # 40 positions: two full blocks and a tail
    req = halves.add_request("e1", None, prompt_embeds=embeds)
    halves.channel.wait(when={"live": 1, "min_outputs": 2}, timeout=30)
    cap = halves.channel.capture(timeout=30)
    data = cap.ledger["data"]
    assert data["requests"] == []
    assert data["left_to_client"] == [
        {
            "request_id": "e1",
            "client_request_id": "e1",
            "left_to_client": "its prompt embeddings are not carried by the ledger",
        }
    ]
    assert cap.get("left_requests") == 1
    assert captured_full_blocks(halves, cap, req) == 2, "the full blocks only: no tail keyed by placeholder ids"


def test_keys_are_vllms_block_hashes(halves: VllmHalves) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    toks = list(range(100, 140))
    ref = Request("x", toks, SamplingParams(max_tokens=1), None, block_hasher=halves.hasher)
    [keys] = halves.channel.keys([{"token_ids": toks, "kv_tokens": 32}]).keys
    assert list(keys) == [bytes(h).hex() for h in ref.block_hashes[:2]]


def test_an_offered_page_lands_in_the_blocks_vllm_allocates_for_a_matching_request(
    halves: VllmHalves, tmp_path: Path
) -> None:
    toks = list(range(200, 240))
    [keys] = halves.channel.keys([{"token_ids": toks, "kv_tokens": 2 * BLOCK}]).keys
    offer = short_dir("offer-")
    shape, dtype = halves.worker.stored_shape(), halves.worker.dtype()
    w = staging.PageWriter(offer, "restore-1", dtype=dtype, page_shape=shape, layers=[n for n, _ in halves.worker.kv])
    pages = [torch.full(shape, 42.0 + i).numpy().tobytes() for i in range(2)]
    for k, p in zip(keys, pages, strict=True):
        w.write(bytes.fromhex(k), p)
    w.commit()
    try:
        assert halves.channel.offer(index=str(w.index_path), ttl=60).offered == 2
        halves.add_request("restored", toks)
        deadline = time.monotonic() + 30
        while not halves.channel.stats()["restored_tokens"].get("restored"):
            assert time.monotonic() < deadline, "the offered pages were never matched"
            time.sleep(0.02)
        assert halves.channel.stats()["restored_tokens"]["restored"] == 2 * BLOCK
        blocks = halves.block_ids("restored")
        assert [page_of(halves, b) for b in blocks[:2]] == pages
        halves.channel.withdraw()
    finally:
        shutil.rmtree(offer, ignore_errors=True)


def test_a_hold_holds_new_requests_until_they_have_all_arrived(halves: VllmHalves) -> None:
    halves.channel.hold(2, timeout=30)
    halves.add_request("a", list(range(1, 20)))
    step = halves.channel.stats()["step"]
    wait_for(
        lambda: halves.channel.stats()["step"] >= step + 5 or halves.failed is not None,
        timeout=60,
        what="five step boundaries (a held request waits through them)",
    )
    assert halves.failed is None, halves.failed
    assert halves.channel.stats()["live"] == 1
    assert halves.block_ids("a") == [], "held: nothing allocated yet"
    halves.add_request("b", list(range(30, 50)))
    halves.channel.wait(when={"live": 2, "min_outputs": 1}, timeout=30)
    assert halves.block_ids("a")
    assert halves.block_ids("b")


def test_the_idle_metadata_crosses_to_the_workers_as_its_name() -> None:
    """vLLM pickles every step's metadata into the workers' queue (``shm_broadcast.MessageQueue``:
    ``pickle.HIGHEST_PROTOCOL``). The idle step's crosses as a reference to :data:`IDLE` — a few
    bytes, read back as that same object, so the worker's idle test holds on every rank — while a
    step with work crosses by value, field for field. (Pickle here is vLLM's wire between its own
    processes, reproduced to see what it does to gpuckpt's objects; no format of gpuckpt's uses it.)"""
    import pickle

    from agent.engines.vllm.meta import IDLE, GpuckptMeta

    def cross(obj: GpuckptMeta) -> tuple[int, GpuckptMeta]:
        raw = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        back: GpuckptMeta = pickle.loads(raw)  # noqa: S301 -- vLLM's own queue, our own bytes
        return len(raw), back

    size, back = cross(IDLE)
    assert back is IDLE
    assert size < 64, f"{size} bytes: the idle metadata is pickled by value"
    assert GpuckptMeta(ranks_known=True, idle=True) == IDLE  # nothing planned in any field

    work = GpuckptMeta(loads=[(3, "p/0001", "ab")], priors=[("r", [1, 2])], ranks_known=True)
    _, back = cross(work)
    assert back == work
    assert back is not work
    assert not back.idle
    _, back = cross(GpuckptMeta(ranks_known=True, idle=True))  # equal to IDLE but not it: by value
    assert back is not IDLE


def test_an_idle_step_binds_no_metadata_so_vllm_skips_the_per_layer_hooks(halves: VllmHalves) -> None:
    """With nothing checkpointed or restored the scheduler half sends its one idle metadata, and
    the worker's connector leaves it unbound: vLLM's per-layer wrapper calls ``wait_for_layer_load``
    and ``save_kv_layer`` only with metadata bound (``has_connector_metadata``), and the other hooks
    have nothing to do. A step with work, or with restored requests' earlier outputs to put in
    front of the sampler, is bound as before."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from agent.engines.vllm.connector import GpuckptConnector
    from agent.engines.vllm.meta import IDLE, GpuckptMeta

    halves.channel.describe()  # the rank's report reached the scheduler half
    wait_for(lambda: len(halves.half.reports) >= 1, 30, "the scheduler half to hold the rank's report")
    with halves.lock:
        meta = halves.half.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))
    assert meta is IDLE  # the one shared idle metadata: no per-step allocation

    c = GpuckptConnector(halves.config, KVConnectorRole.WORKER, halves.kv_cache_config)
    c.register_kv_caches(halves.caches)
    assert c.worker is not None
    assert c.worker.report is not None  # sent until the scheduler has it
    c.bind_connector_metadata(meta)
    assert not c.has_connector_metadata()
    assert c.worker.report is None  # an idle step's metadata means every report is in
    c.start_load_kv(SimpleNamespace())
    c.wait_for_save()
    assert c.build_connector_worker_meta() is None
    assert c.get_finished(set()) == (None, None)
    assert not c.failures
    c.clear_connector_metadata()

    c.worker.priors["r-restored"] = [1, 2, 3]  # a restored request's outputs before the cut
    c.bind_connector_metadata(meta)
    assert c.has_connector_metadata(), "the priors are put in front in start_load_kv: the step is bound"
    c.clear_connector_metadata()
    c.worker.priors.clear()

    c.bind_connector_metadata(GpuckptMeta(ranks_known=True))  # a step with gpuckpt's work
    assert c.has_connector_metadata()
    c.clear_connector_metadata()
    c.shutdown()
