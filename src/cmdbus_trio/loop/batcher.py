"""Work queued on the loop and done in batches by one worker thread: the group
committer and the body reader are built on :class:`ThreadBatcher`. Not admission:
callers bound the queue with their own Gate."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Generic, Protocol, TypeVar

import trio

from ..admission import run_in_thread
from . import turns

T = TypeVar("T")
B = TypeVar("B")
R = TypeVar("R")

__all__ = ["Durability", "ThreadBatcher", "take_up_to"]


class Durability(Protocol):
    """What a batch's outcome waits for before it is settled, when commits are
    replicated (a standby's confirmation): nothing is settled, so nothing is answered
    or seen by a consumer, before the batch could be acknowledged."""

    def sequence(self) -> int:
        """In the worker thread, right after a batch's work: a place in the replication
        at or after that work's commit."""
        ...

    def when_durable(self, sequence: int, done: Callable[[Exception | None], None]) -> None:
        """On the loop: ``done(None)`` once everything through ``sequence`` may be
        acknowledged, ``done(error)`` if it may not."""
        ...


def take_up_to(queue: deque[T], limit: int, weight: Callable[[T], int]) -> list[T]:
    """The oldest items of ``queue`` whose weights add up to at most ``limit``, and at
    least one: a group commit's ``take`` (tickets weigh their records)."""
    batch: list[T] = []
    total = 0
    while queue and (not batch or total + weight(queue[0]) <= limit):
        item = queue.popleft()
        total += weight(item)
        batch.append(item)
    return batch


class ThreadBatcher(Generic[T, B, R]):
    """Work queued on the loop, done in batches by one worker thread (through
    :func:`run_in_thread`), each batch settled back on the loop as soon as it is done.

    :meth:`put` queues an item. :meth:`run` (in the background nursery) starts one thread
    call when items are queued; in it, while items are queued (at most ``max_batches``
    times per call), ``take(queue)`` removes a batch, ``work(batch)`` does it, and
    ``settle(batch, outcome)`` is handed its result, or the exception it raised, on the
    loop at once (``run_sync_soon``) while the thread goes on with the next batch.
    Waiting for the loop between batches made each batch wait for a scheduling round of
    a busy loop while the disk sat idle. When the queue is empty the thread waits up to
    ``linger`` seconds (without the GIL) for more before it returns: a client that sends
    its next request as soon as it has its reply then finds the thread there, not a new
    hop into it (docs/benchmarks.md has what that bought); it is told of new items as the
    loop's turn ends, so that one turn's items go in one batch. The group committer and
    the body reader are built on it.

    The loop only appends to the queue; ``take``, in the thread, alone removes from it.
    ``settle`` runs as a plain callback, not in a task: it must not raise.

    ``name`` names its thread while it runs (``commit:commands``, ``bodies:events``).

    Cancellation: batches that started are finished, and a lingering thread is waited for
    (at most ``linger``; the thread is never abandoned); :meth:`run` then stops.
    """

    def __init__(
        self,
        take: Callable[[deque[T]], B],
        work: Callable[[B], R],
        settle: Callable[[B, R | Exception], None],
        *,
        name: str,
        max_batches: int = 16,
        linger: float = 0.002,
    ) -> None:
        if max_batches < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches}")
        if not 0 <= linger <= 1:
            raise ValueError(f"linger must be 0 to 1 seconds, got {linger}")
        self.queue: deque[T] = deque()
        self._take = take
        self._work = work
        self._settle = settle
        self.max_batches = max_batches
        self.linger = linger
        self.name = name
        self._wake = trio.Event()
        self._arrived = threading.Event()  # for the thread lingering in _batches
        self._arrival_told = False  # _arrived is set as this turn ends (see put)
        self._limiter = trio.CapacityLimiter(1)  # one thread: batches go one after another
        self.durability: Durability | None = None
        """Set when commits are replicated: each batch that worked is settled only once
        ``durability`` says so (with its error, if it says the batch may not be)."""
        self._working = False  # run() has items in hand (see wait_quiet)
        self._quiet: trio.Event | None = None

    def put(self, item: T) -> None:
        """Queue an item; never blocks (callers bound the queue, e.g. with a Gate)."""
        self.queue.append(item)
        self._wake.set()
        if not self._arrival_told:
            # A lingering thread is told as the turn ends, not now: woken at once, it
            # took the first item alone as soon as the loop let go of the GIL (a socket
            # read, say), and the rest of the turn's waited for another commit.
            self._arrival_told = True
            turns.current().at_turn_end(self._tell_arrival)

    def _tell_arrival(self) -> None:
        self._arrival_told = False
        self._arrived.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        token = trio.lowlevel.current_trio_token()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            self._working = True
            while self.queue:
                with trio.CancelScope(shield=True):
                    await run_in_thread(self._batches, token, limiter=self._limiter, name=self.name)
            self._working = False
            if self._quiet is not None:
                self._quiet.set()
                self._quiet = None

    async def wait_quiet(self) -> None:
        """Return once every item put so far is worked and its batch handed to
        ``settle`` or to ``durability`` (the thread hands them over by ``run_sync_soon``
        before it returns, so they have run by then). A stopping primary waits for this
        before its synchronizer stops: a commit still in the thread is not waiting there
        yet.

        Cancellation: the wait stops; nothing else does. Items put once :meth:`run` has
        stopped are never worked: the caller bounds the wait."""
        while self.queue or self._working:
            if self._quiet is None:
                self._quiet = trio.Event()
            await self._quiet.wait()

    def _batches(self, token: trio.lowlevel.TrioToken) -> None:
        for _ in range(self.max_batches):
            while not self.queue:  # (told of an item it took already: wait again)
                self._arrived.clear()
                if not self.queue and not self._arrived.wait(self.linger):
                    return
            batch = self._take(self.queue)
            outcome: R | Exception
            try:
                outcome = self._work(batch)
            except Exception as exc:
                outcome = exc
            durability = self.durability
            if durability is None or isinstance(outcome, Exception):
                token.run_sync_soon(self._settle, batch, outcome)
            else:
                settle = partial(self._settle_durable, batch, outcome)
                token.run_sync_soon(durability.when_durable, durability.sequence(), settle)

    def _settle_durable(self, batch: B, outcome: R, error: Exception | None) -> None:
        self._settle(batch, outcome if error is None else error)
