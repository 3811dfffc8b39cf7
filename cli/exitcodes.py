"""Exit codes of the ``gpuckpt`` command: the one place errors become numbers.

=====  ==============  ==================================================================
code   name            when
=====  ==============  ==================================================================
0      OK              success
1      ERROR           any other :class:`~ckpt.errors.GpuckptError` (RepositoryExists,
                       ObjectExists, InvalidName, OperationAborted, ...)
2      USAGE           a bad command line: typer/click's own usage errors (unknown
                       option, missing argument, a bad duration or rule name)
3      NOT_FOUND       RepositoryNotFound, CheckpointNotFound, ObjectNotFound
4      INTEGRITY       IntegrityError; ``verify`` found problems
5      INCOMPATIBLE    IncompatibleCheckpoint; ``compat`` refuses a warm restore
6      LOCKED          RepositoryLocked
7      UNAVAILABLE     StoreUnavailable, AccessDenied: the store cannot be reached or
                       refuses us; ServiceUnavailable: the agent or the worker does
                       not answer (WorkerUnreachable) or its adapter refuses
                       (EngineRefused)
8      STORAGE_FULL    StorageFull
9      CONFIG          KeyMissing, KeyMismatch (any EncryptionError), ConfigError,
                       EngineMismatch (the worker runs another engine),
                       FormatError (UnsupportedVersion, ManifestError included)
130    INTERRUPTED     interrupted (Ctrl-C, KeyboardInterrupt)
=====  ==============  ==================================================================

:func:`exit_code_for` maps an exception to its code; :data:`ERROR_CODES` is the
table it walks, most specific class first. ``docs/exit-codes.md`` documents
the same table for users (a test keeps the two in step).
"""

from __future__ import annotations

from typing import Final

from ckpt.errors import (
    AccessDenied,
    CheckpointNotFound,
    ConfigError,
    EncryptionError,
    EngineMismatch,
    FormatError,
    IncompatibleCheckpoint,
    IntegrityError,
    ObjectNotFound,
    RepositoryLocked,
    RepositoryNotFound,
    ServiceUnavailable,
    StorageFull,
    StoreUnavailable,
)

__all__ = [
    "CODES",
    "CONFIG",
    "ERROR",
    "ERROR_CODES",
    "INCOMPATIBLE",
    "INTEGRITY",
    "INTERRUPTED",
    "LOCKED",
    "NOT_FOUND",
    "OK",
    "STORAGE_FULL",
    "UNAVAILABLE",
    "USAGE",
    "exit_code_for",
]

OK: Final = 0
ERROR: Final = 1
USAGE: Final = 2
NOT_FOUND: Final = 3
INTEGRITY: Final = 4
INCOMPATIBLE: Final = 5
LOCKED: Final = 6
UNAVAILABLE: Final = 7
STORAGE_FULL: Final = 8
CONFIG: Final = 9
INTERRUPTED: Final = 130

CODES: Final[dict[str, int]] = {
    "OK": OK,
    "ERROR": ERROR,
    "USAGE": USAGE,
    "NOT_FOUND": NOT_FOUND,
    "INTEGRITY": INTEGRITY,
    "INCOMPATIBLE": INCOMPATIBLE,
    "LOCKED": LOCKED,
    "UNAVAILABLE": UNAVAILABLE,
    "STORAGE_FULL": STORAGE_FULL,
    "CONFIG": CONFIG,
    "INTERRUPTED": INTERRUPTED,
}
"""Every documented code by name."""

ERROR_CODES: Final[tuple[tuple[type[BaseException], int], ...]] = (
    # Most specific first: the first isinstance match wins.
    (KeyboardInterrupt, INTERRUPTED),
    (RepositoryNotFound, NOT_FOUND),
    (CheckpointNotFound, NOT_FOUND),
    (ObjectNotFound, NOT_FOUND),
    (IntegrityError, INTEGRITY),
    (IncompatibleCheckpoint, INCOMPATIBLE),
    (RepositoryLocked, LOCKED),
    (StoreUnavailable, UNAVAILABLE),
    (AccessDenied, UNAVAILABLE),
    (EngineMismatch, CONFIG),  # a worker of another engine than configured
    (ServiceUnavailable, UNAVAILABLE),  # WorkerUnreachable, EngineRefused
    (StorageFull, STORAGE_FULL),
    (EncryptionError, CONFIG),  # KeyMissing, KeyMismatch
    (ConfigError, CONFIG),
    (FormatError, CONFIG),  # UnsupportedVersion, ManifestError
)
"""(exception class, exit code), most specific class first."""


def exit_code_for(exc: BaseException) -> int:
    """The exit code for ``exc``: its row in :data:`ERROR_CODES`, else ``ERROR`` (1)."""
    for cls, code in ERROR_CODES:
        if isinstance(exc, cls):
            return code
    return ERROR
