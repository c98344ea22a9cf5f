"""The replication face's codec (cmdbus_trio/ha/_wire.py): every message round-trips,
a large transaction is split into parts, and every malformed frame is a WireError that
names what is wrong (never another exception)."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cmdbus_trio.ha import _wire as wire
from cmdbus_trio.protocol._framing import HEADER_SIZE
from cmdbus_trio.storage._wal_tap import Committed
from cmdbus_trio.storage.replica import Position

PAGE = 4096


def body(frame: bytes) -> bytes:
    return frame[HEADER_SIZE:]


MESSAGES = [
    wire.Hello("b", "secret", 3, {"commands": Position(2, 10), "tier": Position()}),
    wire.Hello("b", None, 0, {}),
    wire.Welcome(3, "a"),
    wire.Refused("not primary", 4, "b"),
    wire.Refused("stale epoch", 4),
    wire.BaseStart("events", 3, Position(3, 99), 1 << 20),
    wire.BaseChunk("events", 3, b"\x00\x01" * 100),
    wire.BaseEnd("events", 3, "ab" * 32),
    wire.Tick(3, 120),
    wire.Confirm(3, 119),
    wire.Pages("tier", 3, 7, 12, PAGE, 0, True, ((1, b"a" * PAGE), (12, b"b" * PAGE))),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: wire.Message) -> None:
    assert wire.decode(body(wire.encode(message))) == message


def test_a_large_transaction_goes_in_parts_each_under_the_cap() -> None:
    count = wire.MAX_PART // PAGE * 2 + 3
    committed = Committed(
        "commands", PAGE, tuple((n, bytes([n % 256]) * PAGE) for n in range(1, count + 1)), count
    )
    parts = list(wire.split("commands", 5, 42, committed))
    assert [(p.part, p.last) for p in parts] == [(0, False), (1, False), (2, True)]
    assert all(len(wire.encode(p)) <= wire.MAX_FRAME for p in parts)
    assert tuple(page for p in parts for page in p.pages) == committed.pages
    small = list(wire.split("commands", 5, 43, Committed("commands", PAGE, ((1, b"x" * PAGE),), 1)))
    assert len(small) == 1 and small[0].last


@pytest.mark.parametrize(
    ("frame", "says"),
    [
        (b"", "an empty frame"),
        (b"Z{}", "an unknown kind"),
        (b"H[1]", "a malformed Hello"),
        (b"H{not json", "a malformed Hello"),
        (b'W{"epoch": 1}', "a malformed Welcome"),
        (b'W{"epoch": 1, "primary": "a", "extra": 1}', "a malformed Welcome"),
        (b'W{"epoch": -1, "primary": "a"}', "Welcome.epoch is not a count"),
        (b'W{"epoch": true, "primary": "a"}', "Welcome.epoch is not a count"),
        (b'W{"epoch": 1, "primary": 7}', "Welcome.primary is not text"),
        (b'C{"epoch": 1, "sequence": "9"}', "Confirm.sequence is not a count"),
        (b'H{"name": "b", "token": null, "epoch": 1, "positions": {"x": {}}}', "a malformed Hello"),
        (b'S{"store": "x", "epoch": 1, "position": 5, "size": 1}', "a malformed BaseStart"),
        (b"P", "a message without its store"),
        (b"P\x05ab", "a store name cut short"),
        (b"P\x00", "a store name cut short or too long"),
        (b"P\x02\xff\xfe" + b"\x00" * 29, "not UTF-8"),
        (b"P\x01x" + b"\x00" * 5, "pages without their header"),
        (b"P\x01x" + wire.PAGES.pack(1, 1, 1, 1000, 0, 1), "a page size of 1000 bytes"),
        (b"P\x01x" + wire.PAGES.pack(1, 1, 1, 512, 0, 1) + b"\x00" * 10, "pages cut short"),
        (
            b"P\x01x" + wire.PAGES.pack(1, 1, 1, 512, 0, 1) + struct.pack(">I", 0) + b"\x00" * 512,
            "a page numbered 0",
        ),
        (b"B\x01x\x00", "a base chunk without its epoch"),
    ],
)
def test_a_malformed_frame_is_a_wire_error_naming_what_is_wrong(frame: bytes, says: str) -> None:
    with pytest.raises(wire.WireError, match=says):
        wire.decode(frame)


def test_a_store_name_over_the_cap_is_refused_before_sending() -> None:
    with pytest.raises(wire.WireError, match="a store name of 65 bytes"):
        wire.encode(wire.BaseChunk("x" * 65, 1, b""))


@given(st.binary(max_size=200))
def test_no_frame_raises_anything_but_a_wire_error(frame: bytes) -> None:
    with contextlib.suppress(wire.WireError):
        wire.decode(frame)
