"""A worker (trio): claims commands, does the work, acks, through writer restarts.

    python examples/worker.py --addr 127.0.0.1:9101 --filter 'commands.shared.>'

Prints one JSON line per command it ran. With the client's defaults it rides through a
writer that drains, restarts or is briefly unreachable (up to a minute): a `next` is
asked again, and an `ack` after a reconnect answers False (the lease went with the
connection), so the command comes again: delivery is at least once, make the work
idempotent. SIGTERM or Ctrl-C stops it after the work in hand (not acked then: the
command comes again), or at once while it waits for a command or for the writer, with
one line and exit status 143 or 130. A writer away for longer than the client's window
ends it with one line and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import trio

from cmdbus_trio.client import ClientError
from cmdbus_trio.client.trio import ClaimClient


async def work(record: dict[str, object]) -> None:
    await trio.sleep(0.001)  # the command's work


async def main(addr: str, filter: str) -> int:
    """The exit status: 128 + the signal that stopped it."""
    stopped_by: list[int] = []
    async with ClaimClient(addr) as claim:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:

                async def stop_on_signal() -> None:
                    async for signum in signals:
                        stopped_by.append(signum)
                        nursery.cancel_scope.cancel()

                nursery.start_soon(stop_on_signal)
                while True:
                    delivery = await claim.next(filter, wait=5.0)  # None after 5 s idle
                    if delivery is None:
                        continue
                    with trio.CancelScope(shield=True):  # the work in hand is finished
                        await work(delivery.record)
                    acked = await claim.ack(delivery)
                    line = {"sort_key": delivery.sort_key, "acked": acked}
                    record = {"execution_id": delivery.record["execution_id"]}
                    print(json.dumps(line | record), flush=True)
    name = signal.Signals(stopped_by[0]).name
    print(f"worker: stopped by {name}", file=sys.stderr, flush=True)
    return 128 + stopped_by[0]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default="127.0.0.1:9101", help="the command claim face")
    parser.add_argument("--filter", default="commands.shared.>", help="the pool's subjects")
    args = parser.parse_args()
    try:
        sys.exit(trio.run(main, args.addr, args.filter))
    except ClientError as error:
        sys.exit(f"worker: {error}")
