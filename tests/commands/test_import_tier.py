"""`cmdbus-trio import-tier`: one writer's tier history copied into another through their
tier faces (the source read in the v1 dialect), killed half-way and resumed: every record
once, in each execution's order, with its transaction id, in every tier."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cmdbus_trio.client import blocking

from ..helpers import cli, environment, serving

pytestmark = pytest.mark.e2e

SIZES = {"eventlog": (40, 150), "projection": (25, 20), "catalog": (5, 10)}  # executions x records


def populate(address: str) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """Interleaved executions (ten records of one, then ten of the next), transaction
    ids changing every 7 records, half the payloads with an event_id."""
    written: dict[tuple[str, str], list[tuple[str, str]]] = {}
    with blocking.TierClient.connect(address) as tier_client:
        for tier, (executions, records) in SIZES.items():
            for start in range(0, records, 10):
                for n in range(executions):
                    execution = f"exec-{n}" if n % 3 else str(1000 + n)  # some integer ids
                    for i in range(start, min(records, start + 10)):
                        body: dict[str, Any] = {"i": i, "tier": tier, "pad": "x" * 100}
                        if i % 2:
                            body["event_id"] = f"{execution}-{i}"
                        payload = json.dumps(body)
                        transaction = f"tx-{i // 7}"
                        tier_client.append(
                            execution, payload, tier=tier, transaction_id=transaction
                        )
                        written.setdefault((tier, execution), []).append((payload, transaction))
    return written


def history(address: str, tier: str, execution: str) -> list[tuple[str, str]]:
    with blocking.TierClient.connect(address) as tier_client:
        return [(r.payload, r.transaction_id) for r in tier_client.read_all(execution, tier=tier)]


def run_import(tmp_path: Path, source: str, dest: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli("import-tier", "--from", source, "--to", dest),
        env=environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_copies_resumes_after_a_kill_and_never_duplicates(tmp_path: Path) -> None:
    (tmp_path / "source").mkdir()
    (tmp_path / "dest").mkdir()
    with (
        serving(tmp_path / "source") as (_, source_ports),
        serving(tmp_path / "dest") as (_, dest_ports),
    ):
        source, dest = source_ports["tier"], dest_ports["tier"]
        written = populate(source)
        with blocking.TierClient.connect(dest) as tier_client:  # the destination's own
            tier_client.append("already-here", '{"mine": true}')

        # Killed half-way through the event log.
        first = subprocess.Popen(
            cli("import-tier", "--from", source, "--to", dest),
            env=environment(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert first.stderr is not None
            while line := first.stderr.readline():
                if line.startswith("eventlog [") and "100%" not in line:
                    break
            first.send_signal(signal.SIGKILL)
        finally:
            first.kill()
            first.wait()
        copied_before = sum(
            len(history(dest, "eventlog", e)) for (t, e) in written if t == "eventlog"
        )
        assert 0 < copied_before < 40 * 150

        resumed = run_import(tmp_path, source, dest)
        assert resumed.returncode == 0, resumed.stdout
        reports = {r["tier"]: r for r in map(json.loads, resumed.stdout.splitlines())}
        assert set(reports) == set(SIZES)
        for tier, (executions, records) in SIZES.items():
            report = reports[tier]
            assert report["matches"] and report["mismatched"] == [], report
            assert report["source_records"] == executions * records
            assert report["executions"] == executions
            assert report["copied"] + report["already_there"] == executions * records
        assert reports["eventlog"]["already_there"] >= copied_before  # it resumed
        for (tier, execution), records in written.items():
            assert history(dest, tier, execution) == records, (tier, execution)
        assert history(dest, "eventlog", "already-here") == [('{"mine": true}', "")]
        assert "eventlog [" in resumed.stderr and "100%" in resumed.stderr  # the progress

        again = run_import(tmp_path, source, dest)  # a third run copies nothing
        assert again.returncode == 0, again.stderr
        for report in map(json.loads, again.stdout.splitlines()):
            assert report["copied"] == 0 and report["matches"], report


def test_import_errors_are_one_line(tmp_path: Path) -> None:
    with serving(tmp_path) as (_, ports):
        unreachable = run_import(tmp_path, "127.0.0.1:1", ports["tier"])
    assert unreachable.returncode == 1
    (line,) = unreachable.stderr.splitlines()
    assert line.startswith("cmdbus-trio import-tier: 127.0.0.1:1:")
    malformed = run_import(tmp_path, "no-port", "127.0.0.1:1")
    assert malformed.returncode == 1
    assert malformed.stderr == (
        "cmdbus-trio import-tier: --from: address 'no-port': expected HOST:PORT\n"
    )


def test_long_runs_are_split_under_the_request_cap(tmp_path: Path) -> None:
    """A run of one execution and transaction larger than a request is sent in several
    batches; a record over the destination's cap is named, and the rest goes on."""
    (tmp_path / "source").mkdir()
    (tmp_path / "dest").mkdir()
    small = {"CMDBUS_MAX_REQUEST_BYTES": str(256 * 1024)}
    with (
        serving(tmp_path / "source") as (_, source_ports),
        serving(tmp_path / "dest", **small) as (_, dest_ports),
    ):
        source, dest = source_ports["tier"], dest_ports["tier"]
        long_run = [json.dumps({"i": i, "pad": 'q"' * 1500}) for i in range(450)]  # escapes
        with blocking.TierClient.connect(source) as tier_client:
            for start in range(0, 450, 90):
                tier_client.append_batch("long", long_run[start : start + 90], transaction_id="t")
            tier_client.append("huge", json.dumps({"pad": "x" * 300_000}))
            tier_client.append("after-huge", "{}")
        done = run_import(tmp_path, source, dest)
        assert done.returncode == 1, done.stderr
        eventlog = json.loads(done.stdout.splitlines()[0])
        assert eventlog["copied"] == 451
        assert eventlog["mismatched"] == [
            "huge: a record of 300011 bytes: over this writer's request cap (262144 bytes, "
            "CMDBUS_MAX_REQUEST_BYTES)"
        ]
        assert history(dest, "eventlog", "long") == [(p, "t") for p in long_run]
        assert history(dest, "eventlog", "after-huge") == [("{}", "")]
