"""How every subcommand prints: for a human on a terminal (a table, or text), JSON lines
when stdout is not a terminal; ``--human`` and ``--json`` choose either way. Errors are
one line on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

import attrs


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--json", action="store_true", help="JSON lines (the default when stdout is not a terminal)"
    )
    mode.add_argument(
        "--human", action="store_true", help="for a human (the default on a terminal)"
    )


def human_wanted(args: argparse.Namespace, stream: TextIO | None = None) -> bool:
    """``--human``, ``--json``, else whether ``stream`` (stdout) is a terminal."""
    if getattr(args, "human", False) or getattr(args, "json", False):
        return bool(getattr(args, "human", False))
    return (stream or sys.stdout).isatty()


class Output:
    """JSON mode prints each row at once (a long ``claim`` streams); human mode collects
    rows and prints one table when the command finishes."""

    def __init__(self, *, human: bool, stream: TextIO | None = None, follow: bool = False) -> None:
        self.human = human
        self.stream = stream or sys.stdout
        self.follow = follow
        """A command that may run until interrupted (``claim``, ``subscribe``): a human
        sees each row as it comes, as ``field=value`` pairs, not a table at the end."""
        self._rows: list[dict[str, Any]] = []

    def row(self, value: Any) -> None:
        document = attrs.asdict(value) if attrs.has(type(value)) else value
        if self.human and isinstance(document, dict):  # no empty columns for a person
            document = {key: item for key, item in document.items() if item not in (None, "")}
        if self.human and self.follow:
            pairs = (f"{key}={_cell(value, 200)}" for key, value in _flat(document))
            print("  ".join(pairs), file=self.stream, flush=True)
        elif self.human:
            self._rows.append(document)
        else:
            print(json.dumps(document, separators=(",", ":")), file=self.stream, flush=True)

    def close(self) -> None:
        if self.human and self._rows:
            print(table(self._rows), file=self.stream, flush=True)
        self._rows.clear()


def table(rows: list[dict[str, Any]], max_cell: int = 60) -> str:
    """A text table: a column per key, nested objects as columns of their own
    (``reasons.0``, ``loop.turn_ms``), a list of plain values as one comma-joined cell."""
    rows = [dict(_flat(row)) for row in rows]
    if len(rows) == 1:  # one record: a field a line reads better than one wide line
        rows = [{"field": key, "value": value} for key, value in rows[0].items()]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_cell(row.get(column), max_cell) for column in columns] for row in rows]
    widths = [max(len(column), *(len(r[i]) for r in cells)) for i, column in enumerate(columns)]
    lines = [columns, ["-" * w for w in widths], *cells]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def _flat(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        return [pair for k, v in value.items() for pair in _flat(v, f"{prefix}{k}.")]
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        return [pair for i, v in enumerate(value) for pair in _flat(v, f"{prefix}{i}.")]
    if isinstance(value, list):
        value = ", ".join(item if isinstance(item, str) else json.dumps(item) for item in value)
    return [(prefix.removesuffix("."), value)]


def _cell(value: Any, max_cell: int) -> str:
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= max_cell else text[: max_cell - 1] + "…"


INTERRUPTED = 130
"""The exit status after Ctrl-C (128 + SIGINT, as shells report it). ``serve`` takes
SIGINT as a drain instead, and exits 0 once it is done."""


class UsageError(ValueError):
    """The command's flags do not go together: exit 2, as argparse's own errors do."""


def fail(command: str, message: str, *, code: int = 1) -> int:
    print(f"cmdbus-trio {command}: {message}", file=sys.stderr, flush=True)
    return code


def leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions inside ``group`` and its nested groups."""
    return [
        leaf
        for exc in group.exceptions
        for leaf in (leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    ]
