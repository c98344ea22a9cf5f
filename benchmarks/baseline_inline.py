"""The seed's design, for comparison: the same store and protocol, with the store work
run directly on the trio loop (no Gate, no worker threads).

    python benchmarks/baseline_inline.py --data-dir DIR --ports-file FILE

Serves the v2 tier ops the benchmarks use (hello, health, append, read_execution) and a
control face with /healthz and /metrics on the same loop. Not for production: it exists to
show, in the same run, what cmdbus-trio's design changes.
"""

from __future__ import annotations

import argparse
import json
import signal
from functools import partial
from pathlib import Path
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from cmdbus_trio import metrics
from cmdbus_trio.commands._addresses import write_ports_file
from cmdbus_trio.protocol import (
    NEED_DATA,
    FrameDecoder,
    dumps,
    encode_frame,
    encode_ok,
    pages,
    parse_request,
)
from cmdbus_trio.protocol import tier as codec
from cmdbus_trio.storage.tier import NewRecord, TierStore

# The storage layer refuses the loop thread; the seed did not. Call the functions behind
# the guard, on purpose, to reproduce it.
_append_batch = TierStore.append_batch.__wrapped__  # type: ignore[attr-defined]
_execution_count = TierStore.execution_count.__wrapped__  # type: ignore[attr-defined]
_iter_execution = TierStore.iter_execution.__wrapped__  # type: ignore[attr-defined]


def handle(store: TierStore, body: bytes) -> bytes:
    request = parse_request(body)
    op = codec.decode_op(request.op, request.fields)
    if isinstance(op, codec.Health):
        return encode_ok(request.id, {"status": "ok"})
    if isinstance(op, codec.Append):
        record = NewRecord(op.payload, op.transaction_id, codec.payload_event_id(op.payload))
        result = _append_batch(store, op.tier, op.execution_id, [record])[0]
        return encode_ok(
            request.id,
            codec.append_body(result.global_sequence, result.log_record_count, result.deduplicated),
        )
    if isinstance(op, codec.ReadExecution):
        count = _execution_count(store, op.tier, op.execution_id)
        fragments: list[bytes] = []
        last = None
        more = False
        for page in _iter_execution(store, op.tier, op.execution_id, after=op.after):
            for record in page:
                if len(fragments) == op.limit:
                    more = True
                    break
                fragments.append(
                    codec.record_fragment(
                        record.global_sequence,
                        record.execution_id,
                        record.transaction_id,
                        record.byte_len,
                        record.payload,
                    )
                )
                last = record.global_sequence
            if more:
                break
        head: dict[str, Any] = {
            "id": request.id,
            "ok": True,
            "execution_id": op.execution_id,
            "record_count": count or 0,
            "returned": len(fragments),
        }
        return pages.with_records(head, fragments, {"next_after": last if more else None})
    return dumps(
        {"id": request.id, "ok": False, "error": {"code": "unsupported", "message": request.op}}
    )


async def tier_connection(store: TierStore, stream: trio.SocketStream) -> None:
    decoder = FrameDecoder(1 << 20)
    first = True
    async with stream:
        while True:
            frame = decoder.next_frame()
            if frame is NEED_DATA:
                data = await stream.receive_some(1 << 16)
                decoder.receive_data(data)
                continue
            if not isinstance(frame, bytes):
                return
            if first:
                first = False
                await stream.send_all(encode_frame(b'{"ok": true, "protocol": 2}'))
                continue
            await stream.send_all(encode_frame(handle(store, frame)))  # on the loop thread


async def control_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/metrics":
        body, content_type = metrics.exposition()
    else:
        body, content_type = json.dumps({"status": "ok"}).encode(), "application/json"
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", content_type.encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def main(store: TierStore, ports_file: Path) -> None:
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                lambda task_status: hypercorn_serve(
                    control_app, config, shutdown_trigger=stop.wait, task_status=task_status
                )
            )  # type: ignore[arg-type]
            listeners = await nursery.start(
                partial(trio.serve_tcp, partial(tier_connection, store), 0, host="127.0.0.1")
            )
            port = listeners[0].socket.getsockname()[1]
            write_ports_file(
                ports_file, {"control": urls[0].split("://")[1], "tier": f"127.0.0.1:{port}"}
            )
            async for _ in signals:
                break
            stop.set()
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--ports-file", type=Path, required=True)
    args = parser.parse_args()
    tier_store = TierStore.open(args.data_dir / "tier.sqlite3")  # before the loop starts
    trio.run(main, tier_store, args.ports_file)
