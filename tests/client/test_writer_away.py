"""Calls that reached no writer ride through, whatever the call: a connection whose hello
failed (the writer closed it while restarting) and a draining writer's `unavailable` (it
refused the call before reading it) mean nothing was done, as when the connect itself
fails. A real writer sits behind a gatekeeper that turns the first connections away."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio

from cmdbus_trio.client import blocking
from cmdbus_trio.client.trio import TierClient
from cmdbus_trio.protocol import (
    NEED_DATA,
    ErrorCode,
    FrameDecoder,
    encode_error,
    encode_frame,
    encode_hello_reply,
    loads,
)

from ..helpers import serving

TURNED_AWAY = 3


async def _read_frame(stream: trio.SocketStream, decoder: FrameDecoder) -> bytes | None:
    while (frame := decoder.next_frame()) is NEED_DATA:
        data = await stream.receive_some(1 << 16)
        decoder.receive_data(data)
        if not data:
            return None
    return frame if isinstance(frame, bytes) else None


async def _pipe(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    try:
        while data := await source.receive_some(1 << 16):
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await trio.aclose_forcefully(sink)


@asynccontextmanager
async def gatekeeper(writer: str, how: str) -> AsyncIterator[tuple[str, list[str]]]:
    """An address whose first :data:`TURNED_AWAY` connections are turned away ``how``:
    ``hello`` closes each once its hello came (a writer restarting), ``drain`` answers
    the hello, then its first request `unavailable` with ``retry_after_ms`` (a draining
    writer), and closes. Later connections reach ``writer``. Yields the address and the
    ops turned away."""
    count = itertools.count(1)
    refused: list[str] = []

    async def handle(client: trio.SocketStream) -> None:
        decoder = FrameDecoder(1 << 20)
        if next(count) <= TURNED_AWAY:
            async with client:
                await _read_frame(client, decoder)  # the hello
                if how == "drain":
                    hello = encode_hello_reply(
                        server="gatekeeper", face="tier", max_request_bytes=1 << 20,
                        max_reply_bytes=1 << 24,
                    )  # fmt: skip
                    await client.send_all(encode_frame(hello))
                    request = loads(await _read_frame(client, decoder) or b"{}")
                    refused.append(request.get("op", "?"))
                    refusal = encode_error(
                        request.get("id"), ErrorCode.UNAVAILABLE, "the writer is draining",
                        retry_after_ms=50,
                    )  # fmt: skip
                    await client.send_all(encode_frame(refusal))
            return
        host, port = writer.rsplit(":", 1)
        upstream = await trio.open_tcp_stream(host, int(port))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pipe, client, upstream)
            nursery.start_soon(_pipe, upstream, client)

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        yield f"127.0.0.1:{listener.socket.getsockname()[1]}", refused
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("how", ["hello", "drain"])
async def test_an_append_that_reached_no_writer_rides_through(tmp_path: Path, how: str) -> None:
    """An append without expected_version may not be sent again after a lost connection
    (it may have been stored), but one that never reached a writer may: the trio and the
    blocking client each append once through three turned-away connections, and each
    record is stored once."""
    with trio.fail_after(60), serving(tmp_path) as (_, ports):
        async with (
            gatekeeper(ports["tier"], how) as (address, refused),
            TierClient(address) as tier,
        ):
            assert not (await tier.append("trio", "{}")).deduplicated
        async with gatekeeper(ports["tier"], how) as (address, refused_too):

            def blocking_append() -> bool:
                with blocking.TierClient(address) as tier:
                    return tier.append("blocking", "{}").deduplicated

            assert not await trio.to_thread.run_sync(blocking_append)
        if how == "drain":
            assert refused == refused_too == ["append"] * TURNED_AWAY
        async with TierClient(ports["tier"]) as tier:
            for execution in ("trio", "blocking"):
                assert (await tier.read_execution(execution)).record_count == 1
