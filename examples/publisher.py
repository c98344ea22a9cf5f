"""A publisher: one command a record, at a steady rate, through writer restarts.

    python examples/publisher.py --addr 127.0.0.1:9100 --count 1000 --rate 100

Prints one JSON line per record once the writer has made it durable. With the client's
defaults it rides through a writer that drains, restarts or is briefly unreachable
(up to a minute), and a publish sent again after a lost connection is stored once (the
client gives it a msg_id). SIGTERM or Ctrl-C stops it at once, even while the writer is
away, with one line and exit status 143 or 130 (a publish in flight then may or may not
have been stored; it is not printed). A writer away for longer than the client's window
ends it with one line and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import trio

from cmdbus_trio.client import ClientError
from cmdbus_trio.client.trio import IngestClient


async def main(addr: str, count: int, rate: float, pool: str) -> int:
    """The exit status: 0 once every record is published, 128 + the signal that
    stopped it."""
    stopped_by: list[int] = []
    async with IngestClient(addr) as ingest:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:

                async def stop_on_signal() -> None:
                    async for signum in signals:
                        stopped_by.append(signum)
                        nursery.cancel_scope.cancel()

                nursery.start_soon(stop_on_signal)
                for n in range(count):
                    payload = json.dumps({"execution_pool": pool, "step": n})
                    published = await ingest.publish({"execution_id": n, "payload": payload})
                    print(json.dumps({"n": n, "sort_key": published.sort_key}), flush=True)
                    await trio.sleep(1 / rate)
                nursery.cancel_scope.cancel()
    if stopped_by:
        name = signal.Signals(stopped_by[0]).name
        print(f"publisher: stopped by {name}", file=sys.stderr, flush=True)
        return 128 + stopped_by[0]
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default="127.0.0.1:9100", help="the command ingest face")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=100.0, help="records a second")
    parser.add_argument("--pool", default="shared", help="the commands' execution_pool")
    args = parser.parse_args()
    try:
        sys.exit(trio.run(main, args.addr, args.count, args.rate, args.pool))
    except ClientError as error:
        sys.exit(f"publisher: {error}")
