"""Structured log formatting.

gpuckpt logs with ``logging`` and puts the facts of an event in ``extra``
(``log.info("checkpoint saved", extra={"checkpoint": id, "blocks": n})``).
These formatters keep those facts as fields: one JSON object per line for
machines (the agent's stdout, journald), ``key=value`` pairs for people.
Values are rendered with ``str`` only for types JSON lacks; nothing is
pickled or repr'd beyond that.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra`` fields of a record."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, then the extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k, v in record_fields(record).items():
            doc.setdefault(k, _jsonable(v))
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``gpuckpt: LEVEL: logger: message key=value ...`` for a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={json.dumps(_jsonable(v))}" for k, v in record_fields(record).items())
        line = f"gpuckpt: {record.levelname.lower()}: {record.name}: {record.getMessage()}"
        out = f"{line} {fields}" if fields else line
        if record.exc_info:
            out += "\n" + self.formatException(record.exc_info)
        return out
