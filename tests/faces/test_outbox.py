"""A connection's outbox: replies written whole, in order, at once when they can be."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from cmdbus_trio.faces import _outbox as outbox_module
from cmdbus_trio.faces._outbox import Outbox


def outbox(stream: trio.abc.Stream, broken: list[int]) -> Outbox:
    return Outbox(
        stream,
        face="test",
        write_timeout=5.0,
        max_unsent=1 << 20,
        broken=lambda: broken.append(1),
    )


@pytest.fixture
async def socket_pair() -> AsyncIterator[tuple[trio.SocketStream, socket.socket]]:
    """Our end as the writer has it; the peer's a plain non-blocking socket, to look at
    what has arrived without letting the loop run."""
    left, theirs = socket.socketpair()
    theirs.setblocking(False)
    ours = trio.SocketStream(trio.socket.from_stdlib_socket(left))
    yield ours, theirs
    await ours.aclose()
    theirs.close()


async def receive_exactly(stream: trio.abc.ReceiveStream | socket.socket, size: int) -> bytes:
    if isinstance(stream, socket.socket):
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(stream))
    data = b""
    with trio.fail_after(5):
        while len(data) < size:
            data += await stream.receive_some(size - len(data))
    return data


async def test_a_reply_on_a_quiet_socket_is_written_before_send_returns(
    socket_pair: tuple[trio.SocketStream, socket.socket],
) -> None:
    ours, theirs = socket_pair
    box = outbox(ours, [])
    assert await box.send(b"one") is True
    assert theirs.recv(16) == b"one"  # there already: no task wrote it later


async def test_replies_settled_by_callbacks_are_written_together_after_them(
    socket_pair: tuple[trio.SocketStream, socket.socket],
) -> None:
    ours, theirs = socket_pair
    box = outbox(ours, [])
    async with trio.open_nursery() as flusher:
        for frame in (b"a", b"b", b"c"):
            box.send_nowait(frame, flusher)
        with pytest.raises(BlockingIOError):
            theirs.recv(16)  # nothing yet: the callbacks running now may add more
        await trio.testing.wait_all_tasks_blocked()
        assert theirs.recv(16) == b"abc"


async def test_many_connections_replies_are_written_in_turn_over_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No time for a second write in a step (a write a pass): every connection's
    replies, settled by callbacks, are still written whole and in order."""
    monkeypatch.setattr(outbox_module, "MAX_WRITE_STEP", 0.0)
    pairs = [socket.socketpair() for _ in range(5)]
    try:
        for _, theirs in pairs:
            theirs.setblocking(False)
        boxes = [
            outbox(trio.SocketStream(trio.socket.from_stdlib_socket(ours)), []) for ours, _ in pairs
        ]
        async with trio.open_nursery() as flusher:
            for n, box in enumerate(boxes):
                box.send_nowait(b"%d:a " % n, flusher)
            for n, box in enumerate(boxes):
                box.send_nowait(b"%d:b" % n, flusher)
            await trio.testing.wait_all_tasks_blocked()
        assert [theirs.recv(64) for _, theirs in pairs] == [b"%d:a %d:b" % (n, n) for n in range(5)]
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


async def test_what_the_socket_does_not_take_is_written_by_a_task_in_order(
    socket_pair: tuple[trio.SocketStream, socket.socket],
) -> None:
    ours, theirs = socket_pair
    box = outbox(ours, [])
    big = bytes(range(256)) * 16_384  # 4 MiB: far more than a socket buffer
    async with trio.open_nursery() as flusher:
        box.send_nowait(big, flusher)
        box.send_nowait(b"after", flusher)
        assert await receive_exactly(theirs, len(big) + 5) == big + b"after"


async def test_wait_flushed_returns_only_once_the_frame_being_written_is_whole() -> None:
    ours, theirs = trio.testing.lockstep_stream_pair()  # a write waits for its reader
    box = outbox(ours, [])
    flushed = False
    async with trio.open_nursery() as nursery:
        nursery.start_soon(box.send, b"x" * 1000)
        await trio.testing.wait_all_tasks_blocked()

        async def close_after_flush() -> None:
            nonlocal flushed
            await box.wait_flushed()
            flushed = True

        nursery.start_soon(close_after_flush)
        await trio.testing.wait_all_tasks_blocked()
        assert not flushed  # the frame is still being written
        assert await receive_exactly(theirs, 1000) == b"x" * 1000
    assert flushed


async def test_a_peer_gone_is_noticed_by_a_direct_write_once(
    socket_pair: tuple[trio.SocketStream, socket.socket],
) -> None:
    ours, theirs = socket_pair
    broken: list[int] = []
    box = outbox(ours, broken)
    theirs.close()
    assert await box.send(b"lost") is False
    assert await box.send(b"lost again") is False
    assert box.peer_gone and broken == [1]
    await box.wait_flushed()  # nothing to wait for
