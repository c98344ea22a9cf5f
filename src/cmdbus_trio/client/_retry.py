"""Opt-in retries: jittered exponential backoff that honours ``retry_after_ms``, under a
retry budget so that retries add at most ~``ratio`` extra load (the SRE book's client-side
throttling: a client whose calls keep failing must not multiply the overload)."""

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
    ClientError,
    ConnectionLost,
    DeadlineExceeded,
    Unavailable,
)


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
    ) -> None:
        self._policy = policy
        self._call = call
        self._deadline = math.inf if deadline is None else deadline
        self._clock = clock
        self._attempt = 1
        if policy is not None:
            policy.budget.record_request()

    def pause_after(self, error: ClientError) -> float | None:
        """Seconds to wait before retrying after ``error``; None: raise it."""
        policy = self._policy
        if policy is None or not policy.should_retry(self._call, error, self._attempt):
            return None
        pause = policy.delay(error, self._attempt)
        if self._clock() + pause >= self._deadline:
            return None
        self._attempt += 1
        return pause
