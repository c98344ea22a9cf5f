from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cmdbus_trio.protocol import (
    CLOSED,
    NEED_DATA,
    ErrorCode,
    FrameDecoder,
    LocalProtocolError,
    RemoteProtocolError,
    encode_frame,
)


def drain(decoder: FrameDecoder) -> list[bytes]:
    frames = []
    while isinstance(frame := decoder.next_frame(), bytes):
        frames.append(frame)
    return frames


bodies = st.lists(st.binary(max_size=300), max_size=20)


@given(bodies, st.data())
def test_round_trip_in_any_chunking(frames: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(encode_frame(body) for body in frames)
    decoder = FrameDecoder(max_bytes=300)
    got: list[bytes] = []
    position = 0
    while position < len(stream):
        size = data.draw(st.integers(1, len(stream) - position))
        decoder.receive_data(stream[position : position + size])
        position += size
        got += drain(decoder)
    assert decoder.next_frame() is NEED_DATA
    decoder.receive_data(b"")
    assert decoder.next_frame() is CLOSED
    assert got == frames


def test_byte_at_a_time() -> None:
    stream = encode_frame(b"hello") + encode_frame(b"") + encode_frame(b"x" * 70)
    decoder = FrameDecoder(max_bytes=100)
    got = []
    for index in range(len(stream)):
        assert decoder.in_partial_frame == (decoder.buffered > 0)
        decoder.receive_data(stream[index : index + 1])
        got += drain(decoder)
    assert got == [b"hello", b"", b"x" * 70]
    assert not decoder.in_partial_frame


def test_wanted_counts_down_to_the_end_of_the_frame() -> None:
    decoder = FrameDecoder(max_bytes=100)
    assert decoder.wanted == 4
    decoder.receive_data(b"\x00\x00")
    assert decoder.wanted == 2
    decoder.receive_data(b"\x00\x0a")
    assert decoder.wanted == 10
    decoder.receive_data(b"123")
    assert decoder.wanted == 7


def test_partial_length_is_known_once_the_header_is_in() -> None:
    decoder = FrameDecoder(max_bytes=100)
    assert decoder.partial_length is None
    decoder.receive_data(b"\x00\x00\x00")
    assert decoder.partial_length is None  # part of a header
    decoder.receive_data(b"\x0a12")
    assert decoder.partial_length == 10
    decoder.receive_data(b"34567890")
    assert decoder.next_frame() == b"1234567890"
    assert decoder.partial_length is None


def test_frame_at_the_cap_is_accepted_one_over_is_refused() -> None:
    decoder = FrameDecoder(max_bytes=8)
    decoder.receive_data(encode_frame(b"12345678"))
    assert decoder.next_frame() == b"12345678"
    decoder.receive_data(encode_frame(b"123456789"))
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    assert info.value.code is ErrorCode.TOO_LARGE
    assert info.value.fatal
    assert "9 bytes exceeds the 8-byte" in info.value.hint


def test_cap_is_checked_on_the_header_before_the_body_arrives() -> None:
    decoder = FrameDecoder(max_bytes=1 << 20)
    decoder.receive_data((1 << 30).to_bytes(4, "big"))  # announces 1 GiB, sends nothing
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    assert info.value.code is ErrorCode.TOO_LARGE
    assert decoder.buffered == 4
    with pytest.raises(RemoteProtocolError):  # the error state is final
        decoder.next_frame()


def test_a_large_announced_length_allocates_nothing_up_front() -> None:
    decoder = FrameDecoder(max_bytes=(1 << 32) - 1)
    tracemalloc.start()
    try:
        decoder.receive_data(((1 << 32) - 1).to_bytes(4, "big"))
        assert decoder.next_frame() is NEED_DATA
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def test_stream_ending_inside_a_frame_is_a_remote_error() -> None:
    decoder = FrameDecoder(max_bytes=100)
    decoder.receive_data(encode_frame(b"abcdef")[:-2])
    decoder.receive_data(b"")
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    assert "stream ended inside a frame" in info.value.hint
    assert info.value.fatal


def test_receive_after_eof_is_a_usage_error() -> None:
    decoder = FrameDecoder(max_bytes=10)
    decoder.receive_data(b"")
    with pytest.raises(RuntimeError):
        decoder.receive_data(b"x")


@given(st.binary(max_size=2000))
def test_garbage_gives_frames_need_data_or_a_protocol_error(garbage: bytes) -> None:
    decoder = FrameDecoder(max_bytes=64)
    if garbage:
        decoder.receive_data(garbage)
    decoder.receive_data(b"")
    try:
        frames = drain(decoder)
    except RemoteProtocolError as exc:
        assert exc.fatal
    else:
        assert all(len(frame) <= 64 for frame in frames)
        assert decoder.next_frame() is CLOSED


def test_encoding_over_the_cap_is_a_local_error() -> None:
    assert encode_frame(b"abc", max_bytes=3) == b"\x00\x00\x00\x03abc"
    with pytest.raises(LocalProtocolError) as info:
        encode_frame(b"abcd", max_bytes=3)
    assert info.value.code is ErrorCode.TOO_LARGE
    assert not info.value.fatal


@pytest.mark.parametrize("bad", [-1, 1 << 32])
def test_decoder_cap_must_fit_the_length_prefix(bad: int) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        FrameDecoder(max_bytes=bad)


def test_buffer_is_compacted_as_frames_are_consumed() -> None:
    decoder = FrameDecoder(max_bytes=100)
    frame = encode_frame(b"y" * 50)
    for _ in range(1000):
        decoder.receive_data(frame + frame[:10])
        decoder.next_frame()
        decoder.receive_data(frame[10:])
        decoder.next_frame()
        assert decoder.buffered == 0
    assert len(decoder._buffer) < 4 * len(frame)
