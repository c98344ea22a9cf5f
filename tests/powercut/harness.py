"""Power cuts for the writer: a mixed load whose every request and reply is written down,
cut at a random moment by the shim (shim.c: SIGKILL, then the data directory as of its
last fsyncs), restarted on what the disk kept, and at the end everything read back and
sorted as Jepsen's queue checkers sort it:

- lost: acknowledged and absent (a publish, an event, a tier append), or an acknowledged
  ack whose record is delivered again;
- unexpected: stored, and nobody published it;
- duplicated: one publish (one ``msg_id``) stored as two records;
- recovered: never acknowledged (its reply was cut off), and stored: allowed;
- reused: one sort key acknowledged for two records, across cuts;
- forgotten: an acknowledged ``msg_id`` the writer no longer recognises (a repeat of it
  is stored again).

The shim is compiled here with the machine's C compiler (`cc`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs

from cmdbus_trio.client import ClientError
from cmdbus_trio.client.blocking import ClaimClient, IngestClient, TierClient
from cmdbus_trio.storage.buslog import BusLog

from ..helpers import serving

SHIM_SOURCE = Path(__file__).with_name("shim.c")
CLIENT = {"reconnect_for": 0}  # a cut is final for a cycle: no client waits it out
TIMEOUT = 5.0


def build_shim() -> Path:
    """The shim, compiled once per source (cached in the temp dir by its hash)."""
    source = SHIM_SOURCE.read_bytes()
    built = (
        Path(tempfile.gettempdir())
        / f"cmdbus-powercut-{hashlib.sha256(source).hexdigest()[:16]}.so"
    )
    if not built.exists():
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise FileNotFoundError("no C compiler (cc): .ci/run installs gcc")
        partial = built.with_suffix(f".{os.getpid()}")
        command = [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror"]
        subprocess.run(
            [*command, "-o", str(partial), str(SHIM_SOURCE), "-ldl", "-lpthread"], check=True
        )
        partial.rename(built)
    return built


def cut(data: Path, image: Path) -> list[str]:
    """Replace ``data`` by its durable image (the writer is dead): each name the directory
    held at its last fsync, with its file's content as of that file's last fsync (empty:
    never synced). The ``-shm`` files are SQLite's shared memory, not state. Returns what
    the shim saw bypass it (a shared writable mmap), which must be nothing."""
    names = [line.split(" ", 1) for line in (image / "names").read_text().splitlines()]
    violations = image / "violations"
    bypassed = violations.read_text().splitlines() if violations.exists() else []
    shutil.rmtree(data)
    data.mkdir()
    for inode, name in names:
        if name.endswith("-shm"):
            continue
        kept = image / "files" / inode
        if kept.exists():
            shutil.copyfile(kept, data / name)
        else:
            (data / name).touch()
    shutil.rmtree(image)
    return bypassed


@attrs.define
class Ledger:
    """Every request the clients made and what came of it, over every cut."""

    lock: threading.Lock = attrs.field(factory=threading.Lock)
    requests: int = 0
    sent: dict[str, set[str]] = attrs.field(factory=lambda: {"commands": set(), "events": set()})
    published: dict[str, dict[str, int]] = attrs.field(
        factory=lambda: {"commands": {}, "events": {}}
    )  # bus -> id -> the sort key its reply gave
    keys: dict[str, dict[int, str]] = attrs.field(factory=lambda: {"commands": {}, "events": {}})
    reused: list[str] = attrs.field(factory=list)
    acked: dict[str, set[int]] = attrs.field(factory=lambda: {"commands": set(), "events": set()})
    appends_sent: set[str] = attrs.field(factory=set)
    appended: dict[str, dict[int, str]] = attrs.field(factory=dict)  # execution -> seq -> id

    def publish(self, bus: str, record_id: str, sort_key: int) -> None:
        with self.lock:
            self.published[bus][record_id] = sort_key
            if self.keys[bus].setdefault(sort_key, record_id) != record_id:
                self.reused.append(f"{bus} {sort_key}: {self.keys[bus][sort_key]}, {record_id}")


Worker = Callable[[dict[str, str], Ledger, threading.Event, str], None]


def publisher(bus: str) -> Worker:
    face = "cmd_ingest" if bus == "commands" else "evt_ingest"

    def run(ports: dict[str, str], ledger: Ledger, stop: threading.Event, name: str) -> None:
        with IngestClient(ports[face], **CLIENT) as ingest:
            for n in range(1, 1_000_000):
                if stop.is_set():
                    return
                record_id = f"{name}-{n}"
                with ledger.lock:
                    ledger.requests += 1
                    ledger.sent[bus].add(record_id)
                record = {"execution_id": n, "payload": json.dumps({"id": record_id})}
                published = ingest.publish(record, msg_id=record_id, timeout=TIMEOUT)
                ledger.publish(bus, record_id, published.sort_key)

    return run


def appender(ports: dict[str, str], ledger: Ledger, stop: threading.Event, name: str) -> None:
    with TierClient(ports["tier"], **CLIENT) as tier:
        for n in range(1, 1_000_000):
            if stop.is_set():
                return
            execution, record_id = f"{name}-{n % 5}", f"{name}-{n}"
            with ledger.lock:
                ledger.requests += 1
                ledger.appends_sent.add(record_id)
            payload = json.dumps({"event_id": record_id})
            appended = tier.append(execution, payload, timeout=TIMEOUT)
            with ledger.lock:
                ledger.appended.setdefault(execution, {})[appended.global_sequence] = record_id


def claimer(bus: str) -> Worker:
    face, group = ("cmd_claim", None) if bus == "commands" else ("evt_claim", "checker")

    def run(ports: dict[str, str], ledger: Ledger, stop: threading.Event, name: str) -> None:
        with ClaimClient(ports[face], **CLIENT) as claim:
            while not stop.is_set():
                taken = claim.next_batch(
                    ">", 20, wait=0.2, group=group, start="beginning" if group else None,
                    timeout=TIMEOUT,
                )  # fmt: skip
                keys = [d.sort_key for d in taken]
                with ledger.lock:
                    ledger.requests += 1
                held = claim.ack_many(keys, group=group, timeout=TIMEOUT) if keys else []
                with ledger.lock:
                    ledger.acked[bus].update(k for k, ok in zip(keys, held, strict=True) if ok)

    return run


LOAD: list[tuple[str, Worker]] = [
    ("c", publisher("commands")), ("e", publisher("events")), ("t", appender),
    ("cc", claimer("commands")), ("ec", claimer("events")),
]  # fmt: skip


@attrs.define
class Tally:
    mode: str
    cuts: int = 0
    requests: int = 0
    acknowledged: int = 0
    lost: int = 0
    acks_lost: int = 0
    unexpected: int = 0
    duplicated: int = 0
    recovered: int = 0
    reused: int = 0
    forgotten: int = 0
    bypassed: list[str] = attrs.field(factory=list)
    examples: list[str] = attrs.field(factory=list)

    def row(self) -> str:
        return (
            f"{self.mode:<14} {self.cuts:>5} {self.requests:>9} {self.acknowledged:>9} "
            f"{self.lost:>6} {self.acks_lost:>6} {self.duplicated:>6} {self.unexpected:>6} "
            f"{self.recovered:>6} {self.reused:>6} {self.forgotten:>6}"
        )

    HEADER = (
        f"{'mode':<14} {'cuts':>5} {'requests':>9} {'acked':>9} {'lost':>6} {'ackslost':>6} "
        f"{'dup':>6} {'unexp':>6} {'recov':>6} {'reused':>6} {'forgot':>6}"
    )

    @property
    def violations(self) -> int:
        return (
            self.lost + self.acks_lost + self.unexpected + self.duplicated + self.reused
            + self.forgotten
        )  # fmt: skip


def power_cuts(
    workdir: Path, shim: Path, mode: str, cuts: int, rng: random.Random, **settings: str
) -> Tally:
    """``cuts`` power cuts under load, then everything read back: the tally. ``mode`` is
    the row's name; ``settings`` are the writer's (CMDBUS_SYNC=normal), and
    ``POWERCUT_FAULT`` the shim's, armed once the writer has started."""
    ledger, tally = Ledger(), Tally(mode)
    data, image = workdir / "data", workdir / "image"
    data.mkdir(parents=True)
    for cycle in range(cuts):
        shimmed = {"LD_PRELOAD": str(shim), "POWERCUT_DIR": str(data), "POWERCUT_IMAGE": str(image)}
        with serving(workdir, **shimmed, **settings) as (process, ports):
            if "POWERCUT_FAULT" in settings:
                (image / "arm").touch()  # the writer started on a sound disk
            stop = threading.Event()
            threads = [
                threading.Thread(
                    target=_quietly, args=(work, ports, ledger, stop, f"{cycle}{name}")
                )
                for name, work in LOAD
            ]
            for thread in threads:
                thread.start()
            time.sleep(rng.uniform(0.5, 2.0))
            process.send_signal(signal.SIGKILL)
            process.wait()
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
        tally.bypassed += cut(data, image)
        tally.cuts += 1
    _check(workdir, ledger, tally, settings)
    return tally


