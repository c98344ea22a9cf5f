"""``cmdbus-trio import-tier --from HOST:PORT``: copy a running writer's tier history
(every record of every execution, in each tier) into this writer, over the wire.

The source is read through its tier face in NoETL's v1 dialect (``scan`` page by page),
so a NoETL writer or another cmdbus-trio writer (which speaks v1 too) can be the source.
Records are appended to the destination in each execution's order, each execution's
first record of a run with ``expected_version`` (its record count before it), the rest of
a run in one ``append_batch``. Before it appends to an execution, the importer reads how
many records of it the destination holds and skips that many: a rerun after a crash, a
kill or a lost connection resumes where the last one stopped and never stores a record
twice. Appends to executions of one page go out together (one group commit for many).

At the end, each execution's record count in the destination is checked against the
source's, and one line per tier says what was copied, what was already there, and what
does not match (exit 1 if anything does not).

Memory: a few integers per execution of the source (the resume position of each).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import attrs

from cmdbus_trio.client import (
    Busy,
    ClientError,
    Conflict,
    ConnectionLost,
    DeadlineExceeded,
    RetryPolicy,
    blocking,
)
from cmdbus_trio.client import _calls as calls
from cmdbus_trio.client._core import split_address
from cmdbus_trio.protocol import CLOSED, NEED_DATA, FrameDecoder, encode_frame
from cmdbus_trio.protocol.tier import TIERS

from ._addresses import STARTING_WAIT, default_address
from ._output import Output, add_output_arguments, fail, human_wanted
from .client import add_connection_arguments, connection_options

HELP = "copy a running writer's tier history into this writer (resumable)"
PAGE = 1000  # the tier face's largest page
ATTEMPTS = 8  # per request to either writer, against busy answers and lost connections
CALL_TIMEOUT = 60.0
MAX_BATCH = 10_000  # payloads in one append_batch
ENVELOPE = 512  # a request's bytes beyond its payloads (ids, tier, transaction id)


def _encoded(payload: str) -> int:
    """The bytes ``payload`` takes inside a request (a JSON string: escapes count)."""
    return len(json.dumps(payload, ensure_ascii=False).encode("utf-8", "surrogatepass"))


class SourceError(Exception):
    """The source writer answered with an error, or could not be read."""


class V1TierReader:
    """A blocking reader of a tier face in the v1 dialect: one JSON request per frame,
    the reply a JSON body or an error text (``busy … retry_after_ms=N`` is retried).

    Error handling: :class:`SourceError` after :data:`ATTEMPTS` lost connections or busy
    answers, or at once for any other error text."""

    def __init__(self, address: str, *, timeout: float = CALL_TIMEOUT) -> None:
        self.address = address
        self._host, self._port = split_address(address)  # ValueError: not HOST:PORT
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder(64 << 20)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def request(self, body: dict[str, Any]) -> dict[str, Any]:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                text = self._exchange(json.dumps(body).encode())
            except OSError as exc:
                self.close()
                if attempt == ATTEMPTS:
                    raise SourceError(f"{self.address}: {exc!r}") from None
                time.sleep(min(2.0, 0.05 * 2**attempt))
                continue
            if text.startswith(b"{"):
                reply: dict[str, Any] = json.loads(text)
                return reply
            words = text.decode("utf-8", "replace")
            if words.startswith("busy ") and attempt < ATTEMPTS:
                retry_after = words.rpartition("retry_after_ms=")[2]
                time.sleep(int(retry_after) / 1000 if retry_after.isdigit() else 0.1)
                continue
            raise SourceError(f"{self.address} answered {body.get('op')}: {words}")
        raise AssertionError("unreachable")

    def _exchange(self, frame: bytes) -> bytes:
        if self._sock is None:
            self._sock = socket.create_connection((self._host, self._port), self.timeout)
            self._decoder = FrameDecoder(64 << 20)
        self._sock.sendall(encode_frame(frame))
        while (reply := self._decoder.next_frame()) is NEED_DATA:
            self._decoder.receive_data(self._sock.recv(1 << 16))
        if reply is CLOSED or not isinstance(reply, bytes):
            raise ConnectionResetError("the source closed the connection")
        return reply

    def scan(self, tier: str, after: int, limit: int = PAGE) -> tuple[list[dict[str, Any]], int]:
        """Records after ``after`` (up to ``limit``), and the ``after`` of the next page
        (0: there is none)."""
        reply = self.request({"op": "scan", "tier": tier, "after": after, "limit": limit})
        records: list[dict[str, Any]] = reply.get("records", [])
        next_after = reply.get("next_after")
        if next_after is None and len(records) == limit:  # a source that does not page
            next_after = records[-1]["global_sequence"]
        return records, int(next_after or 0)

    def last_sequence(self, tier: str) -> int:
        """The tier's highest sequence (about its record count), found with one-record
        scans (a doubling, then a bisection): what the progress bar counts to."""
        low, high = 0, 1
        while self.scan(tier, high, limit=1)[0]:
            low, high = high, high * 2
        while high - low > 1:  # a record after low, none after high
            middle = (low + high) // 2
            low, high = (middle, high) if self.scan(tier, middle, limit=1)[0] else (low, middle)
        return high if self.scan(tier, low, limit=1)[0] else low


@attrs.define
class _Execution:
    seen: int = 0
    """Records of it the source has shown so far: the next one's index."""
    held: int | None = None
    """Records of it the destination holds (read once, then counted)."""
    mismatch: str = ""


