"""The system test's judge (harness/deployment.py) is itself held to the facts: a
redelivery, or a command nobody saw acked, is excused only by what happened, whatever
order the processes noted things in."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from harness.deployment import (
    ACK_WAIT,
    Deployment,
    Outcome,
    _ack_lost_with_the_writer,
    _redelivery_explained,
)


def outcome(
    lines: list[dict[str, Any]], restarts: list[tuple[float, float]] | None = None
) -> Outcome:
    return Outcome(
        root=Path("."),
        faults=False,
        lines=lines,
        probes=[],
        rss=[],
        restarts=restarts or [],
        killed=set(),
        started=0.0,
        quiet=60.0,
        metrics="",
        writer_exit=0,
        writer_log="",
        tier={},
    )


def by_actor(lines: list[dict[str, Any]]) -> dict[str, dict[int, list[dict[str, Any]]]]:
    events_of: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for x in lines:
        events_of[x["actor"]][x["sort_key"]].append(x)
    return events_of


def judge(lines: list[dict[str, Any]]) -> bool:
    events_of = by_actor(lines)
    first, second = [x for x in lines if x["kind"] == "claimed"]
    return _redelivery_explained(outcome(lines), first, second, events_of)


def line(t: float, actor: str, kind: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "actor": actor, "kind": kind, "sort_key": 2, **fields}


def test_a_nack_noted_after_the_redelivery_it_caused_excuses_it() -> None:
    """CI once saw the next worker note its claim before the nacking one noted the reply."""
    lines = [
        line(1.00, "trio", "claimed"),
        line(1.20, "trio", "nacking"),
        line(1.21, "blocking", "claimed"),
        line(1.25, "trio", "nacked", ok=True),
    ]
    assert judge(lines)
    assert not judge([x for x in lines if x["kind"] != "nacking"])


def test_a_redelivery_without_a_cause_is_not_excused() -> None:
    lines = [line(1.0, "trio", "claimed"), line(1.5, "trio", "acking")]
    lines.append(line(1.6, "blocking", "claimed"))
    assert not judge(lines)
    lapsed = [line(1.0, "trio", "claimed"), line(1.0 + ACK_WAIT, "blocking", "claimed")]
    assert judge(lapsed)


def test_an_extension_counts_from_when_it_was_asked() -> None:
    """The new lease starts no earlier than the request: a late-noted reply must not
    make a lapse look early, and a refused extension renews nothing."""
    asked = 1.0 + ACK_WAIT * 0.5
    lines = [
        line(1.0, "trio", "claimed"),
        line(asked, "trio", "extending"),
        line(asked + 0.5, "trio", "extended", ok=True),
        line(asked + ACK_WAIT, "blocking", "claimed"),
    ]
    assert judge(lines)
    lines[-1] = line(asked + ACK_WAIT * 0.5, "blocking", "claimed")
    assert not judge(lines)
    lines[2] = line(asked + 0.5, "trio", "extended", ok=False)
    assert judge(lines)


def test_an_ack_retried_against_the_restarted_writer_was_durable() -> None:
    """CI once saw a worker's ack sent just before the writer was killed; its client
    retried it against the new writer, which answered false: already acked. The record
    was never delivered again, so the first attempt was durable."""
    lines = [
        line(1.0, "trio", "claimed"),
        line(1.5, "trio", "acking"),
        line(3.0, "trio", "acked", ok=False),
    ]
    claim, events_of = lines[0], by_actor(lines)
    assert _ack_lost_with_the_writer(outcome(lines, restarts=[(2.0, 2.5)]), claim, events_of)
    assert not _ack_lost_with_the_writer(outcome(lines), claim, events_of)
    killed_before_the_ack = outcome(lines, restarts=[(1.2, 1.4)])
    assert not _ack_lost_with_the_writer(killed_before_the_ack, claim, events_of)
    lost = [*lines[:2], line(2.1, "trio", "transient", what="command")]
    assert _ack_lost_with_the_writer(outcome(lost), claim, by_actor(lost))


@pytest.mark.parametrize("code", [0, 3])
def test_an_actor_that_failed_before_the_run_ended_fails_the_run(tmp_path: Path, code: int) -> None:
    """An actor ended on its own with an error (a harness bug, a client that raised) did
    not do what the run counts on, and no other check would see it; one that ended with
    0 finished its part (an abandoned group's consumer)."""
    deployment = Deployment(tmp_path)
    ended = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    ended.wait()
    deployment.actors = {
        "ended": ended,
        "running": subprocess.Popen([sys.executable, "-c", "input()"], stdin=subprocess.PIPE),
    }
    if code:
        with pytest.raises(
            AssertionError, match=r"actors failed before the run ended: \{'ended': 3\}"
        ):
            deployment.stop_actors()
    else:
        deployment.stop_actors()
    assert deployment.actors["running"].poll() is not None  # stopped all the same
