"""The vLLM versions gpuckpt supports, against vLLM's own classes (run once per supported release:
``make test`` runs this file in each version's venv too).

- A worker of a vLLM outside the declared range starts with gpuckpt disabled: vLLM's real
  scheduler loads the inert connector, serves its requests to the end, and every control call but
  ``ping`` is refused naming the version and the range; the operator's opt-in runs gpuckpt as asked.
- What moved between releases is met in :mod:`agent.engines.vllm.internals`, by probing: the prefix
  cache enumerated through vLLM's own block pool finds every cached block, and a worker's model
  runner is read from its config (0.34 has only V2).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from agent.engines import versions
from tests.harness.paths import short_dir

pytest.importorskip("vllm")

from tests.harness.workers import BLOCK, NUM_BLOCKS, VllmHalves, vllm_scheduler

# vLLM's Python classes only: run against every supported vLLM release (make test)
pytestmark = pytest.mark.vllm_classes


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.harness.models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def test_the_declared_range_takes_releases_local_builds_and_main_and_nothing_outside() -> None:
    for v in ("0.32.0", "0.32.0+cpu", "0.33.0", "0.34.0", "0.34.1.dev12+gabc1234"):
        assert versions.support("vllm", v).ok, v
    for v in ("0.31.2", "0.35.0", "0.35.0.dev3", "1.0.0", "not-a-version"):
        assert not versions.support("vllm", v).ok, v
    assert versions.support("sglang", "0.5.23").ok
    assert not versions.support("sglang", "0.5.24").ok
    why = versions.refusal("vllm", "0.35.0", allowed=False)
    assert why is not None
    assert "vllm 0.35.0" in why
    assert ">=0.32" in why
    assert "<0.35" in why
    assert versions.ALLOW_ENV in why  # the way out is named where the user meets the refusal
    assert versions.refusal("vllm", "0.35.0", allowed=True) is None


def test_the_installed_vllm_is_in_the_range() -> None:
    """The version this test runs against (each of ``make test``'s version venvs) is one the range
    declares: the range and the releases tested never drift apart."""
    s = versions.support("vllm")
    assert s.ok, s


def test_the_opt_in_comes_from_the_environment_or_the_connector_settings() -> None:
    assert versions.allowed_by({}, {versions.ALLOW_ENV: "1"})
    assert versions.allowed_by({"allow_unsupported_engine": True}, {})
    assert not versions.allowed_by({}, {versions.ALLOW_ENV: "0"})


def _scheduler(model: Path, d: Path) -> Any:
    """vLLM's own scheduler, built as the engine builds it, with gpuckpt configured."""
    return vllm_scheduler(model, d / "c.sock", d / "stage")[2]


def test_a_worker_of_an_unsupported_vllm_serves_with_gpuckpt_disabled_and_says_why(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import dataclasses

    import vllm
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from agent.engines.channel import WorkerChannel
    from agent.engines.vllm.connector import DisabledConnector
    from ckpt.errors import EngineError

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    d = short_dir("ver-")
    with caplog.at_level(logging.ERROR, logger="gpuckpt.vllm"):
        sched = _scheduler(model, d)
    try:
        assert isinstance(sched.connector, DisabledConnector)
        assert any("vllm 0.35.0 is outside" in r.getMessage() for r in caplog.records), caplog.text
        init_none_hash(sha256)
        # the worker serves: a request runs to its end through vLLM's scheduler with the connector
        hasher = get_request_block_hasher(BLOCK, sha256)
        sched.add_request(Request("r", list(range(1, 40)), SamplingParams(max_tokens=5), None, block_hasher=hasher))
        has_index = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
        for _ in range(10):
            so = sched.schedule()
            ids = [r for r, n in so.num_scheduled_tokens.items() if n]
            index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if has_index else {}
            sched.update_from_output(so, ModelRunnerOutput(req_ids=ids, **index, sampled_token_ids=[[7] for _ in ids]))
        assert not sched.requests, "the request finished"
        # the agent's calls: the worker is up, and everything else is refused naming the range
        ch = WorkerChannel(d / "c.sock")
        assert ch.ping().pid > 0
        with pytest.raises(EngineError, match=r"vllm 0\.35\.0 is outside the versions this gpuckpt supports"):
            ch.describe()
        with pytest.raises(EngineError, match=r"<0\.35"):
            ch.capture(timeout=5)
    finally:
        sched.shutdown()


def test_the_operator_may_run_gpuckpt_on_an_untested_vllm(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import vllm

    from agent.engines.vllm.connector import GpuckptConnector

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    monkeypatch.setenv(versions.ALLOW_ENV, "1")
    d = short_dir("ver-")
    with caplog.at_level(logging.WARNING, logger="gpuckpt.vllm"):
        sched = _scheduler(model, d)
    try:
        assert type(sched.connector) is GpuckptConnector
        assert any("not a version this gpuckpt was tested on" in r.getMessage() for r in caplog.records)
    finally:
        sched.shutdown()


def test_the_prefix_cache_is_enumerated_through_vllms_own_block_pool(model: Path) -> None:
    """Every full block vLLM cached is found by the shim's walk, named by the pool's own map (0.34
    keeps block ids there, 0.32 blocks); a block evicted and reused is no longer reported cached."""
    from agent.engines.vllm import internals

    d = short_dir("ver-")
    h = VllmHalves(model, d / "c.sock", d / "stage")
    try:
        r = h.add_request("a", list(range(1, 1 + 4 * BLOCK + 3)), max_tokens=2)
        h.channel.wait(when={"live": 0}, timeout=60)
        with h.lock:
            pool = h.scheduler.kv_cache_manager.block_pool
            found = dict(internals.cached_blocks(pool))
            want = {bytes(x) for x in r.block_hashes[:4]}
            assert {bytes(internals_key_hash(k)) for k in found} >= want
            for k, blk in found.items():
                assert internals.still_cached(pool, k, int(blk.block_id))
                assert not internals.still_cached(pool, k, int(blk.block_id) + 1)
    finally:
        h.close()


def internals_key_hash(key: Any) -> bytes:
    from vllm.v1.core.kv_cache_utils import get_block_hash

    return bytes(get_block_hash(key))


def test_the_model_runner_is_read_from_the_worker_s_config(model: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from agent.engines.vllm import internals

    cfg = EngineArgs(model=str(model), enforce_eager=True, skip_tokenizer_init=True).create_engine_config()
    runner = internals.model_runner(cfg)
    if hasattr(cfg, "use_v2_model_runner"):
        assert runner == ("v2" if cfg.use_v2_model_runner else "v1")
    else:  # 0.34: Model Runner V1 is gone, and the field with it
        assert runner == "v2"
    # what the worker's description records, the ledger's exactness judged by it
    d = short_dir("ver-")
    h = VllmHalves(model, d / "c.sock", d / "stage")
    try:
        assert h.channel.describe().layout["model_runner"] == internals.model_runner(h.config)
    finally:
        h.close()


# --- what vLLM 0.33 and 0.34 added: sleep mode, host-resident KV, the access and hash hooks ---


def test_nothing_is_copied_while_the_worker_sleeps_and_captures_work_again_when_it_wakes(model: Path) -> None:
    """vLLM 0.33+ calls ``unregister_kv_caches`` before sleep mode releases the KV cache's memory
    and ``restore_kv_caches`` after it maps it back: in between, a capture fails naming the sleep
    (a copy would read unmapped GPU memory); after it, a capture copies the request's blocks."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from agent.engines.vllm.connector import GpuckptConnector
    from ckpt.errors import EngineError

    if hasattr(KVConnectorBase_V1, "unregister_kv_caches"):  # 0.33+: the hooks vLLM calls are ours
        for hook in ("unregister_kv_caches", "restore_kv_caches"):
            assert getattr(GpuckptConnector, hook) is not getattr(KVConnectorBase_V1, hook), hook
        assert GpuckptConnector.supports_sleep_mode(None) is True  # carried, not refused
    d = short_dir("ver-")
    h = VllmHalves(model, d / "c.sock", d / "stage")
    try:
        h.add_request("a", list(range(1, 1 + 2 * BLOCK + 3)), max_tokens=500)
        h.channel.wait(when={"live": 1, "min_outputs": 1}, timeout=60)
        h.worker.unregister_kv_caches()
        with pytest.raises(EngineError, match="asleep"):
            h.channel.capture(timeout=30)
        h.worker.restore_kv_caches()
        cap = h.channel.capture(timeout=30)
        try:
            assert cap.get("index"), cap
        finally:
            h.channel.cancel(cap.seq)
    finally:
        h.close()


def test_host_resident_kv_and_groups_vllm_keeps_from_transfer_are_named_not_carried() -> None:
    """HiSparse's source group (vLLM 0.33+: ``host_resident``) lives in pinned host memory under
    block ids of its own pool, and its device groups are replicas vLLM keeps out of transfer: a
    worker with them is described with its KV not carried, naming why — never paged from the
    scheduler's block ids, which index another pool."""
    import dataclasses

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from agent.engines.vllm.groups import carried, kv_groups, not_carried

    fields = {f.name for f in dataclasses.fields(KVCacheGroupSpec)}
    if "host_resident" not in fields:
        pytest.skip("this vLLM has no host-resident KV cache groups (0.33 added them)")
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32)
    host = KVCacheGroupSpec(["l0"], spec, host_resident=True)
    cfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[host])
    groups = kv_groups(cfg, BLOCK)
    assert carried(groups) == []
    assert "host-resident" in (not_carried(groups) or "")
    if "enable_kv_transfer" in fields:
        replica = KVCacheGroupSpec(["l1"], spec, enable_kv_transfer=False)
        cfg = KVCacheConfig(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec), replica]
        )
        assert "out of KV transfer" in (not_carried(kv_groups(cfg, BLOCK)) or "")
    # an ordinary worker's groups are carried, as before
    plain = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    assert not_carried(kv_groups(plain, BLOCK)) is None


