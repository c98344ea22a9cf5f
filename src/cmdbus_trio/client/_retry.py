"""Two kinds of trying again, kept apart: riding through a writer that is away (draining,
restarting, briefly unreachable), by default, within a reconnect window; and opt-in
retries of an overloaded writer's refusals: jittered exponential backoff that honours
``retry_after_ms``, under a retry budget so that retries add at most ~``ratio`` extra load
(the SRE book's client-side throttling: a client whose calls keep failing must not
multiply the overload). A writer that is down is not overloaded: its window spends no
budget."""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from typing import Any

import attrs

from ._calls import Call
from ._errors import (
    Busy,
    CannotConnect,
    ClientClosed,
    ClientError,
    ConnectionLost,
    DeadlineExceeded,
    Unavailable,
)

RECONNECT_FOR = 60.0
"""Seconds a call waits for a writer that is away before it raises (the default)."""
RECONNECT_FIRST_PAUSE = 0.05
RECONNECT_MAX_PAUSE = 1.0


@attrs.frozen
class ReconnectStatistics:
    pauses: int
    """Pauses taken before trying again, because the writer was away."""
    outages: int
    """Calls that found the writer away (and paused at least once)."""
    gave_up: int
    """Calls that raised because the writer stayed away for the whole window."""


class Reconnect:
    """A connection's reconnect window: how long a call rides through a writer that is
    away (``seconds``; 0: it raises at once), and what that cost. Thread-safe.

    What is away: a connection that cannot be made (or whose hello failed), one lost, or a
    draining writer's ``unavailable`` (with its ``retry_after_ms``; a poisoned store's is
    raised). What is sent again: a call that cannot have been carried out (no connection
    was made, or the draining writer refused it unread), or one that is safe to send again
    (:attr:`Call.after_loss`). The pauses are jittered, doubling
    from 50 ms to at most 1 s."""

    def __init__(self, seconds: float = RECONNECT_FOR) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise ValueError(f"reconnect_for must be a number of seconds, got {seconds!r}")
        if not 0 <= seconds < math.inf:
            raise ValueError(f"reconnect_for must be >= 0 seconds and finite, got {seconds}")
        self.seconds = float(seconds)
        self._lock = threading.Lock()
        self._pauses = self._outages = self._gave_up = 0
        self._rng = random.Random()

    def covers(self, call: Call[Any], error: ClientError) -> bool:
        """``error`` says the writer is away, and ``call`` may be sent again for it."""
        if isinstance(error, ClientClosed) or not self.seconds:
            return False
        # Nothing was done: no connection was made, or a draining writer refused the
        # call before admitting it (its `unavailable` says when to ask again; a poisoned
        # store's does not: it refuses writes until a restart, so the caller is told).
        if isinstance(error, CannotConnect) or draining(error):
            return True
        return isinstance(error, ConnectionLost) and call.after_loss

    def pause(self, pauses: int) -> float:
        step = min(RECONNECT_MAX_PAUSE, RECONNECT_FIRST_PAUSE * 2.0**pauses)
        with self._lock:
            self._pauses += 1
            self._outages += pauses == 0
            return step / 2 + self._rng.uniform(0, step / 2)

    def gave_up(self) -> None:
        with self._lock:
            self._gave_up += 1

    def statistics(self) -> ReconnectStatistics:
        with self._lock:
            return ReconnectStatistics(self._pauses, self._outages, self._gave_up)


def draining(error: ClientError) -> bool:
    """``error`` is a draining writer's refusal, made before the call was admitted: a
    ``unavailable`` with ``retry_after_ms`` (a poisoned store's has none)."""
    return isinstance(error, Unavailable) and error.retry_after_ms is not None


class Outage:
    """One call's time with the writer (``who``) away: its window runs from the first
    time it was found away."""

    def __init__(self, reconnect: Reconnect, clock: Callable[[], float], who: str) -> None:
        self._reconnect = reconnect
        self._clock = clock
        self._who = who
        self._until: float | None = None
        self._pauses = 0
        self.over = False
        """The window has passed: the caller raises ``error`` (noted so)."""

    def pause(self, error: ClientError, deadline: float = math.inf) -> float | None:
        """Seconds to wait before trying again; None once the window or the caller's
        ``deadline`` (on the clock) has passed."""
        now = self._clock()
        if self._until is None:
            self._until = now + self._reconnect.seconds
        if now >= self._until:
            self.over = True
            self._reconnect.gave_up()
            seconds = self._reconnect.seconds
            error.add_note(f"{self._who} away for the whole {seconds:g} s window")
            return None
        left = min(self._until, deadline) - now
        if left <= 0:
            return None
        pause = min(self._reconnect.pause(self._pauses), left)
        self._pauses += 1
        return pause


