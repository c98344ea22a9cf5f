"""Acknowledged means on disk: power cuts (harness.py) under a mixed load lose nothing the
writer acknowledged in its default mode; and the same cuts catch the two ways a writer
could fail the promise (negative controls, which must find losses, or the checker proves
nothing): ``CMDBUS_SYNC=normal`` (committed, not yet on disk) and a disk that answers
fsync without storing (the shim's ``lying-fsync``, as a writer answering before its
fsync would behave).

CI runs a few cuts a mode (`--cuts`, default 3); `nox -s powercut -- --cuts 200` is the
long form. Each mode prints its row."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from .harness import Tally, power_cuts

pytestmark = pytest.mark.slow


@pytest.fixture
def rng(power_cuts_wanted: int) -> random.Random:
    seed = int(time.time())
    print(f"\npower-cut seed {seed}")
    return random.Random(seed)


def report(tally: Tally) -> None:
    print(f"\n{Tally.HEADER}\n{tally.row()}")
    for example in tally.examples[:5]:
        print(f"  {example}")


def test_power_cuts_lose_nothing_acknowledged(
    tmp_path: Path, shim: Path, power_cuts_wanted: int, rng: random.Random
) -> None:
    tally = power_cuts(tmp_path, shim, "sync=full", power_cuts_wanted, rng)
    report(tally)
    assert tally.acknowledged > 1000, "the load did little"
    assert tally.bypassed == [], "SQLite wrote a watched file through a shared mmap"
    assert tally.violations == 0, tally.examples


def test_the_checker_catches_a_writer_that_answers_before_its_data_is_on_disk(
    tmp_path: Path, shim: Path, power_cuts_wanted: int, rng: random.Random
) -> None:
    """The negative controls: each must find acknowledged records lost."""
    normal = power_cuts(
        tmp_path / "normal", shim, "sync=normal", max(2, power_cuts_wanted // 2), rng,
        CMDBUS_SYNC="normal",
    )  # fmt: skip
    report(normal)
    assert normal.lost > 0, "CMDBUS_SYNC=normal lost nothing: the cuts are not cutting"
    lying = power_cuts(
        tmp_path / "lying", shim, "lying fsync", 2, rng, POWERCUT_FAULT="lying-fsync"
    )
    report(lying)
    assert lying.lost > 0, "a disk that ignores fsync lost nothing: the checker cannot fail"
