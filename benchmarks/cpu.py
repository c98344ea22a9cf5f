"""What a record costs the writer, at the rates users run: CPU by thread, the event loop's
turns and steps, thread hops and syscalls, per record end to end.

    python benchmarks/cpu.py                              # 100, 500, 1000/s and saturation
    python benchmarks/cpu.py --rates 500 --duration 10    # one rate
    python benchmarks/cpu.py --rates 500 --baseline REV   # this tree beside revision REV
    python benchmarks/cpu.py --floor                      # the floor servers beside
    python benchmarks/cpu.py --rates 500 --consumers 200  # most consumers parked

Each rate is `bus.py --rate`'s steady workload (16 producers publishing the rate between
them, one record a request, 16 consumers claiming and acking one at a time) on a fresh
writer, run twice: first for CPU and syscalls (nothing added to the writer), then with
the loop census on (``POST /debug/loop-census``: a trio instrument with a hook on every
task step, so its window's CPU is not the one reported). "sat" is the same workload
with producers publishing as fast as they are answered.

Per record (a publish, a delivery and an ack), it prints:

- CPU in microseconds: the loop thread, the commit thread (the bus's group committer,
  whose thread also reads bodies when a consumer's body is no longer in memory), and the
  others; from ``/proc/PID/task/TID/stat`` over the window;
- loop turns, by what ended the wait before each: ``ready`` (a task was runnable, the
  loop did not sleep), ``timer`` (a deadline expired) and ``woken`` (bytes arrived, or
  a thread's result through trio's wakeup socket);
- task steps, and the three tasks with the most;
- thread hops (the census counts the offload helper's calls) and run_sync_soon callbacks run on the
  loop (a worker thread writes trio's wakeup socket for each);
- syscalls (``perf stat -e raw_syscalls:sys_enter --per-thread``, where perf and its
  tracepoints are there), of the loop thread and of the others, with the loop's
  ``epoll_wait`` calls and the commit thread's ``fdatasync`` calls.

``--floor`` adds the same rows for `floor_server.py` in memory, durable ("floor+disk")
and durable handing a record to ``next`` only once it is on disk ("floor+strict"),
without the census (they have no hook; their worker thread counts as "other").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bus

SATURATION = 1_000_000.0
"""Records a second asked for the saturating run: more than any writer answers, so each
producer publishes as soon as its last publish is answered."""
THREAD_KINDS = ("loop", "commit", "other")
PERF_EVENTS = (
    "raw_syscalls:sys_enter",
    "syscalls:sys_enter_epoll_wait",
    "syscalls:sys_enter_fdatasync",
    "syscalls:sys_enter_sendto",
)


def thread_kind(pid: int, tid: int, name: str) -> str:
    """The loop is the main thread; a worker thread is named after the job it runs
    while it runs it (``commit:commands``), and ``Trio thread N`` between jobs."""
    if tid == pid:
        return "loop"
    if name.startswith("commit:"):
        return "commit"
    return "other"


def watch_names(pid: int, until: float) -> dict[int, str]:
    """Each thread's name while it ran a job, sampled every 20 ms until ``until``: the
    last one seen that is not trio's name for an idle thread."""
    names: dict[int, str] = {}
    while time.monotonic() < until:
        for tid, (name, _) in thread_times(pid).items():
            if not name.startswith("Trio thread"):
                names[tid] = name
        time.sleep(0.02)
    return names


def thread_times(pid: int) -> dict[int, tuple[str, float]]:
    """(name, utime + stime seconds) of each thread of ``pid``."""
    ticks = os.sysconf("SC_CLK_TCK")
    threads = {}
    for entry in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{entry}/stat").read_text()
            name = Path(f"/proc/{pid}/task/{entry}/comm").read_text().strip()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        threads[int(entry)] = (name, (int(fields[11]) + int(fields[12])) / ticks)
    return threads


def perf_available() -> bool:
    if shutil.which("perf") is None:
        return False
    probe = subprocess.run(
        ["perf", "stat", "-x,", "-e", PERF_EVENTS[0], "true"], capture_output=True, text=True
    )
    return probe.returncode == 0 and "not supported" not in probe.stderr


def perf_counts(pid: int, seconds: float) -> subprocess.Popen[str]:
    command = ["perf", "stat", "-x,", "--per-thread", "-p", str(pid)]
    for name in PERF_EVENTS:
        command += ["-e", name]
    return subprocess.Popen(
        [*command, "--", "sleep", str(seconds)], stderr=subprocess.PIPE, text=True
    )


