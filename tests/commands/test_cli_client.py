"""`cmdbus-trio client …` and `cmdbus-trio bench` through real subprocesses (docs/clients.md,
"Command line")."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from cmdbus_trio.commands import client as client_command

from ..helpers import cli, serving

pytestmark = pytest.mark.e2e  # each test runs the command line, most against a writer


WRITER_SETTINGS = {"CMDBUS_MAX_DELIVER": "1"}  # the `server` fixture's (conftest.py)


def run(*args: str, stdin: str = "", timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(*args), input=stdin, capture_output=True, text=True, timeout=timeout)


def lines(result: subprocess.CompletedProcess[str]) -> list[Any]:
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def assert_fails(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode != 0 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr


def test_publish_claim_lag_dead(server: dict[str, str]) -> None:
    ingest, claim = ("--addr", server["cmd_ingest"]), ("--addr", server["cmd_claim"])
    one = lines(run("client", "publish", *ingest, "--execution-id", "7", "--payload", '{"a": 1}'))
    assert one == [{"sort_key": 1, "subject": "commands.shared.shard.0"}]
    stdin = "\n".join(
        json.dumps({"execution_id": n, "payload": json.dumps({"execution_pool": "cli"})})
        for n in range(3)
    )
    many = lines(run("client", "publish", *ingest, stdin=stdin + "\n\n"))
    assert [r["sort_key"] for r in many] == [2, 3, 4]
    assert {r["subject"] for r in many} == {"commands.cli.shard.0"}
    lag = lines(run("client", "lag", *claim, "--filter", "commands.cli.>"))
    assert lag == [{"subjects": {"commands.cli.shard.0": 3}, "total": 3}]

    claimed = lines(run("client", "claim", *claim, "--filter", "commands.>", "--max", "2"))
    assert [d["sort_key"] for d in claimed] == [1, 2]
    assert claimed[0]["record"] == {"execution_id": 7, "payload": '{"a": 1}'}
    # --no-ack: printed, and released when the command exits; max_deliver 1 parks it.
    held = lines(run("client", "claim", *claim, "--filter", "commands.>", "--max", "1", "--no-ack"))
    assert [d["sort_key"] for d in held] == [3]
    rest = lines(run("client", "claim", *claim, "--filter", "commands.>", "--timeout", "0.3"))
    assert [d["sort_key"] for d in rest] == [4]  # then 0.3 s with nothing: it stops
    dead = lines(run("client", "dead", *claim))
    assert [d["sort_key"] for d in dead] == [3]

    table = run("client", "lag", *claim, "--human")  # one record: a field a line
    assert table.returncode == 0 and table.stdout.splitlines()[0].split() == ["field", "value"]
    assert ["total", "0"] in [line.split() for line in table.stdout.splitlines()]


def test_delete_group(server: dict[str, str]) -> None:
    claim = ("--addr", server["evt_claim"])
    created = lines(run("client", "claim", *claim, "--filter", "events.>", "--group", "cli-g",
                        "--from", "tail", "--timeout", "0.1"))  # fmt: skip
    assert created == []
    assert lines(run("client", "delete-group", *claim, "--group", "cli-g")) == [{"deleted": True}]
    assert lines(run("client", "delete-group", *claim, "--group", "cli-g")) == [{"deleted": False}]
    assert_fails(run("client", "lag", *claim, "--group", "cli-g"), "unknown group")


def test_publish_errors(server: dict[str, str]) -> None:
    ingest = ("--addr", server["cmd_ingest"])
    assert_fails(run("client", "publish", *ingest, stdin="{not json\n"), "stdin line 1: not JSON")
    bad = json.dumps({"execution_id": 1, "payload": "{}", "extra": 1})
    assert_fails(run("client", "publish", *ingest, stdin=bad), "invalid: record.extra")
    assert_fails(
        run("client", "publish", "--addr", "127.0.0.1:1", "--execution-id", "1", "--payload", "{}"),
        "cannot connect",
    )
    assert_fails(run("client", "publish", "--execution-id", "1"), "--payload is required")
    assert_fails(
        run(
            "client",
            "publish",
            "--writers",
            "1@127.0.0.1:1",
            "--execution-id",
            "1",
            "--payload",
            "{}",
        ),
        "shards 0 of 0..1 have no writer",
    )


def test_publish_through_writers_and_events(server: dict[str, str]) -> None:
    writers = f"0@{server['cmd_ingest']}"
    routed = lines(
        run("client", "publish", "--writers", writers, "--execution-id", "x", "--payload", "{}")
    )
    assert routed[0]["subject"] == "commands.shared.shard.0"
    event = lines(
        run(
            "client",
            "publish",
            "--events",
            "--addr",
            server["evt_ingest"],
            "--execution-id",
            "1",
            "--payload",
            '{"event_type": "cli.done"}',
        )
    )
    assert event[0]["subject"] == "events.cli_done"
    group = ("--addr", server["evt_claim"], "--group", "cli", "--from", "beginning")
    claimed = lines(run("client", "claim", *group, "--filter", "events.cli_done", "--max", "1"))
    assert claimed[0]["sort_key"] == event[0]["sort_key"]


def test_claim_errors(server: dict[str, str]) -> None:
    claim = ("--addr", server["cmd_claim"])
    assert_fails(run("client", "claim", *claim, "--filter", "a..b", "--max", "1"), "filter")
    assert_fails(run("client", "claim", *claim, "--filter", ">", "--max", "0"), "--max must be")
    for bad in ("-1", "inf"):
        failed = run("client", "claim", *claim, "--filter", ">", "--reconnect-for", bad)
        assert_fails(failed, "--reconnect-for must be >= 0 seconds")
        assert failed.returncode == 2


def test_flags_that_do_not_go_together_exit_2(server: dict[str, str]) -> None:
    ingest = ("--addr", server["cmd_ingest"])
    for flags, message in (
        (("--execution-id", "7"), "--payload is required with --execution-id"),
        (("--payload", "{}"), "--payload and --msg-id need --execution-id"),
        (("--writers", f"0@{server['cmd_ingest']}", "--execution-id", "7", "--payload", "{}"),
         "give --addr or --writers, not both"),
    ):  # fmt: skip
        failed = run("client", "publish", *ingest, *flags)
        assert_fails(failed, message)
        assert failed.returncode == 2


def test_no_writer_with_no_reconnect_window_fails_at_once_in_a_sentence(tmp_path: Path) -> None:
    """`--reconnect-for 0` waits for nothing (not the 5 s a starting writer is given),
    and the error names the address and what to check, not a Python repr."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{free.getsockname()[1]}"
    failed = run("client", "lag", "--addr", address, "--reconnect-for", "0")
    assert "waited" not in failed.stderr  # (a window of 5 s says "(waited 5 s)")
    assert_fails(failed, f"cannot connect to {address}: connection refused")
    assert "is a writer running there" in failed.stderr
    assert "Error(" not in failed.stderr and "(111" not in failed.stderr


