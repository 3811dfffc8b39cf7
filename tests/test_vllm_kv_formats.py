"""MLA, DeepSeek V3.2's indexer and FP8 KV caches as ``describe`` names them, against vLLM's real
spec classes and a real ``VllmConfig`` (no GPU needed; the facts: docs/design/vllm-gpu-kv-formats.md).

- MLA page formats: each backend's, and ``fp8_ds_mla``'s packed 656-byte content, are distinct.
- A quantized KV cache's scales live outside its pages: the ranks report them, ``describe`` folds
  them into the block namespace, so a checkpoint of a differently scaled worker is refused by name
  and its pages never deduplicate into this worker's; unit scales (the default) leave the
  namespace as it always was, so older checkpoints stay restorable.
- DeepSeek V3.2's indexer puts layers of two page sizes in one group (``UniformTypeKVCacheSpecs``):
  not carried, and ``describe`` says so instead of failing.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from agent.engines.types import WorkerDescription  # noqa: E402
from agent.engines.vllm.describe import describe, kv_scales, kv_scales_digest, page_format  # noqa: E402
from agent.session import restore_decision  # noqa: E402
from agent.session.worker import host_pins  # noqa: E402
from ckpt import Block, Namespace, Pins, Repository, WorkerFacts  # noqa: E402

# vLLM's Python classes only: run against every supported vLLM release (make test)
pytestmark = pytest.mark.vllm_classes

LBNHC = KVCacheLayout.LBNHC.name


def mla(dtype: str = "auto", **kw: Any) -> MLAAttentionSpec:
    """DeepSeek V3's latent cache as ``MLAAttention.get_kv_cache_spec`` builds it (576 = 512 + 64)."""
    packed = {"fp8_ds_mla": 656}.get(dtype)
    return MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.bfloat16 if dtype == "auto" else torch.uint8,
        cache_dtype_str=dtype,
        kv_quant_mode=KVQuantMode.NONE if dtype == "auto" else KVQuantMode.FP8_PER_TENSOR,
        state_content_bytes=packed,
        **kw,
    )


def indexer() -> MLAAttentionSpec:
    """DeepSeek V3.2's indexer K cache (``DeepseekV32IndexerCache.get_kv_cache_spec``): 128 fp8
    values and one fp32 scale a token, as 132 bytes."""
    return MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=128 + 128 // 128 * 4,
        dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
    )


def fmt(backend: AttentionBackendEnum, spec: Any, kb: int = 64) -> str | None:
    return page_format(device="cuda", backend=backend.name, kv_cache_layout=LBNHC, spec=spec, kernel_block_size=kb)


def test_mla_page_formats_name_the_backend_the_dtype_and_a_packed_content() -> None:
    formats = {
        "flashmla": fmt(AttentionBackendEnum.FLASHMLA, mla()),
        "flashmla_fp8": fmt(AttentionBackendEnum.FLASHMLA, mla("fp8")),
        "fa_mla": fmt(AttentionBackendEnum.FLASH_ATTN_MLA, mla(), 16),
        "cutlass": fmt(AttentionBackendEnum.CUTLASS_MLA, mla(), 128),
        "flashinfer": fmt(AttentionBackendEnum.FLASHINFER_MLA, mla()),
        "triton": fmt(AttentionBackendEnum.TRITON_MLA, mla(), 16),
        "sparse_ds": fmt(AttentionBackendEnum.FLASHMLA_SPARSE, mla("fp8_ds_mla")),
    }
    assert len(set(formats.values())) == len(formats), formats
    # the format every MLA checkpoint before packed contents had: unchanged
    assert formats["flashmla"] == "cuda:FLASHMLA:LBNHC:latent576:slots1:kb64:qNONE"
    assert formats["flashmla_fp8"] == "cuda:FLASHMLA:LBNHC:latent576:slots1:kb64:qFP8_PER_TENSOR"
    # 656 bytes a token (512 fp8 + 4 fp32 scales + 64 bf16 RoPE): not what 576 elements say
    assert formats["sparse_ds"] == "cuda:FLASHMLA_SPARSE:LBNHC:latent576@656B:slots1:kb64:qFP8_PER_TENSOR"
    assert mla("fp8_ds_mla").page_size_bytes == 64 * 656


# --- the ranks' scales ---------------------------------------------------------------------------


def layer(dtype: str, k: Any = 1.0, v: Any = 1.0) -> SimpleNamespace:
    """The attributes ``_init_kv_cache_quant`` gives an attention layer, after weight loading."""
    return SimpleNamespace(
        kv_cache_dtype=dtype,
        _k_scale=torch.tensor(k, dtype=torch.float32),
        _v_scale=torch.tensor(v, dtype=torch.float32),
    )