def parse_perf(text: str, pid: int, names: dict[int, str]) -> dict[str, dict[str, float]]:
    """{event: {thread kind: count}} from ``perf stat -x, --per-thread`` output."""
    counts: dict[str, dict[str, float]] = {
        event: dict.fromkeys(THREAD_KINDS, 0.0) for event in PERF_EVENTS
    }
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) < 4 or fields[3] not in counts or not fields[1].isdigit():
            continue
        name, _, tid = fields[0].rpartition("-")
        kind = thread_kind(pid, int(tid), names.get(int(tid), name))
        counts[fields[3]][kind] += int(fields[1])
    return counts


def census(control: str, *, stop: bool = False) -> dict[str, Any] | None:
    request = urllib.request.Request(
        f"http://{control}/debug/loop-census?stop={int(stop)}", method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())["census"]  # type: ignore[no-any-return]
    except urllib.error.HTTPError:  # a revision without the hook
        return None


CONSUMERS = 16
"""Consumers claiming and acking (``--consumers``): with more of them than records come,
most are parked in ``next`` at any moment, which must cost a record nothing."""


def workload(rate: float) -> list[tuple[str, int, float]]:
    return [("produce", 16, rate / 16), ("consume", CONSUMERS, 1)]


Workers = list[tuple[bool, subprocess.Popen[str]]]
"""The load generators, each with whether it consumes (its records are the ones counted)."""


def start_workload(server: bus.Server, rate: float, duration: float) -> tuple[float, Workers]:
    """The steady workload's generators, started; returns once they begin (their window
    starts) and when that was."""
    start_at = time.monotonic() + 2.0  # the generators have connected by then
    workers = [
        (kind == "consume", worker)
        for kind, clients, count in workload(rate)
        for worker in bus.generators(
            "cmdbus-trio", server.address, kind, clients, count, start_at, duration
        )
    ]
    time.sleep(max(0.0, start_at - time.monotonic()))
    return start_at, workers


def finish_workload(workers: Workers, duration: float) -> tuple[int, list[float]]:
    """The records delivered, and their latencies from publish to delivery (seconds)."""
    records, latencies = 0, []
    for consumes, worker in workers:
        result = json.loads(worker.communicate(timeout=duration + 120)[0])
        if consumes:
            records += result["ops"]
            latencies += result["latencies"]
    return records, latencies


def cpu_window(server: bus.Server, rate: float, duration: float, perf: bool) -> dict[str, Any]:
    """The workload once: CPU by thread kind and syscalls over its window."""
    pid = server.process.pid
    start_at, workers = start_workload(server, rate, duration)
    before = thread_times(pid)
    counter = perf_counts(pid, duration) if perf else None
    names = watch_names(pid, start_at + duration)
    after = thread_times(pid)
    records, latencies = finish_workload(workers, duration)
    cpu = dict.fromkeys(THREAD_KINDS, 0.0)
    for tid, (name, seconds) in after.items():
        kind = thread_kind(pid, tid, names.get(tid, name))
        cpu[kind] += seconds - before.get(tid, (name, 0.0))[1]
    syscalls = parse_perf(counter.communicate()[1], pid, names) if counter is not None else None
    return {
        "records": records,
        "rate": records / duration,
        "cores": sum(cpu.values()) / duration,
        "cpu": cpu,
        "syscalls": syscalls,
        "latency": bus.percentiles(latencies),
    }


def census_window(server: bus.Server, rate: float, duration: float) -> dict[str, Any] | None:
    """The workload again, with the loop census on over exactly its window."""
    start_at, workers = start_workload(server, rate, duration)
    census(server.control or "")
    time.sleep(max(0.0, start_at + duration - time.monotonic()))
    counted = census(server.control or "", stop=True)
    records, _ = finish_workload(workers, duration)
    if counted is not None:
        counted["records"] = records
    return counted


def measure(
    name: str,
    start: Callable[[Path], tuple[subprocess.Popen[bytes], str]],
    rates: list[float],
    duration: float,
    perf: bool,
    workdir: Path,
) -> dict[float, dict[str, Any]]:
    """Each rate on a fresh server from ``start``: CPU and syscalls, then the census
    where the server has a control face (the writer; a floor has none, and its worker
    thread counts as "other")."""
    rows = {}
    for rate in rates:
        process, address = start(Path(tempfile.mkdtemp(dir=workdir)))
        server = bus.Server(name, process, address, json.loads(address).get("control"))
        try:
            cpu = cpu_window(server, rate, duration, perf)
            counted = census_window(server, rate, duration) if server.control else None
        finally:
            bus.stop(process)
        rows[rate] = {"cpu": cpu, "census": counted}
        print(f"  {name} at {label(rate)}: {cpu['rate']:.0f} records/s", flush=True)
    return rows


