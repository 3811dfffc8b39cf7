"""Which engine package reads a ledger: chosen by the ledger's ``schema``, never by guessing.

A checkpoint's ledger is written by one engine's adapter and read by the
agent (restore, replay) and by the CLI (``show``). Its layout is that
engine's business: each engine package has a ledger module (no engine
import: the agent reads it) with the functions of :class:`LedgerFormat`,
listed with its schema in :mod:`agent.engines.registry`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, cast

from agent.engines.registry import ledger_module
from agent.engines.types import Resubmission
from ckpt import Ledger

__all__ = ["LedgerFormat", "format_of", "request_count"]


class LedgerFormat(Protocol):
    """One engine's ledger: what the agent needs of it."""

    SCHEMA: str

    def read(self, ledger: Ledger | dict[str, Any]) -> list[dict[str, Any]]: ...

    def resubmissions(self, ledger: Ledger | dict[str, Any]) -> list[Resubmission]: ...

    def judged_on(self, requests: list[Resubmission], layout: Mapping[str, Any]) -> list[Resubmission]:
        """``requests`` with what the restoring worker (its ``describe`` layout) makes inexact added
        to their reasons: the ledger judged them on the worker that wrote it."""
        ...

    def request_states(
        self, ledger: Ledger | dict[str, Any], *, warm: bool
    ) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]: ...

    def key_requests(self, ledger: Ledger | dict[str, Any]) -> list[dict[str, Any]]: ...

    def count(self, ledger: Ledger | dict[str, Any]) -> int: ...


def format_of(ledger: Ledger | dict[str, Any]) -> LedgerFormat:
    """The reader of ``ledger``'s schema, or :class:`ckpt.FormatError` naming the schema."""
    schema = ledger.schema_ if isinstance(ledger, Ledger) else ledger.get("schema")
    return cast(LedgerFormat, ledger_module(schema))


def request_count(ledger: Ledger | None) -> int:
    """Requests in a checkpoint's ledger (0 without one)."""
    return 0 if ledger is None else format_of(ledger).count(ledger)
