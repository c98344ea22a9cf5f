"""A primary's power cut while its standby runs (docs/ha.md): two members, each under the
shim (harness.py) with its own data directory; the mixed load goes to the primary; at a
random moment the primary's power is cut (SIGKILL, then its directory as of its last
fsyncs), the standby takes over, and the cut member starts again on what its disk kept
and follows the new primary. Cut after cut, the members trade places; at the end the last
primary's stores are checked as a single writer's are: nothing acknowledged lost, no sort
key that named two records, no acknowledged ack undone.

The negative control: with ``CMDBUS_HA_SYNC=off`` the standby is stopped (SIGSTOP) while
the primary acknowledges alone, then the primary's power is cut and the standby resumed:
it takes over with what it had, and the checker must find acknowledged records lost."""

from __future__ import annotations

import random
import signal
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from ..ha.test_pair import ha, until
from ..helpers import serving
from .harness import LOAD, Ledger, Tally, _check, _quietly, cut

pytestmark = pytest.mark.slow

LEASE_MS = 1000


class Pair:
    """Two members under the shim; each a ``serve`` process on its own data directory."""

    def __init__(self, workdir: Path, shim: Path, **settings: str) -> None:
        self.workdir, self.shim, self.settings = workdir, shim, settings
        self.processes: dict[str, Any] = {}
        self.ports: dict[str, dict[str, str]] = {}
        self.stacks = {name: ExitStack() for name in ("a", "b")}

    def start(self, name: str) -> None:
        home = self.workdir / name
        (home / "data").mkdir(parents=True, exist_ok=True)
        env = {
            "CMDBUS_HA_LEASE": f"file:{self.workdir / 'lease'}",
            "CMDBUS_HA_NAME": name,
            "CMDBUS_HA_BIND": "127.0.0.1:0",
            "CMDBUS_HA_LEASE_MS": str(LEASE_MS),
            "LD_PRELOAD": str(self.shim),
            "POWERCUT_DIR": str(home / "data"),
            "POWERCUT_IMAGE": str(home / "image"),
            **self.settings,
        }
        process, ports = self.stacks[name].enter_context(serving(home, **env))
        self.processes[name], self.ports[name] = process, ports

    def start_both(self) -> None:
        """``a``, primary once the lease is its, then ``b``, which follows it."""
        self.start("a")
        until(lambda: self.role("a") == "primary")
        self.start("b")

    def role(self, name: str) -> str:
        return str(ha(self.ports[name])["role"])

    def in_sync(self) -> bool:
        return all(ha(ports)["in_sync"] for ports in self.ports.values())

    def power_cut(self, name: str, loaded: tuple[threading.Event, list[Any]], tally: Tally) -> None:
        """SIGKILL, then the member's directory as of its last fsyncs; the load on it
        stopped, and the cut counted with what the shim saw bypass it (nothing, or the cut
        is not a cut)."""
        self.processes[name].send_signal(signal.SIGKILL)
        self.processes[name].wait()
        self.stacks[name].close()
        home = self.workdir / name
        tally.bypassed += cut(home / "data", home / "image")
        stop_load(*loaded)
        tally.cuts += 1

    def close(self) -> None:
        for stack in self.stacks.values():
            stack.close()


def load(ports: dict[str, str], ledger: Ledger, name: str) -> tuple[threading.Event, list[Any]]:
    stop = threading.Event()
    threads = [
        threading.Thread(target=_quietly, args=(work, ports, ledger, stop, f"{name}{part}"))
        for part, work in LOAD
    ]
    for thread in threads:
        thread.start()
    return stop, threads


def stop_load(stop: threading.Event, threads: list[Any]) -> None:
    stop.set()
    for thread in threads:
        thread.join(timeout=30)


