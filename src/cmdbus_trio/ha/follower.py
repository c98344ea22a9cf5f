"""The standby's side of the replication: the primary's transactions applied to this
member's replicas, each confirmed once it is durable.

Transactions are journaled as they come and made durable at each :class:`~._wire.Tick`
(the primary sends one after each batch, and when idle), then confirmed through the
tick's sequence: one fsync and one round-trip for a whole batch. A base copy replaces a
store's replica whole. A message of an epoch older than the newest lease this member
has seen ends the connection: that primary was deposed, and nothing it sends counts.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import trio

from cmdbus_trio.protocol._framing import FrameDecoder
from cmdbus_trio.storage._wal_tap import Committed
from cmdbus_trio.storage.replica import Position, Replica, install_base

from . import _wire as wire
from .source import Offload, receive_message

FOLD_BYTES = 16 << 20
"""Journal bytes a replica holds before they are folded into its database."""


class Deposed(Exception):
    """The primary sent a message of an epoch older than the lease: it was deposed."""


class Refused(Exception):
    """The primary would not take this standby; ``str()`` says why."""


class Follower:
    def __init__(
        self,
        name: str,
        data_dir: Path,
        stores: Iterable[str],
        *,
        offload: Offload,
        token: str | None = None,
        fold_bytes: int = FOLD_BYTES,
    ) -> None:
        self.name = name
        self.data_dir = data_dir
        self.store_names = tuple(stores)
        self.replicas: dict[str, Replica] = {}
        self._offload = offload
        self._token = token
        self._fold_bytes = fold_bytes
        self.confirmed = 0
        """The newest sequence confirmed to the primary (on this connection)."""
        self.primary_sequence = 0
        """The newest sequence the primary said it had."""
        self.base_copies = 0
        self.caught_up = False
        """It has confirmed a tick: every store the primary has, through that tick."""

    @property
    def behind(self) -> int:
        """Transactions the primary has that this member has not confirmed yet."""
        return max(0, self.primary_sequence - self.confirmed)

    def positions(self) -> dict[str, Position]:
        return {name: replica.position for name, replica in self.replicas.items()}

    async def open(self) -> None:
        """Open (and recover) the replicas there are; a store without one gets a base
        copy from the primary."""
        for name in self.store_names:
            path = self._path(name)
            if path.exists():
                self.replicas[name] = await self._offload(partial(Replica.open, path))

    async def close(self) -> None:
        for replica in self.replicas.values():
            await self._offload(replica.fold)
            replica.close()
        self.replicas.clear()

    async def follow(self, stream: trio.abc.Stream, epoch_seen: Callable[[], int]) -> None:
        """Follow the primary at the other end of ``stream`` until the connection ends.
        ``epoch_seen``: the newest lease epoch this member knows."""
        decoder = FrameDecoder(wire.MAX_FRAME)
        hello = wire.Hello(self.name, self._token, epoch_seen(), self.positions())
        await stream.send_all(wire.encode(hello))
        answer = await receive_message(stream, decoder)
        if isinstance(answer, wire.Refused):
            raise Refused(answer.reason)
        if not isinstance(answer, wire.Welcome):
            raise wire.WireError(f"a primary answers Hello with Welcome, not {answer!r:.80}")
        epoch = answer.epoch
        parts: dict[str, list[wire.Pages]] = {}
        ready: list[tuple[Position, Committed]] = []
        base: Any = None  # (store, start message, file, digest) while a copy comes
        while True:
            message = await receive_message(stream, decoder)
            if getattr(message, "epoch", epoch) != epoch or epoch < epoch_seen():
                raise Deposed(f"the primary of epoch {epoch} was deposed")
            if isinstance(message, wire.Pages):
                held = parts.setdefault(message.store, [])
                held.append(message)
                if message.last:
                    pages = tuple(page for part in held for page in part.pages)
                    committed = Committed(message.store, message.page_size, pages,
                                          message.database_pages)  # fmt: skip
                    ready.append((Position(message.epoch, message.sequence), committed))
                    del parts[message.store]
            elif isinstance(message, wire.Tick):
                await self._offload(partial(self._apply, ready))
                ready = []
                self.primary_sequence = message.sequence
                self.confirmed = message.sequence
                self.caught_up = True
                await stream.send_all(wire.encode(wire.Confirm(epoch, message.sequence)))
            elif isinstance(message, wire.BaseStart):
                copy = self._path(message.store).with_name(f".{message.store}.base")
                base = (message, await self._offload(partial(_create, copy)), copy,
                        hashlib.sha256())  # fmt: skip
            elif isinstance(message, wire.BaseChunk) and base is not None:
                await self._offload(partial(os.write, base[1], message.data))
                base[3].update(message.data)
            elif isinstance(message, wire.BaseEnd) and base is not None:
                start, handle, copy, digest = base
                base = None
                if digest.hexdigest() != message.sha256:
                    raise wire.WireError(f"the base copy of {message.store} is damaged")
                await self._offload(partial(self._install, start, handle, copy))
                self.base_copies += 1
            else:
                raise wire.WireError(f"a primary does not send {message!r:.80}")

    def _apply(self, ready: list[tuple[Position, Committed]]) -> None:
        """Journal the transactions and make them durable (in a worker thread)."""
        touched = set()
        for position, committed in ready:
            replica = self.replicas.get(committed.store)
            if replica is None:
                raise wire.WireError(f"transactions of {committed.store} before its base copy")
            if position > replica.position:  # (one resent after a reconnect: had it)
                replica.append(position, committed)
                touched.add(replica)
        for replica in touched:
            replica.sync()
            if replica.unfolded_bytes > self._fold_bytes:
                replica.fold()

    def _install(self, start: wire.BaseStart, handle: int, copy: Path) -> None:
        os.fsync(handle)
        os.close(handle)
        old = self.replicas.pop(start.store, None)
        if old is not None:
            old.close()
        path = self._path(start.store)
        install_base(path, copy, start.position)
        self.replicas[start.store] = Replica.open(path)

    def _path(self, store: str) -> Path:
        return self.data_dir / f"{store}.sqlite3"


def _create(path: Path) -> int:
    path.unlink(missing_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
