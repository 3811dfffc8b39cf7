"""Everything that talks to a serving engine: the engine-neutral types (:mod:`.types`), the
control protocol (:mod:`.protocol`, :mod:`.channel`, :mod:`.control`), page files
(:mod:`.staging`), the engines' table (:mod:`.registry`) and one package per engine (``vllm``,
``sglang``). Only an engine's own package imports the engine.
"""

from __future__ import annotations

import os

from agent.engines.base import Engine
from agent.engines.channel import WorkerChannel
from agent.engines.registry import ENGINES, engine_class, names
from agent.engines.types import Staging
from ckpt import WorkerFacts
from ckpt.errors import ConfigError


def get(name: str, socket: str | os.PathLike[str], staging: Staging | None = None) -> Engine:
    """The worker of engine ``name`` whose adapter answers on ``socket``."""
    return engine_class(name)(socket, staging)


def attach(socket: str | os.PathLike[str], name: str | None = None, staging: Staging | None = None) -> Engine:
    """The worker on ``socket`` as engine ``name``, or as the engine it says it runs (its pins)."""
    if name is None:
        name = WorkerFacts.model_validate(WorkerChannel(socket).describe().facts).engine or "vllm"
    return get(name, socket, staging)


def for_command(command: list[str]) -> type[Engine]:
    """The engine a worker command starts (``vllm serve ...``, ``python -m sglang.launch_server ...``)."""
    for name in ENGINES:
        cls = engine_class(name)
        if cls.runs(command):
            return cls
    raise ConfigError(f"cannot tell which engine {' '.join(command[:3])!r} starts (known: {', '.join(ENGINES)})")


__all__ = ["ENGINES", "Engine", "attach", "engine_class", "for_command", "get", "names"]