def checked(workdir: Path, pair: Pair, primary: str, ledger: Ledger, tally: Tally) -> None:
    """The last primary's stores, served alone from the checker's directory."""
    pair.close()
    (workdir / primary / "data").rename(workdir / "data")
    _check(workdir, ledger, tally, {})
    print(f"\n{Tally.HEADER}\n{tally.row()}")


def test_a_primary_s_power_cuts_while_its_standby_runs_lose_nothing_acknowledged(
    tmp_path: Path, shim: Path, power_cuts_wanted: int
) -> None:
    rng = random.Random(int(time.time()))
    ledger, tally = Ledger(), Tally("ha sync=on")
    pair = Pair(tmp_path, shim)
    try:
        pair.start_both()
        for cycle in range(power_cuts_wanted):
            until(pair.in_sync)
            primary = next(name for name in ("a", "b") if pair.role(name) == "primary")
            standby = "b" if primary == "a" else "a"
            loaded = load(pair.ports[primary], ledger, str(cycle))
            time.sleep(rng.uniform(0.5, 1.5))
            pair.power_cut(primary, loaded, tally)
            until(lambda: pair.role(standby) == "primary", LEASE_MS / 1000 + 10)  # noqa: B023
            pair.start(primary)  # on what its disk kept: it follows the new primary
            until(lambda: pair.role(primary) == "standby")  # noqa: B023
        final = next(name for name in ("a", "b") if pair.role(name) == "primary")
    finally:
        pair.close()
    checked(tmp_path, pair, final, ledger, tally)
    assert tally.acknowledged > 500, "the load did little"
    assert tally.bypassed == [], "SQLite wrote a watched file through a shared mmap"
    assert tally.violations == 0, tally.examples


def test_the_checker_catches_a_standby_that_takes_over_without_what_was_acknowledged(
    tmp_path: Path, shim: Path
) -> None:
    ledger, tally = Ledger(), Tally("ha sync=off")
    pair = Pair(tmp_path, shim, CMDBUS_HA_SYNC="off")
    try:
        pair.start_both()
        caught_up = {"role": "standby", "behind_records": 0}  # (never "in sync" with off)
        until(lambda: ha(pair.ports["b"]).items() >= caught_up.items())
        pair.processes["b"].send_signal(signal.SIGSTOP)
        loaded = load(pair.ports["a"], ledger, "0")
        time.sleep(1.5)
        pair.power_cut("a", loaded, tally)
        pair.processes["b"].send_signal(signal.SIGCONT)
        until(lambda: pair.role("b") == "primary", LEASE_MS / 1000 + 10)
    finally:
        pair.close()
    checked(tmp_path, pair, "b", ledger, tally)
    assert tally.lost > 0, "a standby without the last records lost nothing: the check is blind"


def test_a_primary_acknowledging_alone_keeps_it_through_its_power_cut(
    tmp_path: Path, shim: Path
) -> None:
    """The primary's own disk: the standby is stopped, the primary goes on alone, its
    power is cut and the standby killed; the primary, back on what its disk kept (the
    last primary, with no standby in sync: it takes the lease again), has everything it
    acknowledged. (With a standby in sync, the standby's copy would hide a primary that
    acknowledged before its own fsync.)"""
    ledger, tally = Ledger(), Tally("ha alone")
    pair = Pair(tmp_path, shim)
    try:
        pair.start_both()
        until(pair.in_sync)
        pair.processes["b"].send_signal(signal.SIGSTOP)
        loaded = load(pair.ports["a"], ledger, "0")
        until(lambda: not ha(pair.ports["a"])["in_sync"])  # alone, the lease says so
        time.sleep(1.0)
        pair.power_cut("a", loaded, tally)
        pair.processes["b"].kill()
        pair.stacks["b"].close()
        pair.start("a")
        until(lambda: pair.role("a") == "primary", LEASE_MS / 1000 + 10)
    finally:
        pair.close()
    checked(tmp_path, pair, "a", ledger, tally)
    assert tally.acknowledged > 100, "the load did little"
    assert tally.violations == 0, tally.examples
