"""A worker (blocking client, no trio): claims commands, does the work, acks, through
writer restarts.

    python examples/worker_blocking.py --addr 127.0.0.1:9101 --filter 'commands.shared.>'

The same as examples/worker.py, for a program written with threads or none. SIGTERM or
Ctrl-C stops it after the work in hand (not acked then: the command comes again), or at
once while it waits for a command or for the writer, with one line and exit status 143
or 130. A writer away for longer than the
client's window ends it with one line and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from types import FrameType

from cmdbus_trio.client import ClientError
from cmdbus_trio.client.blocking import ClaimClient


class Stopped(Exception):
    """A signal came while the worker waited (for a command, or for the writer)."""


stopped_by: list[int] = []
waiting = False
"""Whether the worker waits for the writer now (then a signal stops it at once)."""


def stop(signum: int, frame: FrameType | None) -> None:
    stopped_by.append(signum)
    if waiting:  # raised out of the call: the socket's wait ends (PEP 475)
        raise Stopped


def work(record: dict[str, object]) -> None:
    time.sleep(0.001)  # the command's work


def main(addr: str, filter: str) -> int:
    """The exit status: 128 + the signal that stopped it."""
    global waiting
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with ClaimClient(addr) as claim:
        try:
            while not stopped_by:
                waiting = True
                delivery = claim.next(filter, wait=5.0)  # None after 5 s idle
                waiting = False
                if delivery is None:
                    continue
                work(delivery.record)  # a signal now waits for the work in hand
                waiting = True
                if stopped_by:  # stopped during the work: not acked, it comes again
                    break
                acked = claim.ack(delivery)
                waiting = False
                line = {"sort_key": delivery.sort_key, "acked": acked}
                record = {"execution_id": delivery.record["execution_id"]}
                print(json.dumps(line | record), flush=True)
        except Stopped:
            pass
    name = signal.Signals(stopped_by[0]).name
    print(f"worker: stopped by {name}", file=sys.stderr, flush=True)
    return 128 + stopped_by[0]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default="127.0.0.1:9101", help="the command claim face")
    parser.add_argument("--filter", default="commands.shared.>", help="the pool's subjects")
    args = parser.parse_args()
    try:
        sys.exit(main(args.addr, args.filter))
    except ClientError as error:
        sys.exit(f"worker: {error}")