@attrs.define
class _Run:
    """Consecutive records of one execution and transaction in one page."""

    execution_id: str
    transaction_id: str
    first: int
    """The source index of ``payloads[0]`` within its execution."""
    payloads: list[str]
    guarded: bool = False
    """Its first record went in with ``expected_version``: the rest may go in a batch."""


@attrs.define
class TierReport:
    tier: str
    source_records: int = 0
    executions: int = 0
    copied: int = 0
    already_there: int = 0
    mismatched: list[str] = attrs.field(factory=list)

    @property
    def matches(self) -> bool:
        return not self.mismatched


class Importer:
    """Copies one tier at a time from ``source`` into ``dest``."""

    def __init__(self, source: V1TierReader, dest: blocking.TierClient, progress: Progress) -> None:
        self.source = source
        self.dest = dest
        self.progress = progress

    def import_tier(self, tier: str) -> TierReport:
        report = TierReport(tier)
        executions: dict[str, _Execution] = {}
        self.progress.start(tier, self.source.last_sequence(tier))
        after = 0
        while True:
            records, after = self.source.scan(tier, after)
            self._copy_page(tier, records, executions, report)
            report.source_records += len(records)
            if records:
                self.progress.update(records[-1]["global_sequence"], report)
            if not after:
                break
        self.progress.done(report)
        report.executions = len(executions)
        self._verify(tier, executions, report)
        return report

    def _copy_page(
        self,
        tier: str,
        records: list[dict[str, Any]],
        executions: dict[str, _Execution],
        report: TierReport,
    ) -> None:
        runs: dict[str, list[_Run]] = {}
        for record in records:
            execution_id = str(record["execution_id"])
            execution = executions.setdefault(execution_id, _Execution())
            mine = runs.setdefault(execution_id, [])
            transaction = str(record.get("transaction_id") or "")
            if mine and mine[-1].transaction_id == transaction:
                mine[-1].payloads.append(record["payload"])
            else:
                mine.append(_Run(execution_id, transaction, execution.seen, [record["payload"]]))
            execution.seen += 1
        unread = [e for e in runs if executions[e].held is None]
        for execution_id, held in zip(unread, self._held(tier, unread), strict=True):
            executions[execution_id].held = held
        stalled = 0  # rounds in a row that stored nothing (busy, lost, conflicts)
        while pending := self._next_calls(tier, runs, executions, report):
            before = report.copied
            self._send(tier, pending, executions, report)
            stalled = 0 if report.copied > before else stalled + 1
            if stalled == ATTEMPTS:
                for execution_id in runs:
                    executions[execution_id].mismatch = "could not be appended: busy or lost"
                return

    def _next_calls(
        self,
        tier: str,
        runs: dict[str, list[_Run]],
        executions: dict[str, _Execution],
        report: TierReport,
    ) -> list[tuple[_Run, calls.Call[Any], int]]:
        """The next request for each execution with records to copy: the first record
        of a run guarded by ``expected_version``, then the rest of the run in one batch.
        Records the destination already holds are skipped."""
        out: list[tuple[_Run, calls.Call[Any], int]] = []
        for execution_id, mine in runs.items():
            execution = executions[execution_id]
            while mine and not execution.mismatch:
                run, held = mine[0], execution.held or 0
                if held >= run.first + len(run.payloads):  # copied before: skip it
                    report.already_there += len(run.payloads)
                    mine.pop(0)
                    continue
                if held < run.first:
                    execution.mismatch = f"the destination holds {held} records, fewer than copied"
                    break
                if held > run.first:  # partly there
                    report.already_there += held - run.first
                    del run.payloads[: held - run.first]
                    run.first, run.guarded = held, False
                transaction = run.transaction_id or None
                cap = self._request_cap()
                if _encoded(run.payloads[0]) + ENVELOPE > cap:
                    size = len(run.payloads[0])
                    execution.mismatch = (
                        f"a record of {size} bytes: over this writer's request cap ({cap} "
                        "bytes, CMDBUS_MAX_REQUEST_BYTES)"
                    )
                    break
                if run.guarded:
                    taken, size = 0, ENVELOPE
                    for payload in run.payloads[:MAX_BATCH]:  # within the request cap
                        size += _encoded(payload) + 8
                        if taken and size > cap:
                            break
                        taken += 1
                    batch = calls.append_batch(
                        execution_id, run.payloads[:taken], tier=tier, transaction_id=transaction
                    )
                    out.append((run, batch, taken))
                else:
                    guarded = calls.append(
                        execution_id, run.payloads[0], tier=tier,
                        transaction_id=transaction, expected_version=held,
                    )  # fmt: skip
                    out.append((run, guarded, 1))
                break
        for execution_id in [e for e, mine in runs.items() if not mine]:
            del runs[execution_id]
        return out

    def _send(
        self,
        tier: str,
        pending: Sequence[tuple[_Run, calls.Call[Any], int]],
        executions: dict[str, _Execution],
        report: TierReport,
    ) -> None:
        try:
            outcomes = self.dest.call_many([call for _, call, _ in pending], timeout=CALL_TIMEOUT)
        except (ConnectionLost, DeadlineExceeded):
            outcomes = [None] * len(pending)  # unknown: read what the destination holds
        stale = []
        for (run, _, sent), outcome in zip(pending, outcomes, strict=True):
            execution = executions[run.execution_id]
            if outcome is None or isinstance(outcome, Conflict | ConnectionLost):
                stale.append(run.execution_id)
                run.guarded = False
            elif isinstance(outcome, Busy):
                time.sleep((outcome.retry_after_ms or 100) / 1000)
            elif isinstance(outcome, ClientError):
                execution.mismatch = f"append refused: {outcome}"
            else:
                stored = outcome.appended if run.guarded else int(not outcome.deduplicated)
                execution.held = (execution.held or 0) + stored
                report.copied += stored
                del run.payloads[:sent]
                run.first += sent
                run.guarded = True
                if stored < sent:  # the destination had records of it already
                    execution.mismatch = (
                        f"{sent - stored} records were already there by event_id (written "
                        "to this writer directly?)"
                    )
        for execution_id, held in zip(stale, self._held(tier, stale), strict=True):
            executions[execution_id].held = held

    def _request_cap(self) -> int:
        """The destination's request cap, as its hello said (1 MiB until it has)."""
        hello = self.dest.server
        return hello.max_request_bytes if hello is not None else 1 << 20

    def _held(self, tier: str, execution_ids: list[str]) -> Iterator[int]:
        """Each execution's record count in the destination, read 100 at a time."""
        for start in range(0, len(execution_ids), 100):
            chunk = execution_ids[start : start + 100]
            reads = [calls.read_execution(e, tier=tier, limit=1) for e in chunk]
            for attempt in range(ATTEMPTS):
                try:
                    pages = self.dest.call_many(reads, timeout=CALL_TIMEOUT)
                except (ConnectionLost, DeadlineExceeded):
                    if attempt == ATTEMPTS - 1:
                        raise
                    time.sleep(0.1 * 2**attempt)
                    continue
                if not any(isinstance(page, ClientError) for page in pages):
                    break
                if attempt == ATTEMPTS - 1:
                    raise next(page for page in pages if isinstance(page, ClientError))
                time.sleep(0.1 * 2**attempt)
            yield from (int(getattr(page, "record_count", 0) or 0) for page in pages)

    def _verify(self, tier: str, executions: dict[str, _Execution], report: TierReport) -> None:
        names = list(executions)
        for execution_id, held in zip(names, self._held(tier, names), strict=True):
            execution = executions[execution_id]
            if execution.mismatch or held != execution.seen:
                why = execution.mismatch or f"{held} records here, {execution.seen} in the source"
                report.mismatched.append(f"{execution_id}: {why}")


