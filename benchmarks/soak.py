"""Overload soak: offer 10x the measured capacity of the tier face for a long time.

    python benchmarks/soak.py                    # 60 s capacity probe + 10 min at 10x
    python benchmarks/soak.py --quick            # 3 s + 15 s (what CI runs)

1. Capacity: closed-loop appends, enough of them to fill the Gate, for --probe seconds;
   the best one-second goodput is the peak.
2. Overload: an open-loop generator (a separate process) starts --factor x peak appends
   per second whatever comes back, each with a 2 s deadline, for --duration seconds.
   Meanwhile this process probes /healthz every 50 ms on a new connection, as a kubelet
   would, and samples the writer's RSS.
3. Check: every acknowledged append is read back with its sequence.

Printed: peak, goodput under overload (ok/s, and its ratio to the peak: target >= 0.9;
and to the probe's mean, which does not swing with one fast second),
shed and deadline rates, /healthz p50/p99 (target: p99 <= 25 ms, the tier service
issue's), RSS at start and end, and appends lost (must be 0). The last line is the same
as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import trio

from cmdbus_trio.commands.spawn import spawn_writer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _client import Client, http_get, percentiles
from cmdbus_trio.client import RetryBudget, RetryPolicy
from cmdbus_trio.client.trio import TierClient
from cmdbus_trio.protocol import encode_frame

HERE = Path(__file__).resolve()
CONNECTIONS = 32
WINDOW = 256
"""Requests a load connection keeps unanswered at most, as a pipelining client would."""
DEADLINE = 2.0


def healthz(address: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address}/healthz", timeout=10) as response:
        document: dict[str, Any] = json.loads(response.read())
    return document


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


# --- the load generator (its own process) -----------------------------------------------


async def generate(
    address: str, rate: float, duration: float, closed_loop: int, prefix: str, connections: int
) -> dict[str, Any]:
    """Open loop (``rate`` appends per second, whatever comes back) or closed loop
    (``closed_loop`` requests kept in flight). Raw pipelined frames on ``connections``
    connections, no task per request: the generator must be cheaper than the server."""
    per_second: dict[int, int] = {}
    outcomes = {"ok": 0, "busy": 0, "deadline": 0, "error": 0, "unanswered": 0, "not_taken": 0}
    acknowledged: dict[str, list[tuple[int, str]]] = {}
    started = trio.current_time()
    end = started + duration
    sent = 0
    pending: list[dict[int, tuple[str, str]]] = [{} for _ in range(connections)]
    streams = [await Client.connect(address) for _ in range(connections)]
    in_flight = trio.Semaphore(closed_loop) if closed_loop else None

    def frame(connection: int, n: int) -> bytes:
        execution, payload = f"{prefix}-{n % 500}", json.dumps({"n": n})
        pending[connection][n] = (execution, payload)
        request = {"id": n, "op": "append", "deadline_ms": int(DEADLINE * 1000),
                   "execution_id": execution, "payload": payload}  # fmt: skip
        return encode_frame(json.dumps(request).encode())

    async def reader(connection: int) -> None:
        client = streams[connection]
        while True:
            try:
                reply = json.loads(await client.receive())
            except (EOFError, trio.ClosedResourceError, trio.BrokenResourceError):
                return
            execution, payload = pending[connection].pop(reply["id"])
            if in_flight is not None:
                in_flight.release()
            if reply["ok"]:
                outcomes["ok"] += 1
                second = int(trio.current_time() - started)
                per_second[second] = per_second.get(second, 0) + 1
                acknowledged.setdefault(execution, []).append((reply["global_sequence"], payload))
            else:
                code = reply["error"]["code"]
                outcomes[code if code in outcomes else "error"] += 1

    sending = [False] * connections

    async def send(connection: int, frames: list[bytes]) -> None:
        sending[connection] = True  # (the open loop sets it already, when it spawns this)
        try:
            await streams[connection].stream.send_all(b"".join(frames))
        finally:
            sending[connection] = False

    async with trio.open_nursery() as readers:
        for connection in range(connections):
            readers.start_soon(reader, connection)
        async with trio.open_nursery() as senders:
            while trio.current_time() < end:
                if in_flight is not None:
                    await in_flight.acquire()
                    await send(sent % connections, [frame(sent % connections, sent)])
                    sent += 1
                    continue
                due = int((trio.current_time() - started) * rate)
                batches: dict[int, list[bytes]] = {}
                while sent < due:
                    connection = sent % connections
                    if sending[connection] or len(pending[connection]) >= WINDOW:
                        # The writer is not reading this connection (backpressure), or
                        # the connection has a full window of requests unanswered: the
                        # arrival is offered and not taken. This keeps the generator's
                        # memory bounded, as an open loop must.
                        outcomes["not_taken"] += 1
                    else:
                        batches.setdefault(connection, []).append(frame(connection, sent))
                    sent += 1
                for connection, frames in batches.items():
                    # Marked busy now, not when the task first runs: under load this loop
                    # can come round again before it has, and a second send on the same
                    # stream is refused (BusyResourceError).
                    sending[connection] = True
                    senders.start_soon(send, connection, frames)
                await trio.sleep(0.005)
        with trio.move_on_after(30):  # the last replies
            while any(pending):  # noqa: ASYNC110 - the readers empty it; a poll is simplest
                await trio.sleep(0.05)
        readers.cancel_scope.cancel()
    outcomes["unanswered"] = sum(map(len, pending))
    for client in streams:
        await client.aclose()
    return {"outcomes": outcomes, "per_second": per_second, "acknowledged": acknowledged,
            "offered": sent}  # fmt: skip


def run_generator(
    address: str, rate: float, duration: float, closed_loop: int, prefix: str, connections: int
) -> dict[str, Any]:
    command = [
        sys.executable,
        str(HERE),
        "--worker",
        address,
        str(rate),
        str(duration),
        str(closed_loop),
        prefix,
        str(connections),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=duration + 300)
    if result.returncode != 0:
        raise SystemExit(f"load generator failed: {result.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(result.stdout)
    return report


# --- the run ---------------------------------------------------------------------------------


async def probe(control: str, until: float, samples: list[float], failures: list[str]) -> None:
    while time.monotonic() < until:
        begin = time.perf_counter()
        try:
            with trio.fail_after(5):
                status = await http_get(control, "/healthz")
            if status != 200:
                failures.append(f"HTTP {status}")
        except (OSError, trio.TooSlowError) as exc:
            failures.append(repr(exc))
        samples.append(time.perf_counter() - begin)
        await trio.sleep(0.05)


async def overload(
    ports: dict[str, str], pid: int, rate: float, duration: float, connections: int
) -> dict[str, Any]:
    samples: list[float] = []
    failures: list[str] = []
    rss: list[float] = [rss_mib(pid)]
    result: dict[str, Any] = {}

    async def load() -> None:
        result.update(
            await trio.to_thread.run_sync(
                run_generator, ports["tier"], rate, duration, 0, "soak", connections
            )
        )

    async def sample_rss() -> None:
        while not result:
            await trio.sleep(1)
            rss.append(rss_mib(pid))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(load)
        nursery.start_soon(sample_rss)
        await probe(ports["control"], time.monotonic() + duration, samples, failures)
    result["healthz"] = percentiles(samples)
    result["healthz_failures"] = failures
    result["rss"] = rss
    return result


def verify(address: str, acknowledged: dict[str, list[list[Any]]]) -> int:
    async def check() -> int:
        lost = 0
        retry = RetryPolicy(attempts=50, max_delay=1.0, budget=RetryBudget(initial=10_000))
        async with await TierClient.connect(address, retry=retry) as tier:
            for execution, appends in acknowledged.items():
                stored = {
                    r.global_sequence: r.payload async for r in tier.read_all(execution, timeout=30)
                }
                lost += sum(1 for seq, payload in appends if stored.get(seq) != payload)
        return lost

    return trio.run(check)


def middle_seconds(per_second: dict[str, int], duration: float) -> list[int]:
    """Each whole second's count but the first and the last (a ramp and a cut-off), or
    every whole second of a run too short to leave any."""
    whole = int(duration)
    middle = range(1, whole - 1) if whole >= 3 else range(whole)
    return [per_second.get(str(second), 0) for second in middle]


def mean(seconds: list[int]) -> float:
    return sum(seconds) / max(1, len(seconds))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--probe", type=float, default=60.0, help="seconds measuring capacity")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of overload")
    parser.add_argument("--factor", type=float, default=10.0, help="offered load / capacity")
    parser.add_argument("--quick", action="store_true", help="3 s probe, 15 s overload")
    parser.add_argument("--connections", type=int, default=CONNECTIONS, help="load connections")
    args = parser.parse_args()
    if args.quick:
        args.probe, args.duration = 3.0, 15.0
    workdir = Path(tempfile.mkdtemp(prefix="cmdbus-soak-"))
    process, ports = spawn_writer(workdir, ("tier",))
    try:
        inflight = healthz(ports["control"])["gates"]["tier"]["capacity"]
        workers = max(4, 4 * int(inflight))
        closed = run_generator(ports["tier"], 0, args.probe, workers, "probe", args.connections)
        per_second = closed["per_second"]
        whole = [int(s) for s in per_second if int(s) < int(args.probe)]
        peak = max((per_second[str(s)] for s in whole), default=0)
        if peak == 0:
            raise SystemExit("the capacity probe completed nothing")
        probe_mean = mean(middle_seconds(per_second, args.probe))
        rate = args.factor * peak
        print(f"machine: {os.cpu_count()} CPUs; python {sys.version.split()[0]}")
        print(
            f"capacity: peak {peak} appends/s, mean {probe_mean:.0f}/s over {args.probe:.0f} s "
            f"({closed['outcomes']})"
        )
        print(
            f"overload: offering {rate:.0f}/s ({args.factor:g}x) for {args.duration:.0f} s ...",
            flush=True,
        )
        result = trio.run(overload, ports, process.pid, rate, args.duration, args.connections)
        lost = verify(ports["tier"], result["acknowledged"]) + verify(
            ports["tier"], closed["acknowledged"]
        )
        sheds = healthz(ports["control"])["gates"]["tier"]["shed_total"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    outcomes = result["outcomes"]
    seconds = middle_seconds(result["per_second"], args.duration)
    goodput = mean(seconds)
    summary = {
        "peak_per_s": peak,
        "offered_per_s": round(result["offered"] / args.duration, 1),
        "goodput_per_s": round(goodput, 1),
        "goodput_ratio": round(goodput / peak, 3),
        "probe_mean_per_s": round(probe_mean, 1),
        "goodput_ratio_to_mean": round(goodput / probe_mean, 3) if probe_mean else None,
        "worst_second_ratio": round(min(seconds, default=0) / peak, 3),
        "busy_per_s": round(outcomes["busy"] / args.duration, 1),
        "deadline_per_s": round(outcomes["deadline"] / args.duration, 1),
        "errors": outcomes["error"],
        "unanswered": outcomes["unanswered"],
        "sheds_by_reason": sheds,
        "not_taken_per_s": round(outcomes["not_taken"] / args.duration, 1),
        "healthz_p50_ms": round(result["healthz"]["p50"], 2),
        "healthz_p99_ms": round(result["healthz"]["p99"], 2),
        "healthz_failures": len(result["healthz_failures"]),
        "rss_start_mib": round(result["rss"][0], 1),
        "rss_end_mib": round(result["rss"][-1], 1),
        "rss_max_mib": round(max(result["rss"]), 1),
        "acknowledged": outcomes["ok"] + closed["outcomes"]["ok"],
        "lost": lost,
    }
    print(
        f"goodput {summary['goodput_per_s']}/s = {summary['goodput_ratio']:.2f} x peak "
        f"(target >= 0.90; worst second {summary['worst_second_ratio']:.2f}), "
        f"{summary['goodput_ratio_to_mean']} x the probe's mean; "
        f"shed {summary['busy_per_s']}/s, deadline {summary['deadline_per_s']}/s, "
        f"held back in the socket {summary['not_taken_per_s']}/s, errors {summary['errors']}"
    )
    print(
        f"/healthz p50 {summary['healthz_p50_ms']} ms, p99 {summary['healthz_p99_ms']} ms "
        f"(target p99 <= 25 ms), {summary['healthz_failures']} failed"
    )
    print(
        f"RSS {summary['rss_start_mib']} -> {summary['rss_end_mib']} MiB "
        f"(max {summary['rss_max_mib']})"
    )
    print(f"acknowledged appends {summary['acknowledged']}, lost {summary['lost']}")
    print(json.dumps(summary))


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--worker":
        _, _, address, rate, duration, closed_loop, prefix, connections = sys.argv
        report = trio.run(
            generate,
            address,
            float(rate),
            float(duration),
            int(closed_loop),
            prefix,
            int(connections),
        )
        print(json.dumps(report))
    else:
        main()
