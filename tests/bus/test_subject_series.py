"""Subjects are client data (a command's pool, an event's type): the metric series they
label are bounded by CMDBUS_SUBJECT_SERIES, whatever clients send."""

from __future__ import annotations

from typing import Any

import pytest

from cmdbus_trio import metrics
from cmdbus_trio.bus.claims import Claims
from cmdbus_trio.bus.groups import export_feed_lag
from cmdbus_trio.protocol.subjects import parse_filter


def _value(family: Any, subject: str) -> float:
    for metric in family.collect():
        for sample in metric.samples:
            if sample.labels.get("subject") == subject and not sample.name.endswith("_created"):
                return float(sample.value)
    return 0.0


async def test_ten_thousand_pools_grow_the_scrape_by_at_most_200_kb(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    series = metrics.series_of_subjects(500)
    monkeypatch.setattr(metrics, "SUBJECTS", series)
    before = len(metrics.exposition()[0])
    folds = metrics.SUBJECT_FOLDS._value.get()
    claims = Claims("commands", ack_wait=30.0)
    pools = [f"commands.pool{n}.shard.0" for n in range(10_000)]
    claims.add_many((n + 1, subject) for n, subject in enumerate(pools))
    claims.add_many((n + 10_001, subject) for n, subject in enumerate(pools))  # 2 per pool
    owner = object()
    for _ in pools:  # one of each pool's two records delivered
        assert claims.next_nowait(parse_filter(">"), owner) is not None
    export_feed_lag(claims, shard="0")  # what the lag sampler does each second
    grown = len(metrics.exposition()[0]) - before
    assert grown <= 200_000, f"10,000 pools grew /metrics by {grown} bytes"
    assert len(series.named) == 500
    assert metrics.SUBJECT_FOLDS._value.get() - folds >= 9_500
    # The folded pools are summed into one series; a named one keeps its own.
    assert _value(metrics.FEED_SUBJECT_LAG, metrics.OTHER_SUBJECTS) == 2 * 9_500
    assert _value(metrics.FEED_SUBJECT_LAG, pools[0]) == 2
    assert _value(metrics.DELIVERIES, metrics.OTHER_SUBJECTS) >= 9_500


def test_the_first_subjects_keep_their_own_series() -> None:
    series = metrics.series_of_subjects(2)
    assert [series.label(s) for s in ("a", "b", "c", "a", "d", "b")] == [
        "a",
        "b",
        metrics.OTHER_SUBJECTS,
        "a",
        metrics.OTHER_SUBJECTS,
        "b",
    ]
