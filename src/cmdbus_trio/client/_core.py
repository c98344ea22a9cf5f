"""The client side of a v2 connection as a pure state machine, like h11's: feed it bytes
with :meth:`ClientProtocol.receive_data`, pull :meth:`ClientProtocol.next_event`, and
send what :meth:`ClientProtocol.hello_frame` and :meth:`ClientProtocol.request` return.
No I/O and no trio here, so the blocking client shares it."""

from __future__ import annotations

import math
import os
import ssl
from typing import Any, Final

import attrs

from cmdbus_trio import __version__
from cmdbus_trio.protocol import (
    CLOSED,
    NEED_DATA,
    FrameDecoder,
    RemoteProtocolError,
    Sentinel,
    dumps,
    encode_frame,
    loads,
)

from ._errors import (
    CannotConnect,
    ClientError,
    ConnectionLost,
    ServerError,
    TooLarge,
    error_from_reply,
)
from ._retry import RECONNECT_FOR, Reconnect, RetryPolicy, draining

DEFAULT_MAX_REPLY_BYTES: Final = 64 << 20
LOCAL_GRACE: Final = 0.1
"""Seconds a caller waits past its own deadline, so the server's ``deadline`` answer
(which says what happened) normally arrives before the local timeout (which cannot)."""


@attrs.frozen
class ServerHello:
    server: str
    face: str
    max_request_bytes: int
    max_reply_bytes: int


@attrs.frozen
class Reply:
    """A reply frame. ``id`` is ``None`` for an error about a frame the server could not
    read: it concerns the connection, which the server then closes."""

    id: int | None
    result: dict[str, Any] | None
    error: ServerError | None


Event = ServerHello | Reply | Sentinel


class ClientProtocol:
    """One v2 connection, client side.

    Error handling: a frame that breaks the protocol (not JSON, no ``id``, over
    ``max_reply_bytes``, a hello refused) raises :class:`ConnectionLost` or the mapped
    :class:`ServerError` from :meth:`next_event`; close the connection then.
    """

    def __init__(
        self, *, client: str | None = None, token: str | None = None, max_reply_bytes: int = 0
    ) -> None:
        self.client = client or f"cmdbus-trio-client/{__version__}"
        self.token = token
        self._decoder = FrameDecoder(max_reply_bytes or DEFAULT_MAX_REPLY_BYTES)
        self._received = b""  # the first bytes, to name a server that is not ours
        self._next_id = 0
        self.hello: ServerHello | None = None

    def hello_frame(self) -> bytes:
        hello: dict[str, Any] = {"protocol": 2, "client": self.client}
        if self.token is not None:
            hello["token"] = self.token
        return encode_frame(dumps({"hello": hello}))

    def request(
        self, op: str, fields: dict[str, Any], *, deadline: float | None = None
    ) -> tuple[int, bytes]:
        """The id and frame of a new request; ``deadline`` is the seconds the caller still
        has (sent as ``deadline_ms``). Raises :class:`TooLarge`, without sending, when the
        frame would be over the request cap the server announced."""
        self._next_id += 1
        envelope: dict[str, Any] = {"id": self._next_id, "op": op, **fields}
        if deadline is not None and math.isfinite(deadline):
            envelope["deadline_ms"] = max(0, math.floor(deadline * 1000))
        body = dumps(envelope)
        cap = self.hello.max_request_bytes if self.hello is not None else len(body)
        if len(body) > cap:
            raise TooLarge(
                f"{op}: request of {len(body)} bytes exceeds the server's {cap}-byte cap"
            )
        return self._next_id, encode_frame(body)

    def receive_data(self, data: bytes | bytearray) -> None:
        """Bytes from the socket; ``b""`` means the server closed it."""
        if self.hello is None and len(self._received) < 5:
            self._received += bytes(data[: 5 - len(self._received)])
        self._decoder.receive_data(data)

    def next_event(self) -> Event:
        try:
            frame = self._decoder.next_frame()
        except RemoteProtocolError as exc:
            if self.hello is None and self._received.startswith(b"HTTP/"):
                # "HTTP" read as a frame header is a 1,213,486,160-byte frame: say what it is.
                raise ConnectionLost(
                    "the server answered in HTTP: this is not a data face (the control "
                    "face :9090 and the lag ports speak HTTP; data faces, framed JSON)"
                ) from None
            raise ConnectionLost(f"reply stream broken: {exc.hint}") from None
        if frame is NEED_DATA or frame is CLOSED:
            return frame
        assert isinstance(frame, bytes)
        try:
            value = loads(frame)
        except RemoteProtocolError:
            raise ConnectionLost("the server sent a frame that is not JSON") from None
        if not isinstance(value, dict):
            raise ConnectionLost("the server sent a frame that is not a JSON object")
        if self.hello is None:
            return self._hello(value)
        request_id = value.get("id")
        if value.get("ok") is True and isinstance(request_id, int):
            return Reply(request_id, value, None)
        if value.get("ok") is False and (request_id is None or isinstance(request_id, int)):
            return Reply(request_id, None, error_from_reply(value.get("error")))
        raise ConnectionLost(f"the server sent a frame that is not a reply: {frame[:200]!r}")

    def _hello(self, value: dict[str, Any]) -> ServerHello:
        if value.get("ok") is False:
            raise error_from_reply(value.get("error"))
        try:
            limits = value["limits"]
            self.hello = ServerHello(
                str(value["server"]),
                str(value["face"]),
                int(limits["max_request_bytes"]),
                int(limits["max_reply_bytes"]),
            )
        except (KeyError, TypeError, ValueError):
            raise ConnectionLost(f"not a cmdbus-trio v2 hello reply: {value!r}") from None
        return self.hello