def label(rate: float) -> str:
    return "sat" if rate >= SATURATION else f"{rate:.0f}/s"


def report(results: dict[str, dict[float, dict[str, Any]]]) -> None:
    print(
        "\nPer record end to end (a publish, a delivery, an ack). CPU in us: loop thread, "
        "commit thread, others, all; turns by what ended the loop's wait; task steps; "
        "thread hops; run_sync_soon callbacks; syscalls of the loop thread and of the others "
        "(loop epoll_waits, fdatasyncs).\n"
    )
    header = (
        f"{'server':<22}{'rate':>6}{'rec/s':>7}{'p50/p99 ms':>12}{'loop':>6}{'commit':>7}"
        f"{'other':>6}{'all':>6}{'cores':>6}{'turns r/t/w':>17}{'steps':>7}{'hops':>6}{'rss':>5}"
        f"{'sys loop/oth':>14}{'epoll':>6}{'fsync':>6}  busiest tasks (steps/record)"
    )
    print(header)
    for name, rows in results.items():
        for rate, row in rows.items():
            cpu, counted = row["cpu"], row["census"]
            n = max(cpu["records"], 1)
            us = {kind: cpu["cpu"][kind] / n * 1e6 for kind in THREAD_KINDS}
            latency = cpu["latency"]
            line = (
                f"{name:<22}{label(rate):>6}{cpu['rate']:>7.0f}"
                f"{latency['p50']:>6.1f}/{latency['p99']:<5.1f}"
                f"{us['loop']:>6.0f}{us['commit']:>7.0f}{us['other']:>6.0f}{sum(us.values()):>6.0f}"
                f"{cpu['cores']:>6.2f}"
            )
            if counted is not None:
                m = max(counted["records"], 1)
                turns = counted["turns"]
                steps = counted["steps"]
                rss = steps.get("<TrioToken.run_sync_soon task>", 0) / m
                split = "/".join(f"{turns.get(k, 0) / m:.1f}" for k in ("ready", "timer", "woken"))
                hops = counted["thread_hops"] / m
                line += f"{split:>17}{sum(steps.values()) / m:>7.1f}{hops:>6.2f}{rss:>5.1f}"
            else:
                line += f"{'':>35}"
            if cpu["syscalls"] is not None:
                calls = cpu["syscalls"]
                total = calls["raw_syscalls:sys_enter"]
                others = total["commit"] + total["other"]
                line += f"{total['loop'] / n:>7.1f}/{others / n:<6.1f}"
                line += f"{calls['syscalls:sys_enter_epoll_wait']['loop'] / n:>6.1f}"
                fsyncs = sum(calls["syscalls:sys_enter_fdatasync"].values())
                line += f"{fsyncs / n:>6.2f}"
            if counted is not None:
                m = max(counted["records"], 1)
                busiest = sorted(counted["steps"].items(), key=lambda kv: -kv[1])[:3]
                line += "  " + ", ".join(
                    f"{task.rsplit('.', 1)[-1]} {k / m:.1f}" for task, k in busiest
                )
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rates",
        default="100,500,1000,sat",
        help="comma-separated records/s; 'sat' for saturation (default: %(default)s)",
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per window")
    parser.add_argument("--baseline", metavar="REV", help="also measure git revision REV")
    parser.add_argument("--floor", action="store_true", help="the floor servers beside")
    parser.add_argument(
        "--consumers", type=int, default=16, help="consumers claiming (default: %(default)s)"
    )
    args = parser.parse_args()
    global CONSUMERS  # a command-line setting, read by workload()
    CONSUMERS = args.consumers
    rates = [SATURATION if r.strip() == "sat" else float(r) for r in args.rates.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="cmdbus-cpu-"))
    perf = perf_available()
    print(
        f"machine: {os.cpu_count()} CPUs; python {sys.version.split()[0]}; perf: {perf}; "
        f"16 producers, {CONSUMERS} consumers"
    )
    os.environ["CMDBUS_DEBUG_HOOKS"] = "true"  # the writers' census hook (loopback only)
    starters: dict[str, Callable[[Path], tuple[subprocess.Popen[bytes], str]]] = {
        "cmdbus-trio": bus.start_cmdbus
    }
    if args.baseline:
        source = bus.export_revision(args.baseline, workdir)
        starters[f"cmdbus-trio@{args.baseline}"] = lambda where: bus.start_cmdbus(where, source)
    if args.floor:
        starters.update((kind, bus.STARTERS[kind]) for kind in bus.FLOORS)
    results = {
        name: measure(name, start, rates, args.duration, perf, workdir)
        for name, start in starters.items()
    }
    report(results)


if __name__ == "__main__":
    main()