def _quietly(work: Worker, *args: object) -> None:
    with contextlib.suppress(ClientError, OSError):  # the cut: what was in flight is unknown
        work(*args)  # type: ignore[arg-type]


def _stored(path: Path) -> Iterator[tuple[int, str]]:
    log = BusLog.open(path)
    try:
        after = 0
        while page := log.read_after(after, 5000):
            for record in page:
                yield record.sort_key, json.loads(json.loads(record.record)["payload"])["id"]
            after = page[-1].sort_key
    finally:
        log.close()


def _check(workdir: Path, ledger: Ledger, tally: Tally, settings: dict[str, str]) -> None:
    tally.requests = ledger.requests
    tally.acknowledged = (
        sum(map(len, ledger.published.values()))
        + sum(map(len, ledger.acked.values()))
        + sum(map(len, ledger.appended.values()))
    )
    tally.reused = len(ledger.reused)
    tally.examples += ledger.reused[:3]
    data = workdir / "data"
    for bus in ("commands", "events"):
        stored = (
            list(_stored(data / f"{bus}.sqlite3")) if (data / f"{bus}.sqlite3").exists() else []
        )
        counts = Counter(record_id for _, record_id in stored)
        where = {record_id: key for key, record_id in stored}
        for record_id, key in ledger.published[bus].items():
            if where.get(record_id) != key:
                tally.lost += 1
                tally.examples.append(f"lost {bus} {record_id} (acknowledged at {key})")
        tally.duplicated += sum(1 for n in counts.values() if n > 1)
        tally.unexpected += sum(1 for record_id in counts if record_id not in ledger.sent[bus])
        tally.recovered += sum(
            1 for record_id in counts if record_id in ledger.sent[bus]
            and record_id not in ledger.published[bus]
        )  # fmt: skip
    with serving(workdir, **settings) as (process, ports):
        for bus, face, group in (
            ("commands", "cmd_claim", None),
            ("events", "evt_claim", "checker"),
        ):
            with ClaimClient(ports[face], **CLIENT) as claim:
                while taken := claim.next_batch(
                    ">", 500, wait=0.5, group=group, start="beginning" if group else None,
                    timeout=30,
                ):  # fmt: skip
                    again = [d.sort_key for d in taken if d.sort_key in ledger.acked[bus]]
                    tally.acks_lost += len(again)
                    tally.examples += [f"acked {bus} record {k} delivered again" for k in again[:3]]
                    claim.ack_many([d.sort_key for d in taken], group=group, timeout=30)
        with TierClient(ports["tier"], **CLIENT) as tier:
            for execution, acknowledged in ledger.appended.items():
                stored_appends = {
                    r.global_sequence: json.loads(r.payload)["event_id"]
                    for r in tier.read_all(execution)
                }
                for sequence, record_id in acknowledged.items():
                    if stored_appends.get(sequence) != record_id:
                        tally.lost += 1
                        tally.examples.append(f"lost append {execution}@{sequence}")
                seen = Counter(stored_appends.values())
                tally.unexpected += sum(1 for r in seen if r not in ledger.appends_sent)
                tally.duplicated += sum(1 for n in seen.values() if n > 1)
        for bus, face in (("commands", "cmd_ingest"), ("events", "evt_ingest")):
            with IngestClient(ports[face], **CLIENT) as ingest:  # every acknowledged msg_id
                for record_id in ledger.published[bus]:
                    record = {"execution_id": 0, "payload": json.dumps({"id": record_id})}
                    again = ingest.publish(record, msg_id=record_id, timeout=30)
                    if not again.duplicate:
                        tally.forgotten += 1
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
