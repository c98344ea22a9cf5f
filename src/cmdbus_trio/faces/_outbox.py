"""A connection's replies on their way out: whole, in order, coalesced, capped."""

from __future__ import annotations

import os
from collections.abc import Callable

import attrs
import trio

from cmdbus_trio import metrics
from cmdbus_trio.loop.steps import Steps

MAX_WRITE_STEP = 0.0005
"""Seconds of deferred replies written in one step (see :func:`_writes`)."""


def _write_pending(pending: tuple[Outbox, trio.Nursery]) -> None:
    outbox, flusher = pending
    outbox.write_pending(flusher)


_WRITES: trio.lowlevel.RunVar[Steps[tuple[Outbox, trio.Nursery]]] = trio.lowlevel.RunVar(
    "cmdbus_deferred_writes"
)


def _writes() -> Steps[tuple[Outbox, trio.Nursery]]:
    """The run's outboxes waiting for their :meth:`Outbox.write_pending`, written in
    turn, :data:`MAX_WRITE_STEP` at a time (one callback per outbox ran them all in one
    step of trio's callback task: up to ~10 ms when a commit settled replies on every
    connection)."""
    try:
        return _WRITES.get()
    except LookupError:
        writes = Steps(_write_pending, max_step=MAX_WRITE_STEP, name="deferred_writes")
        _WRITES.set(writes)
        return writes


