"""One connection of a data face: scheduling, admission, replies (its reader and timers:
``_reader.py``; its listeners and drain: ``_listen.py``; its writes: ``_outbox.py``).

The wire decisions (dialect, hello, auth, envelopes, error frames, the reply cap) are the
sans-io :class:`~cmdbus_trio.protocol.server.ServerConnection`'s; this module does the
I/O around it. Per connection, a reader task feeds it bytes and hands its events to the
dispatcher over an unbuffered channel, the events of one read at a time (no more than
the Gate has room for), so a client that sends faster than we serve is held back by TCP,
never by our memory; a v2 request that nothing is ahead of and nothing would hold back,
the reader takes itself (:meth:`Connection._take_now`: no hand-over, a turn of the loop
less). The reader also notices when the client goes away, which cancels that
connection's read work.

A v2 request is answered by a task of its own, or, when the handler returns a
:class:`Deferred`, by the callback that settles it (a group committer, the Gate); which
one is the op's. Either way the reply goes through the connection's :class:`Outbox`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial

import attrs
import trio

from cmdbus_trio import __version__, metrics
from cmdbus_trio.admission import Gate, Shed, ShedReason
from cmdbus_trio.logs import event
from cmdbus_trio.loop import turns
from cmdbus_trio.loop.deferred import Deferred
from cmdbus_trio.protocol import ErrorCode, Request, UnsupportedOp, encode_frame
from cmdbus_trio.protocol.server import (
    UNKNOWN_OP,
    Answer,
    Closed,
    Dialect,
    Event,
    FrameReceived,
    Opened,
    ServerConnection,
)

from . import FaceContext
from ._handler import CloseConnection, FaceError, FaceHandler, Sender, as_face_error
from ._outbox import Outbox
from ._reader import (
    LINGER_REQUESTS,
    LINGER_SECONDS,
    MAX_INFLIGHT_PER_CONNECTION,
    MAX_STEP,
    Batch,
    Reader,
    linger,
)

log = logging.getLogger(__name__)


@attrs.define
class OpenCount:
    """Open connections of one face (``max_connections`` caps it)."""

    open: int = 0


class Connection:
    handler: FaceHandler

    def __init__(self, ctx: FaceContext, stream: trio.abc.Stream) -> None:
        config = ctx.config
        self.ctx = ctx
        self.face = ctx.name
        self._scope = trio.CancelScope()
        self.stream = stream
        self.protocol = ServerConnection(
            face=ctx.name,
            server=f"cmdbus-trio {__version__}",
            max_request_bytes=config.max_request_bytes,
            max_reply_bytes=config.max_reply_bytes,
            auth_token=config.auth_token,
            v1_trusted=config.auth_token is not None and ctx.v1_trusted(stream),
        )
        self._replies: trio.Nursery | None = None  # where deferred replies are flushed
        self._deferred = 0  # deferred replies not settled yet
        self._deferred_settled: trio.Event | None = None
        self._closing: Closed | None = None  # the connection takes no more; why
        self.outcome = "closed"
        self._answered_last = False  # a too_large or unreadable frame's answer went out
        self._shed_recently = False
        self.outbox = Outbox(
            stream,
            face=ctx.name,
            write_timeout=config.read_timeout_ms / 1000,
            max_unsent=config.connection_unsent_bytes,
            broken=self._write_failed,
        )
        self._large = trio.CapacityLimiter(
            max(1, config.connection_unsent_bytes // config.max_reply_bytes)
        )
        self._slots = trio.CapacityLimiter(MAX_INFLIGHT_PER_CONNECTION)  # requests in flight
        self.reader = Reader(
            ctx,
            stream,
            self.protocol,
            self.outbox,
            holding=lambda: self.handler.holding(),
            end=self._end,
            take_now=self._take_now,
        )

    @classmethod
    async def run(
        cls,
        ctx: FaceContext,
        make_handler: Callable[[Sender], FaceHandler],
        count: OpenCount,
        stream: trio.abc.Stream,
    ) -> None:
        metrics.CONNECTIONS.labels(face=ctx.name, outcome="accepted").inc()
        if count.open >= ctx.config.max_connections:
            # Accept and close at once: the client sees a clean close, not a hang in the
            # listen backlog, and the refusal is counted.
            metrics.CONNECTIONS.labels(face=ctx.name, outcome="over_capacity").inc()
            await trio.aclose_forcefully(stream)
            return
        count.open += 1
        connection = cls(ctx, stream)
        connection.handler = make_handler(connection.outbox.send)
        try:
            await connection._serve()
            lingers = connection._answered_last or connection.reader.read_in_drain
            if lingers and not connection.outbox.peer_gone:
                await connection._linger()  # still one of the face's open connections
        except Exception as exc:
            # A bug closes this connection only; the face and every other client go on.
            connection._end("internal_error")
            event(log, logging.ERROR, "connection_failed", face=connection.face, exc_info=exc)
        finally:
            count.open -= 1
            # Forcefully: a TLS close_notify to a peer that does not read could hang.
            await trio.aclose_forcefully(stream)
            connection.handler.closed(connection.outcome)
            metrics.CONNECTIONS.labels(face=connection.face, outcome=connection.outcome).inc()

    async def _linger(self) -> None:
        config = self.ctx.config
        seconds = min(LINGER_SECONDS, config.read_timeout_ms / 1000)
        await linger(self.stream, seconds, LINGER_REQUESTS * config.max_request_bytes)

    def _end(self, outcome: str) -> None:
        if self.outcome == "closed":  # the first reason wins
            self.outcome = outcome

    async def _serve(self) -> None:
        send_events, receive_events = trio.open_memory_channel[Batch](0)
        with self._scope:  # cancelled to end the connection from a handler
            try:
                async with trio.open_nursery() as nursery:
                    requests = trio.CancelScope()
                    nursery.start_soon(self.reader.run, send_events, requests)
                    with requests:
                        async with receive_events:
                            await self._dispatch(receive_events)
                    nursery.cancel_scope.cancel()
            finally:  # the reader and the dispatcher are both done
                self.reader.return_untaken()

    # --- dispatching ---------------------------------------------------------------------

    async def _dispatch(self, batches: trio.MemoryReceiveChannel[Batch]) -> None:
        async with trio.open_nursery() as inflight:
            self._replies = inflight
            try:
                await self._take_events(batches, inflight)
                # Requests in flight are still answered, deferred ones too.
                while self._deferred:
                    self._deferred_settled = trio.Event()
                    await self._deferred_settled.wait()
            finally:
                self._replies = None  # a reply settled later has nobody to go to
                self.outbox.write_pending(inflight)  # cancelled too: inflight not yet closed
        if self._closing is not None:  # its last answer after every earlier one
            await self._close(self._closing)

    async def _take_events(
        self, batches: trio.MemoryReceiveChannel[Batch], inflight: trio.Nursery
    ) -> None:
        budget = turns.current()
        while True:
            self.reader.dispatcher_idle = True
            try:
                batch = await batches.receive()
            except trio.EndOfChannel:
                return
            self.reader.dispatcher_idle = False
            await budget.wait()
            until = time.perf_counter() + MAX_STEP
            for taken, arrival in batch:
                if time.perf_counter() > until or not budget.has_room():
                    await trio.lowlevel.checkpoint()  # let the other tasks run
                    await budget.wait()
                    until = time.perf_counter() + MAX_STEP
                if isinstance(taken, Closed):
                    self._closing = taken
                    return
                if isinstance(taken, Opened):
                    await self.outbox.send(taken.reply)
                elif self.protocol.dialect is Dialect.V1:
                    if not await self._v1(taken.data, arrival):
                        return
                elif not await self._take_request(taken.data, arrival, inflight):
                    return

    async def _close(self, closed: Closed) -> None:
        self._end(closed.outcome)
        if closed.final is not None:
            await self.outbox.send(closed.final)
            self._answered_last = True
        await self.outbox.wait_flushed()

    async def _take_request(self, frame: bytes, arrival: float, inflight: trio.Nursery) -> bool:
        """Start answering one frame; False when the connection takes no more."""
        # A client that does not read its replies: take nothing more from it until they
        # drain (its requests wait in its socket, costing the writer nothing).
        await self.outbox.wait_drained()
        lent = self.reader.take_loan()  # lent by the reader before it handed the frame over
        request = self.protocol.read_request(frame)
        if not isinstance(request, Request):
            self._give_back(lent, None)
            if isinstance(request, Closed):  # unparseable: answered last, then closed
                self._closing = request
                return False
            await self._write(request, arrival)
            return True
        gate = self.ctx.gate_of(request.op)
        gated = request.op in self.handler.gated_ops
        if gated and gate.intake_full:
            if self._slots.borrowed_tokens or self._shed_recently:
                # A client with requests in flight, or just told `busy`, while every slot
                # and queue place is taken: its next request waits for room (at most
                # shed_after, the retry_after it was given; then it goes on and, likely
                # shed, gets `busy`), and the rest wait in its socket. Refusing a flood
                # one parsed request at a time would leave the loop too little time for
                # the admitted ones. A lone request still gets `busy` at once.
                with trio.move_on_after(gate.shed_after):
                    await gate.wait_for_room()
        elif gated:
            self._shed_recently = False
        slot = object()  # a hashable borrower token per request
        try:  # without a wait when free (see Reader.lend)
            self._slots.acquire_on_behalf_of_nowait(slot)
        except trio.WouldBlock:
            await self._slots.acquire_on_behalf_of(slot)
        large = request.op in self.handler.large_reply_ops
        if large:
            await self._large.acquire_on_behalf_of(slot)
        self._start(request, arrival, lent, slot, large, inflight)
        return True

    def _take_now(self, frame: FrameReceived, arrival: float, lent: int) -> Event | None:
        """:meth:`_take_request` in the reader's task, for a frame lent its bytes that
        nothing waits ahead of (:attr:`Reader.dispatcher_idle`) nor would hold back
        (replies, slots, Gates, the turn's share). None when taken; else, for the
        dispatcher, the frame (its loan the reader's) or its parse's close (loan back)."""
        inflight = self._replies
        if (
            inflight is None
            or self.protocol.dialect is not Dialect.V2
            or self.outbox.over_cap
            or not self._slots.available_tokens
            or not self._large.available_tokens
            or not self.ctx.room
            or not turns.current().has_room()
        ):
            return frame
        request = self.protocol.read_request(frame.data)
        if not isinstance(request, Request):
            self._give_back(lent, None)
            if isinstance(request, Closed):
                return request
            self._answer_nowait(request, arrival, inflight)
            return None
        if request.op in self.handler.gated_ops:
            self._shed_recently = False  # (every Gate has room)
        slot = object()
        self._slots.acquire_on_behalf_of_nowait(slot)  # free: asked above
        large = request.op in self.handler.large_reply_ops
        if large:
            self._large.acquire_on_behalf_of_nowait(slot)
        self._start(request, arrival, lent, slot, large, inflight)
        return None

    def _start(
        self,
        request: Request,
        arrival: float,
        lent: int,
        slot: object,
        large: bool,
        inflight: trio.Nursery,
    ) -> None:
        """Hand an admitted request to the handler: its reply comes from a task in
        ``inflight`` or from the callback that settles it."""
        gated = request.op in self.handler.gated_ops
        produced = partial(self._give_back, lent, slot if large else None)
        try:
            pending = self.handler.v2(request, arrival)
        except Exception as exc:
            produced()
            self._slots.release_on_behalf_of(slot)
            self._answer_nowait(self._error_answer(request.id, request.op, exc), arrival, inflight)
            return
        gate = self.ctx.gate_of(request.op) if gated else None
        if gate is not None:
            gate.take_in()
        self.reader.asking(+1)
        done = partial(self._request_done, slot, gate)
        if isinstance(pending, Deferred):
            self._deferred += 1
            pending.when_settled(partial(self._deferred_reply, request, arrival, produced, done))
        else:
            inflight.start_soon(self._v2, request, pending, arrival, produced, done)

    def _give_back(self, lent: int, large: object | None) -> None:
        """A request's reply exists (or it has none): its bytes go back to the face's
        budget and its large-reply place to the connection. Before the reply is sent, so
        that a client slow to read holds up only itself."""
        self.reader.give_back(lent)
        if large is not None:
            self._large.release_on_behalf_of(large)

    def _request_done(self, slot: object, gate: Gate | None) -> None:
        self._slots.release_on_behalf_of(slot)
        self.reader.asking(-1)
        if gate is not None:
            gate.taken_out()

    async def _v1(self, frame: bytes, arrival: float) -> bool:
        self.reader.asking(+1)
        lent = self.reader.take_loan()
        try:
            try:
                try:
                    reply = await self.handler.v1(frame, arrival)
                finally:
                    self._give_back(lent, None)
            except CloseConnection as close:
                self._end(close.outcome)
                return False
            sent = await self.outbox.send(reply.data)
            self._observe(reply.op, reply.outcome, arrival)
            return sent
        finally:
            self.reader.asking(-1)

    async def _v2(
        self,
        request: Request,
        pending: Awaitable[bytes],
        arrival: float,
        produced: Callable[[], None],
        done: Callable[[], None],
    ) -> None:
        try:
            try:
                try:
                    outcome: bytes | Exception = await pending
                finally:
                    produced()
            except CloseConnection as close:
                if close.final is not None:  # the writer's choice: not lingered over
                    await self.outbox.send(encode_frame(close.final))
                await self.outbox.wait_flushed()  # no frame is cut in two by the close
                self._end(close.outcome)
                self._scope.cancel()
                return
            except Exception as exc:
                outcome = exc
            # A unit of the data plane, as the readers' are: a commit wakes many such
            # tasks at once, and in one turn they made it (and every probe) long.
            await turns.current().wait()
            await self._write(self._answer(request, outcome), arrival, last=True)
        finally:
            done()

    def _deferred_reply(
        self,
        request: Request,
        arrival: float,
        produced: Callable[[], None],
        done: Callable[[], None],
        outcome: bytes | Exception,
    ) -> None:
        """Called by whatever settles a :class:`Deferred` (on the loop, not in a task of
        this connection): queue the reply for a flush task."""
        produced()
        try:
            answer = self._answer(request, outcome)
            if self._replies is not None:  # else the connection is over
                self._answer_nowait(answer, arrival, self._replies)
            else:
                self._observe(answer.op, answer.outcome, arrival)
        except Exception as exc:  # a bug: it closes this connection only
            self._end("internal_error")
            event(log, logging.ERROR, "connection_failed", face=self.face, exc_info=exc)
            self._scope.cancel()
        finally:
            done()
            self._deferred -= 1
            if not self._deferred and self._deferred_settled is not None:
                self._deferred_settled.set()

    def _answer(self, request: Request, outcome: bytes | Exception) -> Answer:
        if isinstance(outcome, Exception):
            return self._error_answer(request.id, request.op, outcome)
        return self.protocol.reply(request, outcome)

    def _error_answer(self, request_id: int | None, op: str, exc: Exception) -> Answer:
        if isinstance(exc, Shed) and exc.reason is ShedReason.WAITERS_FULL:
            self._shed_recently = True
        if isinstance(exc, UnsupportedOp):
            op = UNKNOWN_OP
        e = as_face_error(exc)
        if e is None:
            event(log, logging.ERROR, "request_failed", face=self.face, op=op, exc_info=exc)
            e = FaceError(ErrorCode.INTERNAL, f"internal error ({type(exc).__name__})")
        return self.protocol.error(request_id, op, e.code, e.message, e.retry_after_ms, e.primary)

    def _answer_nowait(self, answer: Answer, arrival: float, flusher: trio.Nursery) -> None:
        """Queue an answer behind the connection's other replies, for a caller that does
        not wait (see :meth:`Outbox.send_nowait`)."""
        self.outbox.send_nowait(answer.frame, flusher)
        self._observe(answer.op, answer.outcome, arrival)

    async def _write(self, answer: Answer, arrival: float, *, last: bool = False) -> None:
        await self.outbox.send(answer.frame, last=last)
        self._observe(answer.op, answer.outcome, arrival)

    def _observe(self, op: str, outcome: str, arrival: float) -> None:
        metrics.child(metrics.REQUEST_DURATION, self.face, op, outcome).observe(
            trio.current_time() - arrival
        )

    def _write_failed(self) -> None:
        # The stream is unusable (see Outbox): the connection ends here.
        self._end("write_error")
        self._scope.cancel()
