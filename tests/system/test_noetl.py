"""A NoETL-shaped deployment, run the way NoETL runs it (harness/deployment.py):
servers publishing in bursts with idle gaps longer than every timer, workers in both
dialects and both clients that wait for work, crash mid-command and are replaced, event
groups (two created mid-run), a push subscriber, a reader, and probes from outside. Then
every guarantee is checked against what each process saw."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from harness.deployment import ACK_WAIT, Deployment, figures, free_ports, run, violations
from harness.pair import LITESTREAM, MEMBERS

from cmdbus_trio.client import blocking
from cmdbus_trio.storage.datadir import STORE_FILES

from ..helpers import cli, environment, serving

pytestmark = pytest.mark.system


def report(outcome_figures: dict[str, object], problems: list[str]) -> str:
    return "\n".join(
        [f"{len(problems)} guarantees broken:", *problems[:40], json.dumps(outcome_figures)]
    )


def test_a_day_in_a_minute(tmp_path: Path) -> None:
    outcome = run(tmp_path)
    problems = violations(outcome)
    assert not problems, report(figures(outcome), problems)
    assert len(outcome.killed) == 2  # the crashes happened
    assert outcome.kind("extended")  # some command outlived its lease, extended
    batched = [x for x in outcome.kind("claimed") if "batch" in x]
    assert batched and len(batched) < len(outcome.kind("claimed"))  # part of the work
    # What the run cost the writer (workload.py prints it, a command's share too): its
    # CPU over the run, below a whole run's worth of both CPUs.
    assert 0 < figures(outcome)["writer_cpu_s"] < 2 * (outcome.quiet - outcome.started + 60)


def test_a_day_in_a_minute_with_the_writer_killed_twice(tmp_path: Path) -> None:
    """The same, with the writer SIGKILLed and restarted twice, and drained (SIGTERM, as
    a rollout does) and started again twice: at least once, nothing acknowledged lost,
    sort keys never reused; everyone reconnects by themselves, and no error a restart
    causes reaches a program on the Python clients."""
    outcome = run(tmp_path, faults=True, seed=2)
    problems = violations(outcome)
    assert not problems, report(figures(outcome), problems)
    assert len(outcome.restarts) == 4 and outcome.drained == [0, 0]


def test_a_day_in_a_minute_on_a_primary_and_its_standby_through_failovers(
    tmp_path: Path,
) -> None:
    """The same on a pair (docs/ha.md): the primary SIGKILLed twice (its standby takes
    over once the lease expires) and handed over twice (SIGTERM, as a rollout does), each
    time started again to follow the new primary. The Python clients are given both
    members, the v1 workers one address that reaches the primary: nothing acknowledged
    lost, sort keys never reused, and no error a failover causes reaches a program on the
    Python clients."""
    outcome = run(tmp_path, faults=True, seed=3, pair=True)
    problems = violations(outcome)
    assert not problems, report(figures(outcome), problems)
    assert len(outcome.restarts) == 4 and outcome.drained == [0, 0]
    assert outcome.writer_log.count('"lease_acquired"') == 5  # the first, then a failover each
    assert {x["dialect"] for x in outcome.kind("acked")} == {"v1", "v2"}


def test_a_day_in_a_minute_on_a_pair_with_litestream_in_its_primary(tmp_path: Path) -> None:
    """The same pair through the same failovers, each member running Litestream while it
    is primary (docs/ha.md, "With Litestream"), both to one replica: the members serve as
    before, never two Litestreams run at once, and the replica, restored once both
    stopped (the last primary's Litestream syncs as it stops, before its stores close),
    is whole and holds the last primary's records, row for row: its commands, its events
    and its executions' histories."""
    outcome = run(tmp_path, faults=True, seed=4, pair=True, litestream=True)
    problems = violations(outcome)
    assert not problems, report(figures(outcome), problems)
    started = outcome.writer_log.count('"while_primary_started"')
    assert started >= 5  # one per primary term
    # Before each start, the stores' WALs cut back: Litestream's first sync copies them whole.
    assert outcome.writer_log.count('"wals_truncated"') == started
    counts = [int(line.split()[1]) for line in (tmp_path / "litestreams").read_text().split("\n")
              if line]  # fmt: skip
    assert max(counts) == 1, counts  # never two at once (sampled every 50 ms)
    restored = tmp_path / "restored"
    for store in STORE_FILES:
        replica = tmp_path / "replica" / store.removesuffix(".sqlite3")
        command = [LITESTREAM, "restore", "-o", str(restored / store), f"file://{replica}"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        with contextlib.closing(sqlite3.connect(restored / store)) as database:
            assert database.execute("PRAGMA integrity_check").fetchone()[0] == "ok", store
        copy = records(restored / store)
        members = [records(tmp_path / member / "data" / store) for member in MEMBERS]
        if copy not in members:  # (the last primary's: the other stopped first, maybe behind)
            missing = [len(set(rows) - set(copy)) for rows in members]
            extra = [len(set(copy) - set(rows)) for rows in members]
            first = sorted(set(members[0]) - set(copy))[:3]
            raise AssertionError(f"{store}: records of each member's missing {missing} "
                                 f"({first}), records no member has {extra}")  # fmt: skip


def records(path: Path) -> list[tuple[object, ...]]:
    """Every row of a store's record tables (``records``, ``*_records``), with its table."""
    with contextlib.closing(sqlite3.connect(path)) as database:
        tables = [name for (name,) in database.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            if name == "records" or name.endswith("_records")]  # fmt: skip
        assert tables, path
        return [(table, *row) for table in tables
                for row in database.execute(f'SELECT * FROM "{table}" ORDER BY rowid')]  # fmt: skip


def test_noetl_workers_and_a_publisher_run_unchanged_on_a_writer_given_noetl_names(
    tmp_path: Path,
) -> None:
    """Issue 18's "done when": the writer started from the NoETL writer's own variable
    names (binds, lag ports, ack wait, shard, tier) serves the system test's v1 workers and
    publisher unchanged, and its :9102 lag port reads 0 once they are done."""
    deployment = Deployment(tmp_path)
    lag_ports = dict(zip(("cmd", "evt"), free_ports(2), strict=True))
    for face, noetl in (
        ("cmd_ingest", "NOETL_COMMAND_BUS_INGEST_BIND"),
        ("cmd_claim", "NOETL_COMMAND_BUS_CLAIM_BIND"),
        ("evt_ingest", "NOETL_EVENT_BUS_INGEST_BIND"),
        ("evt_claim", "NOETL_EVENT_BUS_CLAIM_BIND"),
    ):
        deployment.env[noetl] = deployment.env.pop(f"CMDBUS_{face.upper()}_BIND")
    del deployment.env["CMDBUS_ACK_WAIT_MS"]
    deployment.env.update(
        NOETL_COMMAND_BUS_METRICS_BIND=f"127.0.0.1:{lag_ports['cmd']}",
        NOETL_EVENT_BUS_METRICS_BIND=f"127.0.0.1:{lag_ports['evt']}",
        NOETL_COMMAND_BUS_ACK_WAIT_SECS=str(ACK_WAIT),
        NOETL_EVENT_BUS_ACK_WAIT_SECS=str(ACK_WAIT),
        NOETL_COMMAND_BUS_HOST="true",
        NOETL_EVENT_BUS_HOST="true",
        NOETL_COMMAND_BUS_SHARD="0",
        NOETL_COMMAND_SHARD_COUNT="1",
        NOETL_EHDB_TIER_MAX_INFLIGHT="4",
    )
    deployment.start_writer()
    try:
        deployment.start_actor("server", "server-a", client="blocking", executions=30, burst=10)
        for pool in ("shared", "system"):
            deployment.start_actor("worker", f"worker-{pool}-v1", pool=pool, dialect="v1")
        server = deployment.actors.pop("server-a")
        assert server.wait(timeout=60) == 0
        deadline = time.monotonic() + 60
        while True:
            lines = deployment.lines()
            published = {x["sort_key"] for x in lines if x["kind"] == "published"}
            acked = {x["sort_key"] for x in lines if x["kind"] == "acked" and x["ok"]}
            if published and published <= acked:
                break
            assert time.monotonic() < deadline, f"not acked: {sorted(published - acked)}"
            time.sleep(0.5)
        time.sleep(1.5)  # the lag sampler runs every second
        url = f"http://127.0.0.1:{lag_ports['cmd']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            lag = response.read().decode()
        # The history the v1 workers wrote comes across to a new writer, as at a cut-over
        # (docs/migrating.md, "Tier history").
        (tmp_path / "new").mkdir()
        with serving(tmp_path / "new") as (_, new):
            imported = subprocess.run(
                cli("import-tier", "--from", deployment.addresses["tier"], "--to", new["tier"]),
                env=environment(tmp_path / "new"),
                capture_output=True,
                text=True,
                timeout=120,
            )
            executions = sorted({x["execution_id"] for x in lines if x["kind"] == "published"})
            with (
                blocking.TierClient.connect(deployment.addresses["tier"]) as old_tier,
                blocking.TierClient.connect(new["tier"]) as new_tier,
            ):
                for execution in executions:
                    before = [(r.payload, r.transaction_id) for r in old_tier.read_all(execution)]
                    after = [(r.payload, r.transaction_id) for r in new_tier.read_all(execution)]
                    assert before and after == before, execution
    finally:
        try:
            deployment.stop_actors()
        finally:
            writer_exit = deployment.stop_writer()
    assert len(published) == 30
    assert {x["dialect"] for x in lines if x["kind"] == "acked"} == {"v1"}
    assert "ehdb_feed_total_lag 0.0" in lag.splitlines()
    log = deployment.writer_log()
    assert log.count('"noetl_alias"') == 11  # six binds, two ack waits, shard, count, tier
    assert '"level": "error"' not in log
    assert writer_exit == 0
    assert imported.returncode == 0, imported.stdout + imported.stderr
    reports = {r["tier"]: r for r in map(json.loads, imported.stdout.splitlines())}
    assert all(r["matches"] for r in reports.values()), reports
    assert reports["eventlog"]["copied"] == reports["eventlog"]["source_records"] > 0
