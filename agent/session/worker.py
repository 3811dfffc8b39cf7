"""The worker a session works on, and the control calls that are an operation of their own.

Every function of :mod:`agent.session` takes the worker first, as a
:data:`WorkerLike`: an :class:`~agent.engines.base.Engine` (its channel, its
staging, and its name, which the worker must run), a
:class:`~agent.engines.channel.WorkerChannel`, or the path of the worker
adapter's control socket. :func:`reach` turns each into a :class:`Worker`.
Errors are the channel's (:mod:`agent.engines.channel`): nothing answering is
:class:`ckpt.errors.WorkerUnreachable`, a refusal or a broken call
:class:`~agent.engines.control.ControlError`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.engines.base import Engine
from agent.engines.channel import WorkerChannel
from agent.engines.types import Staging, WorkerDescription
from ckpt import EngineMismatch, HostFacts, WorkerFacts, host_facts
from ckpt.pins import ABSENT, GPU_FACTS

__all__ = [
    "host_pins",
    "Socket",
    "Worker",
    "WorkerLike",
    "describe",
    "hold",
    "reach",
    "stats",
    "sweep",
    "wait_until",
    "withdraw",
]

Socket = str | os.PathLike[str]
#: what a session function accepts as its worker
WorkerLike = Engine | WorkerChannel | Socket


@dataclass(frozen=True)
class Worker:
    """One worker as a session reaches it: its control channel, where its page files may be
    (see :class:`~agent.engines.types.Staging`), and the engine it must run (None: any)."""

    channel: WorkerChannel
    where: Staging
    engine: str | None = None


def reach(worker: WorkerLike, *, where: Staging | None = None, engine: str | None = None) -> Worker:
    """``worker`` as a :class:`Worker`; ``where`` and ``engine``, when given, replace an
    Engine's own (a bare channel or socket: any staging directory, any engine)."""
    if isinstance(worker, Engine):
        return Worker(worker.channel, where or worker.staging, engine or worker.name)
    channel = worker if isinstance(worker, WorkerChannel) else WorkerChannel(worker)
    return Worker(channel, where or Staging(), engine)


def channel_of(worker: WorkerLike) -> WorkerChannel:
    """The control channel of ``worker``."""
    if isinstance(worker, Engine):
        return worker.channel
    return worker if isinstance(worker, WorkerChannel) else WorkerChannel(worker)


def describe(worker: WorkerLike, engine: str | None = None) -> WorkerDescription:
    """The worker's pins, layout and namespace; :class:`ckpt.EngineMismatch` if it runs another
    engine than ``engine`` (default: an Engine's name), before anything else is asked of it."""
    w = reach(worker, engine=engine)
    r = w.channel.describe()
    desc = WorkerDescription(WorkerFacts.model_validate(r.facts), r.layout, r.namespace)
    if w.engine and desc.facts.engine and desc.facts.engine != w.engine:
        raise EngineMismatch(
            f"the worker on {w.channel.socket} runs {desc.facts.engine}, not {w.engine} (the agent's `engine` setting)"
        )
    return desc


def stats(worker: WorkerLike) -> dict[str, Any]:
    """The worker half's counters: tokens loaded per restored request, current step, offers."""
    return channel_of(worker).stats()


def withdraw(worker: WorkerLike) -> int:
    """End the worker's restore offer: no block or request state of it is used from the next step
    boundary on, and its page files are deleted; returns how many page files it held."""
    return channel_of(worker).withdraw().files


def sweep(worker: WorkerLike) -> list[str]:
    """Ask the worker half to delete capture page files no capture in flight owns (a killed agent's)."""
    return list(channel_of(worker).sweep().removed)


def hold(worker: WorkerLike, requests: int, *, timeout: float = 60.0) -> None:
    """Hold new requests in the engine's queue until ``requests`` have arrived (or ``timeout`` s
    passed), then let them start at one step boundary."""
    channel_of(worker).hold(requests, timeout=timeout)


def wait_until(worker: WorkerLike, *, live: int, min_outputs: int = 0, timeout: float = 120.0) -> dict[str, Any]:
    """Block until a step boundary where ``live`` unfinished requests have ``min_outputs`` outputs each.

    The condition is judged by the worker half on the engine's scheduler
    thread at every step, so it cannot be missed between two polls (requests
    that come and go between them); returns the step, live count and each
    request's outputs at that boundary.
    """
    return dict(channel_of(worker).wait(when={"live": live, "min_outputs": min_outputs}, timeout=timeout).raw)


def host_pins(desc: WorkerDescription) -> HostFacts:
    """This host's pinned facts for a checkpoint of the worker ``desc`` describes, or a restore into
    it: the agent's own probe, with the accelerator facts it cannot see and the worker's torch
    taken from the worker (``layout["host"]``, probed in the worker's process).

    On Kubernetes the device plugin gives the GPU to the worker's container only; the agent
    beside it sees none — its probe says unknown, or, with no device node and a CPU torch (the
    agent image), *absent* — and without the worker's word every checkpoint would pin "no GPU" (an
    H100's checkpoint then matches an A100 pod) or every warm restore be refused. So a GPU fact the
    agent does not know, or finds absent where the worker has one, is the worker's. Where the agent
    sees the accelerator itself (one host, systemd), its own probe wins. The torch version is always
    the worker's where it says one: its torch writes the KV cache, and the agent's is only the agent
    image's. Each fact is validated on its own; a malformed one is not taken."""
    own = host_facts()
    theirs = desc.layout.get("host") if isinstance(desc.layout, Mapping) else None
    if not isinstance(theirs, Mapping):
        return own
    # the agent finds no GPU where the worker has one: each GPU fact of the agent's is its own
    # container's, not the worker's (an absent GPU counts 0 devices, and a CPU torch no runtime)
    blind = own.gpu_product in (None, ABSENT) and theirs.get("gpu_product") not in (None, ABSENT)
    fill: dict[str, Any] = {}
    for k in (*GPU_FACTS, "torch_version"):
        v = theirs.get(k)
        mine = getattr(own, k)
        if v is None or v == mine:
            continue
        if k in GPU_FACTS and mine is not None and not blind:
            continue  # the agent sees the accelerator itself
        try:
            HostFacts.model_validate({k: v})
        except ValueError:
            continue
        fill[k] = v
    return own.model_copy(update=fill) if fill else own