def cannot_connect(address: str, exc: BaseException) -> str:
    """Why no connection to ``address`` could be made, as a sentence a person can act
    on (not the exception's repr)."""
    reason = _first_strerror(exc)
    if isinstance(exc, TimeoutError) or type(exc).__name__ == "TooSlowError":
        why = "no answer in time"
    elif reason:
        why = reason[0].lower() + reason[1:]
    else:
        why = str(exc) or type(exc).__name__
    return f"cannot connect to {address}: {why}: is a writer running there, at that address?"


def _first_strerror(exc: BaseException | None) -> str | None:
    """The OS's words for the first failure in ``exc``, its causes and its groups (trio
    raises "all attempts to connect … failed" from a group of the real errors)."""
    if isinstance(exc, OSError) and exc.strerror:
        return os.strerror(exc.errno) if exc.errno else exc.strerror
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if found := _first_strerror(inner):
                return found
    return None if exc is None else _first_strerror(exc.__cause__)


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) → (host, port); raises :class:`ValueError`."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


class BaseConnection:
    """What both clients' connections keep: the address and options they connect with,
    and the protocol state of the current connection (its hello). A bad ``address``
    raises :class:`ValueError` here, not at the first call."""

    def __init__(
        self,
        address: str,
        *,
        retry: RetryPolicy | None = None,
        client: str | None = None,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout: float = 10.0,
        reconnect_for: float = RECONNECT_FOR,
    ) -> None:
        self.members = [one.strip() for one in address.split(",") if one.strip()]
        for member in self.members or [address]:
            split_address(member)
        self.address = self.members[0]
        """The address connected to (or about to be): one of :attr:`members`, or the
        primary a member named."""
        self.retry = retry
        self.reconnect = Reconnect(reconnect_for)
        """The reconnect window (``reconnect_for`` seconds; 0: a call raises at once
        when the writer is away); ``reconnect.statistics()`` says what it cost."""
        self._client_name = client
        self._token = token
        self._ssl_context = ssl_context
        self._connect_timeout = connect_timeout
        self._protocol = ClientProtocol()
        self._closed = False
        self._heard = 0  # reads that brought bytes (see _left_silent)
        self._init_transport()

    def _init_transport(self) -> None:
        """The connection's I/O state: the subclass's."""

    def _redirected(self, error: ClientError) -> bool:
        """Where to go after ``error``: the primary a member that is not primary named;
        else, when the address cannot be reached or says it is away (draining, or a
        member that knows no primary yet), the next member given. True: the connection
        must be closed (that member serves no more on it). Nothing else moves it."""
        primary = getattr(error, "primary", None)
        if isinstance(primary, str) and primary != self.address:
            try:
                split_address(primary)
            except ValueError:
                return False
            self.address = primary
            return True
        away = draining(error)
        if away or isinstance(error, CannotConnect):
            self._next_member()
        return away

    def _left_silent(self, heard: int) -> bool:
        """After a call ran out of time: when nothing came on the connection since it
        had ``heard`` reads (the member is paused, cut off or wedged, as far as a client
        can tell), go to the next member, which serves or names the primary (a primary
        that was only slow costs a round trip). True: the connection must be closed."""
        return heard == self._heard and self._next_member()

    def _next_member(self) -> bool:
        """Go to the member after the current one; False when there is only one."""
        if len(self.members) < 2:
            return False
        at = self.members.index(self.address) if self.address in self.members else -1
        self.address = self.members[(at + 1) % len(self.members)]
        return True

    @property
    def server(self) -> ServerHello | None:
        """The hello of the current connection (None before the first)."""
        return self._protocol.hello

    def _new_protocol(self) -> ClientProtocol:
        """The protocol state for a new connection, to send its hello."""
        return ClientProtocol(client=self._client_name, token=self._token)
