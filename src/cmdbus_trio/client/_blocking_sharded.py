"""The sharded clients of the blocking client.

Generated from :mod:`._trio_sharded` by ``python -m cmdbus_trio.client._unasync``: do not
edit; change the trio module and regenerate.
"""


from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Generic, Self, TypeVar

import time

from cmdbus_trio.protocol.bus import Published

from . import _calls as calls
from ._calls import Record
from ._errors import ClientError
from ._retry import RECONNECT_FOR, Reconnect
from ._shards import ClaimRounds, Rotation, ShardDelivery, ShardMap, by_shard
from ._blocking_connection import Connection
from ._blocking_faces import ClaimClient, IngestClient

__all__ = ["Router", "ShardedClaimClient"]


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
