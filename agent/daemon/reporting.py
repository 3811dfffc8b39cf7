"""How the agent writes what it reports (status, logs, the restore report): times and errors."""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["describe_error", "now"]


def now() -> str:
    """The wall-clock time as the agent reports it (UTC, milliseconds)."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def describe_error(exc: BaseException) -> str:
    """``Type: first line of the message`` (or the type alone)."""
    msg = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
