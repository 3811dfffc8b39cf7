"""Every reach of gpuckpt into vLLM's internals, in one module.

The connector API (``KVConnectorBase_V1``) is vLLM's contract with a connector; what it does not
give — the prefix cache's enumeration, which model runner a worker runs, the engine and runner
objects a hook is called from — is read here and nowhere else, so that an upgrade of vLLM that
moves them is met in this file. Each function picks its way by probing the feature (an accessor
that exists, a field's type), never by a version string, and uses vLLM's public accessors where
one exists. The versions checked are :data:`agent.engines.versions.SUPPORTED`; ``make test`` runs
the version-independent tests against each (``tests/vllm_versions``).

What moved between the supported releases, and how each function meets it:

- **The prefix cache map** (``BlockPool.cached_block_hash_to_block``): 0.32 and 0.33 map a key to
  a block or to a dict of blocks; 0.34 maps it to an int block id (duplicates apart, in
  ``_dup_ids``). Nothing here reads the map's private dict: the enumeration walks the pool's
  blocks (``BlockPool.blocks``, each block's ``block_hash``) and asks the map's public
  ``contain`` whether it still names that block for that key, in every version.
- **The model runner**: 0.32 and 0.33 have ``VllmConfig.use_v2_model_runner``; 0.34 removed Model
  Runner V1 and the field with it — every worker there runs V2.
- **The engine and the runner** a hook is called from are found in the calling frames, by what they
  have (the engine's client-request handler and input queue, the V1 runner's request states and
  input batch), not by their class names.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any


def cached_blocks(pool: Any) -> Iterator[tuple[Any, Any]]:
    """Every ``(key, block)`` the block pool's prefix cache holds: a block's primary hash and its
    secondary ones (``cached_block_hashes_by_block``, where the pool keeps any), each still named by
    the map for that block (``contain``). A key cached by several blocks comes once per block.

    Walks the pool's blocks, O(blocks), at a capture's consistent point only: vLLM gives no
    enumeration of the map, and its private dict changed shape in 0.34."""
    cache = pool.cached_block_hash_to_block
    secondary: dict[int, Any] = getattr(pool, "cached_block_hashes_by_block", None) or {}
    for blk in pool.blocks:
        key = blk.block_hash
        if key is None:
            continue
        bid = int(blk.block_id)
        if cache.contain(key, bid):
            yield key, blk
        for k in secondary.get(bid, ()):
            if cache.contain(k, bid):
                yield k, blk


def still_cached(pool: Any, key: Any, block_id: int) -> bool:
    """Whether the prefix cache still names block ``block_id`` for ``key`` (then the block's content
    is the one the key names: vLLM drops the entry before it reuses the block)."""
    return bool(pool.cached_block_hash_to_block.contain(key, block_id))


def model_runner(vllm_config: Any) -> str:
    """``"v1"`` or ``"v2"``: the model runner this worker runs. V2 cannot be given a restored
    request's earlier outputs in the sampler's view (the ledger judges penalised requests by it)."""
    if hasattr(vllm_config, "use_v2_model_runner"):
        return "v2" if vllm_config.use_v2_model_runner else "v1"
    # vLLM 0.34 removed Model Runner V1 and the field with it: every worker runs V2
    return "v2"


def _caller(start: FrameType | None, found: Any) -> Any:
    f = start
    while f is not None:
        obj = f.f_locals.get("self")
        if obj is not None and found(obj):
            return obj
        f = f.f_back
    return None


def engine_of_caller(depth: int = 1) -> Any:
    """vLLM's ``EngineCoreProc`` in the frames calling ours (``None`` in-process, with no engine
    process): ``bind_kv_cache_manager`` is called while it builds its scheduler, before its input
    queue exists, so the object is kept, and its queue and block hasher read when needed."""
    return _caller(sys._getframe(depth + 1), lambda o: hasattr(type(o), "_handle_client_request"))


def runner_of_caller(depth: int = 1) -> Any:
    """The V1 model runner in the frames calling ours (``register_kv_caches`` is called from its
    ``initialize_kv_cache``), whose ``requests`` hold seeded requests' generators and whose
    ``input_batch`` is the sampler's view; ``None`` on V2, which has neither (its seeded sampling
    is stateless, and the ledger marks what needs the sampler's view inexact there)."""
    return _caller(
        sys._getframe(depth + 1),
        lambda o: isinstance(getattr(o, "requests", None), dict) and hasattr(o, "input_batch"),
    )


def in_process_access() -> Any:
    """vLLM 0.34's ``KVCacheAccess.IN_PROCESS`` (the hook that asks for it exists only there)."""
    from vllm.config.kv_transfer import KVCacheAccess  # type: ignore[attr-defined,unused-ignore]

    return KVCacheAccess.IN_PROCESS


def host_resident(group: Any) -> bool:
    """Whether a KV cache group lives in host memory (vLLM 0.34's HiSparse source pool: its block
    ids index a pool of its own, not the scheduler's block pool a capture plans from)."""
    return bool(getattr(group, "host_resident", False))


def transfer_groups(kv_cache_config: Any) -> set[int] | None:
    """The KV cache groups vLLM lets a connector transfer (0.34: ``transfer_group_ids`` leaves out
    HiSparse's device replicas), or ``None`` where the config does not say (every group)."""
    ids = getattr(kv_cache_config, "transfer_group_ids", None)
    if ids is None:
        return None
    return {int(i) for i in ids}


def connector_registered(name: str) -> bool:
    """Whether vLLM's connector factory already has ``name`` (it raises on a second registration)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict):
        return name in registry
    try:  # no registry to read: ask for the connector's class by name
        KVConnectorFactory.get_connector_class_by_name(name)
    except Exception:
        return False
    return True
