"""What every data face shares: listening, framing, dialects, timeouts, errors, drain.

A face supplies a :class:`FaceHandler` (how to answer a v1 frame and a v2 request); this
module runs the connections. Per connection, a reader task turns bytes into frames and
hands them over an unbuffered channel, the frames of one read at a time (no more than the
Gate has room for), so a client that sends faster than we serve is held back by TCP,
never by our memory; the reader also notices when the client goes away, which cancels
that connection's read work.

A v2 request is answered by a task of its own, or, when the handler returns a
:class:`Deferred`, by the callback that settles it (the group committer, the body
reader), the reply queued for one flush task per batch of ready replies.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import math
import ssl
from collections.abc import Awaitable, Callable, Iterable, Iterator
from functools import partial
from typing import Protocol, TypeVar

import attrs
import trio

from cmdbus_trio import __version__, metrics
from cmdbus_trio.admission import DeadlineExceeded, Gate, GateClosed, Shed, ShedReason
from cmdbus_trio.config import Config
from cmdbus_trio.logs import event
from cmdbus_trio.protocol import (
    NEED_DATA,
    ErrorCode,
    FrameDecoder,
    Hello,
    LocalProtocolError,
    RemoteProtocolError,
    Request,
    RequestError,
    UnsupportedOp,
    detect_dialect,
    encode_error,
    encode_frame,
    encode_hello_reply,
    parse_request,
)
from cmdbus_trio.storage import StoreUnavailable

from . import FaceContext

T = TypeVar("T")
P = TypeVar("P")

log = logging.getLogger(__name__)

MAX_INFLIGHT_PER_CONNECTION = 32
RECEIVE_CHUNK = 65536

Item = tuple[bytes | RemoteProtocolError, float]
"""A frame and its arrival time, or the error that ends the stream (in order, so that the
answer to it can depend on the dialect the frames before chose)."""
Batch = list[Item]
"""What the reader hands the dispatcher: every frame one read completed (one hand-over per
read, not per frame, for a pipelining client)."""


class FaceError(Exception):
    """An error answer: v2 ``{"ok": false, "error": …}``, v1 as the face words it."""

    def __init__(self, code: ErrorCode, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms


class CloseConnection(Exception):
    """Close the connection, after ``final`` if given (v1's documented response to bad
    input; a v2 subscriber cut off as a slow consumer)."""

    def __init__(self, outcome: str = "protocol_error", final: bytes | None = None) -> None:
        super().__init__(outcome)
        self.outcome = outcome
        self.final = final


Sender = Callable[[bytes], Awaitable[bool]]
"""Sends bytes on the connection, in order; False once the peer is gone."""


class Deferred:
    """A v2 reply that a callback on the loop settles (the group committer settling a
    ticket), so that the connection needs no task to wait for it. Under pipelined load a
    task and a wake-up per request were most of the loop's time."""

    __slots__ = ("_callback", "_outcome")

    def __init__(self) -> None:
        self._callback: Callable[[bytes | Exception], None] | None = None
        self._outcome: bytes | Exception | None = None

    def settle(self, outcome: bytes | Exception) -> None:
        """The reply body, or the exception to answer with (as a handler would raise)."""
        if self._outcome is not None:
            raise RuntimeError("a reply is settled once")
        self._outcome = outcome
        if self._callback is not None:
            self._callback(outcome)

    def when_settled(self, callback: Callable[[bytes | Exception], None]) -> None:
        """Call ``callback`` with the outcome, now if it is already settled."""
        self._callback = callback
        if self._outcome is not None:
            callback(self._outcome)


def checked_pages(pages: Iterable[P]) -> Iterator[P]:
    """``pages``, read in a worker thread, with a cancellation check before each: an
    expired budget or a vanished client stops the thread within one page."""
    for page in pages:
        trio.from_thread.check_cancelled()
        yield page


def each_checked(pages: Iterable[Iterable[T]]) -> Iterator[T]:
    """The items of :func:`checked_pages`."""
    for page in checked_pages(pages):
        yield from page


