"""The deployment of :mod:`deployment` with a standby (docs/ha.md): two members of one
shard, ``a`` and ``b``, each a ``cmdbus-trio serve`` on its own data directory and ports,
agreeing through a ``file:`` lease. The Python clients are given both members of each
face (``a,b``); NoETL's v1 workers, which know one address, go through :class:`Service`,
which forwards each new connection to the member that is primary then, as a Kubernetes
Service whose endpoints are the primary's.

The faults of :func:`deployment.run` become the pair's: a "writer killed" is the primary
SIGKILLed (the standby takes over once the lease expires) and started again (it follows
the new primary); a "rollout" is the primary sent SIGTERM (it hands the lease to its
standby and exits) and started again."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.deployment import FACES, Deployment, free_ports

LEASE_MS = 1000
"""Below every idle gap of the run, so bursts come before and after each takeover."""
MEMBERS = ("a", "b")
ASK_EVERY = 0.25
"""Seconds an answer to "which member is primary" is kept."""
V1_FACES = ("cmd_claim", "tier", "evt_ingest")


LITESTREAM = shutil.which("litestream") or str(Path(sys.executable).parent / "litestream")
STORES = ("commands", "events", "tier")


def litestream_config(data: Path, root: Path) -> str:
    """Litestream's configuration for a member whose stores are in ``data``: one replica
    for both members, ``root/replica``."""
    entry = "  - path: {data}/{store}.sqlite3\n"
    entry += "    replica: {{type: file, path: {root}/replica/{store}}}\n"
    stores = "".join(entry.format(data=data, root=root, store=s) for s in STORES)
    return "logging:\n  level: debug\ndbs:\n" + stores  # (why it snapshots: in its log)


def litestream_pids(root: Path) -> dict[int, str]:
    """The `litestream replicate` processes whose configuration is under ``root``: their
    pids, each with its configuration's folder's name (a member's home, as here)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # (gone meanwhile)
        if b"replicate" in words and b"-config" in words:
            config = Path(words[words.index(b"-config") + 1].decode())
            if config.is_relative_to(root):
                found[int(pid)] = config.parent.name
    return found


def ha(control: str) -> dict[str, Any] | None:
    """A member's ``GET /ha`` (None: it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://{control}/ha", timeout=1) as answer:
            document: dict[str, Any] = json.loads(answer.read())
            return document
    except (OSError, http.client.HTTPException):  # (IncompleteRead: killed mid-answer)
        return None


class Service:
    """One address per face; each connection made to it is forwarded to the member that
    is primary when it is made (none: it is closed at once, and the client connects
    again)."""

    def __init__(self, faces: tuple[str, ...], primary: Callable[[], str | None]) -> None:
        self._primary = primary
        self._listeners = {face: socket.create_server(("127.0.0.1", 0)) for face in faces}
        self.addresses = {
            face: f"127.0.0.1:{listener.getsockname()[1]}"
            for face, listener in self._listeners.items()
        }
        for face, listener in self._listeners.items():
            threading.Thread(target=self._accept, args=(face, listener), daemon=True).start()

    def _accept(self, face: str, listener: socket.socket) -> None:
        with contextlib.suppress(OSError):  # closed: the run is over
            while True:
                client, _ = listener.accept()
                threading.Thread(target=self._forward, args=(face, client), daemon=True).start()

    def _forward(self, face: str, client: socket.socket) -> None:
        primary = self._primary()
        try:
            if primary is None:
                raise OSError("no primary")
            ports = json.loads(Path(primary).read_text())
            host, port = ports[face].rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)), timeout=5)
            upstream.settimeout(None)
        except (OSError, ValueError, KeyError):
            client.close()
            return
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        _pipe(client, upstream)

    def close(self) -> None:
        for listener in self._listeners.values():
            listener.close()


def _kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL a member with its process group (its Litestream: a node lost whole)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(1 << 16):
            sink.sendall(data)
    for sock in (source, sink):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    source.close()


class PairDeployment(Deployment):
    def __init__(
        self, root: Path, *, env: dict[str, str] | None = None, litestream: bool = False
    ) -> None:
        """``litestream``: each member runs Litestream while it is primary, both to one
        replica, ``root/replica`` (docs/ha.md, "With Litestream")."""
        super().__init__(root, env=env)
        self._primary_seen: tuple[float, str | None] = (-ASK_EVERY, None)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.member_env: dict[str, dict[str, str]] = {}
        self.member_addresses: dict[str, dict[str, str]] = {}
        faces = (*FACES, "ha")
        ports = iter(free_ports(len(faces) * len(MEMBERS)))  # in one call: all distinct
        for name in MEMBERS:
            addresses = {face: f"127.0.0.1:{next(ports)}" for face in faces}
            home = root / name
            home.mkdir(parents=True, exist_ok=True)
            self.member_addresses[name] = addresses
            self.member_env[name] = {
                **self.env,
                **{f"CMDBUS_{face.upper()}_BIND": a for face, a in addresses.items()},
                "CMDBUS_DATA_DIR": str(home / "data"),
                "CMDBUS_PORTS_FILE": str(home / "ports.json"),
                "CMDBUS_HA_LEASE": f"file:{root / 'lease'}",
                "CMDBUS_HA_NAME": name,
                "CMDBUS_HA_LEASE_MS": str(LEASE_MS),
            }
            if litestream:
                (home / "litestream.yml").write_text(litestream_config(home / "data", root))
                replicate = f"{LITESTREAM} replicate -config {home}/litestream.yml"
                self.member_env[name] |= {
                    "CMDBUS_CHECKPOINTS": "litestream",
                    "CMDBUS_HA_WHILE_PRIMARY": replicate,
                }
        if litestream:
            threading.Thread(target=self._count_litestreams, daemon=True).start()
        self.service = Service(V1_FACES, self._primary_ports_file)
        self.addresses = {
            face: ",".join(self.member_addresses[name][face] for name in MEMBERS) for face in FACES
        }
        addresses = {**self.addresses, "v1": self.service.addresses}  # (actors.py reads it)
        (root / "addresses.json").write_text(json.dumps(addresses))

    def _count_litestreams(self) -> None:
        """Write to ``root/litestreams`` how many `litestream replicate` of the members run,
        each time it changes (sampled every 50 ms): one at most, ever."""
        seen = None
        while True:
            running = len(litestream_pids(self.root))
            if running != seen:
                with (self.root / "litestreams").open("a") as log:
                    log.write(f"{time.time():.3f} {running}\n")
                seen = running
            time.sleep(0.05)

    def primary(self, fresh: bool = True) -> str | None:
        """The member that says it is primary; not ``fresh``: as asked at most every
        :data:`ASK_EVERY` (v1 workers reconnecting in a burst through the Service would
        otherwise ask /ha as fast as a flood does, and be paced as one)."""
        asked_at, answer = self._primary_seen
        if not fresh and time.monotonic() - asked_at < ASK_EVERY:
            return answer
        answer = next(
            (
                name
                for name in MEMBERS
                if (said := ha(self.member_addresses[name]["control"])) is not None
                and said["role"] == "primary"
            ),
            None,
        )
        self._primary_seen = (time.monotonic(), answer)
        return answer

    def _primary_ports_file(self) -> str | None:
        name = self.primary(fresh=False)
        return None if name is None else str(self.root / name / "ports.json")

    def controls(self) -> list[str]:
        return [self.member_addresses[name]["control"] for name in MEMBERS]

    def control(self) -> str:
        return self.member_addresses[self.primary(fresh=False) or MEMBERS[0]]["control"]

    # --- the members ------------------------------------------------------------------

    def start_writer(self) -> float:
        """Start every member not running (the first to start takes the lease); returns
        once one is primary and the other is its standby in sync. Fails with none left
        running."""
        try:
            for name in MEMBERS:
                process = self.processes.get(name)
                if process is None or process.poll() is not None:
                    self._start(name)
                    self._until(lambda: self.primary() is not None, f"a primary after {name}")
            self._until(self._in_sync, "a standby in sync")
        except BaseException:
            for process in self.processes.values():
                _kill(process)
            raise
        return time.time()

    def _start(self, name: str) -> None:
        ports_file = self.root / name / "ports.json"
        ports_file.unlink(missing_ok=True)
        with (
            (self.root / f"writer-{name}.log").open("ab") as log,
            (self.root / f"stdout-{name}.log").open("ab") as stdout,  # (Litestream's log)
        ):
            process = subprocess.Popen(
                [sys.executable, "-m", "cmdbus_trio", "serve"],
                env=self.member_env[name],
                stdout=stdout,
                stderr=log,
                start_new_session=True,  # (its own process group: see kill_writer)
            )
        self.processes[name] = process
        self.writer = process  # the one whose RSS is sampled
        self._until(lambda: ports_file.exists() or process.poll() is not None, f"{name}")
        if process.poll() is not None:
            raise AssertionError(f"member {name} did not start:\n{self.writer_log()[-3000:]}")

    def _in_sync(self) -> bool:
        answers = [ha(control) for control in self.controls()]
        return all(a is not None and a["in_sync"] for a in answers)

    def _until(self, check: Callable[[], bool], what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.writer_log()[-3000:]}")
            time.sleep(ASK_EVERY)  # (as a person would ask, not a flood: see primary())

    def kill_writer(self) -> float:
        """SIGKILL the primary."""
        _kill(self.processes[self._the_primary()])
        return time.time()

    def stop_writer(self) -> int | None:
        """SIGTERM the primary, as a rollout does: it hands over to its standby and exits."""
        return self._terminate(self._the_primary())

    def _the_primary(self) -> str:
        """The primary, once there is one: a member whose lease write outlasted its lease
        (a loaded disk) has none for a moment, until it or its standby takes the lease."""
        self._until(lambda: self.primary() is not None, "a primary")
        name = self.primary(fresh=False)  # (the answer the wait ended on)
        assert name is not None
        return name

    def _terminate(self, name: str) -> int | None:
        process = self.processes[name]
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _kill(process)
            return None

    def stop(self) -> int | None:
        """Both members, the standby first (0: both exited 0)."""
        self.service.close()
        primary = self.primary()
        order = sorted(self.processes, key=lambda name: name == primary)
        codes = [self._terminate(name) for name in order if self.processes[name].poll() is None]
        return next((code for code in codes if code != 0), 0)

    def writer_log(self) -> str:
        return "".join(
            (self.root / f"writer-{name}.log").read_text(errors="replace")
            for name in MEMBERS
            if (self.root / f"writer-{name}.log").exists()
        )
