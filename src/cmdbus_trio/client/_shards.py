"""Which writer owns a record: the shard map of ``--writers 0@host:port,1@host:port``."""

from __future__ import annotations

import attrs

from cmdbus_trio.protocol.subjects import shard_of

from ._core import split_address


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

    @property
    def shard_count(self) -> int:
        return len(self.addresses)

    def shard_for(self, execution_id: str | int) -> int:
        """The same function the writers use to refuse misrouted records."""
        return shard_of(execution_id, self.shard_count)
