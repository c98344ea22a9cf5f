"""The replication face's messages: a pure codec (no I/O), framed as the data faces
frame theirs (``u32 length || body``), each body a kind byte and its fields.

The standby speaks first (:class:`Hello`: who it is and how far each of its stores is);
the primary answers :class:`Welcome` or :class:`Refused`, then sends, in commit order,
each store's transactions (:class:`Pages`, a transaction split into parts when large),
base copies where the standby is too far behind (:class:`BaseStart`, :class:`BaseChunk`,
:class:`BaseEnd`), and a :class:`Tick` when idle. The standby answers :class:`Confirm`
once what it confirms is durable. Every message from the primary carries its epoch: a
member drops a connection whose epoch is older than the lease it has seen.

Caps are checked before anything is allocated: a frame's length by the decoder, a
store name's and a page's size here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from typing import Any, Final

import attrs

from cmdbus_trio.protocol._framing import encode_frame
from cmdbus_trio.storage._wal_tap import Committed
from cmdbus_trio.storage.replica import Position

MAX_FRAME: Final = 32 << 20
"""Bytes in one replication frame at most (a transaction larger than
:data:`MAX_PART` is sent in parts)."""
MAX_PART: Final = 16 << 20
"""Page bytes in one :class:`Pages` frame at most."""
MAX_PAGE: Final = 65536
"""SQLite's largest page size."""
MAX_NAME: Final = 64
"""A store's or a member's name, bytes at most."""
PROTOCOL: Final = 1

PAGES = struct.Struct(">QQIIIB")  # epoch, sequence, database pages, page size, part, last
PAGE_NUMBER = struct.Struct(">I")


class WireError(ValueError):
    """A frame that is not a replication message; ``str()`` names what is wrong."""


@attrs.frozen
class Hello:
    name: str
    token: str | None
    epoch: int
    """The newest lease epoch the standby has seen."""
    positions: Mapping[str, Position]
    protocol: int = PROTOCOL


@attrs.frozen
class Welcome:
    epoch: int
    primary: str


@attrs.frozen
class Refused:
    reason: str
    epoch: int
    primary: str | None = None
    """The member the refusing one believes is primary, where it knows."""


@attrs.frozen
class Pages:
    """Part of one store's transaction (``last``: its last part)."""

    store: str
    epoch: int
    sequence: int
    database_pages: int
    page_size: int
    part: int
    last: bool
    pages: tuple[tuple[int, bytes], ...]


@attrs.frozen
class BaseStart:
    """A base copy of ``store`` follows, holding every transaction through ``position``."""

    store: str
    epoch: int
    position: Position
    size: int


@attrs.frozen
class BaseChunk:
    store: str
    epoch: int
    data: bytes


@attrs.frozen
class BaseEnd:
    store: str
    epoch: int
    sha256: str


@attrs.frozen
class Tick:
    """The primary is there; ``sequence``: the newest transaction it has committed."""

    epoch: int
    sequence: int


@attrs.frozen
class Confirm:
    """Every transaction through ``sequence`` is durable on the standby."""

    epoch: int
    sequence: int


Message = Hello | Welcome | Refused | Pages | BaseStart | BaseChunk | BaseEnd | Tick | Confirm

_JSON_KINDS: dict[bytes, type[Any]] = {
    b"H": Hello,
    b"W": Welcome,
    b"R": Refused,
    b"S": BaseStart,
    b"E": BaseEnd,
    b"K": Tick,
    b"C": Confirm,
}
_KIND_OF = {kind: code for code, kind in _JSON_KINDS.items()}


def encode(message: Message) -> bytes:
    """One frame (its length prefix included)."""
    if isinstance(message, Pages):
        return encode_frame(_encode_pages(message), MAX_FRAME)
    if isinstance(message, BaseChunk):
        head = _name(message.store) + struct.pack(">Q", message.epoch)
        return encode_frame(b"B" + head + message.data, MAX_FRAME)
    fields = attrs.asdict(message, recurse=False)
    if isinstance(message, Hello):
        fields["positions"] = {k: attrs.asdict(v) for k, v in message.positions.items()}
    if isinstance(message, BaseStart):
        fields["position"] = attrs.asdict(message.position)
    body = json.dumps(fields, separators=(",", ":")).encode()
    return encode_frame(_KIND_OF[type(message)] + body, MAX_FRAME)


