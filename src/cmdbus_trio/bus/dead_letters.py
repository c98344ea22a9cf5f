"""A consumer group's dead letters: listed a page at a time (``dead``), moved back to the
backlog (``requeue``) or deleted (``purge``)."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import trio

from cmdbus_trio.admission import Slot, checked_pages
from cmdbus_trio.protocol import claim as claim_codec
from cmdbus_trio.protocol import pages
from cmdbus_trio.storage.buslog import BusLog

from . import Bus
from .claims import Claims
from .committer import Ticket


async def page(
    bus: Bus,
    claims: Claims,
    slot: Slot,
    head: dict[str, Any],
    *,
    filter: str | None,
    after: int,
    limit: int,
    max_reply: int,
) -> bytes:
    """A page of the group's dead letters after sort key ``after``, as a reply (``head``'s
    fields first): filtered in the query and encoded in the slot's thread, the stored
    records spliced in, never decoded; bounded by ``limit`` and ``max_reply`` like
    ``read_execution`` (:func:`~cmdbus_trio.protocol.pages.page`).

    Cancellation: the thread stops within one page of the store (the slot's budget)."""
    return await slot.run_cancellable(
        _page, bus.log, claims.group, head, filter, after, limit, max_reply
    )


def _page(
    log: BusLog,
    group: str,
    head: dict[str, Any],
    filter: str | None,
    after: int,
    limit: int,
    max_reply: int,
) -> bytes:
    with contextlib.closing(log.iter_dead(group, after=after, filter=filter)) as dead_pages:
        fragments = (
            pages.Fragments.of(
                (
                    dead.sort_key,
                    claim_codec.dead_letter(
                        dead.sort_key, dead.subject, dead.deliveries, dead.record, dead.trace
                    ),
                )
                for dead in page
            )
            for page in checked_pages(dead_pages)
        )
        return pages.page(head, fragments, limit=limit, max_reply=max_reply, name="dead letter")


async def move_dead(
    bus: Bus,
    claims: Claims,
    slot: Slot,
    *,
    requeue: bool,
    filter: str | None,
    sort_keys: tuple[int, ...] | None,
) -> int:
    """Requeue (or purge) the group's dead letters named by ``sort_keys`` or matched by
    ``filter``, durably, in transactions of up to 1,000, under the request's Gate
    ``slot``; returns how many were still dead (and so moved).

    Cancellation: a transaction that started is committed and its records requeued in
    memory (shielded): the store and the coordinator never disagree. One cut short by the
    slot's budget keeps what it did; the request is then answered ``deadline``.
    """
    moved = 0
    after = 0
    while chosen := await slot.run_cancellable(
        partial(
            bus.log.dead_subjects, claims.group, after=after, filter=filter, sort_keys=sort_keys
        )
    ):
        ticket = Ticket(dead_moves=[(claims.group, key, requeue) for key, _ in chosen])
        bus.committer.enqueue(ticket)
        with trio.CancelScope(shield=True):
            await ticket.wait()
            done = set(ticket.moved)
            if requeue:
                evicted = claims.requeue(
                    (key, subject) for key, subject in chosen if (claims.group, key) in done
                )
                bus.groups.count_evicted(claims.group, evicted)
        moved += len(done)
        if sort_keys is not None:
            break  # all of them were in the one query
        after = chosen[-1][0]
    return moved
