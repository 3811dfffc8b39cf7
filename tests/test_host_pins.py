"""The host's pins when the agent cannot see the accelerator (Kubernetes: the device plugin gives
the GPU to the worker's container only): the worker's own probe fills the agent's unknowns."""

from __future__ import annotations

from typing import Any

import pytest

from agent.engines.types import WorkerDescription
from agent.session import worker as worker_mod
from ckpt import HostFacts, WorkerFacts

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


def test_only_accelerator_facts_and_only_valid_ones_are_taken(agent_sees) -> None:
    agent_sees()
    got = worker_mod.host_pins(
        desc({"gpu_count": "many", "cpu_isa": "avx512", "torch_version": "9.9", **{"gpu_product": 3}})
    )
    assert got.gpu_count is None
    assert got.gpu_product is None
    assert got.cpu_isa is None
    assert got.torch_version is None


@pytest.mark.parametrize("host", [None, "not a mapping", ["x"]])
def test_no_word_from_the_worker_leaves_the_agents_probe(agent_sees, host: Any) -> None:
    agent_sees()
    assert worker_mod.host_pins(desc(host)) == HostFacts(cpu_arch="x86_64")
