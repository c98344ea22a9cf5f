"""The server's side of one data-face connection, as a sans-io state machine.

Bytes in (:meth:`ServerConnection.receive_data`), events out
(:meth:`ServerConnection.next_event`), and every frame the server writes built here
(:meth:`~ServerConnection.read_request`, :meth:`~ServerConnection.reply`,
:meth:`~ServerConnection.error`), as h11 does for HTTP. It decides the dialect from the
first frame, checks the hello and its token, reads v2 envelopes and frames replies under
the reply cap. The caller does the I/O, the scheduling and the timers: it reads
:attr:`~ServerConnection.in_partial_frame` to choose between the read and the idle
timeout, and takes a frame's byte budget between :class:`FrameReceived` and
:meth:`~ServerConnection.read_request` (a parsed frame weighs several times its bytes).

A v1 frame is the face's to decode (each face words v1 its own way); this module only
says that the connection speaks v1.
"""

from __future__ import annotations

import enum
import hmac
from typing import Literal

import attrs

from . import _envelope as envelope
from ._envelope import Hello, Request
from ._errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from ._framing import NEED_DATA, FrameDecoder, Sentinel, encode_frame


class Dialect(enum.Enum):
    UNDECIDED = "undecided"
    """No frame has arrived yet."""
    V1 = "v1"
    V2 = "v2"


@attrs.frozen
class Opened:
    """The first frame was a hello and it was accepted: send ``reply``; v2 requests
    follow."""

    hello: Hello
    reply: bytes


@attrs.frozen
class FrameReceived:
    """A complete frame, not decoded yet: a v1 request for the face, or a v2 envelope
    for :meth:`ServerConnection.read_request`."""

    data: bytes


@attrs.frozen
class Closed:
    """The connection takes nothing more. Requests already taken are still answered;
    then send ``final`` if there is one, and close.

    ``outcome`` is why, as a metric label (``closed`` when the peer ended the stream
    cleanly: ``by_peer``, nobody is left to answer)."""

    outcome: str
    final: bytes | None = None
    by_peer: bool = False


Event = Opened | FrameReceived | Closed


@attrs.frozen
class Answer:
    """A v2 frame to write, and the op and outcome it is counted under."""

    frame: bytes
    op: str
    outcome: str


UNKNOWN_OP = "unknown"
"""The op label of a request whose op could not be read, or is not the face's: a name a
client made up is not a metric label."""


