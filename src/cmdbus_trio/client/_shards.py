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
        """Parse ``0@host:port,1@host:port,…``; every shard from 0 to N-1 at least once. A
        shard listed more than once has that many members (a primary and its standby):
        its client goes to whichever serves.

        Error handling: :class:`ValueError` naming the bad entry, or the shards missing.
        """
        members: dict[int, list[str]] = {}
        for entry in filter(None, (part.strip() for part in text.split(","))):
            shard_text, sep, address = entry.partition("@")
            if not sep or not shard_text.isdigit():
                raise ValueError(f"writers: {entry!r}: expected SHARD@HOST:PORT")
            split_address(address)
            shard = int(shard_text)
            if address in members.get(shard, ()):
                raise ValueError(f"writers: {entry!r} is listed twice")
            members.setdefault(shard, []).append(address)
        owners = {shard: ",".join(addresses) for shard, addresses in members.items()}
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


def by_shard(claimed: Sequence[ShardDelivery]) -> dict[int, list[Delivery]]:
    """The deliveries of ``claimed`` per shard, in order (one request to each writer)."""
    deliveries: dict[int, list[Delivery]] = {}
    for one in claimed:
        deliveries.setdefault(one.shard, []).append(one.delivery)
    return deliveries


class Rotation:
    """Round robin over shards: each call starts after the shard that served the last
    one, so a shard with pending work is asked first at least once every N calls. A
    shard whose writer did not answer in time (paused, overloaded) is asked last until
    it answers again, so it costs the others nothing while they have records."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._next = 0
        self._silent: set[int] = set()

    def order(self) -> list[int]:
        order = [(self._next + step) % self.count for step in range(self.count)]
        return sorted(order, key=self._silent.__contains__)  # stable: the rest keep theirs

    def served(self, shard: int) -> None:
        self._next = (shard + 1) % self.count

    def answered(self, shard: int) -> None:
        self._silent.discard(shard)

    def timed_out(self, shard: int) -> None:
        self._silent.add(shard)


MAX_IDLE_PAUSE = 0.25
"""Seconds between rounds over the shards at most, when none had a record."""
ASK_LEAST = 0.5
"""Seconds a writer has to answer one ask at the least, even when the caller's wait is
spent (it is asked with ``wait=0``: a writer that serves answers in milliseconds)."""
ASK_MOST = 10.0
"""Seconds a writer has to answer one ask at the most, for a caller that waits without
end (``wait=None``): a writer that does not answer is skipped, not waited for."""


class ClaimRounds:
    """What a sharded ``next`` decides, without I/O (the trio and blocking clients each
    ask the writers and sleep): the order to ask the shards in, how long each may take to
    answer, what an error from one means, and how long to pause when a round found
    nothing (10 ms, doubling to :data:`MAX_IDLE_PAUSE`). One per ``next`` call.

    The caller's ``wait`` bounds the call whatever a writer does: each ask is bounded by
    what is left of it (see :meth:`ask_timeout`), and a writer that did not answer in
    time is skipped for the rest of the call. Only when every writer is away
    (unreachable or draining) does the call ride through the reconnect window, as a
    call to one writer does, and raise when it has passed."""

    def __init__(
        self, shards: ShardMap, rotation: Rotation, reconnect: Reconnect | None = None
    ) -> None:
        self.shards = shards
        self.rotation = rotation
        self._pause = 0.01
        self._failures: list[ClientError] = []
        self._silent: set[int] = set()  # did not answer in time during this call
        self._reconnect = reconnect
        self._outage: Outage | None = None  # every writer away in the rounds since

    def round(self) -> list[int]:
        """The shards to ask this round, in order."""
        self._failures = []
        return [shard for shard in self.rotation.order() if shard not in self._silent]

    def ask_timeout(self, remaining: float, timeout: float | None) -> float:
        """Seconds one writer has to answer: what is left of the caller's wait (at
        least :data:`ASK_LEAST`, at most :data:`ASK_MOST`), and the caller's own
        ``timeout`` when it is shorter."""
        bound = min(max(remaining, ASK_LEAST), ASK_MOST)
        return bound if timeout is None else min(bound, timeout)

    def failed(self, shard: int, error: ClientError) -> None:
        """A writer that is down (or too slow) is skipped while others serve; any other
        error is the request's fault and is raised, tagged with its shard."""
        if not isinstance(error, (ConnectionLost, Unavailable, DeadlineExceeded)):
            raise self.shards.tag(error, shard)
        if isinstance(error, DeadlineExceeded):
            self._silent.add(shard)
            self.rotation.timed_out(shard)
        self._failures.append(self.shards.tag(error, shard))

    def _all_away(self) -> float:
        last = self._failures[-1]
        if self._reconnect is None or not self._reconnect.seconds:
            raise last
        if self._outage is None:
            self._outage = Outage(self._reconnect, time.monotonic, "every writer was")
        pause = self._outage.pause(last)
        if pause is None:
            raise last
        return pause

    def answered(self, shard: int, delivery: Delivery | None) -> ShardDelivery | None:
        """``shard`` answered ``next``: its delivery, if it had one."""
        self.rotation.answered(shard)
        if delivery is None:
            return None
        self.rotation.served(shard)
        return ShardDelivery(shard, delivery)

    def answered_many(self, shard: int, batch: list[Delivery]) -> list[ShardDelivery]:
        """``shard`` answered ``next_batch``: its deliveries (perhaps none)."""
        self.rotation.answered(shard)
        if batch:
            self.rotation.served(shard)
        return [ShardDelivery(shard, delivery) for delivery in batch]

    def pause(self, remaining: float) -> float | None:
        """After a round without a record: how long to sleep before the next one, or
        None when ``remaining`` (seconds of the caller's wait) is spent, or when no
        writer is left to ask (each did not answer in time).

        Error handling: when every writer was away this round (none of them silent),
        the call rides through the reconnect window whatever its wait, and raises the
        last error once the window has passed."""
        away = len(self._failures) == self.shards.shard_count
        if away and not self._silent:
            return self._all_away()
        self._outage = None
        if remaining <= 0 or len(self._silent) == self.shards.shard_count:
            return None
        pause = min(self._pause, remaining)
        self._pause = min(2 * self._pause, MAX_IDLE_PAUSE)
        return pause
