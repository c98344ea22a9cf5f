"""``cmdbus-trio client subscribe``: the event subscribe face from the shell, one line a
record, until ``--max`` records or ``--timeout`` seconds with none."""

from __future__ import annotations

import argparse
import queue
import threading
from collections.abc import Callable

from cmdbus_trio.client import blocking
from cmdbus_trio.client._calls import Batch

from ._output import Output, UsageError


def add_subscribe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--addr", help="subscribe face (default :9108)")
    parser.add_argument(
        "--filter", help="event subject filter, e.g. events.step_done (default: every event)"
    )
    parser.add_argument(
        "--after", type=int, default=0, help="records after this sort key (default 0: all kept)"
    )
    parser.add_argument("--max", type=int, help="stop after this many records")
    parser.add_argument("--timeout", type=float, help="stop after this many seconds with nothing")


def subscribe(
    args: argparse.Namespace,
    output: Output,
    connect: Callable[[], blocking.SubscribeClient],
) -> int:
    """History after ``--after``, then live records. The subscription streams in a thread
    of its own, so that this one can stop after ``--timeout`` seconds without a record
    (the stream has no end of its own: it waits for the next event)."""
    if args.max is not None and args.max < 1:
        raise UsageError(f"--max must be at least 1, got {args.max}")
    if args.timeout is not None and args.timeout < 0:
        raise UsageError(f"--timeout must be >= 0, got {args.timeout}")
    if args.after < 0:
        raise UsageError(f"--after must be >= 0, got {args.after}")
    received: queue.Queue[Batch | Exception | None] = queue.Queue(maxsize=16)
    with connect() as client:

        def stream() -> None:  # None: the writer ended the subscription
            try:
                for batch in client.subscribe(args.after, filter=args.filter):
                    received.put(batch)
                received.put(None)
            except Exception as error:  # raised again in the command's thread
                received.put(error)

        threading.Thread(target=stream, name="subscribe", daemon=True).start()
        printed = 0
        while args.max is None or printed < args.max:
            try:
                item = received.get(timeout=args.timeout)
            except queue.Empty:
                break
            if isinstance(item, Exception):
                raise item
            if item is None:
                break
            for record in item[: None if args.max is None else args.max - printed]:
                output.row(record)
                printed += 1
    return 0
