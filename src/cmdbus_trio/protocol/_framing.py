"""The frame codec: ``u32 big-endian length || body``, as a sans-io state machine."""

from __future__ import annotations

import enum
import struct
from typing import Final

from ._errors import ErrorCode, LocalProtocolError, RemoteProtocolError

HEADER: Final = struct.Struct(">I")
HEADER_SIZE: Final = HEADER.size
MAX_FRAME_LIMIT: Final = (1 << 32) - 1


class Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"
    CLOSED = "CLOSED"


NEED_DATA: Final = Sentinel.NEED_DATA
"""``next_frame()`` needs more bytes: call ``receive_data`` with what the socket gives."""
CLOSED: Final = Sentinel.CLOSED
"""The peer closed the stream cleanly, on a frame boundary."""


def encode_frame(body: bytes, max_bytes: int = MAX_FRAME_LIMIT) -> bytes:
    """Prefix ``body`` with its length. Raises :class:`LocalProtocolError` (``too_large``)
    when the body is over ``max_bytes``; nothing is built in that case."""
    if len(body) > max_bytes:
        raise LocalProtocolError(
            f"frame of {len(body)} bytes exceeds the {max_bytes}-byte cap",
            code=ErrorCode.TOO_LARGE,
            fatal=False,
        )
    return HEADER.pack(len(body)) + body


class FrameDecoder:
    """Splits a byte stream into frame bodies.

    Feed it with :meth:`receive_data` (``b""`` means end of stream) and pull frames with
    :meth:`next_frame` until it returns :data:`NEED_DATA`. A length above ``max_bytes`` is
    refused as soon as its 4-byte header is complete, before any room for the body is
    allocated or more of it is buffered.

    Error handling: :class:`RemoteProtocolError` from :meth:`next_frame` is final; the
    decoder stays in the error state and raises it again on every call.
    """

    def __init__(self, max_bytes: int) -> None:
        if not 0 <= max_bytes <= MAX_FRAME_LIMIT:
            raise ValueError(f"max_bytes must be 0..{MAX_FRAME_LIMIT}, got {max_bytes}")
        self.max_bytes = max_bytes
        self._buffer = bytearray()
        self._start = 0  # consumed prefix of _buffer, compacted lazily
        self._eof = False
        self._error: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buffer) - self._start

    @property
    def in_partial_frame(self) -> bool:
        """True when part of a frame has arrived: the read timeout applies, not the idle one."""
        return self.buffered > 0

    @property
    def partial_length(self) -> int | None:
        """The body length of the frame being received, once its header is in (None
        before: nothing, or part of a header, is buffered)."""
        if self.buffered < HEADER_SIZE:
            return None
        length: int = HEADER.unpack_from(self._buffer, self._start)[0]
        return length

    @property
    def wanted(self) -> int:
        """How many more bytes would complete the current header or frame (at least 1)."""
        available = self.buffered
        if available < HEADER_SIZE:
            return HEADER_SIZE - available
        length: int = HEADER.unpack_from(self._buffer, self._start)[0]
        return max(1, HEADER_SIZE + length - available)

    def receive_data(self, data: bytes | bytearray) -> None:
        if self._eof:
            raise RuntimeError("receive_data after end of stream")
        if not data:
            self._eof = True
            return
        if self._start and self._start >= len(self._buffer) // 2:
            del self._buffer[: self._start]
            self._start = 0
        self._buffer += data

    def next_frame(self) -> bytes | Sentinel:
        if self._error is not None:
            raise self._error
        available = self.buffered
        if available >= HEADER_SIZE:
            (length,) = HEADER.unpack_from(self._buffer, self._start)
            if length > self.max_bytes:
                self._error = RemoteProtocolError(
                    f"frame of {length} bytes exceeds the {self.max_bytes}-byte request cap",
                    code=ErrorCode.TOO_LARGE,
                    fatal=True,
                )
                raise self._error
            if available >= HEADER_SIZE + length:
                begin = self._start + HEADER_SIZE
                body = bytes(self._buffer[begin : begin + length])
                self._start = begin + length
                if self._start == len(self._buffer):
                    self._buffer.clear()
                    self._start = 0
                return body
        if not self._eof:
            return NEED_DATA
        if available:
            self._error = RemoteProtocolError(
                f"stream ended inside a frame ({available} bytes of it arrived)", fatal=True
            )
            raise self._error
        return CLOSED
