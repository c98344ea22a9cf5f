"""``cmdbus-trio bench``: drive a running writer (``--url``) or a fresh one on a temp dir
(``--spawn``) with a scenario, show a live progress line on stderr, print a final table,
and with ``--plot FILE.png`` draw latency and throughput over time (the ``plot`` extra).

Scenarios (``--concurrency`` workers each, one request at a time):

- ``publish``: durable command publishes.
- ``claim``: half the workers publish, half claim and ack.
- ``tier-append``: appends to many executions.
- ``tier-read``: reads of a 100-record execution.
- ``stall``: the incident at small scale: ``--events`` records (1 KB) in one execution,
  read page by page by every worker, plus appends; watch ``/healthz`` stay fast.
- ``mixed``: publish, claim+ack, tier append and tier read together.

``/healthz`` is probed every 100 ms on a new connection throughout, as a kubelet would:
its latency is the number that must stay low whatever the load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio

from cmdbus_trio.client import Busy, ClientError
from cmdbus_trio.client.trio import ClaimClient, IngestClient, TierClient

from ._addresses import add_control_url_arguments, default_control_url, server_of
from ._output import INTERRUPTED, Output, add_output_arguments, fail, human_wanted, leaves
from .client import add_connection_arguments, connection_options
from .spawn import SpawnError, spawn_writer

SCENARIOS = ("publish", "claim", "tier-append", "tier-read", "stall", "mixed")
PROBE_PERIOD = 0.1
CALL_TIMEOUT = 10.0


@attrs.define
class Recorder:
    """Latencies and outcomes per op and per second of the run."""

    started: float
    seconds: dict[int, dict[str, list[float]]] = attrs.field(
        factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    shed: dict[str, int] = attrs.field(factory=lambda: defaultdict(int))
    errors: dict[str, int] = attrs.field(factory=lambda: defaultdict(int))
    last_error: dict[str, str] = attrs.field(factory=dict)

    async def timed(self, op: str, work: Awaitable[Any]) -> Any:
        begin = time.perf_counter()
        try:
            result = await work
        except Busy:
            self.shed[op] += 1
            return None
        except ClientError as exc:
            self.errors[op] += 1
            self.last_error[op] = str(exc)
            return None
        now = time.perf_counter()
        self.seconds[int(now - self.started)][op].append(now - begin)
        return result

    def latencies(self, *ops: str, seconds: range | None = None) -> list[float]:
        keys = self.seconds if seconds is None else [s for s in seconds if s in self.seconds]
        return sorted(x for s in keys for op in ops for x in self.seconds[s].get(op, ()))

    def ops(self) -> list[str]:
        names = {op for by_op in self.seconds.values() for op in by_op}
        return sorted(names | set(self.shed) | set(self.errors))


def quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


# --- the writer under test ------------------------------------------------------------------


def _addresses(url: str, health: dict[str, Any]) -> dict[str, str]:
    """Data-face addresses from /healthz; a wildcard bind is reached at the URL's host."""
    host = urlsplit(url).hostname or "127.0.0.1"
    out = {}
    for face, state in health.get("faces", {}).items():
        address = state.get("address")
        if address and face != "control":
            bound, _, port = address.rpartition(":")
            out[face] = f"{host if bound in ('0.0.0.0', '[::]', '::') else bound}:{port}"
    return out


