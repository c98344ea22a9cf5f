"""Live fan-out of the event bus to its subscribers, with a bounded buffer each.

The committer hands every committed batch to the :class:`Hub`, which puts each record
(encoded once) into the buffer of every subscriber whose filter matches. A buffer is
bounded (``CMDBUS_SUBSCRIBER_BUFFER`` records): a subscriber that falls that far behind is
cut off — it never makes the writer buffer without bound, nor slows the others.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import attrs
import trio

from cmdbus_trio import metrics
from cmdbus_trio.protocol import dumps_str
from cmdbus_trio.protocol.subjects import matches

from .committer import Ticket


def fragment(sort_key: int, subject: str, record: str) -> bytes:
    """One pushed record, encoded: ``{"sort_key", "subject", "record"}`` (``record`` is the
    stored JSON text, inserted as it is)."""
    return (
        f'{{"sort_key":{int(sort_key)},"subject":{dumps_str(subject)},"record":{record}}}'.encode()
    )


@attrs.frozen
class Pushed:
    sort_key: int
    subject: str
    fragment: bytes


class Subscription:
    def __init__(self, filter_tokens: tuple[str, ...] | None, capacity: int) -> None:
        self.filter = filter_tokens
        self._send, self._receive = trio.open_memory_channel[Pushed](capacity)
        self.overflowed = False

    def offer(self, pushed: Pushed) -> None:
        try:
            self._send.send_nowait(pushed)
        except trio.WouldBlock:
            self.overflowed = True  # too far behind: it is cut off, the others go on
            metrics.SUBSCRIBERS_DROPPED.inc()
            self.end()
        except trio.ClosedResourceError:
            pass

    def end(self) -> None:
        self._send.close()

    async def batches(self, most: int) -> AsyncIterator[list[Pushed]]:
        """Everything buffered, up to ``most`` at a time, until the subscription ends."""
        async for first in self._receive:
            batch = [first]
            while len(batch) < most:
                try:
                    batch.append(self._receive.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            yield batch


class Hub:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._subscriptions: set[Subscription] = set()
        self._closed = False
        metrics.SUBSCRIBERS.set_function(lambda: len(self._subscriptions))

    @contextmanager
    def subscribe(self, filter_tokens: tuple[str, ...] | None) -> Iterator[Subscription]:
        subscription = Subscription(filter_tokens, self.capacity)
        if self._closed:
            subscription.end()
        self._subscriptions.add(subscription)
        try:
            yield subscription
        finally:
            self._subscriptions.discard(subscription)
            subscription.end()

    def feed(self, batch: list[Ticket]) -> None:
        """A committer listener: push each newly committed record to its subscribers."""
        if not self._subscriptions:
            return
        for ticket in batch:
            for published, record in zip(ticket.published or (), ticket.stored, strict=False):
                if published.duplicate:
                    continue
                pushed = Pushed(
                    published.sort_key,
                    published.subject,
                    fragment(published.sort_key, published.subject, record),
                )
                for subscription in list(self._subscriptions):
                    if subscription.filter is None or matches(subscription.filter, pushed.subject):
                        subscription.offer(pushed)

    def close(self) -> None:
        """End every subscription (the writer is draining)."""
        self._closed = True
        for subscription in self._subscriptions:
            subscription.end()