def as_face_error(exc: Exception) -> FaceError | None:
    """The answer for an exception from admission, the stores or the codecs."""
    if isinstance(exc, FaceError):
        return exc
    if isinstance(exc, Shed):
        if exc.reason.value == "deadline":
            return FaceError(ErrorCode.DEADLINE, "the request's budget ran out before it started")
        return FaceError(ErrorCode.BUSY, exc.reason.value, exc.retry_after_ms)
    if isinstance(exc, DeadlineExceeded):
        return FaceError(ErrorCode.DEADLINE, "the request's budget ran out; read work stopped")
    if isinstance(exc, GateClosed):  # draining, or the consumer group was deleted
        return FaceError(ErrorCode.UNAVAILABLE, str(exc) or "the writer is draining")
    if isinstance(exc, StoreUnavailable):
        return FaceError(ErrorCode.UNAVAILABLE, str(exc))
    if isinstance(exc, RemoteProtocolError | LocalProtocolError) and not exc.fatal:
        return FaceError(exc.code, exc.hint)  # a bad field, or a reply over the cap
    return None


@attrs.frozen
class V1Reply:
    op: str
    data: bytes
    """Sent as it is (a face frames it, or not, as its v1 dialect says)."""
    outcome: str = "ok"


class FaceHandler(Protocol):
    gated_ops: frozenset[str]
    """The v2 ops that take a Gate slot (the others never wait for one)."""
    large_reply_ops: frozenset[str]
    """The v2 ops whose reply may be as large as the reply cap (pages): a connection
    runs only as many at once as its unsent-bytes cap holds (at least one)."""

    async def v1(self, frame: bytes, arrival: float) -> V1Reply:
        """Answer one v1 frame. Raise :class:`CloseConnection` to close instead."""
        ...

    def v2(self, request: Request, arrival: float) -> Awaitable[bytes] | Deferred:
        """Start one v2 request; the awaitable (run in a task of its own) or the
        :class:`Deferred` gives its reply body (``{"id": …, "ok": true, …}``). Called in
        the order the requests arrived, so whatever this does before returning keeps that
        order (an ``async def`` does nothing before it is awaited). Raise, here or from
        the awaitable, or settle with, an exception that :func:`as_face_error` maps, for
        an error answer."""
        ...

    def holding(self) -> bool:
        """The connection holds work that has timers of its own (claim leases): it is
        not idle while it does, even when it asks nothing."""
        ...

    def closed(self) -> None:
        """The connection ended (whatever the reason): let go of what it held."""
        ...


