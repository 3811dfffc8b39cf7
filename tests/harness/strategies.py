"""Hypothesis strategies for the library's models."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from ckpt.pins import ABSENT, HostFacts, Pins, WorkerFacts

# Integer facts and their smallest valid value; every other fact is a string.
INT_FIELDS = {
    "gpu_count": 0,
    "block_size": 1,
    "num_kv_heads": 1,
    "head_size": 1,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "rank": 0,
}


def _fact(name: str) -> st.SearchStrategy[Any]:
    if name in INT_FIELDS:
        return st.none() | st.integers(min_value=INT_FIELDS[name], max_value=2**40)
    return st.none() | st.just(ABSENT) | st.text()


def _facts(model: type[HostFacts] | type[WorkerFacts]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({name: _fact(name) for name in model.model_fields})


def pins_strategy() -> st.SearchStrategy[Pins]:
    """Any valid Pins, unknown (None) and ABSENT facts included."""
    return st.builds(
        lambda h, w: Pins(host=HostFacts(**h), worker=WorkerFacts(**w)),
        _facts(HostFacts),
        _facts(WorkerFacts),
    )
