"""The command line as an operator meets it: tables on a terminal and JSON lines in a pipe
(a pseudo-terminal here), one server address for every face, Ctrl-C, `client subscribe`,
`serve --help` and its yes/no flags, the settings line of the console log, and `/` on
the control port."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from cmdbus_trio import cli as cli_module
from cmdbus_trio.client import blocking
from cmdbus_trio.commands._addresses import default_address, server_host, server_of
from cmdbus_trio.commands._output import table
from cmdbus_trio.commands._serve_help import SECTIONS, allowed
from cmdbus_trio.config import SETTINGS

from ..helpers import cli, environment, server_log, serving

pytestmark = pytest.mark.e2e


def on_a_terminal(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run ``command`` with its stdout on a pseudo-terminal: its exit status and output."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(command, stdout=follower, stderr=subprocess.PIPE, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return process.wait(timeout=60), b"".join(chunks).decode().replace("\r\n", "\n")


def test_a_terminal_gets_a_table_and_a_pipe_json_lines(tmp_path: Path) -> None:
    with serving(tmp_path) as (_, ports):
        env = environment(tmp_path)
        health = cli("client", "health", "--url", ports["control"])
        code, shown = on_a_terminal(health, env)
        assert code == 0 and shown.splitlines()[0].split() == ["field", "value"], shown
        assert any(line.split()[:2] == ["status", "ok"] for line in shown.splitlines()), shown
        assert not shown.lstrip().startswith("{")
        code, forced = on_a_terminal([*health, "--json"], env)
        assert code == 0 and json.loads(forced)["status"] == "ok"
        piped = subprocess.run(health, capture_output=True, text=True, env=env, timeout=60)
        assert json.loads(piped.stdout)["status"] == "ok"
        human = subprocess.run([*health, "--human"], capture_output=True, text=True, env=env)
        assert human.stdout.splitlines()[0].split() == ["field", "value"]


def test_a_table_reads_as_a_table() -> None:
    rows = [
        {"subject": "a", "lag": {"total": 3, "pending": 1}, "reasons": ["x", "y"]},
        {"subject": "b", "lag": {"total": 0, "pending": 0}, "reasons": []},
    ]
    lines = table(rows).splitlines()
    assert lines[0].split() == ["subject", "lag.total", "lag.pending", "reasons"]
    assert lines[2].split() == ["a", "3", "1", "x,", "y"]
    assert "{" not in table(rows)  # no JSON in a cell


def test_a_person_sees_no_empty_fields_and_a_pipe_sees_every_field() -> None:
    """A delivery without trace context: no empty `traceparent=`/`tracestate=` columns on a
    terminal (followed or tabled); JSON keeps every key, null ones too."""
    import io

    from cmdbus_trio.client._calls import Delivery
    from cmdbus_trio.commands._output import Output

    delivery = Delivery(7, "commands.a", False, 1, {"execution_id": 1, "payload": "{}"})
    for follow in (True, False):
        shown = io.StringIO()
        output = Output(human=True, stream=shown, follow=follow)
        output.row(delivery)
        output.close()
        assert "sort_key" in shown.getvalue() and "trace" not in shown.getvalue()
    piped = io.StringIO()
    Output(human=False, stream=piped).row(delivery)
    assert json.loads(piped.getvalue())["traceparent"] is None


def test_one_server_address_for_every_face(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_address("cmd_ingest", server="10.0.0.7") == "10.0.0.7:9100"
    assert default_address("control", server="[::1]") == "[::1]:9090"
    assert server_host("::1") == "[::1]" and server_host(" cmdbus-0 ") == "cmdbus-0"
    for wrong in ("cmdbus-0:9100", "http://cmdbus-0", "", "a,b:9100"):
        with pytest.raises(ValueError, match="--server"):
            server_host(wrong)
    pair = server_host("cmdbus-0a, ::1")  # the two members of a pair
    assert pair == "cmdbus-0a,[::1]"
    assert default_address("cmd_ingest", server=pair) == "cmdbus-0a:9100,[::1]:9100"
    assert default_address("control", server=pair) == "cmdbus-0a:9090"  # one control face
    monkeypatch.setenv("CMDBUS_SERVER", "10.0.0.8")
    assert server_of(cli_module._parser().parse_args(["client", "lag"])) == "10.0.0.8"
    given = cli_module._parser().parse_args(["client", "lag", "--server", "10.0.0.9"])
    assert server_of(given) == "10.0.0.9"  # the flag wins over the variable


def test_server_reaches_every_face_at_its_default_port(tmp_path: Path) -> None:
    env = {**environment(tmp_path), "CMDBUS_SERVER": "127.0.0.9"}  # nobody listens there
    env.pop("CMDBUS_PORTS_FILE")
    publish = cli("client", "publish", "--execution-id", "1", "--payload", "{}")
    refused = subprocess.run(
        [*publish, "--reconnect-for", "0"], capture_output=True, text=True, env=env, timeout=60
    )
    assert refused.returncode == 1 and "127.0.0.9:9100" in refused.stderr, refused.stderr
    diagnose = cli("diagnose", "--interval", "0.1", "--json")
    unreachable = subprocess.run(diagnose, capture_output=True, text=True, env=env, timeout=60)
    assert "127.0.0.9:9090" in unreachable.stdout, unreachable.stdout
    with serving(tmp_path) as (_, ports):  # --addr wins over the server
        done = subprocess.run(
            [*publish, "--addr", ports["cmd_ingest"]], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr


def test_ctrl_c_exits_130_with_one_line(tmp_path: Path) -> None:
    with serving(tmp_path) as (_, ports):
        claim = cli("client", "claim", "--addr", ports["cmd_claim"], "--filter", "x.>")
        waiting = subprocess.Popen(
            [*claim, "--timeout", "600"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=environment(tmp_path),
        )  # fmt: skip
        time.sleep(2)  # waiting for a record that will not come
        waiting.send_signal(signal.SIGINT)
        _, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 130
    assert err == "cmdbus-trio: interrupted\n", err


def test_client_subscribe_prints_history_then_stops(tmp_path: Path) -> None:
    with serving(tmp_path) as (_, ports):
        with blocking.IngestClient(ports["evt_ingest"]) as events:
            keys = [
                events.publish(
                    {"execution_id": n, "payload": json.dumps({"event_type": t})}
                ).sort_key
                for n, t in enumerate(["step.started", "step.done", "step.done"])
            ]
        follow = cli("client", "subscribe", "--addr", ports["evt_subscribe"], "--json")
        env = environment(tmp_path)
        first_two = subprocess.run([*follow, "--max", "2"], capture_output=True, text=True, env=env)
        assert [json.loads(line)["sort_key"] for line in first_two.stdout.splitlines()] == keys[:2]
        idle = subprocess.run(
            [*follow, "--filter", "events.step_done", "--after", str(keys[1]), "--timeout", "1"],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert idle.returncode == 0, idle.stderr
        assert [json.loads(line)["sort_key"] for line in idle.stdout.splitlines()] == keys[2:]
        bad = subprocess.run([*follow, "--max", "0"], capture_output=True, text=True, env=env)
        assert bad.returncode == 2 and "--max must be at least 1" in bad.stderr
        # On a terminal each record is shown as it comes (the command may run until
        # Ctrl-C), as field=value pairs, not a table at the end.
        watch = cli("client", "subscribe", "--addr", ports["evt_subscribe"], "--timeout", "1")
        code, shown = on_a_terminal(watch, env)
        assert code == 0, shown
        assert [line.split()[0] for line in shown.splitlines()] == [f"sort_key={k}" for k in keys]
        assert "subject=events.step_started" in shown.splitlines()[0]


def test_serve_help_groups_every_setting_and_shows_what_it_takes() -> None:
    grouped = [name for names in SECTIONS.values() for name in names]
    assert sorted(grouped) == sorted(s.name for s in SETTINGS)  # each in one section
    assert len(grouped) == len(set(grouped))
    text = subprocess.run(cli("serve", "--help"), capture_output=True, text=True).stdout
    assert "--sync {full,normal}" in text and "--log-level {debug,info,warning,error}" in text
    assert "VALUE\n" not in text and " VALUE " not in text.split("\n", 1)[1]
    assert "storage:" in text and "retention:" in text
    assert allowed(next(s for s in SETTINGS if s.name == "ack_wait_ms")) == "an integer >= 1"
    flags = vars(cli_module._parser().parse_args(["serve", "--debug-hooks", "--allow-v1=false"]))
    assert (flags["debug_hooks"], flags["allow_v1"]) == ("true", "false")


def test_serve_help_cannot_drift_from_what_the_settings_take() -> None:
    """What `serve --help` says a setting takes is its parser's own refusal, so it holds:
    each integer bound it names is taken and the value past it refused. The help line
    does not say again what that text says, and the debug hooks named are those the
    control face has."""
    import re

    from cmdbus_trio.control._debug import HOOKS

    for setting in SETTINGS:
        takes = allowed(setting)
        for low in map(int, re.findall(r"an integer >= (\d+)", takes)):
            setting.parse(str(low)), setting.parse(str(low + 1))
            with pytest.raises(ValueError):
                setting.parse(str(low - 1))
        for low, high in re.findall(r"an integer in (\d+)\.\.(\d+)", takes):
            setting.parse(low), setting.parse(high)
            with pytest.raises(ValueError):
                setting.parse(str(int(high) + 1))
        if takes.startswith("0 "):
            setting.parse("0")
        for said in ("HOST:PORT", "no cap", "empty"):
            assert not (said in takes and said in setting.help), (setting.name, setting.help)
    debug = next(setting for setting in SETTINGS if setting.name == "debug_hooks")
    assert set(re.findall(r"/debug/[a-z-]+", debug.help)) == set(HOOKS)


def test_the_console_log_prints_the_changed_settings_one_a_line(tmp_path: Path) -> None:
    settings = {"CMDBUS_LOG_FORMAT": "console", "CMDBUS_SHUTDOWN_TIMEOUT_MS": "3000"}
    with serving(tmp_path, **settings) as (writer, ports):
        with urllib.request.urlopen(f"http://{ports['control']}/", timeout=10) as reply:
            index = json.loads(reply.read())
        writer.send_signal(signal.SIGTERM)
        assert writer.wait(timeout=30) == 0
    assert set(index["endpoints"]) == {"/livez", "/readyz", "/healthz", "/metrics", "/ha"}
    lines = server_log(tmp_path).splitlines()
    started = next(i for i, line in enumerate(lines) if " started " in f"{line} ")
    block = lines[started : started + 40]
    assert "  settings:" in block
    assert "    shutdown_timeout_ms = 3000" in block
    assert not any(line.strip().startswith("sync = ") for line in block)  # a default
    assert max(len(line) for line in block) < 200


def test_shared_flags_may_come_before_the_command() -> None:
    from cmdbus_trio.cli import hoisted

    assert hoisted(["--server", "h", "--json", "client", "lag"]) == [
        "client", "lag", "--server", "h", "--json"
    ]  # fmt: skip
    assert hoisted(["--reconnect-for=0", "client", "lag"]) == ["client", "lag", "--reconnect-for=0"]
    assert hoisted(["client", "lag", "--server", "h"]) == ["client", "lag", "--server", "h"]
    assert hoisted(["--version"]) == ["--version"]  # not a shared flag: left where it is


@pytest.mark.parametrize(
    ("argv", "usage", "said"),
    [
        (["client", "lag", "--serverr", "h"], "usage: cmdbus-trio client lag ",
         "unrecognized arguments: --serverr (did you mean --server?) h"),
        (["serve", "--ack-wait", "5"], "usage: cmdbus-trio serve ",
         "--ack-wait (did you mean --ack-wait-ms?)"),
        (["--token", "t", "check", "--data-dir", "d"], "usage: cmdbus-trio check ",
         "unrecognized arguments: --token t"),
        (["client", "tier", "read", "--execution-id", "1", "--zzz"],
         "usage: cmdbus-trio client tier read ", "unrecognized arguments: --zzz"),
    ],
)  # fmt: skip
def test_an_unknown_flag_shows_its_commands_usage_and_the_nearest_flag(
    argv: list[str], usage: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from cmdbus_trio.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and said in err, err


def test_serve_logs_short_lines_on_a_terminal_and_json_elsewhere(tmp_path: Path) -> None:
    """`CMDBUS_LOG_FORMAT` unset (`auto`): a person running `serve` in a terminal reads
    one short line an event; the same writer logging to a file (a container's log)
    writes JSON lines."""
    env = environment(tmp_path, CMDBUS_SHUTDOWN_TIMEOUT_MS="1000")
    leader, follower = pty.openpty()
    writer = subprocess.Popen(cli("serve"), stdout=subprocess.DEVNULL, stderr=follower, env=env)
    os.close(follower)
    shown = b""
    try:
        deadline = time.monotonic() + 30
        while b" started" not in shown and time.monotonic() < deadline:
            shown += os.read(leader, 65536)
    finally:
        writer.send_signal(signal.SIGTERM)
        writer.wait(timeout=30)
        os.close(leader)
    first = shown.decode().splitlines()[0]
    assert not first.startswith("{") and len(first) < 200, first
    piped = tmp_path / "piped"
    piped.mkdir()
    with serving(piped):
        pass
    assert server_log(piped).lstrip().startswith("{")
