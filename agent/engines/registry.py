"""The engines gpuckpt knows: one table, name → Engine class, ledger module, ledger schema.

A third engine is a package ``agent/engines/<name>/`` (its adapter, its
:class:`~agent.engines.base.Engine` subclass, its ledger module) plus one row
in :data:`ENGINES`. The table names modules by their dotted path and imports
them only when asked (:func:`importlib.import_module`): nothing here imports
an engine's package, so neither the agent nor the CLI loads an engine's code
(or the engine itself) to know its name, and the packages stay independent of
each other. Every engine-specific choice elsewhere — the agent's ``engine``
setting, which package reads a ledger (:mod:`agent.engines.ledgers`), which
Engine a command starts — reads this table.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from agent.engines.base import Engine
from ckpt.errors import ConfigError, FormatError

__all__ = ["ENGINES", "EngineEntry", "engine_class", "ledger_module", "names"]


@dataclass(frozen=True)
class EngineEntry:
    """One engine: its name, its Engine class (``module:attribute``), the module that reads its
    ledgers (no engine import: the agent reads them) and the schema its ledgers carry."""

    name: str
    engine: str
    ledger: str
    schema: str


#: engine name → its entry
ENGINES: dict[str, EngineEntry] = {
    e.name: e
    for e in (
        EngineEntry("vllm", "agent.engines.vllm.engine:VllmEngine", "agent.engines.vllm.ledger", "gpuckpt-vllm-ledger"),
        EngineEntry(
            "sglang", "agent.engines.sglang.engine:SglangEngine", "agent.engines.sglang.ledger", "gpuckpt-sglang-ledger"
        ),
    )
}


def names() -> list[str]:
    """The known engines' names, sorted."""
    return sorted(ENGINES)


def engine_class(name: str) -> type[Engine]:
    """The engine called ``name``, or :class:`ckpt.ConfigError` naming the known ones."""
    entry = ENGINES.get(name)
    if entry is None:
        raise ConfigError(f"unknown engine {name!r}; one of {', '.join(names())}")
    module, attr = entry.engine.split(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise ConfigError(f"{entry.engine} is not an Engine")
    return cls


def ledger_module(schema: object) -> ModuleType:
    """The module that reads ledgers of ``schema``, or :class:`ckpt.FormatError` naming the schema."""
    entry = next((e for e in ENGINES.values() if e.schema == schema), None)
    if entry is None:
        known = ", ".join(sorted(e.schema for e in ENGINES.values()))
        raise FormatError(f"ledger schema {schema!r} is not one this gpuckpt reads ({known})")
    module = importlib.import_module(entry.ledger)
    if getattr(module, "SCHEMA", None) != entry.schema:
        raise FormatError(f"{entry.ledger} does not read {entry.schema!r} ledgers (registry out of step)")
    return module