async def serve(
    ctx: FaceContext,
    make_handler: Callable[[Sender], FaceHandler],
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on ``ctx.bind`` and serve connections until ``ctx.draining``; then stop
    accepting, let every connection finish its in-flight requests, and return.
    ``make_handler`` gives each connection its handler (stateless faces share one); it is
    given the connection's sender, for faces that push frames (subscriptions)."""
    tls = _tls_context(ctx.config)  # before binding: a bad certificate fails the start
    sockets = await trio.open_tcp_listeners(ctx.bind.port, host=ctx.bind.host)
    listeners: list[trio.abc.Listener[trio.abc.Stream]] = list(sockets)
    if tls is not None:
        # The handshake happens on the connection's first read, under its idle timeout.
        listeners = [trio.SSLListener(listener, tls) for listener in sockets]
    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as acceptor:
            handle = partial(_Connection.run, ctx, make_handler, _Count())
            await acceptor.start(
                partial(trio.serve_listeners, handle, listeners, handler_nursery=connections)
            )
            host, port = sockets[0].socket.getsockname()[:2]
            task_status.started(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
            await ctx.draining.wait()
            acceptor.cancel_scope.cancel()
        for listener in listeners:  # new clients are refused; connections finish
            await listener.aclose()


def _tls_context(config: Config) -> ssl.SSLContext | None:
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(config.tls_cert, config.tls_key)
    return context


@attrs.define
class _Count:
    """Open connections of one face."""

    open: int = 0


def _peer_address(stream: trio.abc.Stream) -> str | None:
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    if not isinstance(stream, trio.SocketStream):
        return None
    try:
        peer = stream.socket.getpeername()
    except OSError:
        return None
    return str(peer[0]) if isinstance(peer, tuple) else None


class _Connection:
    handler: FaceHandler

    def __init__(self, ctx: FaceContext, stream: trio.abc.Stream) -> None:
        self.ctx = ctx
        self.face = ctx.name
        self._scope = trio.CancelScope()
        self.stream = stream
        self.decoder = FrameDecoder(ctx.config.max_request_bytes)
        self.max_reply = ctx.config.max_reply_bytes
        self._outbox: list[bytes] = []
        self._flushing = False
        self._replies: trio.Nursery | None = None  # where deferred replies are flushed
        self._deferred = 0  # deferred replies not settled yet
        self._deferred_settled: trio.Event | None = None
        self.outcome = "closed"
        self.peer_gone = False
        self._shed_recently = False
        self.max_unsent = ctx.config.connection_unsent_bytes
        self._unsent = 0  # bytes queued in the outbox or being written
        self._drained: trio.Event | None = None  # set once unsent is back under the cap
        self._large = trio.CapacityLimiter(max(1, self.max_unsent // self.max_reply))
        self._asked = 0  # requests being answered (the idle timeout waits for none)
        self._idle_wait: trio.CancelScope | None = None  # the reader's idle wait, if any

    @classmethod
    async def run(
        cls,
        ctx: FaceContext,
        make_handler: Callable[[Sender], FaceHandler],
        count: _Count,
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
        connection.handler = make_handler(connection._send)
        try:
            await connection._serve()
        except Exception as exc:
            # A bug met by one connection closes that connection only; the face and
            # every other client keep going.
            connection._end("internal_error")
            event(log, logging.ERROR, "connection_failed", face=connection.face, exc_info=exc)
        finally:
            count.open -= 1
            # Forcefully: a TLS close_notify to a peer that does not read could hang.
            await trio.aclose_forcefully(stream)
            connection.handler.closed()
            metrics.CONNECTIONS.labels(face=connection.face, outcome=connection.outcome).inc()

    def _end(self, outcome: str) -> None:
        if self.outcome == "closed":  # the first reason wins
            self.outcome = outcome

    async def _serve(self) -> None:
        send_frames, receive_frames = trio.open_memory_channel[Batch](0)
        with self._scope:  # cancelled to end the connection from a handler
            async with trio.open_nursery() as nursery:
                requests = trio.CancelScope()
                nursery.start_soon(self._read_frames, send_frames, requests)
                with requests:
                    async with receive_frames:
                        await self._dispatch(receive_frames)
                nursery.cancel_scope.cancel()

    # --- reading -----------------------------------------------------------------------

    async def _read_frames(
        self, out: trio.MemorySendChannel[Batch], requests: trio.CancelScope
    ) -> None:
        config = self.ctx.config
        async with out, trio.open_nursery() as reading:
            reading.start_soon(self._stop_reading_on_drain, reading.cancel_scope)
            await self._read_loop(out, config.read_timeout_ms)
            reading.cancel_scope.cancel()
        if self.peer_gone:
            requests.cancel()  # nobody to answer: stop read work (started writes finish)

    async def _stop_reading_on_drain(self, reading: trio.CancelScope) -> None:
        await self.ctx.draining.wait()
        reading.cancel()

    async def _read_loop(self, out: trio.MemorySendChannel[Batch], read_ms: int) -> None:
        batch: Batch = []
        while True:
            try:
                frame = self.decoder.next_frame()
            except RemoteProtocolError as exc:
                batch.append((exc, trio.current_time()))
                await out.send(batch)
                return
            if isinstance(frame, bytes):
                batch.append((frame, trio.current_time()))
                if len(batch) >= min(MAX_INFLIGHT_PER_CONNECTION, self.ctx.room):
                    # No more than can be taken in at once: the rest wait unread, their
                    # clocks not started (frames waiting in a batch would age, and a
                    # held-back flood would run out its budgets there). The room is the
                    # fullest Gate's: a flood of writes fills their lane, not the face's.
                    await out.send(batch)
                    batch = []
                continue
            if batch:
                await out.send(batch)
                batch = []
            if frame is not NEED_DATA:  # CLOSED: the peer finished cleanly
                self.peer_gone = True
                return
            with trio.CancelScope() as waited:
                if self.decoder.in_partial_frame:
                    waited.deadline = trio.current_time() + read_ms / 1000
                else:  # idle only while nothing is asked (see _asking)
                    self._idle_wait = waited
                    self._asking(0)
                try:
                    data = await self.stream.receive_some(RECEIVE_CHUNK)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                finally:
                    self._idle_wait = None
            if waited.cancelled_caught:
                if not self.decoder.in_partial_frame and self.handler.holding():
                    continue  # a worker mid-command: its leases time themselves
                self._end("idle_timeout")
                return
            self.decoder.receive_data(data)

    def _asking(self, change: int) -> None:
        """Count the requests this connection is answering, and time the idle timeout
        only while there are none: a worker whose ``next`` waits for work, or a
        subscriber, is not idle however long it waits (the wait is the client's). It
        restarts from the last answer."""
        self._asked += change
        if self._idle_wait is not None:
            idle = self.ctx.config.idle_timeout_ms / 1000
            self._idle_wait.deadline = math.inf if self._asked else trio.current_time() + idle

    # --- dispatching ---------------------------------------------------------------------

    async def _answer_unreadable(self, exc: RemoteProtocolError) -> None:
        """The error for a frame whose request could not be read: ``id`` is null."""
        await self._send(encode_frame(encode_error(None, exc.code, exc.hint)))

    def _stream_error(self, exc: RemoteProtocolError) -> None:
        self._end("too_large" if exc.code is ErrorCode.TOO_LARGE else "protocol_error")

    async def _dispatch(self, frames: trio.MemoryReceiveChannel[Batch]) -> None:
        try:
            batch = await frames.receive()
        except trio.EndOfChannel:
            return
        first = batch[0][0]
        if isinstance(first, RemoteProtocolError):  # no dialect chosen yet: just close
            self._stream_error(first)
            return
        try:
            hello = detect_dialect(first)
        except RemoteProtocolError as exc:
            self._end("protocol_error")
            await self._answer_unreadable(exc)
            return
        if refusal := self._unauthorized(hello):
            self._end("unauthorized")
            if hello is not None:  # v1 has no error frame for this: it is closed
                await self._answer_unreadable(RemoteProtocolError(refusal, fatal=True))
            return
        if hello is None:
            await self._serve_v1(batch, frames)
        else:
            await self._serve_v2(batch[1:], frames)

    def _unauthorized(self, hello: Hello | None) -> str | None:
        """Why the connection may not go on (``CMDBUS_AUTH_TOKEN``), or None."""
        config = self.ctx.config
        if config.auth_token is None:
            return None
        if hello is not None:
            token = hello.fields.get("token")
            if isinstance(token, str) and hmac.compare_digest(
                token.encode(), config.auth_token.encode()
            ):
                return None
            return "hello.token: missing or not accepted"
        if config.allow_v1:
            peer = _peer_address(self.stream)
            if peer is not None and any(
                ipaddress.ip_address(peer) in network for network in config.v1_cidrs
            ):
                return None
        return "v1 is refused: an auth token is required"

    async def _serve_v1(self, batch: Batch, frames: trio.MemoryReceiveChannel[Batch]) -> None:
        while True:
            for frame, arrival in batch:
                if isinstance(frame, RemoteProtocolError):
                    self._stream_error(frame)  # v1: the documented answer is to close
                    return
                if not await self._v1(frame, arrival):
                    return
            try:
                batch = await frames.receive()
            except trio.EndOfChannel:
                return

    async def _serve_v2(self, batch: Batch, frames: trio.MemoryReceiveChannel[Batch]) -> None:
        await self._send(
            encode_frame(
                encode_hello_reply(
                    server=f"cmdbus-trio {__version__}",
                    face=self.face,
                    max_request_bytes=self.ctx.config.max_request_bytes,
                    max_reply_bytes=self.max_reply,
                )
            )
        )
        async with trio.open_nursery() as inflight:
            self._replies = inflight
            try:
                await self._take_requests(batch, frames, inflight)
                # Requests in flight are still answered, deferred ones too.
                while self._deferred:
                    self._deferred_settled = trio.Event()
                    await self._deferred_settled.wait()
            finally:
                self._replies = None  # a reply settled later has nobody to go to

    async def _take_requests(
        self, batch: Batch, frames: trio.MemoryReceiveChannel[Batch], inflight: trio.Nursery
    ) -> None:
        slots = trio.CapacityLimiter(MAX_INFLIGHT_PER_CONNECTION)
        while True:
            for frame, arrival in batch:
                if not await self._take_request(frame, arrival, slots, inflight):
                    return
            try:
                batch = await frames.receive()
            except trio.EndOfChannel:
                return

    async def _take_request(
        self,
        frame: bytes | RemoteProtocolError,
        arrival: float,
        slots: trio.CapacityLimiter,
        inflight: trio.Nursery,
    ) -> bool:
        """Start answering one frame; False when the connection takes no more."""
        if isinstance(frame, RemoteProtocolError):
            self._stream_error(frame)
            if frame.code is ErrorCode.TOO_LARGE:
                await self._answer_unreadable(frame)
            return False
        if self._unsent > self.max_unsent:
            # A client that does not read its replies: take nothing more from it until
            # they drain (its requests wait in its socket, costing the writer nothing).
            metrics.child(metrics.UNSENT_WAITS, self.face).inc()
            await self._wait_drained()
        budget = self.ctx.pending_bytes
        # Before parsing: a parsed frame weighs several times its bytes.
        lent = 0 if budget is None else await budget.acquire(len(frame))
        try:
            request = parse_request(frame)
        except RequestError as exc:
            self._give_back(lent, None)
            await self._send_v2_error(exc.request_id, "unknown", exc, arrival)
            return True
        except RemoteProtocolError as exc:  # unparseable: answer, then close
            self._give_back(lent, None)
            self._end("protocol_error")
            await self._answer_unreadable(exc)
            return False
        gate = self.ctx.gate_of(request.op)
        gated = request.op in self.handler.gated_ops
        if gated and gate.intake_full:
            if slots.borrowed_tokens or self._shed_recently:
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
        await slots.acquire_on_behalf_of(slot)
        large = request.op in self.handler.large_reply_ops
        if large:
            await self._large.acquire_on_behalf_of(slot)
        produced = partial(self._give_back, lent, slot if large else None)
        try:
            pending = self.handler.v2(request, arrival)
        except Exception as exc:
            produced()
            slots.release_on_behalf_of(slot)
            await self._send_v2_error(request.id, request.op, exc, arrival)
            return True
        if gated:
            gate.take_in()
        self._asking(+1)
        done = partial(self._request_done, slots, slot, gate if gated else None)
        if isinstance(pending, Deferred):
            self._deferred += 1
            pending.when_settled(partial(self._deferred_reply, request, arrival, produced, done))
        else:
            inflight.start_soon(self._v2, request, pending, arrival, produced, done)
        return True

    def _give_back(self, lent: int, large: object | None) -> None:
        """A request's reply exists (or it has none): its bytes go back to the face's
        budget and its large-reply place to the connection. Before the reply is sent, so
        that a client slow to read holds up only itself."""
        if lent and self.ctx.pending_bytes is not None:
            self.ctx.pending_bytes.release(lent)
        if large is not None:
            self._large.release_on_behalf_of(large)

    def _request_done(self, slots: trio.CapacityLimiter, slot: object, gate: Gate | None) -> None:
        slots.release_on_behalf_of(slot)
        self._asking(-1)
        if gate is not None:
            gate.taken_out()

    async def _v1(self, frame: bytes, arrival: float) -> bool:
        self._asking(+1)
        budget = self.ctx.pending_bytes
        lent = 0 if budget is None else await budget.acquire(len(frame))
        try:
            try:
                try:
                    reply = await self.handler.v1(frame, arrival)
                finally:
                    self._give_back(lent, None)
            except CloseConnection as close:
                self._end(close.outcome)
                return False
            sent = await self._send(reply.data)
            self._observe(reply.op, reply.outcome, arrival)
            return sent
        finally:
            self._asking(-1)

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
                if close.final is not None:
                    await self._send(encode_frame(close.final))
                self._end(close.outcome)
                self._scope.cancel()
                return
            except Exception as exc:
                outcome = exc
            frame, op, result = self._answer(request, outcome)
            await self._send(frame)
            self._observe(op, result, arrival)
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
            frame, op, result = self._answer(request, outcome)
            self._queue(frame)
            self._observe(op, result, arrival)
        except Exception as exc:  # a bug: it closes this connection only
            self._end("internal_error")
            event(log, logging.ERROR, "connection_failed", face=self.face, exc_info=exc)
            self._scope.cancel()
        finally:
            done()
            self._deferred -= 1
            if not self._deferred and self._deferred_settled is not None:
                self._deferred_settled.set()

    def _answer(self, request: Request, outcome: bytes | Exception) -> tuple[bytes, str, str]:
        """The frame answering ``request``, and the op and outcome it is counted under."""
        if isinstance(outcome, Exception):
            return self._error_frame(request.id, request.op, outcome)
        try:
            return encode_frame(outcome, self.max_reply), request.op, "ok"
        except LocalProtocolError as exc:
            return self._error_frame(request.id, request.op, FaceError(exc.code, exc.hint))

    async def _send_v2_error(
        self, request_id: int | None, op: str, exc: Exception, arrival: float
    ) -> None:
        frame, op, outcome = self._error_frame(request_id, op, exc)
        await self._send(frame)
        self._observe(op, outcome, arrival)

    def _error_frame(
        self, request_id: int | None, op: str, exc: Exception
    ) -> tuple[bytes, str, str]:
        if isinstance(exc, Shed) and exc.reason is ShedReason.WAITERS_FULL:
            self._shed_recently = True
        if isinstance(exc, UnsupportedOp):
            op = "unknown"  # a name the client made up is not a metric label
        error = as_face_error(exc)
        if error is None:
            event(log, logging.ERROR, "request_failed", face=self.face, op=op, exc_info=exc)
            error = FaceError(ErrorCode.INTERNAL, f"internal error ({type(exc).__name__})")
        body = encode_error(
            request_id, error.code, error.message, retry_after_ms=error.retry_after_ms
        )
        return encode_frame(body), op, error.code.value

    def _observe(self, op: str, outcome: str, arrival: float) -> None:
        metrics.child(metrics.REQUEST_DURATION, self.face, op, outcome).observe(
            trio.current_time() - arrival
        )

    async def _send(self, data: bytes) -> bool:
        """Send whole, in order; a peer that does not read for a read timeout is cut off.
        Returns False (and ends the connection) when the reply could not be delivered.

        Replies are coalesced: the first sender writes everything queued meanwhile in one
        ``send_all``, the others only queue (one write per batch of ready replies, not
        one per reply: that was a quarter of the loop's time under pipelined load)."""
        if self.peer_gone:
            return False  # after a failed write not one more byte: it would be mid-frame
        self._outbox.append(data)
        self._unsent += len(data)
        if self._flushing:
            # The flushing task writes it; a sender whose replies pile up unread (a
            # subscription, a stream of pages) waits for them to drain.
            if self._unsent > self.max_unsent:
                metrics.child(metrics.UNSENT_WAITS, self.face).inc()
                await self._wait_drained()
            return not self.peer_gone
        return await self._flush()

    async def _wait_drained(self) -> None:
        """Return once the unsent replies are within the cap (or the peer is gone)."""
        while self._unsent > self.max_unsent and not self.peer_gone:
            if self._drained is None:
                self._drained = trio.Event()
            await self._drained.wait()

    def _sent(self, size: int) -> None:
        self._unsent -= size
        if self._drained is not None and (self._unsent <= self.max_unsent or self.peer_gone):
            self._drained.set()
            self._drained = None

    def _queue(self, data: bytes) -> None:
        """:meth:`_send` for a caller that is not a task of this connection: a flush task
        (one per batch of ready replies) writes it."""
        if self._replies is None or self.peer_gone:
            return  # the connection is over
        self._outbox.append(data)
        self._unsent += len(data)
        if not self._flushing:
            self._flushing = True
            self._replies.start_soon(self._flush)

    async def _flush(self) -> bool:
        self._flushing = True
        try:
            while self._outbox:
                chunk = b"".join(self._outbox)
                self._outbox.clear()
                # Per write: a client that keeps reading is never cut off, however long
                # the stream of replies lasts. (move_on_after, not fail_after: the latter
                # is a generator-based context manager, twice the cost per reply.)
                with trio.move_on_after(self.ctx.config.read_timeout_ms / 1000) as writing:
                    await self.stream.send_all(chunk)
                if writing.cancelled_caught:
                    raise trio.TooSlowError
                self._sent(len(chunk))
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
            # A write cut short may have sent part of a frame: the stream is unusable, so
            # the connection ends here (writing the next reply after it would hand the
            # client a corrupt frame, as a slow reader once got).
            self._end("write_error")
            self.peer_gone = True
            self._outbox.clear()
            self._sent(self._unsent)
            self._scope.cancel()
            return False
        finally:
            self._flushing = False
        return True
