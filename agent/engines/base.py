"""An engine: what differs between serving engines, as the daemon, its API and the CLI reach a worker.

The worker half (inside the serving process: vLLM's KV connector, SGLang's
cache linker) answers gpuckpt's control protocol (:mod:`agent.engines.protocol`)
on its control socket and exchanges pages through page files
(:mod:`agent.engines.staging`), the same for every engine, so checkpointing,
restore planning (pins, namespace, policy, canary, resubmission) and streaming
are engine-neutral and written once (:mod:`agent.session`, over the worker's
:class:`~agent.engines.channel.WorkerChannel`). What an engine adds is how its
worker is started (:meth:`Engine.worker_command`), how a command is recognized
as its own (:meth:`Engine.runs`) and how requests get back into it
(:meth:`Engine.client`); its ledger's layout is its own package's. Engines are
listed in one table, :mod:`agent.engines.registry`; get one with
:func:`agent.engines.get`. The types they exchange are :mod:`agent.engines.types`.
"""

from __future__ import annotations

import abc
import os
import shlex
import shutil
import sys
from typing import ClassVar

from agent.engines.channel import WorkerChannel
from agent.engines.types import (
    TRUST_DOMAIN,
    Capture,
    Checkpointed,
    RestorePlan,
    Resubmission,
    ServingClient,
    Staging,
    WorkerDescription,
    token_digest,
)

__all__ = [
    # the types, for importers written before agent.engines.types
    "TRUST_DOMAIN",
    "Capture",
    "Checkpointed",
    "Engine",
    "RestorePlan",
    "Resubmission",
    "ServingClient",
    "Staging",
    "WorkerDescription",
    "script_python",
    "token_digest",
]


class Engine(abc.ABC):
    """A serving engine's worker: its name and default port, its control channel, where its page
    files may be (``staging``), how its server is started and how its requests API is reached."""

    #: the name in ``engine = ...``, in the registry and in a worker's pins (``WorkerFacts.engine``)
    name: ClassVar[str]
    #: the port its API server listens on when the command names none
    default_port: ClassVar[int]

    def __init__(self, socket: str | os.PathLike[str], staging: Staging | None = None) -> None:
        self.socket = socket
        #: where the worker's page files may be and whom to trust with them
        self.staging = staging if staging is not None else Staging()
        #: the worker half's control protocol, one typed method per command
        self.channel = WorkerChannel(socket)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.socket)!r})"

    @abc.abstractmethod
    def client(self, url: str) -> ServingClient:
        """A client of the worker's request API at ``url`` (canary probe, resubmission)."""

    @classmethod
    @abc.abstractmethod
    def runs(cls, command: list[str]) -> bool:
        """Whether ``command`` (``gpuckpt launch -- ...``) starts a worker of this engine."""

    @classmethod
    @abc.abstractmethod
    def worker_command(
        cls,
        command: list[str],
        *,
        control_socket: str,
        staging_dir: str | None,
        shared_group: str | None,
        hold_retries_s: float = 0.0,
    ) -> list[str]:
        """``command`` with this engine's gpuckpt adapter configured (its own flags, no patch).

        ``hold_retries_s``: a restore will follow; where the engine's server can, requests that
        may be retries (they carry an ``X-Request-Id``) wait up to this long for the agent to say
        which requests it resubmits, so that a retry attaches instead of starting a duplicate."""


def script_python(script: str) -> str:
    """The interpreter a console script runs with (its ``#!`` line; ours where it cannot be read)."""
    path = shutil.which(script)
    if path:
        with open(path, "rb") as f:
            first = f.readline().decode(errors="replace")
        if first.startswith("#!"):
            return shlex.split(first[2:].strip())[0]
    return sys.executable