def ctx(**layers: Any) -> SimpleNamespace:
    return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=layers))


def test_a_rank_reports_its_scales_only_when_its_kv_cache_is_quantized() -> None:
    assert kv_scales(ctx(a=layer("auto"), b=layer("auto"))) is None
    got = kv_scales(ctx(a=layer("fp8", 0.5, 0.25), idx=SimpleNamespace(kv_cache=None), b=layer("fp8")))
    assert got == {"a": ["fp8", [0.5], [0.25]], "b": ["fp8", [1.0], [1.0]]}, "the indexer's cache has none"
    heads = kv_scales(ctx(a=layer("fp8_e4m3", [0.5, 0.75], [0.25, 0.125])))
    assert heads == {"a": ["fp8_e4m3", [0.5, 0.75], [0.25, 0.125]]}, "attn_head strategy: one per local head"


def report(rank: int, heads: tuple[int, int], scales: dict[str, list[Any]] | None) -> dict[str, Any]:
    r: dict[str, Any] = {"rank": rank, "kv_heads": list(heads), "backend": "FLASH_ATTN"}
    if scales is not None:
        r["kv_scales"] = scales
    return r


def test_unit_scales_are_the_default_and_leave_the_namespace_alone() -> None:
    unit = {"a": ["fp8", [1.0], [1.0]]}
    assert kv_scales_digest([report(0, (0, 2), unit)], 1, "fp8") is None
    assert kv_scales_digest([report(0, (0, 2), None)], 1, "bfloat16") is None
    # a layer left unquantized (kv_cache_dtype_skip_layers) changes what the pages hold
    mixed = {"a": ["fp8", [1.0], [1.0]], "b": ["auto", [1.0], [1.0]]}
    assert kv_scales_digest([report(0, (0, 2), mixed)], 1, "fp8") is not None


def test_the_digest_is_the_scales_whatever_the_tensor_parallel_size() -> None:
    tp1 = kv_scales_digest([report(0, (0, 2), {"a": ["fp8", [0.5], [0.25]]})], 1, "fp8")
    tp2 = kv_scales_digest(
        [report(r, (r, 1), {"a": ["fp8", [0.5], [0.25]]}) for r in (1, 0)], 2, "fp8"
    )  # per tensor: every rank holds the same value
    assert tp1 is not None
    assert tp1.startswith("sha256:")
    assert tp1 == tp2
    # per head: each rank holds its own heads' scales
    whole = kv_scales_digest([report(0, (0, 2), {"a": ["fp8", [0.5, 0.75], [0.25, 0.5]]})], 1, "fp8")
    split = kv_scales_digest(
        [
            report(0, (0, 1), {"a": ["fp8", [0.5], [0.25]]}),
            report(1, (1, 1), {"a": ["fp8", [0.75], [0.5]]}),
        ],
        2,
        "fp8",
    )
    assert whole == split
    assert whole != tp1
    other = kv_scales_digest([report(0, (0, 2), {"a": ["fp8", [0.5], [0.3]]})], 1, "fp8")
    assert other not in (tp1, None)
    # a rank that has not reported: unknown, never another worker's value
    assert kv_scales_digest([report(0, (0, 1), {"a": ["fp8", [0.5], [0.25]]})], 2, "fp8") == "unknown"


# --- describe with a real VllmConfig --------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.harness.models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def vllm_config(model: Path, cache_dtype: str = "auto") -> Any:
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=str(model), tokenizer=str(model), skip_tokenizer_init=True, dtype="bfloat16")
    return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=32, cache_dtype=cache_dtype))


def one_group(spec: Any) -> KVCacheConfig:
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    return KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)], kv_cache_layout="LBHNC"
    )


def description(d: dict[str, Any]) -> WorkerDescription:
    return WorkerDescription(WorkerFacts(**d["facts"]), d["layout"], d["namespace"])


def fp8_worker(model: Path, k: float) -> WorkerDescription:
    spec = FullAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=64, dtype=torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR
    )
    scales = {f"model.layers.{i}.self_attn.attn": ["fp8", [k], [k]] for i in range(2)}
    return description(describe(vllm_config(model, "fp8"), one_group(spec), [report(0, (0, 2), scales)]))


