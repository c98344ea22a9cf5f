from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from cmdbus_trio.protocol.subjects import (
    SubjectError,
    as_i64,
    command_subject,
    event_subject,
    matches,
    parse_filter,
    pool_of,
    shard_of,
)


def test_xxhash64_reference_vectors() -> None:
    # Published XXH64 (seed 0) values: the shard function stands on these.
    assert xxhash.xxh64_intdigest(b"", seed=0) == 0xEF46DB3751D8E999
    assert xxhash.xxh64_intdigest(b"a", seed=0) == 0xD24EC4F1A98C6E5B
    assert xxhash.xxh64_intdigest(b"abc", seed=0) == 0x44BC2CF5AD770999


def test_string_ids_hash_their_utf8_bytes() -> None:
    assert shard_of("a", 1_000_003) == 0xD24EC4F1A98C6E5B % 1_000_003
    assert shard_of("abc", 7) == 0x44BC2CF5AD770999 % 7


@pytest.mark.parametrize("number", [0, 1, -1, 42, (1 << 63) - 1, -(1 << 63), 10**17 + 3])
def test_integer_ids_hash_8_little_endian_bytes(number: int) -> None:
    expected = xxhash.xxh64_intdigest(struct.pack("<q", number), seed=0) % 16
    assert shard_of(number, 16) == expected
    assert shard_of(str(number), 16) == expected  # text that parses as i64: the same shard


@pytest.mark.parametrize(
    ("text", "value"),
    [("0042", 42), ("+7", 7), ("-0", 0), ("9223372036854775807", (1 << 63) - 1),
     ("-9223372036854775808", -(1 << 63)), ("9223372036854775808", None), ("1.0", None),
     ("", None), (" 1", None), ("1e3", None), ("٣", None)],
)  # fmt: skip
def test_i64_parsing(text: str, value: int | None) -> None:
    assert as_i64(text) == value


def test_shard_count_of_one_or_less_is_shard_zero() -> None:
    assert shard_of("anything", 1) == 0
    assert shard_of(12345, 0) == 0


@given(st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.text()), st.integers(2, 64))
def test_shard_is_in_range(execution_id: int | str, count: int) -> None:
    assert 0 <= shard_of(execution_id, count) < count


@pytest.mark.parametrize(
    ("payload", "pool"),
    [({}, "shared"), ({"execution_pool": ""}, "shared"), ({"execution_pool": None}, "shared"),
     ({"execution_pool": "system"}, "system"), ([1], "shared"), ("text", "shared")],
)  # fmt: skip
def test_pools(payload: object, pool: str) -> None:
    assert pool_of(payload) == pool
    assert command_subject(pool, 3) == f"commands.{pool}.shard.3"


@pytest.mark.parametrize("pool", ["a.b", "a*", "x>", "a b", "\t", 5])
def test_bad_pools(pool: object) -> None:
    with pytest.raises(SubjectError, match=r"^payload\.execution_pool: "):
        pool_of({"execution_pool": pool})


@pytest.mark.parametrize(
    ("payload", "subject"),
    [({"event_type": "step.started"}, "events.step_started"), ({}, "events.unknown"),
     ({"event_type": ""}, "events.unknown"), ({"event_type": "a.b.c"}, "events.a_b_c")],
)  # fmt: skip
def test_event_subjects(payload: object, subject: str) -> None:
    assert event_subject(payload) == subject


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("commands.>", "commands.shared.shard.0", True),
        ("commands.>", "commands", False),
        ("commands.*.shard.0", "commands.system.shard.0", True),
        ("commands.*.shard.0", "commands.system.shard.1", False),
        ("commands.*", "commands.shared.shard.0", False),
        ("commands.shared.shard.0", "commands.shared.shard.0", True),
        ("*.*.*.*", "commands.shared.shard.0", True),
        (">", "events.x", True),
        ("events.*", "events.x", True),
        ("events.*", "events", False),
    ],
)
def test_nats_matching(pattern: str, subject: str, expected: bool) -> None:
    assert matches(parse_filter(pattern), subject) is expected


@pytest.mark.parametrize("bad", ["", "a..b", ".a", "a.", "a.>.b", None, 5])
def test_bad_filters(bad: object) -> None:
    with pytest.raises(SubjectError, match=r"^filter: "):
        parse_filter(bad)
