"""Engine adapters: the engine-neutral interface (:mod:`agent.engines.base`), the agent side
every engine shares (:mod:`.driver`, :mod:`.control`, :mod:`.staging`, :mod:`.canary`) and one
package per engine (``vllm``, ``sglang``). Only an engine's own package imports the engine.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from agent.engines.base import Engine
from ckpt.errors import ConfigError

#: engine name → its :class:`~agent.engines.base.Engine` class (module:attribute, imported on use)
ENGINES: dict[str, str] = {
    "vllm": "agent.engines.vllm.engine:VllmEngine",
    "sglang": "agent.engines.sglang.engine:SglangEngine",
}


def engine_class(name: str) -> type[Engine]:
    """The engine called ``name``, or :class:`ckpt.ConfigError` naming the known ones."""
    spec = ENGINES.get(name)
    if spec is None:
        raise ConfigError(f"unknown engine {name!r}; one of {', '.join(sorted(ENGINES))}")
    module, attr = spec.split(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise ConfigError(f"{spec} is not an Engine")
    return cls


def get(name: str, socket: str | os.PathLike[str], staging: Any = None) -> Engine:
    """The worker of engine ``name`` whose adapter answers on ``socket``."""
    return engine_class(name)(socket, staging)


def attach(socket: str | os.PathLike[str], name: str | None = None, staging: Any = None) -> Engine:
    """The worker on ``socket`` as engine ``name``, or as the engine it says it runs (its pins)."""
    if name is None:
        from agent.engines import driver

        name = driver.describe(socket).facts.engine or "vllm"
    return get(name, socket, staging)


def for_command(command: list[str]) -> type[Engine]:
    """The engine a worker command starts (``vllm serve ...``, ``python -m sglang.launch_server ...``)."""
    for name in ENGINES:
        cls = engine_class(name)
        if cls.runs(command):
            return cls
    raise ConfigError(f"cannot tell which engine {' '.join(command[:3])!r} starts (known: {', '.join(ENGINES)})")


__all__ = ["ENGINES", "Engine", "attach", "engine_class", "for_command", "get"]