def test_a_checkpoint_of_a_differently_scaled_fp8_worker_is_refused_by_name_and_never_shares_a_page(
    model: Path, tmp_path: Path
) -> None:
    a, b, unit = fp8_worker(model, 0.5), fp8_worker(model, 0.25), fp8_worker(model, 1.0)
    assert a.facts.kv_dtype == "fp8"
    assert a.layout["kv_scales"] == a.namespace_fields["kv_scales"]
    assert "kv_scales" not in unit.namespace_fields, "unit scales: the namespace every fp8 checkpoint had"
    repo = Repository.open(str(tmp_path / "repo"), create=True)
    page = Block(key=b"k" * 32, data=b"\x01" * 64, dtype="uint8", shape=(64,))
    saved = {}
    for name, w in (("a", a), ("b", b)):
        m = repo.save(
            [page],
            worker_id=name,
            namespace=w.in_domain("fleet"),  # one trust domain: workers share pages by key
            pins=Pins(host=host_pins(w), worker=w.facts),
            layout=dict(w.layout),
        )
        saved[name] = m
    assert saved["b"].sizes.new_blocks == 1, "b's page was deduplicated into a's, written under other scales"
    same = restore_decision(saved["a"], a, trust_domain="fleet")
    assert same.warm, same.reasons
    d = restore_decision(saved["a"], b, trust_domain="fleet")
    assert not d.warm
    assert len(d.reasons) == 1
    assert d.reasons[0].startswith("namespace:")
    assert "kv_scales" in d.reasons[0]
    assert Namespace(dict(a.namespace_fields)).id != Namespace(dict(b.namespace_fields)).id


def test_an_mla_worker_with_deepseek_v32s_indexer_is_described_and_restores_cold_naming_it(
    model: Path, tmp_path: Path
) -> None:
    """V3.2: the latent cache (576 bf16, 1152 bytes a token) and the indexer's (132 bytes) are both
    MLAAttentionSpec with one block size, so vLLM puts them in one group of per-layer page sizes;
    the worker half pages one layout across layer slots and cannot carry it."""
    specs = {f"model.layers.{i}.self_attn.attn": mla() for i in range(2)}
    specs |= {f"model.layers.{i}.self_attn.indexer.k_cache": indexer() for i in range(2)}
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    assert uniform is not None, "vLLM groups them as one uniform type"
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(specs), uniform)])
    w = description(describe(vllm_config(model), kv, []))
    why = w.layout["kv_not_carried"]
    assert why is not None
    assert why.startswith("KV cache group 0 (UniformTypeKVCacheSpecs, 4 layers): UniformTypeKVCacheSpecs:")
    assert w.facts.head_size == 576
    assert w.facts.kv_groups == "g0=UniformTypeKVCacheSpecs/4"
    # its checkpoint (the ledger, no pages) restores cold, and the reason reaches the user
    repo = Repository.open(str(tmp_path / "repo"), create=True)
    m = repo.save(
        [], worker_id="w", namespace=w.namespace, pins=Pins(host=host_pins(w), worker=w.facts), layout=dict(w.layout)
    )
    d = restore_decision(m, w)
    assert not d.warm
    assert f"KV not carried (worker): {why}" in d.reasons


def test_the_layers_own_kv_dtype_names_the_page_where_cache_config_does_not(model: Path) -> None:
    """FLASHMLA_SPARSE serves ``fp8`` as ``fp8_ds_mla``: the layer rewrites the worker's
    cache_config, not EngineCore's, whose spec (collected from the worker) says it."""
    d = describe(vllm_config(model, "fp8"), one_group(mla("fp8_ds_mla")), [])
    assert d["facts"]["kv_dtype"] == "fp8_ds_mla"
    assert describe(vllm_config(model), one_group(mla()), [])["facts"]["kv_dtype"] == "bfloat16"


def test_a_worker_with_no_layer_it_can_page_starts_and_its_captures_carry_the_ledger_only(
    model: Path, tmp_path: Path
) -> None:
    """The worker half of a V3.2 worker (every layer in the one uniform-type group) registers
    without disabling itself — a disabled rank fails every capture, ledger included — and a
    capture's file of that rank holds no page."""
    from agent.engines.vllm.capture import CopyJob
    from agent.engines.vllm.meta import GpuckptMeta
    from agent.engines.vllm.worker import PAGELESS, WorkerHalf

    specs = {f"model.layers.{i}.self_attn.attn": mla() for i in range(2)}
    specs |= {f"model.layers.{i}.self_attn.indexer.k_cache": indexer() for i in range(2)}
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(specs), uniform)])
    half = WorkerHalf(vllm_config(model), kv, {"staging_dir": str(tmp_path / "stage")})
    half.register_kv_caches({name: torch.zeros(8, 1, 64, 576) for name in specs})
    assert half.disabled is None
    assert [n for n, _ in half.kv] == [PAGELESS]
    assert half.report is not None
    job = CopyJob(seq=1, chunk=0, directory=str(tmp_path / "stage"), name="capture-1", pages=[], tails=[])
    half.wait_for_save(GpuckptMeta(capture=job))
    wm = None
    for _ in range(500):  # the page file is written by a thread of its own
        wm = half.build_connector_worker_meta()
        if wm is not None and wm.done:
            break
        threading.Event().wait(0.01)
    assert wm is not None
    (rec,) = wm.done[job.job].values()
    assert "error" not in rec, rec
    assert rec["pages_written"] == 0


