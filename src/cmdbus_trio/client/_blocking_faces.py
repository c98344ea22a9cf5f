"""The faces of the blocking client: one class per face, and the sharded clients.

Generated from :mod:`._trio_faces` by ``python -m cmdbus_trio.client._unasync``: do not
edit; change the trio faces and regenerate.
"""


from __future__ import annotations

import math
from collections.abc import Iterator, Iterable, Sequence
from typing import Any, Generic, Self, TypeVar

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
from ._retry import RECONNECT_FOR, Attempts, Reconnect
from ._shards import ClaimRounds, Rotation, ShardDelivery, ShardMap, by_shard
from ._blocking_connection import Connection

__all__ = [
    "ClaimClient",
    "IngestClient",
    "Router",
    "ShardedClaimClient",
    "SubscribeClient",
    "TierClient",
]


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
                attempts = attempts or Attempts(None, call, None, time.monotonic, self.reconnect)
                pause = attempts.pause_after(error)
                if pause is None:
                    raise
                time.sleep(pause)


W = TypeVar("W", bound=Connection)


class _Writers(Generic[W]):
    """One client per shard's writer, closed together."""

    writers: Sequence[W]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


class Router(_Writers[IngestClient]):
    """Publishes each record to the writer that owns its shard.

        router = Router(ShardMap.parse("0@10.0.0.1:9100,1@10.0.0.2:9100"))

    Connections open on first use and reconnect after a writer restarts. Errors carry
    ``error.shard``.
    """

    def __init__(self, shards: ShardMap, **options: Any) -> None:
        self.shards = shards
        self.writers = [IngestClient(address, **options) for address in shards.addresses]

    def publish(
        self, record: Record, *, msg_id: str | None = None, timeout: float | None = None
    ) -> Published:
        shard = self.shards.shard_for(record["execution_id"])
        try:
            return self.writers[shard].publish(record, msg_id=msg_id, timeout=timeout)
        except ClientError as error:
            raise self.shards.tag(error, shard) from None

    def publish_batch(
        self, records: list[Record], *, timeout: float | None = None
    ) -> list[tuple[int, int]]:
        """One ``publish_batch`` per shard; ``(shard, sort_key)`` per record, in order.
        A shard's failure raises (tagged) after the shards before it were published."""
        keys: list[tuple[int, int]] = [(0, 0)] * len(records)
        for shard, indexes in sorted(self.shards.split(records).items()):
            try:
                sort_keys = self.writers[shard].publish_batch(
                    [records[i] for i in indexes], timeout=timeout
                )
            except ClientError as error:
                raise self.shards.tag(error, shard) from None
            for index, sort_key in zip(indexes, sort_keys, strict=True):
                keys[index] = (shard, sort_key)
        return keys


class ShardedClaimClient(_Writers[ClaimClient]):
    """Claims from several writers (one claim address per shard) fairly: round robin
    over the shards with pending work, so none is starved. When no shard has a record it
    asks again after a pause (10 ms, doubling to 250 ms) until ``wait`` passes; a
    writer that is down is skipped (and asked again next round) while others serve.
    ``wait`` bounds a call whatever a writer does: each writer has what is left of it to
    answer (at least 0.5 s, at most 10 s), and one that does not answer in time (paused,
    overloaded) is skipped for the rest of the call and asked last by later calls until
    it answers. When every writer is away (unreachable or draining) a call rides through
    the reconnect window, as a call to one writer does, and raises once it has passed."""

    def __init__(self, shards: ShardMap, **options: Any) -> None:
        self.shards = shards
        self.writers = [ClaimClient(address, **options) for address in shards.addresses]
        self.reconnect = Reconnect(options.get("reconnect_for", RECONNECT_FOR))
        self._rotation = Rotation(shards.shard_count)

    def next(
        self,
        filter: str,
        *,
        wait: float | None = None,
        group: str | None = None,
        start: str | None = None,
        timeout: float | None = None,
    ) -> ShardDelivery | None:
        deadline = math.inf if wait is None else time.monotonic() + wait
        rounds = ClaimRounds(self.shards, self._rotation, self.reconnect)
        call = calls.next_delivery(filter, wait=0, group=group, start=start)
        while True:
            for shard in rounds.round():
                ask = rounds.ask_timeout(deadline - time.monotonic(), timeout)
                try:  # a writer that is away or silent is not waited for: others may serve
                    delivery = self.writers[shard].call(call, timeout=ask, reconnect=False)
                except ClientError as error:
                    rounds.failed(shard, error)  # raises unless the writer is down
                    continue
                if (claimed := rounds.answered(shard, delivery)) is not None:
                    return claimed
            pause = rounds.pause(deadline - time.monotonic())
            if pause is None:
                return None
            time.sleep(pause)

    def ack(
        self, claimed: ShardDelivery, *, group: str | None = None, timeout: float | None = None
    ) -> bool:
        try:
            return self.writers[claimed.shard].ack(
                claimed.delivery, group=group, timeout=timeout
            )
        except ClientError as error:
            raise self.shards.tag(error, claimed.shard) from None

    def next_batch(
        self,
        filter: str,
        most: int,
        *,
        wait: float | None = None,
        group: str | None = None,
        start: str | None = None,
        timeout: float | None = None,
    ) -> list[ShardDelivery]:
        """Up to ``most`` records from the first shard in the round that has any (the
        rounds as for :meth:`next`); an empty list after ``wait``."""
        deadline = math.inf if wait is None else time.monotonic() + wait
        rounds = ClaimRounds(self.shards, self._rotation, self.reconnect)
        call = calls.next_batch(filter, most, wait=0, group=group, start=start)
        while True:
            for shard in rounds.round():
                ask = rounds.ask_timeout(deadline - time.monotonic(), timeout)
                try:
                    batch = self.writers[shard].call(call, timeout=ask, reconnect=False)
                except ClientError as error:
                    rounds.failed(shard, error)  # raises unless the writer is down
                    continue
                if claimed := rounds.answered_many(shard, batch):
                    return claimed
            pause = rounds.pause(deadline - time.monotonic())
            if pause is None:
                return []
            time.sleep(pause)

    def ack_many(
        self,
        claimed: Sequence[ShardDelivery],
        *,
        group: str | None = None,
        timeout: float | None = None,
    ) -> list[bool]:
        """Each shard's records acked in one request to it; the outcomes in order."""
        outcomes: dict[tuple[int, int], bool] = {}
        for shard, deliveries in by_shard(claimed).items():
            try:
                acked = self.writers[shard].ack_many(deliveries, group=group, timeout=timeout)
            except ClientError as error:
                raise self.shards.tag(error, shard) from None
            keys = [delivery.sort_key for delivery in deliveries]
            outcomes.update(((shard, key), ok) for key, ok in zip(keys, acked, strict=True))
        return [outcomes[c.shard, c.delivery.sort_key] for c in claimed]
