"""A NoETL-shaped workload for as long as asked, to size a writer by.

    python benchmarks/workload.py --minutes 1            # about a minute and a half
    python benchmarks/workload.py --minutes 10 --rate 40
    python benchmarks/workload.py --minutes 2 --faults   # the writer SIGKILLed twice too

The same scenario as the system test (harness/deployment.py), stretched: two servers
publish commands in bursts with idle gaps (2.5 s) to both pools at about --rate commands
a second; workers in v1 and v2 wait for them, run them, append their events to the tier
and publish them to the event bus, then ack (some nack, some run past ack_wait with
extends, two are SIGKILLed and replaced); five event groups and a subscriber consume
every event; probes hit /readyz and /healthz every 0.2 s. Prints goodput, the writer's
CPU (in all, and a command), the latency from publish to claim and from claim to ack
(p50/p99), redeliveries, sheds, probe latency and the writer's RSS, then every guarantee
the run broke (none expected).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.deployment import GAP, figures, run, violations


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--rate", type=float, default=20.0, help="commands a second, about")
    parser.add_argument(
        "--workers", type=int, default=3, help="workers of each of the 5 kinds (default 3: 15)"
    )
    parser.add_argument("--faults", action="store_true", help="SIGKILL the writer twice")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory")
    args = parser.parse_args()
    cycle = GAP + 0.5  # a burst and its gap, about
    bursts = max(2, math.ceil(args.minutes * 60 / cycle))
    burst = max(1, round(args.rate * cycle / 2))  # two servers
    root = Path(tempfile.mkdtemp(prefix="cmdbus-workload-"))
    print(f"machine: {os.cpu_count()} CPUs; python {sys.version.split()[0]}; run in {root}")
    outcome = run(
        root,
        faults=args.faults,
        bursts=bursts,
        burst=burst,
        workers=args.workers,
        log=lambda line: print(line, flush=True),
    )
    result = figures(outcome)
    print(
        f"{result['commands']} commands and {result['events']} events in {result['seconds']} s:"
        f" goodput {result['goodput_commands_per_s']} commands/s"
    )
    since = " since its last start" if args.faults else ""
    cpu = result["writer_cpu_s"]
    print(
        f"  writer CPU{since}: {cpu:.1f} s, {cpu / result['seconds']:.2f} cores over the run,"
        f" {cpu / max(result['commands'], 1) * 1000:.1f} ms a command (with its two events)"
    )
    for name in ("publish_to_claim_ms", "claim_to_ack_ms", "probe_ms"):
        print(f"  {name:22} p50 {result[name]['p50']:8.1f}  p99 {result[name]['p99']:8.1f}")
    print(
        f"  redeliveries {result['redeliveries']:.0f}, shed {result['shed']:.0f}, failed probes "
        f"{result['probes_failed']}, writer RSS {result['rss_mib']['min']}-"
        f"{result['rss_mib']['max']} MiB"
    )
    problems = violations(outcome)
    print(f"guarantees broken: {len(problems)}")
    for problem in problems[:40]:
        print(f"  {problem}")
    print(json.dumps(result))
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
