"""The host's pins when the agent cannot see the accelerator (Kubernetes: the device plugin gives
the GPU to the worker's container only): the worker's own probe fills the agent's unknowns."""

from __future__ import annotations

from typing import Any

import pytest

from agent.engines.types import WorkerDescription
from agent.session import worker as worker_mod
from ckpt import ABSENT, HostFacts, WorkerFacts

H100 = {
    "gpu_product": "NVIDIA H100 80GB HBM3",
    "gpu_compute_capability": "9.0",
    "gpu_count": 1,
    "driver_version": "550.54.15",
    "cuda_driver_version": "12.4",
    "cuda_runtime_version": "12.4",
}


def desc(host: Any) -> WorkerDescription:
    return WorkerDescription(WorkerFacts(engine="vllm"), {"host": host} if host is not None else {}, {})


@pytest.fixture
def agent_sees(monkeypatch: pytest.MonkeyPatch):
    def see(**facts: Any) -> None:
        monkeypatch.setattr(worker_mod, "host_facts", lambda: HostFacts(cpu_arch="x86_64", **facts))

    return see


def test_a_gpu_only_the_worker_sees_is_pinned(agent_sees) -> None:
    agent_sees()  # a sidecar without the GPU
    got = worker_mod.host_pins(desc(H100))
    assert got.gpu_product == H100["gpu_product"]
    assert got.gpu_count == 1
    assert got.driver_version == "550.54.15"
    assert got.cpu_arch == "x86_64"  # the agent's own facts stay


def test_the_agents_own_probe_wins(agent_sees) -> None:
    agent_sees(gpu_product="NVIDIA A100-SXM4-80GB", gpu_count=8)
    got = worker_mod.host_pins(desc(H100))
    assert got.gpu_product == "NVIDIA A100-SXM4-80GB"
    assert got.gpu_count == 8
    assert got.driver_version == "550.54.15"  # unknown to the agent: the worker's


def test_the_agents_absent_gpu_is_no_match_for_the_workers(agent_sees) -> None:
    """The agent image (a CPU torch, no device node in its container) proves "no GPU" for itself
    only: the worker's GPU is pinned, so an H100's checkpoint never matches an A100 pod."""
    none = {**dict.fromkeys(H100, ABSENT), "gpu_count": 0}
    agent_sees(**none)
    got = worker_mod.host_pins(desc(H100))
    assert {k: getattr(got, k) for k in H100} == H100
    # a worker with no GPU either: absent on both sides
    got = worker_mod.host_pins(desc(none))
    assert {k: getattr(got, k) for k in H100} == none


def test_the_workers_torch_is_pinned_not_the_agents(agent_sees) -> None:
    """The worker's torch writes the KV cache; the agent's is its image's (a new agent image must
    not turn every older checkpoint cold, nor hide a worker's torch upgrade)."""
    agent_sees(torch_version="2.13.0+cpu")
    assert worker_mod.host_pins(desc({"torch_version": "2.14.0+cu130"})).torch_version == "2.14.0+cu130"
    assert worker_mod.host_pins(desc({})).torch_version == "2.13.0+cpu"  # an older worker: the agent's


def test_only_accelerator_facts_and_torch_and_only_valid_ones_are_taken(agent_sees) -> None:
    agent_sees()
    got = worker_mod.host_pins(
        desc({"gpu_count": "many", "cpu_isa": "avx512", "torch_version": 9, **{"gpu_product": 3}})
    )
    assert got.gpu_count is None
    assert got.gpu_product is None
    assert got.cpu_isa is None
    assert got.torch_version is None


@pytest.mark.parametrize("host", [None, "not a mapping", ["x"]])
def test_no_word_from_the_worker_leaves_the_agents_probe(agent_sees, host: Any) -> None:
    agent_sees()
    assert worker_mod.host_pins(desc(host)) == HostFacts(cpu_arch="x86_64")
