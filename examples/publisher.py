"""A publisher: one command a record, at a steady rate, through writer restarts.

    python examples/publisher.py --addr 127.0.0.1:9100 --count 1000 --rate 100

Prints one JSON line per record once the writer has made it durable. With the client's
defaults it rides through a writer that drains, restarts or is briefly unreachable
(up to a minute), and a publish sent again after a lost connection is stored once (the
client gives it a msg_id). SIGTERM or Ctrl-C stops it after the publish in flight.
"""

from __future__ import annotations

import argparse
import json
import signal

import trio

from cmdbus_trio.client.trio import IngestClient


async def main(addr: str, count: int, rate: float, pool: str) -> None:
    async with IngestClient(addr) as ingest:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:

                async def stop_on_signal() -> None:
                    async for _ in signals:
                        nursery.cancel_scope.cancel()

                nursery.start_soon(stop_on_signal)
                for n in range(count):
                    payload = json.dumps({"execution_pool": pool, "step": n})
                    with trio.CancelScope(shield=True):  # a publish begun is finished
                        published = await ingest.publish({"execution_id": n, "payload": payload})
                    print(json.dumps({"n": n, "sort_key": published.sort_key}), flush=True)
                    await trio.sleep(1 / rate)
                nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default="127.0.0.1:9100", help="the command ingest face")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=100.0, help="records a second")
    parser.add_argument("--pool", default="shared", help="the commands' execution_pool")
    args = parser.parse_args()
    trio.run(main, args.addr, args.count, args.rate, args.pool)
