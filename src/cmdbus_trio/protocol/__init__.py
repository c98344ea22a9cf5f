"""The wire protocol as pure state machines: no I/O, no trio (docs/protocol.md)."""

from ._envelope import (
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Hello,
    Request,
    RequestError,
    detect_dialect,
    encode_error,
    encode_hello_reply,
    encode_ok,
    parse_request,
)
from ._errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from ._fields import FieldError, UnsupportedOp, is_int
from ._framing import CLOSED, HEADER_SIZE, NEED_DATA, FrameDecoder, Sentinel, encode_frame
from ._json import dumps, dumps_str, loads

__all__ = [
    "CLOSED",
    "HEADER_SIZE",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "ErrorCode",
    "FieldError",
    "FrameDecoder",
    "Hello",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "Request",
    "RequestError",
    "Sentinel",
    "UnsupportedOp",
    "detect_dialect",
    "dumps",
    "dumps_str",
    "encode_error",
    "encode_frame",
    "encode_hello_reply",
    "encode_ok",
    "is_int",
    "loads",
    "parse_request",
]
