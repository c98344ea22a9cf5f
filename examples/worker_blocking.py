"""A worker (blocking client, no trio): claims commands, does the work, acks, through
writer restarts.

    python examples/worker_blocking.py --addr 127.0.0.1:9101 --filter 'commands.shared.>'

The same as examples/worker.py, for a program written with threads or none. SIGTERM or
Ctrl-C stops it after the command in hand.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from types import FrameType

from cmdbus_trio.client.blocking import ClaimClient

stopping = False


def stop(signum: int, frame: FrameType | None) -> None:
    global stopping
    stopping = True


def work(record: dict[str, object]) -> None:
    time.sleep(0.001)  # the command's work


def main(addr: str, filter: str) -> None:
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with ClaimClient(addr) as claim:
        while not stopping:
            delivery = claim.next(filter, wait=1.0)  # None after 1 s idle: look at `stopping`
            if delivery is None:
                continue
            work(delivery.record)
            acked = claim.ack(delivery)
            line = {"sort_key": delivery.sort_key, "acked": acked}
            print(json.dumps(line | {"execution_id": delivery.record["execution_id"]}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default="127.0.0.1:9101", help="the command claim face")
    parser.add_argument("--filter", default="commands.shared.>", help="the pool's subjects")
    args = parser.parse_args()
    main(args.addr, args.filter)
