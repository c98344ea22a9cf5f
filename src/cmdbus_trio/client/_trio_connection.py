"""The trio client's connection: pipelined v2 requests over one stream (the faces'
methods are in :mod:`._trio_faces`; the public names in :mod:`cmdbus_trio.client.trio`)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Self, TypeVar

import attrs
import trio

from cmdbus_trio.protocol import NEED_DATA

from ._calls import (
    Call,
)
from ._core import (
    LOCAL_GRACE,
    BaseConnection,
    Reply,
    ServerHello,
    cannot_connect,
    split_address,
)
from ._errors import CannotConnect, ClientClosed, ClientError, ConnectionLost, DeadlineExceeded
from ._retry import Attempts
from ._sockets import closed_by_peer

T = TypeVar("T")
RECEIVE_CHUNK = 1 << 16


@attrs.define
class _Slot:
    """Where replies to one request id land: one for a call, many for a subscription
    (at most one received chunk's worth, since the reading waits for the consumer)."""

    event: trio.Event = attrs.field(factory=trio.Event)
    replies: deque[Reply] = attrs.field(factory=deque)
    error: ClientError | None = None

    @property
    def done(self) -> bool:
        return bool(self.replies) or self.error is not None


class Connection(BaseConnection):
    """A v2 connection to one data face, reconnected on the next call after it broke.

    Cancellation: a call cancelled while waiting forgets its request; a reply that comes
    later is dropped. A call cancelled while sending breaks the connection (part of a
    frame may be on the wire); the next call reconnects.

    Error handling: the server's error answers raise the :mod:`~cmdbus_trio.client`
    exception of their code; a lost connection raises :class:`ConnectionLost` for every
    call waiting on it; no reply within ``timeout`` raises :class:`DeadlineExceeded`.
    """

    def _init_transport(self) -> None:
        self._stream: trio.abc.Stream | None = None
        self._transport: trio.SocketStream | None = None
        self._pending: dict[int, _Slot] = {}
        self._reading = False
        self._send_lock = trio.StrictFIFOLock()
        self._connect_lock = trio.Lock()

    @classmethod
    async def connect(cls, address: str, **options: Any) -> Self:
        """A connected client (the hello exchanged); raises :class:`CannotConnect`."""
        connection = cls(address, **options)
        await connection._connected()
        return connection

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        self._break(ClientClosed("the client was closed"))

    async def call(
        self, call: Call[T], *, timeout: float | None = None, reconnect: bool = True
    ) -> T:
        """Run ``call``; ``timeout`` (seconds) is sent as its ``deadline_ms`` and bounds
        the wait for the reply and any retries. ``reconnect=False``: not within the
        reconnect window (a caller with somewhere else to go, as a sharded claim)."""
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        window = self.reconnect if reconnect else None
        attempts = Attempts(self.retry, call, deadline, trio.current_time, window)
        while True:
            try:
                return call.parse(await self._attempt(call, deadline))
            except ClientError as error:
                self._follow(error)
                pause = attempts.pause_after(error)
                if pause is None:
                    raise
                await trio.sleep(pause)

    def _follow(self, error: ClientError) -> None:
        """After ``error``, the connection closed if the next attempt goes elsewhere (the
        primary a member named, or the next member: :meth:`_redirected`)."""
        if self._redirected(error):
            self._break(ConnectionLost(f"going to the primary, {self.address}"))

    async def _attempt(self, call: Call[Any], deadline: float) -> dict[str, Any]:
        stream = await self._connected(deadline)
        remaining = deadline - trio.current_time()
        if remaining <= 0:
            raise DeadlineExceeded(f"{call.op}: the time budget ran out before sending")
        request_id, frame = self._protocol.request(
            call.op, call.fields, deadline=None if call.wait else remaining
        )
        slot = self._pending[request_id] = _Slot()
        try:
            await self._send(stream, frame)
            local = remaining + LOCAL_GRACE + (call.wait or 0.0)
            heard = self._heard
            with trio.move_on_after(local):
                return await self._wait(slot)
            silent = self.address
            if self._left_silent(heard):
                self._break(ConnectionLost(f"{silent} said nothing in time"))
            raise DeadlineExceeded(f"{call.op}: no reply in time")
        finally:
            if self._pending.get(request_id) is slot:  # ids restart when we reconnect
                del self._pending[request_id]

    async def _connected(self, deadline: float = math.inf) -> trio.abc.Stream:
        """The connection, made (and its hello exchanged) if there is none, within
        ``connect_timeout`` and the call's ``deadline``. Raises :class:`CannotConnect`,
        or :class:`DeadlineExceeded` when the deadline came first."""
        async with self._connect_lock:
            if self._closed:
                raise ClientClosed("the client was closed")
            if self._stream is not None:
                transport = self._transport
                idle = not self._pending and not self._reading
                if not (idle and transport and closed_by_peer(transport.socket.fileno())):
                    return self._stream
                # Idled out by the server: nothing was sent on it, reconnect.
                self._break(ConnectionLost(f"{self.address} closed the idle connection"))
            host, port = split_address(self.address)
            protocol = self._new_protocol()
            transport = None
            cut_short = deadline < trio.current_time() + self._connect_timeout
            try:
                with trio.fail_at(min(deadline, trio.current_time() + self._connect_timeout)):
                    transport = await trio.open_tcp_stream(host, port)
                    stream: trio.abc.Stream = transport
                    if self._ssl_context is not None:
                        stream = trio.SSLStream(transport, self._ssl_context, server_hostname=host)
                    try:
                        await stream.send_all(protocol.hello_frame())
                        while (event := protocol.next_event()) is NEED_DATA:
                            protocol.receive_data(await stream.receive_some(RECEIVE_CHUNK))
                    except BaseException:
                        await trio.aclose_forcefully(stream)
                        raise
            except (OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
                # Until the hello is answered no request was sent: any call may be sent
                # again, as when the connect itself fails. (A hello refused, or a server
                # that is not ours, raises as it is: waiting would not change it.)
                if cut_short and isinstance(exc, trio.TooSlowError):
                    late = self.address
                    self._next_member()  # the next call tries another
                    raise DeadlineExceeded(f"no connection to {late} in time") from None
                if transport is None:
                    raise CannotConnect(cannot_connect(self.address, exc)) from None
                cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else None
                raise CannotConnect(f"hello with {self.address} failed: {cause or exc!r}") from None
            if not isinstance(event, ServerHello):
                await trio.aclose_forcefully(stream)
                raise CannotConnect(f"{self.address} closed the connection during the hello")
            self._stream, self._transport, self._protocol = stream, transport, protocol
            return stream

    async def _send(self, stream: trio.abc.Stream, frame: bytes) -> None:
        async with self._send_lock:
            try:
                await stream.send_all(frame)
            except BaseException as exc:
                lost = ConnectionLost(f"sending to {self.address} failed: {exc!r}")
                self._break(lost)
                if isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError | OSError):
                    raise lost from None
                raise

    async def _wait(self, slot: _Slot) -> dict[str, Any]:
        """Wait for ``slot``'s reply, reading the socket for every caller meanwhile if no
        other caller is reading it."""
        while not slot.done:
            if self._reading:
                await slot.event.wait()
                if not slot.done:  # woken to take over the reading
                    slot.event = trio.Event()
                continue
            self._reading = True
            try:
                while not slot.done:
                    await self._receive()
            finally:
                self._reading = False
                for other in self._pending.values():
                    if not other.done:
                        other.event.set()  # hand the reading over
                        break
        if slot.replies:
            reply = slot.replies.popleft()
            if reply.error is not None:
                raise reply.error
            assert reply.result is not None
            return reply.result
        assert slot.error is not None
        raise slot.error

    async def _receive(self) -> None:
        stream = self._stream
        if stream is None:
            return  # broken meanwhile: every slot has its error
        cause: Exception | None = None
        try:
            data = await stream.receive_some(RECEIVE_CHUNK)
            self._heard += 1
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            data, cause = b"", exc
        if self._stream is not stream:
            return  # broken (and perhaps reconnected) meanwhile: not this protocol's bytes
        try:
            self._protocol.receive_data(data)
            while (event := self._protocol.next_event()) is not NEED_DATA:
                if isinstance(event, Reply) and event.id is not None:
                    self._settle(event)
                elif isinstance(event, Reply):
                    assert event.error is not None
                    raise event.error  # about the connection: the server closes it
                else:
                    raise ConnectionLost(f"{self.address} closed the connection ({cause or 'EOF'})")
        except ClientError as error:
            self._break(error)

    def _settle(self, reply: Reply) -> None:
        slot = self._pending.get(reply.id) if reply.id is not None else None
        if slot is None:
            return  # its caller gave up (cancelled or timed out)
        slot.replies.append(reply)
        slot.event.set()

    def _break(self, error: ClientError) -> None:
        transport, self._stream, self._transport = self._transport, None, None
        if transport is not None:
            transport.socket.close()  # no await: callers may be cancelled already
        for slot in self._pending.values():
            if not slot.done:
                slot.error = error
                slot.event.set()

    async def _stream_replies(self, call: Call[T]) -> AsyncIterator[T]:
        """Send ``call`` and yield every reply frame to it (a subscription)."""
        stream = await self._connected()
        request_id, frame = self._protocol.request(call.op, call.fields)
        await self._send(stream, frame)
        slot = self._pending[request_id] = _Slot()
        try:
            while True:
                result = await self._wait(slot)
                if not slot.done:
                    slot.event = trio.Event()
                yield call.parse(result)
        finally:
            if self._pending.get(request_id) is slot:
                del self._pending[request_id]
