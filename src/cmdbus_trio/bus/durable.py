"""A group's coordinator and the store: loading it (:func:`open_claims`), and making what
it settles, and its settled position, durable through the group committer."""

from __future__ import annotations

from collections.abc import Callable

import trio

from cmdbus_trio.admission import run_in_thread
from cmdbus_trio.storage.buslog import BusLog

from .claims import STUCK_AFTER, Claims
from .committer import Committed, GroupCommitter, Ticket


def persist_low_water(claims: Claims, committer: GroupCommitter) -> None:
    """Make the group's settled position durable when it moved (group-committed): a
    restart then reloads from there instead of scanning the whole history, and the acks
    below it are pruned from the store. What it passes unsettled is recorded as owed
    (see :meth:`Claims.position`)."""
    mark, passed_unsettled = claims.position(trio.current_time())
    if mark > claims.persisted_low_water:
        owe = []
        if passed_unsettled:
            after = max(claims.start_after, claims.persisted_low_water - 1)
            owe.append((claims.group, after, passed_unsettled))
        claims.persisted_low_water = mark
        committer.enqueue(Ticket(positions=[(claims.group, mark)], owe=owe))


def durable_settlements(
    committer: GroupCommitter, group: str
) -> tuple[Callable[[int, str, int], None], Callable[[int, int], None]]:
    """The ``on_dead`` and ``on_count`` callbacks of a group's :class:`Claims`: each
    group-commits what it is told."""

    def park(sort_key: int, _subject: str, deliveries: int) -> None:
        committer.enqueue(Ticket(dead=[(group, sort_key, deliveries)]))

    def count(sort_key: int, deliveries: int) -> None:
        committer.enqueue(Ticket(counts=[(group, sort_key, deliveries)]))

    return park, count


RELOAD_PAGE = 10_000


async def open_claims(
    log: BusLog,
    committer: GroupCommitter,
    group: str,
    *,
    start_after: int,
    ack_wait: float,
    max_deliver: int,
    limiter: trio.CapacityLimiter,
    stuck_after: float = STUCK_AFTER,
) -> Claims:
    """A group's coordinator, loaded with every record after ``start_after`` that the
    group has neither acked nor parked, fed each newly committed record, and making its
    dead letters durable through ``committer``.

    Every record reaches the group exactly once, whatever is committed while its history
    loads: the live feed is attached first, at a fixed sort key (the newest committed);
    the history is loaded up to that key, and the feed holds what comes after it until
    the history is in.

    Cancellation: nothing is left behind (the feed is detached).
    """

    park, count = durable_settlements(committer, group)
    claims = Claims(
        group,
        ack_wait=ack_wait,
        max_deliver=max_deliver,
        on_dead=park,
        on_count=count,
        start_after=start_after,
        stuck_after=stuck_after,
    )
    # No await between reading the newest key and attaching: a record at or below it is
    # committed (so the history query sees it), one above it is settled later (so the
    # feed sees it).
    feed = _LiveFeed(claims, through=log.last_sort_key)
    committer.listeners.append(feed)
    try:
        settled_below = await run_in_thread(log.settled_below, group, limiter=limiter)
        below = max(start_after, settled_below - 1)  # `unsettled` starts there too
        claims.persisted_low_water = below + 1
        claims.restore_owed(await run_in_thread(log.owed, group, below, limiter=limiter))
        after = start_after
        while page := await run_in_thread(
            log.unsettled, group, after, RELOAD_PAGE, feed.through, limiter=limiter
        ):
            claims.add_many((key, subject) for key, subject, _ in page)
            claims.restore_deliveries((key, count) for key, _, count in page)
            after = page[-1][0]
    except BaseException:
        committer.listeners.remove(feed)
        raise
    feed.go_live()
    return claims


class _LiveFeed:
    """A committer listener handing a group every record committed after ``through``:
    held while the group's history (up to ``through``) loads, then as they come."""

    def __init__(self, claims: Claims, through: int) -> None:
        self.claims = claims
        self.through = through
        self._held: list[tuple[int, str]] | None = []

    def __call__(self, committed: list[Committed]) -> None:
        records = [(c.sort_key, c.subject) for c in committed if c.sort_key > self.through]
        if self._held is None:
            self.claims.add_many(records)
        else:
            self._held += records

    def go_live(self) -> None:
        """The history is in: hand over what was held, then every record as it comes."""
        held, self._held = self._held or [], None
        self.claims.add_many(held, seen_through=self.through)
