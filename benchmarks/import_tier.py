"""How long `cmdbus-trio import-tier` takes per GB of tier history, beside its floor.

Two writers on loopback (tier face only): the source is filled with ``--records``
records of ``--payload-bytes`` (NoETL-like events: execution ids interleaved ten records
at a time, a transaction id per seven), then, in the same run:

- floor: the source read alone, every page of ``scan`` in the v1 dialect (what the
  import cannot beat: it reads the same pages);
- import: ``cmdbus-trio import-tier --from source --to dest`` as a user runs it;
- resume: the same command again (everything already there: the cost of a rerun).

Prints seconds, MB/s and minutes per GB of payload for each.

    python3 benchmarks/import_tier.py                       # 100,000 records of 1 KB
    python3 benchmarks/import_tier.py --records 20000       # quicker
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cmdbus_trio.client import blocking
from cmdbus_trio.commands.import_tier import V1TierReader
from cmdbus_trio.commands.spawn import spawn_writer


def fill(address: str, records: int, payload_bytes: int, executions: int) -> int:
    """Append ``records`` interleaved records; returns the payload bytes written."""
    written = 0
    pad = "x" * max(0, payload_bytes - 60)
    with blocking.TierClient.connect(address) as tier:
        done, round_ = 0, 0
        while done < records:
            for n in range(executions):
                batch = []
                for i in range(min(10, records - done - len(batch))):
                    index = round_ * 10 + i
                    batch.append(json.dumps({"event_id": f"e{n}-{index}", "i": index, "pad": pad}))
                if not batch:
                    break
                tier.append_batch(f"exec-{n}", batch, transaction_id=f"tx-{round_}")
                written += sum(len(p) for p in batch)
                done += len(batch)
                if done >= records:
                    break
            round_ += 1
    return written


def read_all(address: str) -> float:
    reader = V1TierReader(address)
    started = time.perf_counter()
    after = 0
    while True:
        _, after = reader.scan("eventlog", after)
        if not after:
            break
    reader.close()
    return time.perf_counter() - started


def import_tier(source: str, dest: str) -> tuple[float, dict[str, object]]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "cmdbus_trio", "import-tier", "--from", source, "--to", dest,
         "--tier", "eventlog"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"import-tier failed: {done.stdout}{done.stderr}")
    report: dict[str, object] = json.loads(done.stdout.splitlines()[0])
    return seconds, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--payload-bytes", type=int, default=1024)
    parser.add_argument("--executions", type=int, default=200)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="cmdbus-import-bench-"))
    source_process, source_ports = spawn_writer(workdir / "source", ("tier",))
    dest_process, dest_ports = spawn_writer(workdir / "dest", ("tier",))
    try:
        print(f"filling the source: {args.records:,} records of ~{args.payload_bytes} B ...")
        payload = fill(source_ports["tier"], args.records, args.payload_bytes, args.executions)
        megabytes = payload / 1e6
        rows = [("floor: scan the source", read_all(source_ports["tier"]), None)]
        seconds, report = import_tier(source_ports["tier"], dest_ports["tier"])
        rows.append(("import-tier", seconds, report))
        seconds, report = import_tier(source_ports["tier"], dest_ports["tier"])
        rows.append(("import-tier again (resume)", seconds, report))
        print(f"\n{args.records:,} records, {megabytes:,.1f} MB of payload, "
              f"{args.executions} executions interleaved")  # fmt: skip
        print(f"{'run':<28} {'seconds':>8} {'MB/s':>7} {'min/GB':>7}  records/s")
        for name, took, result in rows:
            per_gb = took / megabytes * 1000 / 60
            print(
                f"{name:<28} {took:8.1f} {megabytes / took:7.1f} {per_gb:7.1f}"
                f"  {args.records / took:,.0f}" + (f"  {result}" if result else "")
            )
    finally:
        for process in (source_process, dest_process):
            process.terminate()
            process.wait()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