async def http_get(url: str) -> tuple[int, bytes]:
    """GET on a new connection, as a kubelet probe does: the status and body. HTTP/1.0,
    so the body is not chunked and ends with the connection. Raises :class:`OSError`."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            request = f"GET {parts.path or '/'} HTTP/1.0\r\nHost: {parts.netloc}\r\n\r\n"
            data = bytearray()
            try:
                await stream.send_all(request.encode())
                while chunk := await stream.receive_some(1 << 16):
                    data += chunk
            except trio.BrokenResourceError as exc:  # reset: not an OSError in trio
                raise ConnectionError(f"{url}: the connection broke: {exc!r}") from None
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    try:
        return int(head.split(b" ", 2)[1]), body
    except (IndexError, ValueError):
        raise OSError(f"{url}: not an HTTP response") from None


async def _health(url: str) -> dict[str, Any]:
    try:
        status, body = await http_get(url + "/healthz")
    except trio.TooSlowError:
        raise ClientError(f"{url}/healthz: no answer within 5 s") from None
    if status != 200:
        raise ClientError(f"{url}/healthz answered HTTP {status}")
    document: dict[str, Any] = json.loads(body)
    return document


# --- scenarios --------------------------------------------------------------------------------


def _record(n: int) -> dict[str, Any]:
    return {"execution_id": n, "payload": json.dumps({"n": n, "pad": "x" * 200})}


async def _run_scenario(
    name: str,
    faces: dict[str, str],
    recorder: Recorder,
    workers: int,
    duration: float,
    events: int,
    options: Mapping[str, Any],
) -> None:
    end = trio.current_time() + duration
    counter = iter(range(1, 1 << 62))

    async def loop(work: Callable[[], Awaitable[None]]) -> None:
        while trio.current_time() < end:
            await work()

    async def publisher(nursery: trio.Nursery) -> None:
        client = await IngestClient.connect(faces["cmd_ingest"], **options)
        nursery.start_soon(
            loop,
            lambda: recorder.timed(
                "publish", client.publish(_record(next(counter)), timeout=CALL_TIMEOUT)
            ),
        )

    async def consumer(nursery: trio.Nursery) -> None:
        client = await ClaimClient.connect(faces["cmd_claim"], **options)

        async def cycle() -> None:
            delivery = await recorder.timed(
                "next", client.next("commands.>", wait=0.5, timeout=CALL_TIMEOUT)
            )
            if delivery is not None:
                await recorder.timed("ack", client.ack(delivery.sort_key, timeout=CALL_TIMEOUT))

        nursery.start_soon(loop, cycle)

    async def appender(nursery: trio.Nursery) -> None:
        client = await TierClient.connect(faces["tier"], **options)
        nursery.start_soon(
            loop,
            lambda: recorder.timed(
                "append",
                client.append(
                    f"bench-{next(counter)}", '{"pad": "' + "x" * 200 + '"}', timeout=CALL_TIMEOUT
                ),
            ),
        )

    async def reader(nursery: trio.Nursery, execution: str, op: str) -> None:
        client = await TierClient.connect(faces["tier"], **options)

        async def read_all() -> None:
            after: int | None = None
            while trio.current_time() < end:
                page = await recorder.timed(
                    op, client.read_execution(execution, after=after, timeout=CALL_TIMEOUT)
                )
                if page is None or page.next_after is None:
                    return
                after = page.next_after

        nursery.start_soon(loop, read_all)

    async with trio.open_nursery() as nursery:
        if name in ("tier-read", "stall", "mixed"):
            size = events if name == "stall" else 100
            execution = f"bench-read-{os.getpid()}-{time.time_ns()}"
            await _preload(faces["tier"], execution, size, options)
        plan: Sequence[Callable[[trio.Nursery], Awaitable[None]]]
        if name == "publish":
            plan = [publisher] * workers
        elif name == "claim":
            plan = [publisher, consumer] * max(1, workers // 2)
        elif name == "tier-append":
            plan = [appender] * workers
        elif name == "tier-read":
            plan = [lambda n: reader(n, execution, "read")] * workers
        elif name == "stall":
            plan = [lambda n: reader(n, execution, "read_page")] * workers + [appender] * 2
        else:
            plan = [publisher, consumer, appender, lambda n: reader(n, execution, "read")] * max(
                1, workers // 4
            )
        for start in plan:
            await start(nursery)


async def _preload(address: str, execution: str, records: int, options: Mapping[str, Any]) -> None:
    payload = json.dumps({"event_type": "bench", "pad": "x" * 1000})
    async with await TierClient.connect(address, **options) as tier:
        assert tier.server is not None
        per_batch = max(1, min(10_000, tier.server.max_request_bytes // (len(payload) + 64)))
        for begin in range(0, records, per_batch):
            batch = [payload] * min(per_batch, records - begin)
            await tier.append_batch(execution, batch, timeout=60)


async def _probe(url: str, recorder: Recorder, end: float) -> None:
    while trio.current_time() < end:
        begin = time.perf_counter()
        try:
            await http_get(url + "/healthz")
        except (OSError, trio.TooSlowError):
            recorder.errors["healthz"] += 1
        else:
            now = time.perf_counter()
            recorder.seconds[int(now - recorder.started)]["healthz"].append(now - begin)
        await trio.sleep(PROBE_PERIOD)


async def _progress(recorder: Recorder, end: float, stream: Any) -> None:
    tty = stream.isatty()
    while trio.current_time() < end:
        await trio.sleep(1)
        second = int(time.perf_counter() - recorder.started) - 1
        work = [op for op in recorder.ops() if op != "healthz"]
        done = sum(len(recorder.seconds.get(second, {}).get(op, ())) for op in work)
        window = recorder.latencies(*work, seconds=range(second, second + 1))
        shed = sum(recorder.shed.values())
        total = shed + len(recorder.latencies(*work))
        health = recorder.latencies("healthz", seconds=range(max(0, second - 4), second + 1))
        line = (
            f"t={second + 1:>4}s  {done:>7}/s  p50 {quantile(window, 0.5) * 1000:7.2f} ms  "
            f"p99 {quantile(window, 0.99) * 1000:7.2f} ms  "
            f"shed {100 * shed / max(total, 1):5.1f}%  "
            f"healthz p99 {quantile(health, 0.99) * 1000:6.2f} ms"
        )
        print(("\r" if tty else "") + line, end="" if tty else "\n", file=stream, flush=True)
    if tty:
        print(file=stream)


def summary(recorder: Recorder, duration: float) -> list[dict[str, Any]]:
    rows = []
    for op in recorder.ops():
        ordered = recorder.latencies(op)
        attempts = len(ordered) + recorder.shed.get(op, 0) + recorder.errors.get(op, 0)
        rows.append(
            {
                "op": op,
                "ok": len(ordered),
                "rate_per_s": round(len(ordered) / duration, 1),
                "p50_ms": round(quantile(ordered, 0.5) * 1000, 3),
                "p99_ms": round(quantile(ordered, 0.99) * 1000, 3),
                "max_ms": round((ordered[-1] if ordered else math.nan) * 1000, 3),
                "shed_pct": round(100 * recorder.shed.get(op, 0) / max(attempts, 1), 2),
                "errors": recorder.errors.get(op, 0),
            }
        )
    return rows


def plot(recorder: Recorder, path: Path, title: str, duration: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds = sorted(s for s in recorder.seconds if s < int(duration))  # whole seconds only
    figure, (latency, throughput) = plt.subplots(2, 1, sharex=True, figsize=(10, 7))
    for op in recorder.ops():
        series = [sorted(recorder.seconds[s].get(op, ())) for s in seconds]
        latency.plot(seconds, [quantile(x, 0.99) * 1000 for x in series], label=f"{op} p99")
        if op != "healthz":
            throughput.plot(seconds, [len(x) for x in series], label=op)
    latency.set_ylabel("latency p99 (ms)")
    latency.set_yscale("log")
    latency.legend(loc="upper right")
    throughput.set_ylabel("completed / s")
    throughput.set_xlabel("seconds")
    throughput.legend(loc="upper right")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


async def bench(
    url: str,
    scenario: str,
    duration: float,
    workers: int,
    events: int,
    options: Mapping[str, Any] | None = None,
    recorder: Recorder | None = None,
) -> Recorder:
    """Run ``scenario`` against the writer at ``url``; what it measured goes into
    ``recorder`` (a new one if None), which the caller keeps if the run is
    interrupted."""
    faces = _addresses(url, await _health(url))
    needed = {"publish": ["cmd_ingest"], "claim": ["cmd_ingest", "cmd_claim"]}.get(
        scenario,
        ["tier"]
        if scenario.startswith("tier") or scenario == "stall"
        else ["cmd_ingest", "cmd_claim", "tier"],
    )
    if missing := [face for face in needed if face not in faces]:
        raise ClientError(
            f"scenario {scenario} needs the faces {', '.join(missing)}, which are off"
        )
    recorder = recorder or Recorder(time.perf_counter())
    recorder.started = time.perf_counter()
    end = trio.current_time() + duration
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_probe, url, recorder, end)
        nursery.start_soon(_progress, recorder, end, sys.stderr)
        await _run_scenario(scenario, faces, recorder, workers, duration, events, options or {})
    return recorder


HELP = "drive a writer with a scenario and report rates and latencies"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    add_control_url_arguments(parser, url_into=where)
    where.add_argument("--spawn", action="store_true", help="start a writer on a temp dir")
    parser.add_argument("--scenario", required=True, choices=SCENARIOS)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=16, help="workers")
    parser.add_argument("--events", type=int, default=20_000, help="stall: records to read")
    parser.add_argument("--plot", type=Path, help="write a PNG of latency and throughput")
    add_output_arguments(parser)
    add_connection_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if not args.duration > 0 or args.concurrency < 1 or args.events < 1:
        return fail("bench", "--duration must be > 0, --concurrency and --events >= 1")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return fail("bench", "--plot needs matplotlib: pip install 'cmdbus-trio[plot]'")
    process = None
    recorder: Recorder | None = None
    try:
        if args.spawn and args.server:
            raise ValueError("give --spawn or --server, not both")
        url = args.url or (
            "" if args.spawn else default_control_url(server=server_of(args), wait=0)
        )
    except ValueError as exc:
        return fail("bench", str(exc))
    try:
        if args.spawn:
            process, ports = spawn_writer(Path(tempfile.mkdtemp(prefix="cmdbus-bench-")))
            url = f"http://{ports['control']}"
        options = connection_options(args)
        recorder = Recorder(time.perf_counter())
        trio.run(
            bench,
            url,
            args.scenario,
            args.duration,
            args.concurrency,
            args.events,
            options,
            recorder,
        )
    except KeyboardInterrupt:
        return _interrupted(args, recorder)
    except (ClientError, SpawnError) as exc:
        return fail("bench", str(exc))
    except BaseExceptionGroup as group:
        if all(isinstance(leaf, KeyboardInterrupt) for leaf in leaves(group)):
            return _interrupted(args, recorder)
        errors, rest = group.split((ClientError, OSError))
        if errors is None or rest is not None:
            raise
        return fail("bench", "; ".join(sorted({str(e) for e in leaves(errors)})))
    except OSError as exc:
        return fail("bench", f"cannot reach {url}: {exc}")
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    _report(args, recorder, args.duration)
    if args.plot is not None:
        title = f"cmdbus-trio bench {args.scenario}, {args.concurrency} workers"
        plot(recorder, args.plot, title, args.duration)
    return 0


def _report(args: argparse.Namespace, recorder: Recorder, duration: float) -> None:
    output = Output(human=human_wanted(args))
    for row in summary(recorder, duration):
        output.row(row)
    output.close()


def _interrupted(args: argparse.Namespace, recorder: Recorder | None) -> int:
    """Ctrl-C: what was measured until then (its rates over the time it ran), then the
    interrupted line and status the command line gives."""
    if recorder is not None and recorder.ops():
        _report(args, recorder, max(time.perf_counter() - recorder.started, 1e-3))
    print("cmdbus-trio: interrupted", file=sys.stderr, flush=True)
    return INTERRUPTED