def test_pages_whose_head_slots_map_to_ranks_otherwise_are_refused_by_name(model: Path, tmp_path: Path) -> None:
    """A stored page's head slots are the model's KV heads, or one per rank (``page_heads``: a state
    group at TP above the KV heads). The pins cannot tell a checkpoint of one kind from the other
    (an MLA + linear-attention worker at TP > 1, checkpointed before ``page_heads`` existed, has
    today's pins and pages holding rank 0's state alone): the layouts are compared, by name."""
    w = fp8_worker(model, 1.0)
    slotted = WorkerDescription(w.facts, {**w.layout, "page_heads": 2}, w.namespace_fields)
    repo = Repository.open(str(tmp_path / "repo"), create=True)
    page = Block(key=b"k" * 32, data=b"\x01" * 64, dtype="uint8", shape=(64,))
    saved = {
        name: repo.save(
            [page],
            worker_id=name,
            namespace=d.in_domain("fleet"),
            pins=Pins(host=host_pins(d), worker=d.facts),
            layout=dict(d.layout),
        )
        for name, d in (("heads", w), ("slots", slotted))
    }
    assert restore_decision(saved["slots"], slotted, trust_domain="fleet").warm
    old = restore_decision(saved["heads"], slotted, trust_domain="fleet")
    assert old.reasons == [
        "page heads: the checkpoint's pages hold head slots one per KV head of the model; this worker's 2, one per rank"
    ]
    new = restore_decision(saved["slots"], w, trust_domain="fleet")
    assert new.reasons == [
        "page heads: the checkpoint's pages hold head slots 2, one per rank; this worker's one per KV head of the model"
    ]


def test_the_plan_names_each_request_this_worker_would_not_continue_exactly(model: Path, tmp_path: Path) -> None:
    """The dry run (``restore_decision``: ``gpuckpt restore --dry-run``, ``GET /restore/plan``)
    says which requests would not be exact continuations, judged on the restoring worker: a seeded
    request restored onto speculative decoding, a penalised one onto async scheduling."""
    from agent.engines.vllm.ledger import make_ledger

    def req(rid: str, **sampling: Any) -> dict[str, Any]:
        return {
            "request_id": f"{rid}-0",
            "client_request_id": rid,
            "prompt_token_ids": [1, 2, 3],
            "output_token_ids": [4, 5],
            "num_computed_tokens": 4,
            "max_tokens": 10,
            "remaining_max_tokens": 8,
            "min_tokens": 0,
            "sampling": {"max_tokens": 10, **sampling},
            "structured_outputs": None,
            "priority": 0,
            "cache_salt": None,
            "lora": None,
            "arrival_time": 0.0,
            "inexact_reasons": [],
            "exact": True,
        }

    w = fp8_worker(model, 1.0)
    led = make_ledger(
        [
            req("seeded", temperature=1.0, seed=7),
            req("penalised", frequency_penalty=0.5),
            req("greedy", temperature=0.0),
        ],
        step=1,
        block_size=32,
    )
    repo = Repository.open(str(tmp_path / "repo"), create=True)
    m = repo.save(
        [],
        worker_id="w",
        namespace=w.namespace,
        pins=Pins(host=host_pins(w), worker=w.facts),
        layout=dict(w.layout),
        ledger=led,
    )
    # on this worker's own runner: V1 gives a restored request its earlier outputs back, V2 (vLLM
    # 0.34's only runner) cannot, so there the penalised request is named
    here = set(restore_decision(m, w).inexact)
    assert here == (set() if w.layout["model_runner"] == "v1" else {"penalised"}), here
    spec = WorkerDescription(
        w.facts, {**w.layout, "speculative": "ngram", "async_scheduling": True}, w.namespace_fields
    )
    d = restore_decision(m, spec)
    assert d.warm, d.reasons  # neither is a pin: the KV is the same
    assert set(d.inexact) == {"seeded", "penalised"}
    assert d.inexact["seeded"][0].startswith("on this worker: seeded sampling with speculative decoding (ngram)")
    assert "async scheduling" in d.inexact["penalised"][0]
    assert d.to_json()["inexact"] == d.inexact
