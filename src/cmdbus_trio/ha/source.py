"""The primary's side of the replication: each commit's pages, numbered in commit order,
kept in a bounded backlog, streamed to the standby; the standby's confirmations, which
acknowledgements wait for.

Taps (:class:`~cmdbus_trio.storage._wal_tap.WalTap`) call :meth:`Source.committed` from
the stores' threads, under each store's write lock, so the numbering is the commit
order. The backlog keeps the newest transactions up to :data:`BACKLOG_BYTES`; a standby
that comes back within it resumes where it stopped, one further behind (or one whose
history went another way: a deposed primary) gets a base copy of the store first.

One standby at a time: a new connection replaces the one before.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import attrs
import trio

from cmdbus_trio.logs import event
from cmdbus_trio.protocol._framing import NEED_DATA, FrameDecoder
from cmdbus_trio.storage._sqlite import SqliteStore
from cmdbus_trio.storage._wal_tap import Committed
from cmdbus_trio.storage.replica import Position, snapshot

from . import _wire as wire

log = logging.getLogger(__name__)

BACKLOG_BYTES = 64 << 20
"""Page bytes of recent transactions kept for a standby that falls behind."""
TICK_EVERY = 0.2
"""Seconds between :class:`~._wire.Tick` frames on an idle stream."""
CHUNK = 1 << 20
"""Bytes of a base copy per frame, and about the most the stream sends at once."""
HELLO_TIMEOUT = 5.0
"""Seconds a connection to the replication face has to say Hello before it is closed."""

Offload = Callable[[Callable[[], Any]], Any]


@attrs.frozen
class _Entry:
    sequence: int
    epoch: int
    committed: Committed
    size: int
    at: float  # time.monotonic() at the commit


class Source:
    def __init__(
        self,
        stores: Mapping[str, SqliteStore],
        epoch: int,
        *,
        first_sequence: int = 1,
        token: str | None = None,
        primary: str = "",
        offload: Offload,
        backlog_bytes: int = BACKLOG_BYTES,
    ) -> None:
        self.stores = dict(stores)
        self.epoch = epoch
        self.primary = primary
        self._token = token
        self._offload = offload
        self._backlog_bytes = backlog_bytes
        self._lock = threading.Lock()
        self._entries: collections.deque[_Entry] = collections.deque()
        self._bytes = 0
        self.sequence = first_sequence - 1
        """The newest transaction numbered."""
        self.floor = first_sequence - 1
        """Every transaction after this one is still in the backlog."""
        self.confirmed = -1
        """The newest transaction the standby confirmed durable (-1: no standby)."""
        self.standby: str | None = None
        self._trio_token = trio.lowlevel.current_trio_token()
        self._grew = trio.Event()
        self._confirmed = trio.Event()
        self._connection = 0  # the one serving now (a newer one replaces it)
        self.listeners: list[Callable[[], None]] = []
        """Called when the standby confirms more, connects or goes (the synchronizer)."""

    # --- in the stores' threads ------------------------------------------------------------

    def committed(self, committed: Committed) -> None:
        """A transaction committed (a tap's callback: under its store's write lock)."""
        size = sum(len(page) for _, page in committed.pages)
        with self._lock:
            self.sequence += 1
            entry = _Entry(self.sequence, self.epoch, committed, size, time.monotonic())
            self._entries.append(entry)
            self._bytes += size
            while self._bytes > self._backlog_bytes and len(self._entries) > 1:
                dropped = self._entries.popleft()
                self._bytes -= dropped.size
                self.floor = dropped.sequence
        self._trio_token.run_sync_soon(self._wake_senders)

    def _wake_senders(self) -> None:
        self._grew.set()
        self._grew = trio.Event()

    def lag_seconds(self) -> float:
        """How long the oldest transaction the standby has not confirmed has waited."""
        with self._lock:
            waiting = self._after(self.confirmed, 1)
        return time.monotonic() - waiting[0].at if waiting else 0.0

    def _after(self, sequence: int, most: int | None = None) -> list[_Entry]:
        """The backlog's entries after ``sequence`` (``most`` of them), counted from the
        newest (their sequences are consecutive): a sender asks for the few it has not
        sent, at each commit, of a backlog of thousands. Under the lock."""
        if not self._entries:
            return []
        count = min(len(self._entries), max(0, self._entries[-1].sequence - sequence))
        after = list(itertools.islice(reversed(self._entries), count))[::-1]
        return after if most is None else after[:most]

    # --- on the loop ---------------------------------------------------------------------

    def close(self) -> None:
        """End the standby's connection (the primary stops being one): its sender stops
        within a tick."""
        self._connection += 1
        self._wake_senders()

    async def wait_confirmed(self, sequence: int) -> None:
        """Until the standby confirmed ``sequence`` durable (the caller bounds the wait)."""
        while self.confirmed < sequence:
            await self._confirmed.wait()

    async def serve(self, stream: trio.abc.Stream, hello_timeout: float = HELLO_TIMEOUT) -> None:
        """One standby's connection, until it ends or a newer one replaces it (only once
        it said Hello, with the token: a connection that says nothing, or anything else,
        is closed and displaces nobody)."""
        decoder = FrameDecoder(wire.MAX_FRAME)
        hello: wire.Message | None = None
        with trio.move_on_after(hello_timeout):
            hello = await receive_message(stream, decoder)
        if hello is None:
            raise wire.WireError(f"no Hello within {hello_timeout} s")
        if not isinstance(hello, wire.Hello):
            raise wire.WireError(f"a standby must say Hello first, not {type(hello).__name__}")
        if self._token is not None and not hmac.compare_digest(hello.token or "", self._token):
            await stream.send_all(wire.encode(wire.Refused("wrong token", self.epoch)))
            return
        if hello.epoch > self.epoch:
            await stream.send_all(wire.encode(wire.Refused("deposed", self.epoch)))
            return
        self._connection += 1  # (it replaces the one before: a standby reconnecting)
        mine = self._connection
        await stream.send_all(wire.encode(wire.Welcome(self.epoch, self.primary)))
        event(log, logging.INFO, "standby_connected", standby=hello.name, epoch=self.epoch)
        self.standby = hello.name
        self._wake_confirmed()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._confirmations, stream, decoder, mine)
                await self._send(stream, hello.positions, mine)
                nursery.cancel_scope.cancel()
        finally:
            if self._connection == mine:
                self.standby = None
                self.confirmed = -1
                self._wake_confirmed()

    async def _confirmations(
        self, stream: trio.abc.Stream, decoder: FrameDecoder, mine: int
    ) -> None:
        while self._connection == mine:
            message = await receive_message(stream, decoder)
            if not isinstance(message, wire.Confirm) or message.epoch != self.epoch:
                raise wire.WireError(f"a standby may only confirm, not send {message!r:.80}")
            if message.sequence > self.confirmed:
                self.confirmed = message.sequence
                self._wake_confirmed()

    def _wake_confirmed(self) -> None:
        self._confirmed.set()
        self._confirmed = trio.Event()
        for listener in self.listeners:
            listener()

    async def _send(
        self, stream: trio.abc.Stream, positions: Mapping[str, Position], mine: int
    ) -> None:
        resume: dict[str, int] = {}
        for name, store in self.stores.items():
            position = positions.get(name)
            if position is not None and self._continues(position):
                resume[name] = position.sequence
            else:
                resume[name] = await self._base_copy(stream, name, store)
        sent = min(resume.values(), default=self.sequence)
        while self._connection == mine:
            grew = self._grew
            with self._lock:
                if sent < self.floor:  # fell out of the backlog while copying
                    raise wire.WireError("the standby fell behind the backlog: it starts again")
                pending = self._after(sent)
            frames: list[bytes] = []  # one send for many: a commit's pages and the tick
            size = 0
            for entry in pending:
                of = entry.committed.store
                if entry.sequence > resume.get(of, entry.sequence):
                    for part in wire.split(of, entry.epoch, entry.sequence, entry.committed):
                        frames.append(wire.encode(part))
                        size += len(frames[-1])
                if size >= CHUNK:
                    await stream.send_all(b"".join(frames))
                    frames, size = [], 0
                sent = entry.sequence
            frames.append(wire.encode(wire.Tick(self.epoch, sent)))
            await stream.send_all(b"".join(frames))
            with trio.move_on_after(TICK_EVERY):
                await grew.wait()

    def _continues(self, position: Position) -> bool:
        """The standby's store at ``position`` is on this primary's history, and what
        follows it is all in the backlog."""
        if position.sequence == 0:
            return False  # it has nothing yet
        with self._lock:  # (the entry at its position tells the epoch that made it)
            found = self._after(position.sequence - 1, 1)
        return (
            bool(found)
            and found[0].sequence == position.sequence
            and found[0].epoch == position.epoch
        )

    async def _base_copy(self, stream: trio.abc.Stream, name: str, store: SqliteStore) -> int:
        """Send a copy of ``store`` as of now; the sequence it holds everything through."""
        target = store.path.with_name(f".{store.path.name}.standby-{os.getpid()}")
        target.unlink(missing_ok=True)

        def at() -> Position:
            with self._lock:
                return Position(self.epoch, self.sequence)

        try:
            position: Position = await self._offload(lambda: snapshot(store, target, at))
            size = target.stat().st_size
            await stream.send_all(wire.encode(wire.BaseStart(name, self.epoch, position, size)))
            digest = hashlib.sha256()
            for offset in range(0, size, CHUNK):
                chunk = await self._offload(partial(_read_chunk, target, offset))
                digest.update(chunk)
                await stream.send_all(wire.encode(wire.BaseChunk(name, self.epoch, chunk)))
            await stream.send_all(wire.encode(wire.BaseEnd(name, self.epoch, digest.hexdigest())))
        finally:
            target.unlink(missing_ok=True)
        return position.sequence


def _read_chunk(path: os.PathLike[str], offset: int) -> bytes:
    with open(path, "rb") as copy:
        copy.seek(offset)
        return copy.read(CHUNK)


async def receive_message(stream: trio.abc.Stream, decoder: FrameDecoder) -> wire.Message:
    """The next message on a replication stream (either end), read as it comes."""
    while True:
        frame = decoder.next_frame()
        if frame is not NEED_DATA:
            if not isinstance(frame, bytes | bytearray):
                raise EOFError("the other member closed the connection")
            return wire.decode(bytes(frame))
        data = await stream.receive_some(1 << 16)
        decoder.receive_data(data)
