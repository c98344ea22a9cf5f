"""The blocking client's connection: v2 requests over a plain socket, one call at a time
(the faces' methods are generated in :mod:`._blocking_faces`; the public names in
:mod:`cmdbus_trio.client.blocking`). It never imports trio."""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Self, TypeVar

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
from ._errors import (
    CannotConnect,
    ClientClosed,
    ClientError,
    ConnectionLost,
    DeadlineExceeded,
    ServerError,
)
from ._retry import Attempts
from ._sockets import closed_by_peer

T = TypeVar("T")
RECEIVE_CHUNK = 1 << 16


SEND_WINDOW = 256 * 1024
"""Request bytes :meth:`Connection.call_many` sends before it reads their replies (a frame
larger than this goes alone): well within a socket's buffers, so sending never blocks on
a writer that waits for its replies to be read."""


def _send_windows(frames: Sequence[bytes], ids: Sequence[int]) -> Iterator[list[tuple[bytes, int]]]:
    window: list[tuple[bytes, int]] = []
    size = 0
    for frame, request_id in zip(frames, ids, strict=True):
        if window and size + len(frame) > SEND_WINDOW:
            yield window
            window, size = [], 0
        window.append((frame, request_id))
        size += len(frame)
    if window:
        yield window


class Connection(BaseConnection):
    """A v2 connection to one data face, reconnected on the next call after it broke.

    Error handling: the server's error answers raise the :mod:`~cmdbus_trio.client`
    exception of their code; a lost connection raises :class:`ConnectionLost`; no reply
    within ``timeout`` raises :class:`DeadlineExceeded` (a reply that comes later is
    dropped).
    """

    def _init_transport(self) -> None:
        self._sock: socket.socket | None = None
        self._lock = threading.RLock()

    @classmethod
    def connect(cls, address: str, **options: Any) -> Self:
        connection = cls(address, **options)
        connection._connected()
        return connection

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._drop()

    def call(self, call: Call[T], *, timeout: float | None = None, reconnect: bool = True) -> T:
        """Run ``call``; ``timeout`` (seconds) is sent as its ``deadline_ms`` and bounds
        the wait for the reply and any retries. ``reconnect=False``: not within the
        reconnect window (a caller with somewhere else to go, as a sharded claim)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        window = self.reconnect if reconnect else None
        attempts = Attempts(self.retry, call, deadline, time.monotonic, window)
        while True:
            try:
                outcome = self._exchange([call], deadline)[0]
                if isinstance(outcome, ClientError):
                    raise outcome
                return call.parse(outcome)
            except ClientError as error:
                self._follow(error)
                pause = attempts.pause_after(error)
                if pause is None:
                    raise
                time.sleep(pause)

    def _follow(self, error: ClientError) -> None:
        """After ``error``, the connection closed if the next attempt goes elsewhere (the
        primary a member named, or the next member: :meth:`_redirected`)."""
        if self._redirected(error):
            with self._lock:
                self._drop()

    def call_many(
        self, batch: Sequence[Call[Any]], *, timeout: float | None = None
    ) -> list[Any | ServerError]:
        """Send every call at once and wait for all replies: each result, or the
        :class:`ServerError` that call got. No retries."""
        deadline = None if timeout is None else time.monotonic() + timeout
        outcomes = self._exchange(batch, deadline)
        return [
            outcome if isinstance(outcome, ClientError) else call.parse(outcome)
            for call, outcome in zip(batch, outcomes, strict=True)
        ]

    def _exchange(
        self, batch: Sequence[Call[Any]], deadline: float | None
    ) -> list[dict[str, Any] | ServerError]:
        with self._lock:
            sock = self._connected(deadline)
            frames, ids = [], []
            for call in batch:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise DeadlineExceeded(f"{call.op}: the time budget ran out before sending")
                request_id, frame = self._protocol.request(
                    call.op, call.fields, deadline=None if call.wait else remaining
                )
                frames.append(frame)
                ids.append(request_id)
            wait = max((call.wait or 0.0) for call in batch)
            local = None if deadline is None else deadline + LOCAL_GRACE + wait
            if local is not None and not math.isfinite(local):
                local = None  # a `next` that waits until a record comes
            replies: dict[int, dict[str, Any] | ServerError] = {}
            # One window at a time: a blocking socket cannot read while it sends, and the
            # writer stops reading a connection whose unsent replies pass its cap, so a
            # batch sent whole could wait on itself until the writer's read timeout.
            heard = self._heard
            try:
                for window in _send_windows(frames, ids):
                    self._send_window(sock, window)
                    wanted = {request_id for _, request_id in window}
                    while not wanted <= replies.keys():
                        reply = self._next_reply(local, batch[0].op)
                        if reply.id in wanted and reply.id not in replies:
                            replies[reply.id] = reply.error if reply.error else reply.result or {}
            except DeadlineExceeded:
                if self._left_silent(heard):
                    self._drop()
                raise
            return [replies[request_id] for request_id in ids]

    def _send_window(self, sock: socket.socket, window: list[tuple[bytes, int]]) -> None:
        try:
            sock.sendall(b"".join(frame for frame, _ in window))
        except OSError as exc:
            self._drop()
            raise ConnectionLost(f"sending to {self.address} failed: {exc!r}") from None

    def _next_reply(self, local_deadline: float | None, op: str) -> Reply:
        """The next reply frame; raises on a connection-level error, EOF or timeout."""
        sock = self._sock
        while True:
            if sock is None:
                raise ConnectionLost(f"connection to {self.address} lost")
            try:
                event = self._protocol.next_event()
            except ClientError:
                self._drop()
                raise
            if isinstance(event, Reply) and event.id is not None:
                return event
            if isinstance(event, Reply):
                self._drop()
                assert event.error is not None
                raise event.error  # about the connection: the server closes it
            if event is not NEED_DATA:
                self._drop()
                raise ConnectionLost(f"{self.address} closed the connection")
            if local_deadline is not None:
                remaining = local_deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded(f"{op}: no reply in time")
                sock.settimeout(remaining)
            else:
                sock.settimeout(None)
            try:
                data = sock.recv(RECEIVE_CHUNK)
                self._heard += 1
            except TimeoutError:
                raise DeadlineExceeded(f"{op}: no reply in time") from None
            except OSError as exc:
                self._drop()
                raise ConnectionLost(f"receiving from {self.address} failed: {exc!r}") from None
            self._protocol.receive_data(data)

    def _connected(self, deadline: float | None = None) -> socket.socket:
        """The connection, made (and its hello exchanged) if there is none, within
        ``connect_timeout`` and the call's ``deadline``. Raises :class:`CannotConnect`,
        or :class:`DeadlineExceeded` when the deadline came first."""
        if self._closed:
            raise ClientClosed("the client was closed")
        if self._sock is not None:
            if not closed_by_peer(self._sock.fileno()):
                return self._sock
            self._drop()  # idled out by the server: nothing was sent on it, reconnect
        host, port = split_address(self.address)
        protocol = self._new_protocol()
        timeout = self._connect_timeout
        cut_short = deadline is not None and deadline - time.monotonic() < timeout
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
            if timeout <= 0:
                raise DeadlineExceeded(
                    f"the time budget ran out before connecting to {self.address}"
                )
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except TimeoutError:
            if cut_short:
                late = self.address
                self._next_member()  # the next call tries another
                raise DeadlineExceeded(f"no connection to {late} in time") from None
            raise CannotConnect(cannot_connect(self.address, TimeoutError())) from None
        except OSError as exc:
            raise CannotConnect(cannot_connect(self.address, exc)) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._protocol = sock, protocol
        try:
            if self._ssl_context is not None:
                sock = self._sock = self._ssl_context.wrap_socket(sock, server_hostname=host)
            sock.sendall(protocol.hello_frame())
            while (event := protocol.next_event()) is NEED_DATA:
                protocol.receive_data(sock.recv(RECEIVE_CHUNK))
        except (OSError, ClientError) as exc:
            self._drop()
            if isinstance(exc, ClientError):
                raise  # a hello refused, or a server that is not ours: waiting won't help
            if cut_short and isinstance(exc, TimeoutError):
                late = self.address
                self._next_member()  # the next call tries another
                raise DeadlineExceeded(f"no hello from {late} in time") from None
            # Until the hello is answered no request was sent: any call may be sent
            # again, as when the connect itself fails.
            raise CannotConnect(f"hello with {self.address} failed: {exc!r}") from None
        if not isinstance(event, ServerHello):
            self._drop()
            raise CannotConnect(f"{self.address} closed the connection during the hello")
        return sock

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _stream_replies(self, call: Call[T]) -> Iterator[T]:
        with self._lock:
            sock = self._connected()
            request_id, frame = self._protocol.request(call.op, call.fields)
            try:
                sock.sendall(frame)
            except OSError as exc:
                self._drop()
                raise ConnectionLost(f"sending to {self.address} failed: {exc!r}") from None
            while True:
                reply = self._next_reply(None, call.op)
                if reply.id != request_id:
                    continue
                if reply.error is not None:
                    raise reply.error
                yield call.parse(reply.result or {})
