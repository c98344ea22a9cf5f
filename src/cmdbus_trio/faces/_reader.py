"""A data connection's reader: bytes from the socket into its sans-io protocol, the
events out to the connection's dispatcher, and the timers that end a connection (the
first frame's deadline, the read timeout mid-frame, the idle timeout between frames)."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

import attrs
import trio

from cmdbus_trio.loop import turns
from cmdbus_trio.protocol import NEED_DATA, Sentinel
from cmdbus_trio.protocol.server import Closed, Dialect, Event, FrameReceived, ServerConnection

from . import FaceContext
from ._outbox import Outbox

MAX_INFLIGHT_PER_CONNECTION = 32
MAX_STEP = 0.0005
"""Seconds of requests a connection takes in before the loop's other tasks run: every
task runs once per pass of the loop, so a long step makes every other task late."""
RECEIVE_CHUNK = 65536
LINGER_SECONDS = 2.0
"""At most this long (and never longer than the read timeout) a connection the writer
ends with a last answer discards what its client still sends (see :func:`linger`)."""
LINGER_REQUESTS = 8
"""At most this many requests' worth (of the cap) is discarded so."""

Batch = list[tuple[Event, float]]
"""What the reader hands the dispatcher: every event one read completed, each with its
arrival time (one hand-over per read, not per frame, for a pipelining client)."""

TakeNow = Callable[[FrameReceived, float, int], Event | None]
"""Take a frame, lent its bytes, in the reader's own task, without a wait (the
connection's ``_take_now``): None when taken, else the event the dispatcher is handed
instead: the frame (its loan still the reader's) or the close its parse answered (its
loan given back)."""


async def linger(stream: trio.abc.Stream, seconds: float, max_bytes: int) -> int:
    """End a connection the writer closes with a last answer (``too_large``, say) the
    way HTTP servers do: shut down the sending side after the answer, then read and
    discard what the client still sends, for at most ``seconds`` and
    ``max_bytes`` bytes or until it closes; the caller closes the socket after. Closed
    with its input unread, the kernel answers the client's next bytes with a reset,
    and the answer, though sent, is lost to the client. The bytes discarded.

    Cancellation: at any point; the caller closes the socket either way. Errors from a
    peer that is gone end the wait."""
    discarded = 0
    budget = turns.current()
    with trio.move_on_after(seconds):
        try:
            if isinstance(stream, trio.abc.HalfCloseableStream):
                await stream.send_eof()
            while discarded < max_bytes:
                data = await stream.receive_some(RECEIVE_CHUNK)
                if not data:
                    break
                discarded += len(data)
                await budget.wait()  # a unit of the data plane, as every read
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    return discarded