def test_the_connector_declares_in_process_access_and_keeps_vllms_block_hashes(tmp_path: Path) -> None:
    """vLLM 0.34 asks a connector how it reaches the KV cache (``kv_cache_access``: gpuckpt copies
    with torch ops in the worker's process, so the extensible KV cache stays on) and whether it
    takes lookahead block hashes (no: a checkpoint's pages keep the keys every supported version
    computes)."""
    from vllm.config import KVTransferConfig

    from agent.engines.vllm.connector import GpuckptConnector
    from agent.engines.vllm.serve import kv_transfer_config

    assert GpuckptConnector.supports_lookahead_block_hashes(None) is False
    ktc = KVTransferConfig(**kv_transfer_config(str(tmp_path / "c.sock"), str(tmp_path / "stage")))
    if not hasattr(ktc, "kv_cache_access"):
        pytest.skip("this vLLM does not ask a connector how it reaches the KV cache (0.34 does)")
    from vllm.config.kv_transfer import KVCacheAccess  # type: ignore[attr-defined,unused-ignore]

    assert ktc.kv_cache_access() == KVCacheAccess.IN_PROCESS  # vLLM's own resolution, through its factory


def test_the_worker_pages_only_the_blocks_its_kv_cache_config_counts(model: Path) -> None:
    """vLLM 0.34's extensible KV cache hands ``register_kv_caches`` views of the committed blocks
    only, with a KV cache config counting exactly those (``extend_kv_cache``); every block id the
    scheduler names is below that count, and the views keep their addresses. The worker half pages
    through those views alone: a layer's page is its committed block's bytes, and a tensor that
    spans more than the config counts (the reservation) is refused by name, never indexed."""
    import dataclasses

    import torch

    from agent.engines.vllm.worker import WorkerHalf

    d = short_dir("ver-")
    h = VllmHalves(model, d / "c.sock", d / "stage")
    try:
        committed = NUM_BLOCKS // 2
        cfg = dataclasses.replace(h.kv_cache_config, num_blocks=committed)
        extra = {"control_socket": str(d / "w2.sock"), "staging_dir": str(d / "stage2")}
        reserved = {
            name: torch.arange(NUM_BLOCKS, dtype=torch.float32)[:, None, None, None]
            .expand(NUM_BLOCKS, *t.shape[1:])
            .contiguous()
            for name, t in h.caches.items()
        }
        w = WorkerHalf(h.config, cfg, extra)
        w.register_kv_caches({name: t[:committed] for name, t in reserved.items()})
        assert w.copier is not None
        page = torch.frombuffer(bytearray(w.copier.page(committed - 1)), dtype=torch.float32)
        assert set(page.tolist()) == {float(committed - 1)}  # the last committed block's own bytes
        w.shutdown()
        w = WorkerHalf(h.config, cfg, extra)
        with pytest.raises(NotImplementedError, match=f"{committed} blocks"):
            w.register_kv_caches(reserved)
        w.shutdown()
    finally:
        h.close()