@attrs.define(kw_only=True)
class ServerConnection:
    """One connection of a data face.

    ``auth_token``: when set, a v2 hello must carry it (``hello.token``) and v1 is
    accepted only if ``v1_trusted`` (the caller knows the peer's address; the settings
    say which networks may speak v1).

    Error handling: nothing here raises for anything the peer sends. A stream or
    envelope the protocol does not allow gives :class:`Closed` (with the documented
    answer as its ``final`` frame) or an error :class:`Answer`; once closed,
    :meth:`next_event` gives the same :class:`Closed` again.
    """

    face: str
    server: str
    """How the hello reply names the server."""
    max_request_bytes: int
    max_reply_bytes: int
    _auth_token: str | None = None
    _v1_trusted: bool = False
    dialect: Dialect = attrs.field(default=Dialect.UNDECIDED, init=False)
    _closed: Closed | None = attrs.field(default=None, init=False)
    _decoder: FrameDecoder = attrs.field(init=False)

    @_decoder.default
    def _frames(self) -> FrameDecoder:
        return FrameDecoder(self.max_request_bytes)

    @property
    def in_partial_frame(self) -> bool:
        """Part of a frame has arrived: the read timeout applies, not the idle one."""
        return self._decoder.in_partial_frame

    @property
    def partial_length(self) -> int | None:
        """The body length of the frame being received, once its header is in: a
        connection lends that many bytes of its face's budget before it reads a large
        frame whole."""
        return self._decoder.partial_length

    @property
    def closed(self) -> Closed | None:
        """Why the connection takes nothing more, or None while it does."""
        return self._closed

    def receive_data(self, data: bytes | bytearray) -> None:
        """What the socket gave; ``b""`` at the end of the stream."""
        self._decoder.receive_data(data)

    def next_event(self) -> Event | Literal[Sentinel.NEED_DATA]:
        """The next event, or :data:`NEED_DATA`."""
        if self._closed is not None:
            return self._closed
        try:
            frame = self._decoder.next_frame()
        except RemoteProtocolError as exc:
            return self._close(*self._stream_error(exc))
        if frame is NEED_DATA:
            return NEED_DATA
        if not isinstance(frame, bytes):  # CLOSED: on a frame boundary
            return self._close("closed", by_peer=True)
        if self.dialect is Dialect.UNDECIDED:
            return self._first(frame)
        return FrameReceived(frame)

    def read_request(self, frame: bytes) -> Request | Answer | Closed:
        """The v2 request in ``frame``; or the error answer to send for an envelope that
        names a bad field (the connection goes on); or, for a frame that is not a JSON
        object at all, :class:`Closed` with the answer (``id`` null) as its final frame."""
        try:
            return envelope.parse_request(frame)
        except envelope.RequestError as exc:
            return self.error(exc.request_id, UNKNOWN_OP, exc.code, exc.hint)
        except RemoteProtocolError as exc:
            return self._close("protocol_error", self._unreadable(exc.code, exc.hint))

    def reply(self, request: Request, body: bytes) -> Answer:
        """The frame carrying ``body``, the reply to ``request``; a body over the reply
        cap is answered ``too_large`` instead (the connection goes on)."""
        try:
            return Answer(encode_frame(body, self.max_reply_bytes), request.op, "ok")
        except LocalProtocolError as exc:
            return self.error(request.id, request.op, exc.code, exc.hint)

    def error(
        self,
        request_id: int | None,
        op: str,
        code: ErrorCode,
        message: str,
        retry_after_ms: int | None = None,
        primary: str | None = None,
    ) -> Answer:
        """An error answer (``{"ok": false, "error": …}``; ``primary``: where to ask
        instead, from a member that is not primary)."""
        body = envelope.encode_error(
            request_id, code, message, retry_after_ms=retry_after_ms, primary=primary
        )
        return Answer(encode_frame(body), op, code.value)

    def _first(self, frame: bytes) -> Event:
        try:
            hello = envelope.detect_dialect(frame)
        except RemoteProtocolError as exc:
            return self._close("protocol_error", self._unreadable(exc.code, exc.hint))
        if hello is None:
            if self._auth_token is not None and not self._v1_trusted:
                return self._close("unauthorized")  # v1 has no error frame for this
            self.dialect = Dialect.V1
            return FrameReceived(frame)
        if not self._token_accepted(hello):
            refusal = "hello.token: missing or not accepted"
            return self._close("unauthorized", self._unreadable(ErrorCode.INVALID, refusal))
        self.dialect = Dialect.V2
        reply = envelope.encode_hello_reply(
            server=self.server,
            face=self.face,
            max_request_bytes=self.max_request_bytes,
            max_reply_bytes=self.max_reply_bytes,
        )
        return Opened(hello, encode_frame(reply))

    def _token_accepted(self, hello: Hello) -> bool:
        if self._auth_token is None:
            return True
        token = hello.fields.get("token")
        # Constant time: the comparison must not tell a prober how much of it matched.
        # surrogatepass: JSON can carry a lone surrogate ("\ud800"), which a strict
        # encode refused with an error logged for every unauthenticated prober.
        return isinstance(token, str) and hmac.compare_digest(
            token.encode("utf-8", "surrogatepass"), self._auth_token.encode()
        )

    def _stream_error(self, exc: RemoteProtocolError) -> tuple[str, bytes | None]:
        too_large = exc.code is ErrorCode.TOO_LARGE
        outcome = "too_large" if too_large else "protocol_error"
        if too_large and self.dialect is Dialect.V2:
            return outcome, self._unreadable(exc.code, exc.hint)
        return outcome, None  # v1, or no dialect yet: the documented answer is to close

    @staticmethod
    def _unreadable(code: ErrorCode, hint: str) -> bytes:
        """The answer to a frame whose request could not be read: ``id`` is null."""
        return encode_frame(envelope.encode_error(None, code, hint))

    def _close(self, outcome: str, final: bytes | None = None, *, by_peer: bool = False) -> Closed:
        self._closed = Closed(outcome, final, by_peer)
        return self._closed
