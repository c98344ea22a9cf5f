"""A member that says nothing (a primary paused, cut off or wedged: the kernel still
accepts its connections) costs a client given several members one call's timeout: that
call raises, and the next goes to the next member. A client given one address stays
with it (there is nowhere else to go), and a member that answers slowly is not left."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from cmdbus_trio.client import DeadlineExceeded, blocking
from cmdbus_trio.client.trio import IngestClient
from cmdbus_trio.protocol import (
    NEED_DATA,
    FrameDecoder,
    encode_frame,
    encode_hello_reply,
    encode_ok,
    loads,
)

from ..helpers import serving

RECORD = {"execution_id": 1, "payload": json.dumps({"n": 1})}


@asynccontextmanager
async def silent(answers_hello: bool) -> AsyncIterator[str]:
    """An address that accepts connections, answers the hello or not, then reads every
    request and answers only publishes of execution 2 (a member slow with the others)."""

    async def handle(client: trio.SocketStream) -> None:
        decoder = FrameDecoder(1 << 20)

        async def frame() -> dict[str, Any] | None:
            while (got := decoder.next_frame()) is NEED_DATA:
                data = await client.receive_some(1 << 16)
                if not data:
                    return None
                decoder.receive_data(data)
            return loads(got) if isinstance(got, bytes) else None

        async with client:
            await frame()  # the hello
            if not answers_hello:
                await trio.sleep_forever()
            hello = encode_hello_reply(
                server="silent", face="cmd_ingest", max_request_bytes=1 << 20,
                max_reply_bytes=1 << 24,
            )  # fmt: skip
            await client.send_all(encode_frame(hello))
            while (request := await frame()) is not None:
                if request.get("record", {}).get("execution_id") == 2:
                    published = {"sort_key": 7, "subject": "s", "duplicate": False}
                    await client.send_all(encode_frame(encode_ok(request["id"], published)))

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        yield f"127.0.0.1:{listener.socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("answers_hello", [True, False], ids=["after-hello", "at-hello"])
async def test_a_silent_member_costs_one_call_then_the_next_member_serves(
    tmp_path: Path, answers_hello: bool
) -> None:
    with trio.fail_after(60), serving(tmp_path) as (_, ports):
        async with silent(answers_hello) as quiet:
            members = f"{quiet},{ports['cmd_ingest']}"
            async with IngestClient(members) as ingest:
                with pytest.raises(DeadlineExceeded):
                    await ingest.publish(RECORD, timeout=0.5)
                assert (await ingest.publish(RECORD, timeout=10)).sort_key > 0
                assert ingest.address == ports["cmd_ingest"]

            def blocking_publishes() -> str:
                with blocking.IngestClient(members) as ingest:
                    with pytest.raises(DeadlineExceeded):
                        ingest.publish(RECORD, timeout=0.5)
                    assert ingest.publish(RECORD, timeout=10).sort_key > 0
                    return ingest.address

            assert await trio.to_thread.run_sync(blocking_publishes) == ports["cmd_ingest"]


async def test_a_client_given_one_address_stays_with_a_silent_writer() -> None:
    with trio.fail_after(30):
        async with silent(answers_hello=True) as quiet, IngestClient(quiet) as ingest:
            for _ in range(2):
                with pytest.raises(DeadlineExceeded):
                    await ingest.publish(RECORD, timeout=0.3)
                assert ingest.address == quiet

            def blocking_publish() -> str:
                with blocking.IngestClient(quiet) as ingest:
                    with pytest.raises(DeadlineExceeded):
                        ingest.publish(RECORD, timeout=0.3)
                    return ingest.address

            assert await trio.to_thread.run_sync(blocking_publish) == quiet


async def test_a_member_that_answered_anything_meanwhile_is_not_left() -> None:
    """A call runs out of time while the member answered another on the connection: it
    is slow with that call, not gone, and the client stays."""
    with trio.fail_after(30):
        async with silent(answers_hello=True) as slow:
            members = f"{slow},127.0.0.1:9"  # the second is never reached
            async with IngestClient(members) as ingest, trio.open_nursery() as nursery:

                async def publish_meanwhile() -> None:
                    await trio.sleep(0.1)
                    await ingest.publish({**RECORD, "execution_id": 2}, timeout=5)

                nursery.start_soon(publish_meanwhile)
                with pytest.raises(DeadlineExceeded):
                    await ingest.publish(RECORD, timeout=0.5)
                assert ingest.address == slow
