"""The faces of the blocking client.

Generated from :mod:`._trio_faces` by ``python -m cmdbus_trio.client._unasync``: do not
edit; change the trio module and regenerate.
"""


from __future__ import annotations

from collections.abc import Iterator, Iterable, Sequence
from typing import Any

import time

from cmdbus_trio.protocol.bus import Published
from cmdbus_trio.protocol.tier import TierRecord

from . import _calls as calls
from ._calls import (
    Appended,
    Batch,
    BatchAppended,
    DeadPage,
    Delivery,
    Lag,
    Page,
    Record,
    Settled,
)
from ._errors import ClientError
from ._retry import Attempts
from ._blocking_connection import Connection

__all__ = ["ClaimClient", "IngestClient", "SubscribeClient", "TierClient"]


class IngestClient(Connection):
    """The command (:9100) or event (:9103) ingest face."""

    def publish(
        self, record: Record, *, msg_id: str | None = None, timeout: float | None = None
    ) -> Published:
        return self.call(calls.publish(record, msg_id), timeout=timeout)

    def publish_batch(
        self, records: Iterable[Record], *, timeout: float | None = None
    ) -> list[int]:
        return self.call(calls.publish_batch(records), timeout=timeout)


class ClaimClient(Connection):
    """The command (:9101) or event (:9104) claim face. Leases belong to the connection:
    closing it releases them at once."""

    def next(
        self,
        filter: str,
        *,
        wait: float | None = None,
        group: str | None = None,
        start: str | None = None,
        timeout: float | None = None,
    ) -> Delivery | None:
        """The next record for ``filter``, or ``None`` after ``wait`` seconds without one.
        On the event face ``group`` is required; ``start`` (``beginning`` or ``tail``)
        creates the group when it is new."""
        call = calls.next_delivery(filter, wait=wait, group=group, start=start)
        return self.call(call, timeout=timeout)

    def next_batch(
        self,
        filter: str,
        most: int,
        *,
        wait: float | None = None,
        group: str | None = None,
        start: str | None = None,
        timeout: float | None = None,
    ) -> list[Delivery]:
        """Up to ``most`` (1..1,000) records for ``filter`` as soon as one is there, each
        leased on its own (ack, nack or extend each, or many at once); an empty list
        after ``wait`` seconds without one. The reply stays within the writer's reply
        cap: fewer records, never a larger frame."""
        call = calls.next_batch(filter, most, wait=wait, group=group, start=start)
        return self.call(call, timeout=timeout)

    def ack(
        self, delivery: Settled, *, group: str | None = None, timeout: float | None = None
    ) -> bool:
        """Ack ``delivery`` (a :class:`Delivery`, or a sort key): True once it is durable,
        False when this connection does not hold that lease: it ended (it expired, the
        connection that took it was lost, or it was settled already) and the record
        comes again, if it was not acked. Pass the delivery, not its sort key, when
        tasks share a client: an ack sent late, or again after a reconnect, must not ack
        the record's later lease (another task's)."""
        return self.call(calls.ack(delivery, group), timeout=timeout)

    def ack_many(
        self,
        deliveries: Sequence[Settled],
        *,
        group: str | None = None,
        timeout: float | None = None,
    ) -> list[bool]:
        """Ack up to 1,000 records in one request, durable in one group commit: for
        each, in order, whether this connection held its lease (as :meth:`ack`)."""
        return self.call(calls.ack_many(deliveries, group), timeout=timeout)

    def nack_many(
        self,
        deliveries: Sequence[Settled],
        *,
        group: str | None = None,
        delay: float | None = None,
        timeout: float | None = None,
    ) -> list[bool]:
        return self.call(calls.nack_many(deliveries, group, delay), timeout=timeout)

    def extend_many(
        self,
        deliveries: Sequence[Settled],
        *,
        group: str | None = None,
        timeout: float | None = None,
    ) -> list[bool]:
        return self.call(calls.extend_many(deliveries, group), timeout=timeout)

    def nack(
        self,
        delivery: Settled,
        *,
        group: str | None = None,
        delay: float | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Give ``delivery`` back, to come again after ``delay`` seconds (default: the
        writer's ack wait); False as for :meth:`ack`, and then nothing is given back."""
        return self.call(calls.nack(delivery, group, delay), timeout=timeout)

    def extend(
        self, delivery: Settled, *, group: str | None = None, timeout: float | None = None
    ) -> bool:
        return self.call(calls.extend(delivery, group), timeout=timeout)

    def lag(
        self, filter: str | None = None, *, group: str | None = None, timeout: float | None = None
    ) -> Lag:
        return self.call(calls.lag(filter, group), timeout=timeout)

    def dead(
        self,
        filter: str | None = None,
        *,
        group: str | None = None,
        limit: int | None = None,
        after: int | None = None,
        timeout: float | None = None,
    ) -> DeadPage:
        """A page of dead letters (up to ``limit``, 100 by default), oldest first; page
        on with ``after=page.next_after`` until it is ``None``."""
        return self.call(calls.dead(filter, group, limit, after), timeout=timeout)

    def requeue(
        self,
        sort_keys: Sequence[int] | None = None,
        *,
        filter: str | None = None,
        group: str | None = None,
        timeout: float | None = None,
    ) -> int:
        """Put dead letters back in the queue, with a fresh delivery count: those of
        ``sort_keys`` (at most 1,000), or every one matching ``filter``. Returns how many
        were requeued, durably."""
        return self.call(
            calls.move_dead("requeue", sort_keys, filter, group), timeout=timeout
        )

    def purge(
        self,
        sort_keys: Sequence[int] | None = None,
        *,
        filter: str | None = None,
        group: str | None = None,
        timeout: float | None = None,
    ) -> int:
        """Drop dead letters for good (selected as for :meth:`requeue`). Returns how many
        were purged, durably."""
        return self.call(calls.move_dead("purge", sort_keys, filter, group), timeout=timeout)

    def delete_group(self, group: str, *, timeout: float | None = None) -> bool:
        """Delete an event consumer group and all it recorded (event claim face only);
        False when there is no such group."""
        return self.call(calls.delete_group(group), timeout=timeout)


class TierClient(Connection):
    """The tier face (:9110)."""

    def append(
        self,
        execution_id: str | int,
        payload: str,
        *,
        tier: str | None = None,
        transaction_id: str | None = None,
        expected_version: int | None = None,
        timeout: float | None = None,
    ) -> Appended:
        call = calls.append(
            execution_id,
            payload,
            tier=tier,
            transaction_id=transaction_id,
            expected_version=expected_version,
        )
        return self.call(call, timeout=timeout)

    def append_batch(
        self,
        execution_id: str | int,
        payloads: Iterable[str],
        *,
        tier: str | None = None,
        transaction_id: str | None = None,
        timeout: float | None = None,
    ) -> BatchAppended:
        call = calls.append_batch(execution_id, payloads, tier=tier, transaction_id=transaction_id)
        return self.call(call, timeout=timeout)

    def delete_execution(
        self, execution_id: str | int, *, tier: str | None = None, timeout: float | None = None
    ) -> int:
        """Delete the execution's history in ``tier`` (default ``eventlog``), durably; the
        records deleted (0: it had none). For clean-up tooling: the tier keeps history
        unless told otherwise."""
        return self.call(calls.delete_execution(execution_id, tier=tier), timeout=timeout)

    def read_execution(
        self,
        execution_id: str | int,
        *,
        tier: str | None = None,
        after: int | None = None,
        limit: int | None = None,
        timeout: float | None = None,
    ) -> Page:
        call = calls.read_execution(execution_id, tier=tier, after=after, limit=limit)
        return self.call(call, timeout=timeout)

    def scan(
        self,
        *,
        tier: str | None = None,
        after: int | None = None,
        limit: int | None = None,
        timeout: float | None = None,
    ) -> Page:
        return self.call(calls.scan(tier=tier, after=after, limit=limit), timeout=timeout)

    def health(self, *, timeout: float | None = None) -> dict[str, Any]:
        return self.call(calls.tier_health(), timeout=timeout)

    def read_all(
        self, execution_id: str | int, *, tier: str | None = None, timeout: float | None = None
    ) -> Iterator[TierRecord]:
        """Every record of the execution, page after page (``timeout`` per page)."""
        after: int | None = None
        while True:
            page = self.read_execution(execution_id, tier=tier, after=after, timeout=timeout)
            for record in page.records:
                yield record
            if page.next_after is None:
                return
            after = page.next_after


class SubscribeClient(Connection):
    """The event subscribe face (:9108). A subscription holds its connection."""

    def subscribe(self, start: int = 0, *, filter: str | None = None) -> Iterator[Batch]:
        """Batches of records with sort key > ``start``: history first, then live.
        Through a writer that is away (its reconnect window), it subscribes again after
        the last record received: no gap, no repeat. Raises :class:`Busy` when the server
        cut this subscriber off as too slow."""
        after = start
        attempts: Attempts | None = None  # since the last batch: an outage's window
        while True:
            call = calls.subscribe(after, filter)
            try:
                for batch in self._stream_replies(call):
                    attempts = None
                    if batch:
                        after = batch[-1].sort_key
                    yield batch
                return
            except ClientError as error:
                self._follow(error)  # a pair's standby, or a member gone: to the primary
                attempts = attempts or Attempts(None, call, None, time.monotonic, self.reconnect)
                pause = attempts.pause_after(error)
                if pause is None:
                    raise
                time.sleep(pause)