@attrs.define(eq=False)
class Reader:
    """Reads for one connection until the peer closes, a timer expires or the face
    drains. ``holding()`` says whether the connection holds work that times itself (a
    worker's leases), which the idle timeout waits for; ``end(outcome)`` is told when a
    timer ends the connection."""

    ctx: FaceContext
    stream: trio.abc.Stream
    protocol: ServerConnection
    outbox: Outbox
    _holding: Callable[[], bool] = attrs.field(kw_only=True)
    _end: Callable[[str], None] = attrs.field(kw_only=True)
    _take_now: TakeNow = attrs.field(kw_only=True)
    dispatcher_idle: bool = attrs.field(default=False, init=False)
    """The dispatcher has taken in every event handed to it and waits for more: the
    reader may take a frame itself (:attr:`_take_now`) without passing one before it.
    The dispatcher sets it; a hand-over clears it."""
    _reading_loan: int = attrs.field(default=0, init=False)
    """Bytes lent for the large frame being read."""
    _untaken: deque[int] = attrs.field(factory=deque, init=False)
    """Bytes lent for the frames handed to the dispatcher and not yet taken, in order."""
    _held: int = attrs.field(default=0, init=False)
    """Bytes of the face's budget this connection holds: frames read, being read and
    being answered (until each reply exists)."""
    _all_returned: trio.Event | None = attrs.field(default=None, init=False)
    _asked: int = attrs.field(default=0, init=False)
    """Requests being answered (the idle timeout waits for none)."""
    _quiet_since: float = attrs.field(factory=trio.current_time, init=False)
    """The last read or answer (see :meth:`asking`)."""
    _scope: trio.CancelScope | None = attrs.field(default=None, init=False)
    """The scope of the reads under way (the drain cancels it: see :meth:`_read`)."""
    _drained: bool = attrs.field(default=False, init=False)
    read_in_drain: int = attrs.field(default=0, init=False)
    """Bytes read once the face drained: the client was sending, so its connection is
    closed the lingering way (see :func:`linger`), not with a reset."""

    # --- the face's byte budget, lent to each frame until its reply exists ----------------
    #
    # The reader is a connection's only borrower, and it borrows in the order the frames
    # come: each frame before it is handed over (a large one before it is read whole), so
    # the dispatcher never waits for bytes. And a connection never waits for the budget
    # while it holds some of it: when there is no room, the reader first waits for its own
    # bytes to come back (the frames ahead of it are answered without the budget), then
    # queues with nothing in hand. A connection that asked for a large frame's bytes while
    # an earlier frame waited for its own held the budget against itself, and the face's
    # queue, first come first served, behind it.

    def lend_nowait(self, size: int) -> int | None:
        """Lend ``size`` bytes of the face's budget if they are free (0 without a
        budget) and the client reads its replies, else None (see :meth:`lend`)."""
        budget = self.ctx.pending_bytes
        if budget is None:
            return 0
        if self.outbox.over_cap:
            return None  # its frames would hold their bytes until the client reads
        try:
            lent = budget.acquire_nowait(size)
        except trio.WouldBlock:
            return None
        self._held += lent
        return lent

    async def lend(self, size: int) -> int:
        """Lend ``size`` bytes of the face's budget (at most all of it: a frame larger
        than the budget is taken in alone), waiting with none of it in hand.

        Cancellation: nothing is lent when cancelled."""
        lent = self.lend_nowait(size)
        if lent is not None:
            return lent
        budget = self.ctx.pending_bytes
        assert budget is not None  # else lent at once
        # A client that does not read its replies: take nothing more from it until
        # they drain (its requests wait in its socket, costing the writer nothing).
        await self.outbox.wait_drained()
        while self._held:
            self._all_returned = trio.Event()
            await self._all_returned.wait()
        lent = await budget.acquire(size)
        self._held += lent
        return lent

    def take_loan(self) -> int:
        """The dispatcher takes the next frame handed to it: the bytes lent for it."""
        return self._untaken.popleft()

    def give_back(self, lent: int) -> None:
        """Bytes lent by :meth:`lend` go back to the face's budget."""
        if lent and self.ctx.pending_bytes is not None:
            self.ctx.pending_bytes.release(lent)
            self._held -= lent
            if not self._held and self._all_returned is not None:
                self._all_returned.set()

    def return_untaken(self) -> None:
        """The connection is over: what was lent for frames not taken goes back."""
        for lent in (self._reading_loan, *self._untaken):
            self.give_back(lent)
        self._reading_loan = 0
        self._untaken.clear()

    def asking(self, change: int) -> None:
        """Count the requests being answered. The idle timeout runs only while there are
        none (a worker's ``next`` waiting for work is not idle), from the last answer or
        read. The reader's wait is not re-timed here (a cancel-scope deadline moved twice
        per request): when it expires, the reader looks again."""
        self._asked += change
        if not self._asked:
            self._quiet_since = trio.current_time()

    async def run(self, out: trio.MemorySendChannel[Batch], requests: trio.CancelScope) -> None:
        """Read until the end; then, if the peer is gone, cancel ``requests`` (the
        connection's read work: nobody is left to answer; started writes finish)."""
        async with out, trio.open_nursery() as reading:
            reading.start_soon(self._stop_on_drain)
            # BrokenResourceError: the dispatcher takes no more (it met the end).
            with contextlib.suppress(trio.BrokenResourceError):
                await self._read(out, self.ctx.config.read_timeout_ms / 1000)
            reading.cancel_scope.cancel()
        if self.outbox.peer_gone:
            requests.cancel()

    async def _stop_on_drain(self) -> None:
        await self.ctx.draining.wait()
        self._drained = True
        if self._scope is not None:
            self._scope.cancel()

    def _receive_nowait(self) -> bytes | None:
        """Once the face drains: the bytes the peer sent that are here already (b"" once
        it is gone), else None (nothing more is waited for, nor read past
        :data:`LINGER_REQUESTS` requests' worth of the cap; a TLS stream is not read)."""
        cap = LINGER_REQUESTS * self.ctx.config.max_request_bytes
        stream = self.stream
        if not isinstance(stream, trio.SocketStream) or self.read_in_drain >= cap:
            return None
        fd = stream.socket.fileno()
        if fd < 0:
            return b""
        try:
            data = os.read(fd, RECEIVE_CHUNK)
        except BlockingIOError:
            return None
        except OSError:
            return b""
        self.read_in_drain += len(data)
        return data

    async def _receive(self) -> bytes | bytearray:
        """The next bytes from the peer, b"" once it is gone. On a plain socket, read
        at once when bytes are there, and wait for the socket only when none are:
        ``receive_some`` yields a turn of the loop after every read that found bytes,
        and at a steady rate that turn was a fifth of a request's cost on the loop
        (docs/benchmarks.md, "What a record costs"). It is still a cancellation point.
        TLS streams read through their stream."""
        stream = self.stream
        if not isinstance(stream, trio.SocketStream):
            try:
                return await stream.receive_some(RECEIVE_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return b""
        await trio.lowlevel.checkpoint_if_cancelled()
        socket = stream.socket
        while True:
            # Asked each time, not kept: a closed socket says -1 (see Outbox._write_now).
            fd = socket.fileno()
            if fd < 0:
                return b""
            try:
                return os.read(fd, RECEIVE_CHUNK)
            except BlockingIOError:
                pass
            except OSError:  # reset by the peer: as a broken stream
                return b""
            try:
                await trio.lowlevel.wait_readable(socket)
            except trio.ClosedResourceError:
                return b""

    async def _read(self, out: trio.MemorySendChannel[Batch], read_timeout: float) -> None:
        """One cancel scope times many reads: entering a scope with a deadline and
        leaving it cost ~10% of the loop's time at ack-each loads (py-spy). Its deadline
        comes no later than either timer can expire; when it passes, the reader looks
        which timer, if any, did.

        Cancellation: the timer's scope may cancel the hand-over to a busy dispatcher;
        the events are kept and handed over in the next scope (trio's ``send`` either
        delivers or raises). It may cancel the wait for room in the turn
        (:mod:`cmdbus_trio.loop.turns`): the bytes read are the protocol's by then."""
        protocol = self.protocol
        budget = turns.current()
        idle_timeout = self.ctx.config.idle_timeout_ms / 1000
        horizon = min(read_timeout, idle_timeout)
        batch: Batch = []
        taking_until = 0.0  # the reader takes frames itself until then (see MAX_STEP)
        handing_over = reading = False
        closed: Closed | None = None
        unlent: tuple[FrameReceived, float] | None = None
        waiting_since = now = trio.current_time()
        # The first frame (a hello, or v1's first request) by a deadline from the accept:
        # the read timeout restarts with each byte, so a peer trickling bytes held a
        # connection of the face's cap for as long as it liked, without authenticating.
        hello_by = now + self.ctx.config.hello_timeout_ms / 1000
        timer = min(self._quiet_since + idle_timeout, now + horizon, hello_by)
        while True:
            with trio.CancelScope(deadline=math.inf if self._drained else timer) as scope:
                self._scope = scope
                while True:
                    if handing_over:
                        try:  # the dispatcher waits for it: no need to yield a turn
                            out.send_nowait(batch)
                        except trio.WouldBlock:
                            await out.send(batch)
                        self.dispatcher_idle = False
                        if closed is not None:
                            if closed.by_peer:
                                self.outbox.peer_gone = True
                            return
                        batch, handing_over = [], False
                        waiting_since = trio.current_time()
                    next_event: Event | Literal[Sentinel.NEED_DATA]
                    if unlent is not None:  # a frame read whole, waiting for its bytes
                        next_event, arrival = unlent
                    else:
                        next_event = protocol.next_event()
                        arrival = trio.current_time()
                    if next_event is not NEED_DATA:
                        lent = 0
                        if self._reading_loan:  # the large frame it was lent for
                            if isinstance(next_event, FrameReceived):
                                lent = self._reading_loan
                            else:
                                self.give_back(self._reading_loan)
                            self._reading_loan = 0
                        elif isinstance(next_event, FrameReceived):
                            lent_now = self.lend_nowait(len(next_event.data))
                            if lent_now is None:
                                unlent = (next_event, arrival)
                                if batch:  # the frames lent before it go first
                                    handing_over = True
                                    continue
                                # Cancelled (a timer), it is asked for again.
                                lent_now = await self.lend(len(next_event.data))
                                unlent = None
                            lent = lent_now
                        if (
                            not batch
                            and self.dispatcher_idle
                            and isinstance(next_event, FrameReceived)
                            and time.perf_counter() < taking_until
                        ):
                            # Nothing waits ahead of it: taken here, the request costs no
                            # hand-over (a turn of the loop and a step of the dispatcher).
                            handed = self._take_now(next_event, arrival, lent)
                            if handed is None:
                                continue
                            next_event = handed
                        if isinstance(next_event, FrameReceived):
                            self._untaken.append(lent)
                        batch.append((next_event, arrival))
                        if isinstance(next_event, Closed):
                            handing_over, closed = True, next_event
                        elif len(batch) >= min(MAX_INFLIGHT_PER_CONNECTION, self.ctx.room):
                            # No more than can be taken in at once: the rest wait unread,
                            # their clocks not started (frames waiting in a batch would
                            # age, and a held-back flood would run out its budgets there).
                            # The room is the fullest Gate's: a flood of writes fills their
                            # lane, not the face's.
                            handing_over = True
                        continue
                    if batch:
                        handing_over = True
                        continue
                    length = protocol.partial_length
                    if length is not None and length > RECEIVE_CHUNK and not self._reading_loan:
                        # A large frame is lent its bytes before it is read whole (a flood
                        # of them waits in the clients' sockets), not once it is in memory.
                        self._reading_loan = await self.lend(length)
                    if self._drained:  # what was sent is answered; nothing more is waited for
                        drained = self._receive_nowait()
                        if drained is None:
                            return
                        data: bytes | bytearray = drained
                    else:
                        reading = True
                        data = await self._receive()
                        reading = False
                    waiting_since = self._quiet_since = trio.current_time()
                    protocol.receive_data(data)
                    # After the bytes are the protocol's: a timer firing in the wait
                    # loses nothing. Waiting here also leaves the next read in the kernel.
                    await budget.wait()
                    taking_until = time.perf_counter() + MAX_STEP
            # The timer's deadline passed, or the drain began (the only ways out of the
            # scope but a return): a batch, a frame waiting for its bytes, or bytes in the
            # protocol are kept, and taken on in the next scope.
            if self._drained:
                reading = False
                continue
            now = trio.current_time()
            undecided = protocol.dialect is Dialect.UNDECIDED
            if undecided and now >= hello_by:
                self._end("hello_timeout")
                return
            if reading and protocol.in_partial_frame:
                expires = waiting_since + read_timeout
            elif reading:
                expires = self._quiet_since + idle_timeout
                if now >= expires and (self._asked or self._holding()):
                    # A worker's leases time themselves: not idle, look again later.
                    self._quiet_since = now
                    expires = now + idle_timeout
            else:  # handing over to a busy dispatcher: no timer runs
                expires = now + horizon
            if now >= expires:
                self._end("idle_timeout")
                return
            reading = False
            timer = min(expires, now + horizon, hello_by if undecided else expires)