@attrs.frozen
class RetryStatistics:
    requests: int
    """First attempts."""
    retries: int
    """Attempts after the first."""
    refused: int
    """Retries not made because the budget was spent."""


class RetryBudget:
    """A token bucket: every first attempt deposits ``ratio`` tokens (up to ``cap``),
    every retry withdraws one. So retries <= ``ratio`` * requests + ``initial`` at any
    time. Thread-safe, so one budget may serve a process's blocking clients."""

    def __init__(self, ratio: float = 0.1, *, initial: float = 10.0, cap: float = 100.0) -> None:
        if not 0 <= ratio <= 1:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        self.ratio = ratio
        self.cap = cap
        self._tokens = min(initial, cap)
        self._lock = threading.Lock()
        self._requests = self._retries = self._refused = 0

    def record_request(self) -> None:
        with self._lock:
            self._requests += 1
            self._tokens = min(self.cap, self._tokens + self.ratio)

    def try_withdraw(self) -> bool:
        with self._lock:
            if self._tokens < 1:
                self._refused += 1
                return False
            self._tokens -= 1
            self._retries += 1
            return True

    def statistics(self) -> RetryStatistics:
        with self._lock:
            return RetryStatistics(self._requests, self._retries, self._refused)


@attrs.frozen
class RetryPolicy:
    """Retry ``Busy`` always (nothing was done); ``Unavailable``, ``ConnectionLost`` and
    a local timeout only for idempotent calls (reads, acks, publishes with a ``msg_id``,
    appends with ``expected_version``)."""

    attempts: int = 4
    """Attempts in all, the first included."""
    base_delay: float = 0.05
    max_delay: float = 2.0
    budget: RetryBudget = attrs.field(factory=RetryBudget)
    rng: random.Random = attrs.field(factory=random.Random, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {self.attempts}")

    def should_retry(self, call: Call[Any], error: ClientError, attempt: int) -> bool:
        """After failed attempt number ``attempt`` (1-based); withdraws from the budget."""
        if attempt >= self.attempts:
            return False
        retryable = isinstance(error, Busy | CannotConnect) or (  # nothing was done
            call.idempotent and isinstance(error, Unavailable | ConnectionLost | DeadlineExceeded)
        )
        return retryable and self.budget.try_withdraw()

    def delay(self, error: ClientError, attempt: int) -> float:
        """Full jitter over the exponential step, but never before ``retry_after_ms``."""
        step = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
        jittered = self.rng.uniform(0, step)
        retry_after = getattr(error, "retry_after_ms", None) or 0
        return max(jittered, retry_after / 1000 * self.rng.uniform(1.0, 1.2))


class Attempts:
    """One call's attempts under ``policy`` (None: one attempt), for both clients: it
    records the request in the budget, counts the attempts and says how long to pause
    before the next one, if there is one before ``deadline`` (on ``clock``; None:
    none)."""

    def __init__(
        self,
        policy: RetryPolicy | None,
        call: Call[Any],
        deadline: float | None,
        clock: Callable[[], float],
        reconnect: Reconnect | None = None,
    ) -> None:
        self._policy = policy
        self._call = call
        self._deadline = math.inf if deadline is None else deadline
        self._clock = clock
        self._attempt = 1
        self._reconnect = reconnect
        self._outage: Outage | None = None
        if policy is not None:
            policy.budget.record_request()

    def pause_after(self, error: ClientError) -> float | None:
        """Seconds to wait before trying again after ``error``; None: raise it."""
        reconnect = self._reconnect
        if reconnect is not None and reconnect.covers(self._call, error):
            if self._outage is None:
                self._outage = Outage(reconnect, self._clock, "the writer was")
            return self._outage.pause(error, self._deadline)
        return self._retry(error)

    def _retry(self, error: ClientError) -> float | None:
        policy = self._policy
        if policy is None or not policy.should_retry(self._call, error, self._attempt):
            return None
        pause = policy.delay(error, self._attempt)
        if self._clock() + pause >= self._deadline:
            return None
        self._attempt += 1
        return pause
