"""How every subcommand prints: JSON lines on stdout, or a table with ``--human``, and
errors as one line on stderr."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

import attrs


class Output:
    """JSON mode prints each row at once (a long ``claim`` streams); human mode collects
    rows and prints one table when the command finishes."""

    def __init__(self, *, human: bool, stream: TextIO | None = None) -> None:
        self.human = human
        self.stream = stream or sys.stdout
        self._rows: list[dict[str, Any]] = []

    def row(self, value: Any) -> None:
        document = attrs.asdict(value) if attrs.has(type(value)) else value
        if self.human:
            self._rows.append(document)
        else:
            print(json.dumps(document, separators=(",", ":")), file=self.stream, flush=True)

    def close(self) -> None:
        if self.human and self._rows:
            print(table(self._rows), file=self.stream, flush=True)
        self._rows.clear()


def table(rows: list[dict[str, Any]], max_cell: int = 60) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_cell(row.get(column), max_cell) for column in columns] for row in rows]
    widths = [max(len(column), *(len(r[i]) for r in cells)) for i, column in enumerate(columns)]
    lines = [columns, ["-" * w for w in widths], *cells]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def _cell(value: Any, max_cell: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= max_cell else text[: max_cell - 1] + "…"


def fail(command: str, message: str) -> int:
    print(f"cmdbus-trio {command}: {message}", file=sys.stderr, flush=True)
    return 1


def leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions inside ``group`` and its nested groups."""
    return [
        leaf
        for exc in group.exceptions
        for leaf in (leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    ]