class Progress:
    """A bar on a terminal; elsewhere a line at each tenth."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self._tier, self._total, self._shown, self._started = "", 1, -1, 0.0

    def start(self, tier: str, total: int) -> None:
        self._tier, self._total, self._shown = tier, max(1, total), -1
        self._started = time.monotonic()

    def update(self, sequence: int, report: TierReport) -> None:
        share = min(1.0, sequence / self._total)
        tenth = int(share * 10)
        if not self.tty and tenth == self._shown:
            return
        self._shown = tenth
        rate = report.copied / max(1e-3, time.monotonic() - self._started)
        bar = "#" * int(share * 30)
        line = (
            f"{self._tier} [{bar:<30}] {share:4.0%}  {report.source_records:,} records read, "
            f"{report.copied:,} copied ({rate:,.0f}/s)"
        )
        print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", file=self.stream)
        self.stream.flush()

    def done(self, report: TierReport) -> None:
        self._shown = -1
        self.update(self._total, report)
        if self.tty:
            print(file=self.stream)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--from", dest="source", required=True, metavar="HOST:PORT", help="the source tier face"
    )
    parser.add_argument("--to", help="this writer's tier face (default :9110, or the ports file's)")
    parser.add_argument(
        "--tier",
        action="append",
        choices=TIERS,
        help=f"a tier to copy (repeatable; default all: {', '.join(TIERS)})",
    )
    add_output_arguments(parser)
    add_connection_arguments(parser)


def run(args: argparse.Namespace) -> int:
    output = Output(human=human_wanted(args))
    try:
        source = V1TierReader(args.source)
    except ValueError as exc:  # --from is not HOST:PORT
        return fail("import-tier", f"--from: {exc}")
    try:
        address = args.to or default_address("tier", wait=STARTING_WAIT)
        retry = RetryPolicy(attempts=ATTEMPTS)
        with blocking.TierClient(address, retry=retry, **connection_options(args)) as dest:
            importer = Importer(source, dest, Progress(sys.stderr))
            reports = [importer.import_tier(tier) for tier in args.tier or TIERS]
    except (SourceError, ClientError, ValueError, OSError) as exc:
        return fail("import-tier", str(exc))
    finally:
        source.close()
    for report in reports:
        output.row(
            {
                "tier": report.tier,
                "source_records": report.source_records,
                "executions": report.executions,
                "copied": report.copied,
                "already_there": report.already_there,
                "matches": report.matches,
                "mismatched": report.mismatched[:20],
            }
        )
    output.close()
    return 0 if all(report.matches for report in reports) else 1
