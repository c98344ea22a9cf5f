"""What one tier append costs in its worker thread, alone and beside a thread that holds
the GIL part of the time, as the event loop does while it serves.

    python benchmarks/lane_gil.py              # 3 s a row
    python benchmarks/lane_gil.py --seconds 0.2

Each row calls ``TierStore.append_batch`` (one record, its own transaction and fsync)
back to back for ``--seconds``, with ``sys.setswitchinterval`` at the
writer's default (1 ms). The competing thread spins in Python for a share of every
millisecond and sleeps the rest. The first row, alone, is the baseline of the same run:
what the rows below add is the append's statements waiting to retake the GIL.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

from cmdbus_trio.storage.tier import TIERS, NewRecord, TierStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _client import percentiles

DUTIES = (0.0, 0.5, 0.9)
"""Shares of each millisecond the competing thread holds the GIL (0: no such thread)."""


def spin(duty: float, stop: threading.Event) -> None:
    while not stop.is_set():
        began = time.perf_counter()
        while time.perf_counter() - began < 0.001 * duty:
            pass
        time.sleep(0.001 * (1 - duty))


def appends(store: TierStore, seconds: float) -> list[float]:
    tier = sorted(TIERS)[0]
    took: list[float] = []
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        start = time.perf_counter()
        record = NewRecord(json.dumps({"n": len(took)}))
        store.append_batch(tier, f"execution-{len(took) % 500}", [record])
        took.append(time.perf_counter() - start)
    return took


def beside(duty: float, store: TierStore, seconds: float) -> list[float]:
    """The appends' times, with a thread holding the GIL ``duty`` of the time beside."""
    stop = threading.Event()
    competitor = threading.Thread(target=spin, args=(duty, stop))
    if duty:
        competitor.start()
    try:
        return appends(store, seconds)
    finally:
        stop.set()
        if duty:
            competitor.join()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds a row")
    args = parser.parse_args()
    sys.setswitchinterval(0.001)
    print(f"{'GIL held beside':<16} {'appends/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'x alone':>8}")
    with tempfile.TemporaryDirectory(prefix="cmdbus-lane-") as directory:
        store = TierStore.open(Path(directory) / "tier.sqlite3")
        try:
            alone = 0.0
            for duty in DUTIES:
                took = beside(duty, store, args.seconds)
                ms = percentiles(took)
                alone = alone or ms["p50"]
                print(
                    f"{duty:<16.0%} {len(took) / args.seconds:>10.0f} {ms['p50']:>8.2f} "
                    f"{ms['p99']:>8.2f} {ms['p50'] / alone:>7.2f}x"
                )
        finally:
            store.close()


if __name__ == "__main__":
    main()
