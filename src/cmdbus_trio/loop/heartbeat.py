"""The event loop's heartbeat: how late the loop is, and whether it counts as stalled."""

from __future__ import annotations

import attrs
import trio

from .. import metrics
from . import turns


@attrs.frozen
class LoopStatistics:
    last_lag: float
    """Lateness of the latest beat, seconds."""
    beat_age: float
    """Seconds since the latest beat; above ``interval`` plus a little means the loop is
    stalled right now (or the heartbeat task has not been scheduled yet)."""
    worst_recent_lag: float
    """Worst lateness seen within the liveness window, seconds."""
    stalled: bool
    reason: str | None


class Heartbeat:
    """Wakes every ``interval`` seconds and records how late it woke.

    The loop counts as stalled when the heartbeat is overdue by more than ``threshold``,
    or when a beat was later than ``threshold`` within the last ``window`` seconds. The
    second condition matters because a request that was itself stuck behind a stall may
    be served before the heartbeat runs again: it must still see the stall.
    """

    def __init__(self, *, interval: float = 0.1, threshold: float, window: float) -> None:
        self.interval = interval
        self.threshold = threshold
        self.window = window
        self._last_beat = trio.current_time()
        self._last_lag = 0.0
        self._stall_at = -float("inf")  # when the latest over-threshold beat ended
        self._stall_lag = 0.0
        # The turn budget's counts as last added to the metrics (which only count up).
        self._turns_synced = turns.TurnStatistics(
            turns=0, deferred=0, busy=0.0, control_first=0.0, control=0.0, control_waited=0.0
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._last_beat = trio.current_time()
        task_status.started()
        while True:
            expected = self._last_beat + self.interval
            await trio.sleep_until(expected)
            self._beat(trio.current_time(), expected)

    def _beat(self, now: float, expected: float) -> None:
        lag = max(0.0, now - expected)
        metrics.LOOP_LAG.observe(lag)
        synced, now_turns = self._turns_synced, turns.current().statistics()
        metrics.LOOP_TURNS.inc(now_turns.turns - synced.turns)
        metrics.LOOP_TURNS_DEFERRED.inc(now_turns.deferred - synced.deferred)

        metrics.LOOP_BUSY.inc(now_turns.busy - synced.busy)
        metrics.LOOP_CONTROL_FIRST.inc(now_turns.control_first - synced.control_first)
        metrics.LOOP_CONTROL.inc(now_turns.control - synced.control)
        metrics.CONTROL_PACED.inc(now_turns.control_waited - synced.control_waited)
        self._turns_synced = now_turns
        self._last_beat = now
        self._last_lag = lag
        if lag > self.threshold:
            self._stall_at, self._stall_lag = now, lag

    def statistics(self) -> LoopStatistics:
        now = trio.current_time()
        beat_age = now - self._last_beat
        overdue = beat_age - self.interval
        recent = now - self._stall_at <= self.window
        worst = self._stall_lag if recent else self._last_lag
        reason = None
        if overdue > self.threshold:
            reason = f"event loop stalled: heartbeat overdue by {overdue:.3f} s"
        elif recent:
            reason = f"event loop stalled {self._stall_lag:.3f} s, {now - self._stall_at:.1f} s ago"
        if reason is not None:
            reason += f" (threshold {self.threshold:.3f} s)"
        return LoopStatistics(
            last_lag=self._last_lag,
            beat_age=beat_age,
            worst_recent_lag=max(worst, max(0.0, overdue)),
            stalled=reason is not None,
            reason=reason,
        )
