"""Which writer owns a record: the shard map of ``--writers 0@host:port,1@host:port``."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence

import attrs

from cmdbus_trio.protocol.subjects import shard_of

from ._calls import Delivery, Record
from ._core import split_address
from ._errors import ClientError, ConnectionLost, DeadlineExceeded, Unavailable
from ._retry import Outage, Reconnect

WRITERS_ENV: Mapping[str, tuple[str, ...]] = {
    "commands": ("CMDBUS_CMD_WRITERS", "NOETL_COMMAND_BUS_WRITER_ADDRS"),
    "events": ("CMDBUS_EVT_WRITERS", "NOETL_EVENT_BUS_WRITER_ADDRS"),
}
"""Where the clients find a bus's writers, first set wins."""


@attrs.frozen
class ShardMap:
    addresses: tuple[str, ...]
    """The ingest address of shard ``i`` at index ``i``."""

    @classmethod
    def parse(cls, text: str) -> ShardMap:
        """Parse ``0@host:port,1@host:port,…``; every shard from 0 to N-1 exactly once.

        Error handling: :class:`ValueError` naming the bad entry, or the shards missing.
        """
        owners: dict[int, str] = {}
        for entry in filter(None, (part.strip() for part in text.split(","))):
            shard_text, sep, address = entry.partition("@")
            if not sep or not shard_text.isdigit():
                raise ValueError(f"writers: {entry!r}: expected SHARD@HOST:PORT")
            split_address(address)
            shard = int(shard_text)
            if shard in owners:
                raise ValueError(f"writers: shard {shard} is listed twice")
            owners[shard] = address
        if not owners:
            raise ValueError("writers: expected at least one SHARD@HOST:PORT")
        count = max(owners) + 1
        if missing := sorted(set(range(count)) - set(owners)):
            raise ValueError(
                f"writers: shards {', '.join(map(str, missing))} of 0..{count - 1} have no writer"
            )
        return cls(tuple(owners[shard] for shard in range(count)))

    @classmethod
    def from_environ(cls, bus: str, environ: Mapping[str, str] | None = None) -> ShardMap | None:
        """The ingest writers of ``bus`` (``commands`` or ``events``) named in the
        environment: ``CMDBUS_CMD_WRITERS`` / ``CMDBUS_EVT_WRITERS``, else NoETL's
        ``NOETL_COMMAND_BUS_WRITER_ADDRS`` / ``NOETL_EVENT_BUS_WRITER_ADDRS`` (the same
        ``0@host:port,…`` form); None when neither is set.

        Error handling: :class:`ValueError` naming the variable and the bad entry."""
        environ = os.environ if environ is None else environ
        for name in WRITERS_ENV[bus]:
            if text := environ.get(name, "").strip():
                try:
                    return cls.parse(text)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        return None

    @property
    def shard_count(self) -> int:
        return len(self.addresses)

    def shard_for(self, execution_id: str | int) -> int:
        """The same function the writers use to refuse misrouted records."""
        return shard_of(execution_id, self.shard_count)

    def split(self, records: list[Record]) -> dict[int, list[int]]:
        """Indexes of ``records`` by the shard that owns each."""
        by_shard: dict[int, list[int]] = {}
        for index, record in enumerate(records):
            by_shard.setdefault(self.shard_for(record["execution_id"]), []).append(index)
        return by_shard

    def tag(self, error: ClientError, shard: int) -> ClientError:
        """``error`` marked with the shard and writer it came from (``error.shard``)."""
        error.shard = shard
        error.add_note(f"shard {shard} at {self.addresses[shard]}")
        return error


@attrs.frozen
class ShardDelivery:
    """A delivery and the shard (writer) it came from: ack it there."""

    shard: int
    delivery: Delivery


def by_shard(claimed: Sequence[ShardDelivery]) -> dict[int, list[int]]:
    """The sort keys of ``claimed`` per shard, in order (one request to each writer)."""
    keys: dict[int, list[int]] = {}
    for one in claimed:
        keys.setdefault(one.shard, []).append(one.delivery.sort_key)
    return keys


class Rotation:
    """Round robin over shards: each call starts after the shard that served the last
    one, so a shard with pending work is asked first at least once every N calls."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._next = 0

    def order(self) -> list[int]:
        return [(self._next + step) % self.count for step in range(self.count)]

    def served(self, shard: int) -> None:
        self._next = (shard + 1) % self.count


MAX_IDLE_PAUSE = 0.25
"""Seconds between rounds over the shards at most, when none had a record."""


class ClaimRounds:
    """What a sharded ``next`` decides, without I/O (the trio and blocking clients each
    ask the writers and sleep): the order to ask the shards in, what an error from one
    means, and how long to pause when a round found nothing (10 ms, doubling to
    :data:`MAX_IDLE_PAUSE`). One per ``next`` call."""

    def __init__(
        self, shards: ShardMap, rotation: Rotation, reconnect: Reconnect | None = None
    ) -> None:
        self.shards = shards
        self.rotation = rotation
        self._pause = 0.01
        self._failures: list[ClientError] = []
        self._reconnect = reconnect
        self._outage: Outage | None = None  # every writer away in the rounds since

    def round(self) -> list[int]:
        """The shards to ask this round, in order."""
        self._failures = []
        return self.rotation.order()

    def failed(self, shard: int, error: ClientError) -> None:
        """A writer that is down (or too slow) is skipped while others serve; any other
        error is the request's fault and is raised, tagged with its shard."""
        if not isinstance(error, (ConnectionLost, Unavailable, DeadlineExceeded)):
            raise self.shards.tag(error, shard)
        self._failures.append(self.shards.tag(error, shard))

    def _all_away(self, remaining: float) -> float | None:
        last = self._failures[-1]
        if self._reconnect is None or not self._reconnect.seconds:
            raise last
        if self._outage is None:
            self._outage = Outage(self._reconnect, time.monotonic, "every writer was")
        pause = self._outage.pause(last, time.monotonic() + remaining)
        if self._outage.over:
            raise last
        return pause

    def served(self, shard: int, delivery: Delivery) -> ShardDelivery:
        self.rotation.served(shard)
        return ShardDelivery(shard, delivery)

    def served_many(self, shard: int, batch: list[Delivery]) -> list[ShardDelivery]:
        self.rotation.served(shard)
        return [ShardDelivery(shard, delivery) for delivery in batch]

    def pause(self, remaining: float) -> float | None:
        """After a round without a record: how long to sleep before the next one, or
        None when ``remaining`` (seconds of the caller's wait) is spent.

        Error handling: raises the last error when every writer failed this round for
        longer than the reconnect window."""
        if len(self._failures) == self.shards.shard_count:
            return self._all_away(remaining)
        self._outage = None
        if remaining <= 0:
            return None
        pause = min(self._pause, remaining)
        self._pause = min(2 * self._pause, MAX_IDLE_PAUSE)
        return pause
