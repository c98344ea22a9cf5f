"""Structured logging: one JSON object per line (or a console line for humans).

Log with :func:`event`: a stable event name plus fields, never a formatted sentence, so
that lines can be searched and counted.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO, TypeGuard

_FIELDS = "cmdbus_fields"


def event(
    logger: logging.Logger,
    level: int,
    name: str,
    *,
    exc_info: BaseException | None = None,
    **fields: Any,
) -> None:
    logger.log(level, name, exc_info=exc_info, extra={_FIELDS: fields})


def leaf(exc: BaseException) -> BaseException:
    """The one error inside nested single-member exception groups (trio wraps each level)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def why(exc: BaseException) -> str:
    """An error for a log field: its type and message, unwrapped (:func:`leaf`)."""
    inner = leaf(exc)
    return f"{type(inner).__name__}: {inner}"


def _render(record: logging.LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z",
        "level": record.levelname.lower(),
        "logger": record.name,
        "event": record.getMessage(),
    }
    out.update(getattr(record, _FIELDS, {}))
    if record.exc_info:
        out["traceback"] = logging.Formatter().formatException(record.exc_info)
    return out


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_render(record), default=str, ensure_ascii=False)


class ConsoleFormatter(logging.Formatter):
    """One line a record, ``key=value`` after its event; a field that is a table (the
    settings, the addresses) follows on lines of its own, one entry a line."""

    def format(self, record: logging.LogRecord) -> str:
        fields = _render(record)
        head = f"{fields.pop('ts')} {fields.pop('level'):7} {fields.pop('event')}"
        fields.pop("logger")
        traceback = fields.pop("traceback", None)
        tables = {key: fields.pop(key) for key, value in list(fields.items()) if _table(value)}
        line = head + "".join(f" {key}={value}" for key, value in fields.items())
        for key, table in tables.items():
            line += f"\n  {key}:" + "".join(f"\n    {k} = {v}" for k, v in table.items())
        return line + (f"\n{traceback}" if traceback else "")


def _table(value: object) -> TypeGuard[dict[str, object]]:
    return isinstance(value, dict) and len(value) > 2


class OncePerBurst(logging.Filter):
    """Lets one record through per ``period`` seconds and drops the rest, counting them;
    the next one let through says how many were dropped. As a filter: trio's listeners
    log every failed accept (EMFILE: out of descriptors) at error level, ten times a
    second. As :meth:`event`: the committers' refused commits, one a group commit."""

    def __init__(self, period: float = 10.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.period = period
        self._clock = clock
        self._last = -float("inf")
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        dropped = self._let_through()
        if dropped is None:
            return False
        if dropped:
            record.msg = f"{record.msg} (and {dropped} more like it, not logged)"
        return True

    def event(self, logger: logging.Logger, level: int, name: str, **fields: Any) -> None:
        """:func:`event`, once per ``period``: the line logged counts those that were
        not since the last one (``not_logged``). For an event that comes a batch or a
        request at a time while one cause lasts, logged once where it is found."""
        dropped = self._let_through()
        if dropped is None:
            return
        if dropped:
            fields["not_logged"] = dropped
        event(logger, level, name, **fields)

    def _let_through(self) -> int | None:
        """None to drop this one; else how many were dropped since the last one."""
        now = self._clock()
        if now - self._last < self.period:
            self.dropped += 1
            return None
        self._last = now
        dropped, self.dropped = self.dropped, 0
        return dropped


def resolved(log_format: str, stream: TextIO) -> str:
    """``auto`` as ``console`` on a terminal and ``json`` elsewhere (a pipe, a file, a
    container's log); any other format as it is."""
    if log_format != "auto":
        return log_format
    return "console" if stream.isatty() else "json"


def configure(log_format: str, level: str) -> None:
    """Send every ``cmdbus_trio`` and ``hypercorn`` log line to stderr in ``log_format``;
    trio's failed-accept lines once per burst."""
    listeners = logging.getLogger("trio.serve_listeners")
    if not any(isinstance(f, OncePerBurst) for f in listeners.filters):
        listeners.addFilter(OncePerBurst())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else ConsoleFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
