"""gpuckpt's vLLM plugin against vLLM's own configuration (the CPU wheel's ``VllmConfig``): a
worker that a fleet runs with PyTorch's expandable segments still starts with gpuckpt loaded,
while every other connector keeps vLLM's check."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.engines.vllm import plugin
from agent.engines.vllm.serve import kv_transfer_config
from tests.harness.models import write_tiny_llama

# vLLM's Python classes only: run against every supported vLLM release (make test)
pytestmark = pytest.mark.vllm_classes

EXPANDABLE = "expandable_segments:True"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("plugin-model"))


def engine_config(model: Path, ktc: Any) -> Any:
    """vLLM's whole configuration as ``vllm serve`` builds it (plugins loaded, then validated)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model), kv_transfer_config=ktc, enforce_eager=True, skip_tokenizer_init=True)
    return args.create_engine_config()


def test_a_worker_with_expandable_segments_starts_with_gpuckpt_loaded(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM refuses any KV connector beside ``expandable_segments:True`` (a connector that
    registers the KV cache with a NIC would keep stale pages); gpuckpt registers nothing, and
    before this exemption loading it kept such a worker from starting at all."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", EXPANDABLE)
    cfg = engine_config(model, kv_transfer_config(str(tmp_path / "c.sock"), str(tmp_path / "stage")))
    assert cfg.kv_transfer_config.kv_connector == plugin.NAME
    from vllm.config import VllmConfig

    before = VllmConfig._verify_kv_transfer_compat
    plugin.register()  # vLLM loads plugins in each of its processes, more than once in some
    assert VllmConfig._verify_kv_transfer_compat is before, "a second registration wraps nothing twice"


def test_every_other_connector_is_still_checked_by_vllm(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.config import KVTransferConfig

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", EXPANDABLE)
    other = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path / "kv")},
    )
    with pytest.raises(Exception, match="incompatible with PYTORCH_CUDA_ALLOC_CONF=expandable_segments"):
        engine_config(model, other)


def test_a_multimodal_worker_keeps_refusing_client_supplied_embeddings(tmp_path: Path) -> None:
    """vLLM takes any ``kv_both`` connector for a disaggregated consumer and turns on
    ``enable_mm_embeds`` (pre-computed embeddings from clients, "only for trusted users": a wrong
    shape can crash the engine) and lets requests omit their embedding tensors. A worker that
    loads gpuckpt keeps the user's setting and vLLM's check, as without gpuckpt."""
    from vllm.config import KVTransferConfig, VllmConfig

    plugin.register()

    def config(connector: str) -> SimpleNamespace:
        # (0.34 also reads language_model_only: a text-only consumer stays text-only)
        mm = SimpleNamespace(enable_mm_embeds=False, allow_missing_mm_embeddings=None, language_model_only=False)
        ktc = KVTransferConfig(
            kv_connector=connector,
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
        )
        return SimpleNamespace(
            model_config=SimpleNamespace(multimodal_config=mm), kv_transfer_config=ktc, ec_transfer_config=None
        )

    other = config("ExampleConnector")
    VllmConfig._resolve_mm_embedding_inputs(other)  # vLLM's rule, as every other connector gets it
    assert other.model_config.multimodal_config.enable_mm_embeds is True
    assert other.model_config.multimodal_config.allow_missing_mm_embeddings is True
    ours = config(plugin.NAME)
    VllmConfig._resolve_mm_embedding_inputs(ours)
    assert ours.model_config.multimodal_config.enable_mm_embeds is False
    assert ours.model_config.multimodal_config.allow_missing_mm_embeddings is False