def test_a_claiming_worker_goes_on_through_a_writer_restart(tmp_path: Path) -> None:
    """`client claim` as the deploy's worker runs it: one record claimed, the writer
    drained and started again on the same ports, a second record published; the
    command takes it too and exits 0 (it used to exit 1 at the drain)."""
    import signal

    from ..helpers import serving

    with serving(tmp_path) as (writer, ports):
        publish = ("client", "publish", "--addr", ports["cmd_ingest"], "--execution-id")
        claim = subprocess.Popen(
            cli("client", "claim", "--addr", ports["cmd_claim"], "--filter", ">", "--max", "2"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            lines(run(*publish, "1", "--payload", "{}"))
            assert claim.stdout is not None
            assert json.loads(claim.stdout.readline())["sort_key"] == 1
            writer.send_signal(signal.SIGTERM)
            assert writer.wait(timeout=30) == 0
            again = {f"CMDBUS_{face.upper()}_BIND": address for face, address in ports.items()}
            with serving(tmp_path, **again):
                lines(run(*publish, "2", "--payload", "{}"))
                out, err = claim.communicate(timeout=60)
            assert claim.returncode == 0, err
            assert json.loads(out)["sort_key"] == 2
        finally:
            claim.kill()


def test_tier_append_read_scan_delete(server: dict[str, str]) -> None:
    tier = ("--addr", server["tier"])
    appended = lines(
        run("client", "tier", "append", *tier, "--execution-id", "e1", "--payload", '{"n": 1}')
    )
    assert appended == [{"global_sequence": 1, "log_record_count": 1, "deduplicated": False}]
    run("client", "tier", "append", *tier, "--execution-id", "e1", "--payload", '{"n": 2}')
    run(
        "client",
        "tier",
        "append",
        *tier,
        "--tier",
        "catalog",
        "--execution-id",
        "e1",
        "--payload",
        "{}",
    )
    read = lines(run("client", "tier", "read", *tier, "--execution-id", "e1"))
    assert [r["payload"] for r in read] == ['{"n": 1}', '{"n": 2}']
    assert read[0]["execution_id"] == "e1" and read[0]["global_sequence"] == 1
    scanned = lines(run("client", "tier", "scan", *tier, "--after", "1", "--limit", "5"))
    assert [r["global_sequence"] for r in scanned] == [2]
    assert len(lines(run("client", "tier", "scan", *tier, "--tier", "catalog"))) == 1
    human = run("client", "tier", "read", *tier, "--execution-id", "e1", "--human")
    assert human.stdout.splitlines()[0].split()[:2] == ["global_sequence", "execution_id"]
    assert_fails(
        run("client", "tier", "append", *tier, "--execution-id", "e1", "--payload", "nope"),
        "invalid: payload",
    )
    assert_fails(run("client", "tier", "scan", *tier, "--limit", "0"), "--limit must be")
    deleted = lines(run("client", "tier", "delete", *tier, "--execution-id", "e1"))
    assert deleted == [{"deleted": 2}]
    assert lines(run("client", "tier", "read", *tier, "--execution-id", "e1")) == []
    catalog = ("--tier", "catalog")
    assert lines(run("client", "tier", "delete", *tier, *catalog, "--execution-id", "e1")) == [
        {"deleted": 1}
    ]


def test_health(server: dict[str, str]) -> None:
    document = lines(run("client", "health", "--url", f"http://{server['control']}"))[0]
    assert document["status"] == "ok" and document["ready"] is True
    assert_fails(run("client", "health", "--url", "http://127.0.0.1:1"), "no answer")


def test_usage_errors_exit_2() -> None:
    result = run("client", "claim")
    assert result.returncode == 2 and "--filter" in result.stderr


def test_bench_spawn_with_plot(tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    result = run(
        "bench",
        "--spawn",
        "--scenario",
        "claim",
        "--duration",
        "2",
        "--concurrency",
        "4",
        "--plot",
        str(plot),
        timeout=120,
    )
    rows = {row["op"]: row for row in lines(result)}
    assert {"publish", "next", "ack", "healthz"} <= set(rows)
    assert rows["publish"]["ok"] > 0 and rows["ack"]["ok"] > 0 and rows["healthz"]["ok"] > 0
    assert rows["publish"]["p99_ms"] >= rows["publish"]["p50_ms"] > 0
    assert "shed" in result.stderr and "/s" in result.stderr  # the progress line
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_stall_against_a_running_writer(server: dict[str, str]) -> None:
    result = run(
        "bench",
        "--url",
        f"http://{server['control']}",
        "--scenario",
        "stall",
        "--duration",
        "1.5",
        "--events",
        "3000",
        "--concurrency",
        "2",
        "--human",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    header, _, *rows = result.stdout.splitlines()
    assert header.split()[:3] == ["op", "ok", "rate_per_s"]
    assert {row.split()[0] for row in rows} == {"append", "healthz", "read_page"}


def test_bench_interrupted_prints_what_it_measured(server: dict[str, str]) -> None:
    """Ctrl-C two seconds into a 60 s run: the rows measured so far (rates over the time
    it ran), then the interrupted line, and status 130."""
    command = cli(
        "bench", "--url", f"http://{server['control']}", "--scenario", "publish",
        "--duration", "60", "--concurrency", "2",
    )  # fmt: skip
    bench = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3.0)
        bench.send_signal(signal.SIGINT)
        out, err = bench.communicate(timeout=30)
    finally:
        bench.kill()
    assert bench.returncode == 130, err
    assert err.rstrip().endswith("cmdbus-trio: interrupted"), err
    rows = {row["op"]: row for row in map(json.loads, out.splitlines())}
    assert rows["publish"]["ok"] > 0 and rows["publish"]["rate_per_s"] > 0, rows


def test_bench_errors() -> None:
    assert_fails(
        run("bench", "--url", "http://127.0.0.1:1", "--scenario", "publish", "--duration", "1"),
        "cannot reach http://127.0.0.1:1",
    )
    assert_fails(run("bench", "--scenario", "publish", "--duration", "0"), "--duration must be > 0")


def test_lag_dead_read_and_diagnose_error_paths(server: dict[str, str]) -> None:
    assert_fails(run("client", "lag", "--addr", server["cmd_claim"], "--filter", "a..b"), "filter")
    assert_fails(run("client", "dead", "--addr", server["cmd_claim"], "--group", "g"), "group")
    assert_fails(
        run("client", "tier", "read", "--addr", "127.0.0.1:1", "--execution-id", "1"),
        "cannot connect",
    )
    assert_fails(run("diagnose", "--interval", "0"), "--interval and --request-timeout must be > 0")


def test_publish_and_claim_across_two_shards(tmp_path: Path) -> None:
    (tmp_path / "w0").mkdir()
    (tmp_path / "w1").mkdir()
    with (
        serving(tmp_path / "w0", CMDBUS_SHARD="0", CMDBUS_SHARD_COUNT="2") as (_, w0),
        serving(tmp_path / "w1", CMDBUS_SHARD="1", CMDBUS_SHARD_COUNT="2") as (_, w1),
    ):
        writers = f"0@{w0['cmd_ingest']},1@{w1['cmd_ingest']}"
        stdin = "\n".join(json.dumps({"execution_id": n, "payload": "{}"}) for n in range(10))
        published = lines(run("client", "publish", "--writers", writers, stdin=stdin))
        assert {p["subject"] for p in published} == {
            "commands.shared.shard.0",
            "commands.shared.shard.1",
        }
        claims = f"0@{w0['cmd_claim']},1@{w1['cmd_claim']}"
        claimed = lines(
            run("client", "claim", "--writers", claims, "--filter", ">", "--timeout", "0.5")
        )
        assert sorted(d["record"]["execution_id"] for d in claimed) == list(range(10))
        assert {d["shard"] for d in claimed} == {0, 1}
        assert_fails(
            run("client", "claim", "--writers", f"1@{w1['cmd_claim']}", "--filter", ">"),
            "shards 0 of 0..1 have no writer",
        )


def test_bench_speaks_to_a_writer_with_a_token(tmp_path: Path) -> None:
    """`bench` had no --token (nor --tls-ca): a writer with auth could not be measured."""
    with serving(tmp_path, CMDBUS_AUTH_TOKEN="sesame") as (_, ports):
        bench = ("bench", "--url", f"http://{ports['control']}", "--scenario", "publish",
                 "--duration", "0.5", "--concurrency", "2")  # fmt: skip
        measured = lines(run(*bench, "--token", "sesame"))
        assert {row["op"]: row for row in measured}["publish"]["ok"] > 0
        assert_fails(run(*bench), "token")


def test_a_control_url_without_a_scheme_is_http(server: dict[str, str]) -> None:
    """`diagnose 127.0.0.1:9090` said UNREACHABLE: the address was read as a URL with no
    host."""
    diagnosed = run("diagnose", server["control"], "--interval", "0.2")
    found = [json.loads(line) for line in diagnosed.stdout.splitlines()]
    assert found and found[0]["verdict"] != "unreachable", diagnosed
    assert lines(run("client", "health", "--url", server["control"]))[0]["status"] == "ok"


def test_a_client_pointed_at_an_http_port_says_so(server: dict[str, str]) -> None:
    """It reported a frame of 1,213,486,160 bytes ("HTTP" read as a frame header)."""
    assert_fails(run("client", "lag", "--addr", server["control"]), "the server answered in HTTP")


def test_claim_says_when_records_it_printed_were_not_acked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    client_command._refused([True, True])
    assert capsys.readouterr().err == ""
    client_command._refused([True, False, False])
    err = capsys.readouterr().err
    assert "2 of the 3 records just printed were not acked" in err
    assert "CMDBUS_ACK_WAIT_MS" in err and "delivered again" in err
