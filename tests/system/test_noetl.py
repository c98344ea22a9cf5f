"""A NoETL-shaped deployment, run the way NoETL runs it (tests/system/deployment.py):
servers publishing in bursts with idle gaps longer than every timer, workers in both
dialects and both clients that wait for work, crash mid-command and are replaced, event
groups (two created mid-run), a push subscriber, a reader, and probes from outside. Then
every guarantee is checked against what each process saw."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .deployment import figures, run, violations

pytestmark = pytest.mark.system


def report(outcome_figures: dict[str, object], problems: list[str]) -> str:
    return "\n".join(
        [f"{len(problems)} guarantees broken:", *problems[:40], json.dumps(outcome_figures)]
    )


def test_a_day_in_a_minute(tmp_path: Path) -> None:
    outcome = run(tmp_path)
    problems = violations(outcome)
    assert not problems, report(figures(outcome), problems)
    assert len(outcome.killed) == 2  # the crashes happened
    assert outcome.kind("extended")  # some command outlived its lease, extended


def test_a_day_in_a_minute_with_the_writer_killed_twice(tmp_path: Path) -> None:
    """The same, with the writer SIGKILLed and restarted twice: at least once, nothing
    acknowledged lost, sort keys never reused; everyone reconnects by themselves."""
    outcome = run(tmp_path, faults=True, seed=2)
    problems = violations(outcome)
    assert not problems, report(figures(outcome), problems)
    assert len(outcome.restarts) == 2
