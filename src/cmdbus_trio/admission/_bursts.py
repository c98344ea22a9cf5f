"""Shed bursts: one log line when shedding starts, one when it has stopped."""

from __future__ import annotations

import enum
import logging
from collections import Counter as _Tally

from cmdbus_trio.logs import event

log = logging.getLogger(__name__)


class ShedReason(enum.StrEnum):
    """Why the Gate refused a request (the ``reason`` of ``cmdbus_shed_total``)."""

    WAITERS_FULL = "waiters_full"
    QUEUE_TIMEOUT = "queue_timeout"
    DEADLINE = "deadline"


class ShedBursts:
    """Logs one line when shedding starts and one when it has stopped for
    ``quiet_period`` seconds, instead of a line per shed request."""

    quiet_period = 1.0

    def __init__(self, face: str) -> None:
        self.face = face
        self._started: float | None = None
        self._last = 0.0
        self._reasons: _Tally[str] = _Tally()

    def shed(self, reason: ShedReason, now: float) -> None:
        if self._started is None:
            self._started = now
            event(log, logging.WARNING, "shed_burst_started", face=self.face, reason=reason.value)
        self._last = now
        self._reasons[reason.value] += 1

    def tick(self, now: float) -> None:
        if self._started is not None and now - self._last >= self.quiet_period:
            event(
                log,
                logging.WARNING,
                "shed_burst_ended",
                face=self.face,
                duration_s=round(self._last - self._started, 3),
                shed=dict(self._reasons),
            )
            self._started = None
            self._reasons.clear()
