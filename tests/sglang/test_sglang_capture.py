"""The SGLang linker's capture of the whole radix tree, streamed with the tree's pages pinned.

One real SGLang 0.5.23 server (CPU, tiny random-weight Llama). The linker of
before walked the prefix cache from the token sequences of the live requests
and the last 4,096 finished ones (``track_requests`` in its extra config);
this server sets that knob to 4, so a request older than 4 finished ones is
"older than 4,096" to that code, which would leave its pages out. The linker
now walks the tree itself and takes no such knob.

A page is pinned (a lock reference on its tree node) from the consistent point
until it is copied; SGLang's own count of locked tokens (``tree_protected_tokens``,
read by the linker on the scheduler thread at a ``wait``) says whether anything
is still held.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent import session
from agent.engines import staging
from agent.engines.channel import WorkerChannel
from agent.engines.control import ControlError
from agent.testing import SglangProcess
from ckpt import Repository, host_facts
from ckpt.pins import GPU_FACTS
from tests.harness.sglang import Start
from tests.harness.waiting import wait_for

PAGE = 16
GREEDY = {"temperature": 0.0, "ignore_eos": True}
OLD = [3 + (11 * i) % 470 for i in range(3 * PAGE + 5)]  # three full pages and a bit
NEWER = [[20 + j] + [5 + (7 * i + j) % 460 for i in range(PAGE)] for j in range(8)]  # one page each


@pytest.fixture(scope="module")
def server(start_server: Start) -> SglangProcess:
    # the old linker's history bound, lowered so that "older than 4,096" takes 4 requests
    return start_server("capture", linker={"track_requests": 4})


def _protected(s: SglangProcess) -> int:
    """Tokens of the tree that lock references hold, at the next step boundary (no request runs)."""
    return int(session.wait_until(s.control_socket, live=0, timeout=60)["tree_protected_tokens"])


def _old_keys(s: SglangProcess) -> set[str]:
    reply = WorkerChannel(s.control_socket).keys([{"token_ids": OLD, "kv_tokens": 3 * PAGE}])
    keys = set(reply.keys[0])
    assert len(keys) == 3
    return keys


@pytest.fixture(scope="module")
def old_then_newer(server: SglangProcess) -> SglangProcess:
    server.client.complete(OLD, {**GREEDY, "max_new_tokens": 2}, rid="old")
    for j, prompt in enumerate(NEWER):
        server.client.complete(prompt, {**GREEDY, "max_new_tokens": 1}, rid=f"newer-{j}")
    return server


def test_a_page_older_than_the_last_finished_requests_is_in_the_checkpoint(
    old_then_newer: SglangProcess, tmp_path: Path
) -> None:
    s = old_then_newer
    repo = Repository.open(str(tmp_path / "repo"), create=True)
    taken = session.checkpoint(s.control_socket, repo, "sg-tree", copy_per_step=1)  # a page a step
    stored = {b.key for b in taken.manifest.blocks}
    assert _old_keys(s) <= stored
    # the newer requests' pages too: every page of the tree
    for prompt in NEWER:
        (key,) = WorkerChannel(s.control_socket).keys([{"token_ids": prompt, "kv_tokens": PAGE}]).keys[0]
        assert key in stored
    stats: dict[str, Any] = dict(taken.stats)
    assert stats["chunks"] >= len(stored)  # streamed, one page per chunk after the consistent point
    assert stats["lost_pages"] == 0
    assert _protected(s) == 0  # every page copied, every lock released


def test_a_cancelled_capture_releases_its_pins_and_deletes_its_files(old_then_newer: SglangProcess) -> None:
    s = old_then_newer
    ch = WorkerChannel(s.control_socket)
    cap = ch.capture(copy_per_step=1, full=True, timeout=60)  # durable pages too
    assert not cap.get("last")  # pages are still to come: the tree is pinned
    assert _protected(s) > 0
    assert ch.cancel(cap.seq).cancelled
    wait_for(lambda: _protected(s) == 0, 60, "the cancelled capture's locks to go")
    staged = Path(str(cap.get("index"))).parent
    wait_for(lambda: not list(staged.glob(f"capture-*-{cap.seq}-*")), 60, "the cancelled capture's files")
    with pytest.raises(ControlError, match=f"capture {cap.seq}"):
        ch.next(seq=cap.seq, timeout=1)


def test_a_flush_during_a_capture_ends_it_and_the_next_capture_works(old_then_newer: SglangProcess) -> None:
    s = old_then_newer
    ch = WorkerChannel(s.control_socket)
    cap = ch.capture(copy_per_step=1, full=True, timeout=60)  # durable pages too
    staging.unlink_pair(str(cap.get("index")))  # chunk 0 read
    httpx.post(s.url + "/flush_cache", timeout=30).raise_for_status()
    with pytest.raises(ControlError, match="flushed"):
        ch.next(seq=cap.seq, ack=[0], timeout=30)
    assert _protected(s) == 0
    # the tree is empty now; a new request's pages are found by the next capture
    s.client.complete(OLD, {**GREEDY, "max_new_tokens": 2}, rid="old-again")
    cap = ch.capture(full=True, timeout=60)
    parts: list[Any] = [cap.raw]
    keys: set[str] = set()
    while True:
        acks = []
        for part in parts:
            index = str(part["shards"][0]["index"])
            keys |= {k.hex() for k in staging.PageFile(index, mapped=False).index.keys}
            staging.unlink_pair(index)
            acks.append(int(part["chunk"]))
        r = ch.next(seq=cap.seq, ack=acks, timeout=60)
        if r.done:
            break
        parts = list(r.parts)
    assert _old_keys(s) <= keys
    assert _protected(s) == 0


def test_the_description_carries_the_gpu_facts_as_the_servers_process_probes_them(
    server: SglangProcess, sglang_python: str
) -> None:
    # on Kubernetes only the worker's container has the GPU: the agent fills its unknowns from here;
    # and the torch that writes the KV cache is the server's (pinned, not the agent's)
    desc = WorkerChannel(server.control_socket).describe()
    host = desc.layout["host"]
    assert set(host) == {*GPU_FACTS, "torch_version"}
    theirs = subprocess.run(
        [sglang_python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, timeout=300
    )
    assert host["torch_version"] == theirs.stdout.strip()
    mine = host_facts(use_cuda=False).model_dump(include=set(GPU_FACTS))
    nvml = ("gpu_product", "gpu_count", "driver_version")  # one machine: NVML answers both processes alike
    assert {k: host[k] for k in nvml} == {k: mine[k] for k in nvml}