@attrs.define(eq=False)
class Outbox:
    """Writes a connection's frames whole and in order.

    Replies are coalesced: the first sender writes everything queued meanwhile in one
    ``send_all``, the others only queue (one write per batch of ready replies, not one
    per reply: that was a quarter of the loop's time under pipelined load).

    On a plain socket with nothing queued, a frame is first written at once, without a
    task or a timeout: on loopback or a LAN the kernel nearly always takes a reply
    whole, and a task and cancel scope per reply cost more than the write. What it does
    not take is queued and written as above. Replies settled by callbacks are gathered
    first (:meth:`send_nowait`): one write per connection for all the replies settled
    before its turn among the run's deferred writes.

    Error handling: a write that fails, or that the peer does not read for
    ``write_timeout`` seconds, calls ``broken`` once; from then on the outbox is
    :attr:`peer_gone` and writes nothing more (a write cut short may have sent part of a
    frame: the next reply after it would hand the client a corrupt frame, as a slow
    reader once got).
    """

    stream: trio.abc.Stream
    face: str = attrs.field(kw_only=True)
    write_timeout: float = attrs.field(kw_only=True)
    max_unsent: int = attrs.field(kw_only=True)
    _broken: Callable[[], None] = attrs.field(kw_only=True)
    peer_gone: bool = attrs.field(default=False, init=False)
    _frames: list[bytes] = attrs.field(factory=list, init=False)
    _flushing: bool = attrs.field(default=False, init=False)
    _write_pending: bool = attrs.field(default=False, init=False)  # see send_nowait
    _flush_ended: trio.Event | None = attrs.field(default=None, init=False)
    _writes: Steps[tuple[Outbox, trio.Nursery]] = attrs.field(factory=_writes, init=False)
    _unsent: int = attrs.field(default=0, init=False)  # bytes queued or being written
    # Set once unsent is back under the cap:
    _drained: trio.Event | None = attrs.field(default=None, init=False)

    @property
    def over_cap(self) -> bool:
        """More than ``max_unsent`` bytes wait to be written."""
        return self._unsent > self.max_unsent

    async def send(self, data: bytes, *, last: bool = False) -> bool:
        """Send ``data`` after everything before it; False when it could not be
        delivered (the peer is gone). A sender whose frames pile up unread (a
        subscription, a stream of pages) waits here for them to drain.

        A send is a checkpoint, written at once or not, unless ``last`` (the caller's
        task ends with it: a request's reply): then a reply written at once costs no
        turn of the loop, which the task would only take to end."""
        if self.peer_gone:
            return False
        if not self._flushing:
            data = self._write_now(data)
            if not data:
                if not last:
                    await trio.lowlevel.checkpoint()
                return not self.peer_gone
        self._put(data)
        if self._flushing:
            await self.wait_drained()
            return not self.peer_gone
        return await self._flush()

    def send_nowait(self, data: bytes, flusher: trio.Nursery) -> None:
        """:meth:`send` for a caller that is not a task of the connection (a callback
        that settles a reply). The frame is queued, and the outbox joins the run's
        deferred writes (:func:`_writes`): by its turn, the other replies settled
        meanwhile are queued too and go in the same write (:meth:`write_pending`); what
        the socket does not take then is written by a task in ``flusher``."""
        if self.peer_gone:
            return
        self._put(data)
        if not self._flushing and not self._write_pending:
            self._write_pending = True
            self._writes.push((self, flusher))

    def write_pending(self, flusher: trio.Nursery) -> None:
        """Write what :meth:`send_nowait` queued, now if not done yet (the connection
        calls it before it closes ``flusher``)."""
        if not self._write_pending:
            return
        self._write_pending = False
        if self._flushing or self.peer_gone or not self._frames:
            return  # a flush under way writes them
        chunk = b"".join(self._frames)
        self._frames.clear()
        rest = self._write_now(chunk)
        if self.peer_gone:
            return
        self._sent(len(chunk) - len(rest))
        if rest:
            self._frames.append(rest)
            self._flushing = True
            flusher.start_soon(self._flush)

    async def wait_drained(self) -> None:
        """Return once the unsent frames are within the cap (or the peer is gone); a
        wait is counted in ``cmdbus_unsent_waits_total``."""
        if self.over_cap:
            metrics.child(metrics.UNSENT_WAITS, self.face).inc()
        while self.over_cap and not self.peer_gone:
            if self._drained is None:
                self._drained = trio.Event()
            await self._drained.wait()

    async def wait_flushed(self) -> None:
        """Return once every queued frame is written, or the peer is gone (each write
        has its timeout). A connection that closes itself waits for this first, so that
        its close never cuts a frame in two (another task's reply being written).

        Cancellation: a wait for another task's flush stops and that flush goes on; a
        write this call makes itself (frames queued for a ``write_pending``) may stop
        mid-frame, which only a connection that is ending anyway can afford."""
        while not self.peer_gone and (self._frames or self._flushing):
            if not self._flushing:  # queued for a write_pending: write them now
                await self._flush()
                continue
            if self._flush_ended is None:
                self._flush_ended = trio.Event()
            await self._flush_ended.wait()

    def _write_now(self, data: bytes) -> bytes:
        """Write what the socket takes of ``data`` now; return the rest. Only while no
        flush runs and nothing is queued (no frame can overtake another), and only on a
        plain socket (TLS frames its own records)."""
        if self._frames or not isinstance(self.stream, trio.SocketStream):
            return data
        # Asked each time, not kept: a closed socket says -1, while a kept number could
        # by then belong to another connection.
        fd = self.stream.socket.fileno()
        if fd < 0:
            return data  # closed: the flush path raises and marks the peer gone
        try:
            written = os.write(fd, data)
        except BlockingIOError:
            return data
        except OSError:  # reset or broken pipe: as a failed send_all
            self._lost()
            return b""
        return data[written:]

    def _lost(self) -> None:
        self.peer_gone = True
        self._frames.clear()
        self._sent(self._unsent)
        self._broken()

    def _put(self, data: bytes) -> None:
        self._frames.append(data)
        self._unsent += len(data)

    def _sent(self, size: int) -> None:
        self._unsent -= size
        if self._drained is not None and (not self.over_cap or self.peer_gone):
            self._drained.set()
            self._drained = None

    async def _flush(self) -> bool:
        self._flushing = True
        try:
            while self._frames:
                chunk = b"".join(self._frames)
                self._frames.clear()
                # Per write: a client that keeps reading is never cut off, however long
                # the stream of replies lasts. (move_on_after, not fail_after: the latter
                # is a generator-based context manager, twice the cost per reply.)
                with trio.move_on_after(self.write_timeout) as writing:
                    await self.stream.send_all(chunk)
                if writing.cancelled_caught:
                    raise trio.TooSlowError
                self._sent(len(chunk))
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
            self._lost()
            return False
        finally:
            self._flushing = False
            if self._flush_ended is not None:
                self._flush_ended.set()
                self._flush_ended = None
        return True
