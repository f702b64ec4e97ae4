"""Log output of the `msdata-server` CLI: human text, or one JSON object per line for log collectors.

Only the CLI calls ``configure_logging`` (library code never configures logging). The JSON lines carry
``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message`` and, when present, ``exc_info``/``stack_info`` text
and ``fields``: the structured figures a record was logged with (``log.info(..., extra={"fields": {...}})``,
e.g. a job's end-of-run summary); text lines carry them only in their message.
"""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from collections.abc import Hashable
from datetime import UTC, datetime
from typing import IO

import orjson

from ..config import LOG_FORMATS, LOG_LEVELS, LogFormat

__all__ = ["LOG_FORMATS", "LOG_LEVELS", "JsonFormatter", "LogFormat", "Once", "configure_logging"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a message's own newlines are escaped by JSON)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            doc["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exc_info"] = record.exc_text
        if record.stack_info:
            doc["stack_info"] = self.formatStack(record.stack_info)
        fields = record.__dict__.get("fields")
        if isinstance(fields, dict):
            doc["fields"] = fields
        return orjson.dumps(doc, default=str).decode()


def configure_logging(level: str | int = "INFO", fmt: str = "text", *, stream: IO[str] | None = None) -> None:
    """Send every log record at ``level`` or above to ``stream`` (stderr) as ``fmt``; replaces earlier handlers."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r} must be one of {list(LOG_FORMATS)}")
    if isinstance(level, str):
        if level.upper() not in LOG_LEVELS:
            raise ValueError(f"log level {level!r} must be one of {list(LOG_LEVELS)}")
        level = getattr(logging, level.upper())
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.captureWarnings(True)  # Python warnings (a library's DeprecationWarning, Pillow's) as log records too


class Once:
    """Which warnings were already logged, so a client, peer or sample that misbehaves again and again is named
    once and not in a loop: ``if once(kind, who): log.warning(...)``. Bounded: past ``limit`` keys the oldest is
    forgotten (and may be logged again), so a stream of distinct offenders cannot grow memory."""

    def __init__(self, limit: int = 1024):
        if limit < 1:
            raise ValueError(f"{limit=} must be >= 1")
        self.limit = limit
        self.suppressed = 0  # repeats not logged (a figure for status)
        self._seen: OrderedDict[tuple[Hashable, ...], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def __call__(self, *key: Hashable) -> bool:
        """True the first time ``key`` is seen (log it), False on a repeat."""
        if key in self._seen:
            self._seen.move_to_end(key)
            self.suppressed += 1
            return False
        self._seen[key] = None
        if len(self._seen) > self.limit:
            self._seen.popitem(last=False)
        return True
