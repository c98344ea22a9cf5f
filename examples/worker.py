"""A worker (trio): claims commands, does the work, acks, through writer restarts.

    python examples/worker.py --addr 127.0.0.1:9101 --filter 'commands.shared.>'

Prints one JSON line per command it ran. With the client's defaults it rides through a
writer that drains, restarts or is briefly unreachable (up to a minute): a `next` is
asked again, and an `ack` after a reconnect answers False (the lease went with the
connection), so the command comes again: delivery is at least once, make the work
idempotent. SIGTERM or Ctrl-C stops it after the command in hand.
"""

from __future__ import annotations

import argparse
import json
import signal

import trio

from cmdbus_trio.client.trio import ClaimClient


async def work(record: dict[str, object]) -> None:
    await trio.sleep(0.001)  # the command's work


async def main(addr: str, filter: str) -> None:
    async with ClaimClient(addr) as claim:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:

                async def stop_on_signal() -> None:
                    async for _ in signals:
                        nursery.cancel_scope.cancel()

                nursery.start_soon(stop_on_signal)
                while True:
                    delivery = await claim.next(filter, wait=5.0)  # None after 5 s idle
                    if delivery is None:
                        continue
                    with trio.CancelScope(shield=True):  # the command in hand is finished
                        await work(delivery.record)
                        acked = await claim.ack(delivery)
                    line = {"sort_key": delivery.sort_key, "acked": acked}
                    record = {"execution_id": delivery.record["execution_id"]}
                    print(json.dumps(line | record), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default="127.0.0.1:9101", help="the command claim face")
    parser.add_argument("--filter", default="commands.shared.>", help="the pool's subjects")
    args = parser.parse_args()
    trio.run(main, args.addr, args.filter)