def split(store: str, epoch: int, sequence: int, committed: Committed) -> Iterator[Pages]:
    """A transaction as :class:`Pages` frames of at most :data:`MAX_PART` page bytes."""
    per_part = max(1, MAX_PART // committed.page_size)
    pages = committed.pages
    parts = range(0, len(pages), per_part)
    for part, start in enumerate(parts):
        yield Pages(
            store, epoch, sequence, committed.database_pages, committed.page_size,
            part, start + per_part >= len(pages), pages[start : start + per_part],
        )  # fmt: skip


def decode(body: bytes) -> Message:
    """A frame's body as its message. :class:`WireError` naming what is wrong."""
    if not body:
        raise WireError("an empty frame")
    kind, rest = body[:1], memoryview(body)[1:]
    if kind == b"P":
        return _decode_pages(rest)
    if kind == b"B":
        store, offset = _read_name(rest)
        if len(rest) < offset + 8:
            raise WireError("a base chunk without its epoch")
        (epoch,) = struct.unpack_from(">Q", rest, offset)
        return BaseChunk(store, epoch, bytes(rest[offset + 8 :]))
    cls = _JSON_KINDS.get(kind)
    if cls is None:
        raise WireError(f"an unknown kind of message {kind!r}")
    try:
        fields = json.loads(bytes(rest))
        if not isinstance(fields, dict):
            raise TypeError("not an object")
        if cls is Hello:
            fields["positions"] = {
                str(k): Position(int(v["epoch"]), int(v["sequence"]))
                for k, v in fields["positions"].items()
            }
        if cls is BaseStart:
            position = fields["position"]
            fields["position"] = Position(int(position["epoch"]), int(position["sequence"]))
        message = cls(**fields)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise WireError(f"a malformed {cls.__name__}: {exc}") from None
    _check_types(message)
    return message  # type: ignore[no-any-return]


def _check_types(message: Any) -> None:
    for field in attrs.fields(type(message)):
        value = getattr(message, field.name)
        if field.name in ("epoch", "sequence", "size", "protocol") and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise WireError(f"{type(message).__name__}.{field.name} is not a count: {value!r}")
        if field.name in ("name", "store", "primary", "reason", "token", "sha256") and not (
            value is None or isinstance(value, str)
        ):
            raise WireError(f"{type(message).__name__}.{field.name} is not text: {value!r}")


def _name(name: str) -> bytes:
    raw = name.encode()
    if not 0 < len(raw) <= MAX_NAME:
        raise WireError(f"a store name of {len(raw)} bytes (1 to {MAX_NAME})")
    return bytes([len(raw)]) + raw


def _read_name(view: memoryview) -> tuple[str, int]:
    if not view:
        raise WireError("a message without its store")
    length = view[0]
    if not 0 < length <= MAX_NAME or len(view) < 1 + length:
        raise WireError("a store name cut short or too long")
    try:
        return bytes(view[1 : 1 + length]).decode(), 1 + length
    except UnicodeDecodeError:
        raise WireError("a store name that is not UTF-8") from None


def _encode_pages(message: Pages) -> bytes:
    head = PAGES.pack(
        message.epoch, message.sequence, message.database_pages, message.page_size,
        message.part, message.last,
    )  # fmt: skip
    body = b"".join(PAGE_NUMBER.pack(number) + page for number, page in message.pages)
    return b"P" + _name(message.store) + head + body


def _decode_pages(view: memoryview) -> Pages:
    store, offset = _read_name(view)
    if len(view) < offset + PAGES.size:
        raise WireError("pages without their header")
    epoch, sequence, database_pages, page_size, part, last = PAGES.unpack_from(view, offset)
    if not 512 <= page_size <= MAX_PAGE or page_size & (page_size - 1):
        raise WireError(f"a page size of {page_size} bytes")
    body = view[offset + PAGES.size :]
    step = PAGE_NUMBER.size + page_size
    if len(body) % step:
        raise WireError("pages cut short")
    pages = tuple(
        (PAGE_NUMBER.unpack_from(body, at)[0], bytes(body[at + PAGE_NUMBER.size : at + step]))
        for at in range(0, len(body), step)
    )
    if any(number == 0 for number, _ in pages):
        raise WireError("a page numbered 0")
    return Pages(store, epoch, sequence, database_pages, page_size, part, bool(last), pages)
