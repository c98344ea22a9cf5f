"""What a commit costs the event loop for each event group on the bus's tail (issue 38):
groups created ``from: tail`` that never consume, then commits of one event each; the
loop's time per commit with 0, 100 and 1,000 such groups, for this tree and a baseline
revision, side by side in the same run.

    python benchmarks/lagging_groups.py --baseline 61a7046
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GROUPS = (0, 100, 1000)
COMMITS = 20_000


def measure() -> dict[int, float]:
    """Microseconds of loop time per commit, by number of groups (best of 3)."""
    import trio

    from cmdbus_trio.bus.claims import Claims
    from cmdbus_trio.bus.tail import Tail
    from cmdbus_trio.storage.buslog import StoredRecord

    class NoLog:
        last_sort_key = 0

    async def one(groups: int) -> float:
        tail = Tail(NoLog(), limiter=trio.CapacityLimiter(1))  # type: ignore[arg-type]
        for n in range(groups):
            Claims(f"lagging{n}", ack_wait=30, tail=tail).attach(0, ())
        batches = [[StoredRecord(key, "events.e", "{}")] for key in range(1, COMMITS + 1)]
        began = time.perf_counter()
        for batch in batches:
            tail(batch)
        return (time.perf_counter() - began) / COMMITS * 1e6

    return {groups: min(trio.run(one, groups) for _ in range(3)) for groups in GROUPS}


def run_tree(src: Path | None) -> dict[int, float]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    command = [sys.executable, __file__, "--measure"]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return {int(k): v for k, v in json.loads(out).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a revision to measure beside this tree")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return
    rows = {"this tree": run_tree(None)}
    if args.baseline:
        with tempfile.TemporaryDirectory() as workdir:
            archive = subprocess.run(
                ["git", "-C", str(HERE.parent), "archive", args.baseline, "src"],
                check=True,
                capture_output=True,
            )
            subprocess.run(["tar", "-x", "-C", workdir], input=archive.stdout, check=True)
            rows[args.baseline] = run_tree(Path(workdir) / "src")
    print(f"loop time per commit of one event, us ({COMMITS:,} commits, best of 3)")
    print(f"{'groups from the tail, never consuming':40}" + "".join(f"{g:>10,}" for g in GROUPS))
    for name, figures in rows.items():
        print(f"{name:40}" + "".join(f"{figures[g]:10.2f}" for g in GROUPS))


if __name__ == "__main__":
    main()
