"""`cmdbus-trio serve` as a real subprocess."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.deployment import free_ports

from .helpers import cli, environment, server_log, serving


def http_get(address: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def log_events(stderr: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_writes_ports_file_and_exits_0_on_signal(tmp_path: Path, signum: int) -> None:
    with serving(tmp_path, "--shutdown-timeout-ms", "3000") as (process, ports):
        assert "control" in ports
        assert http_get(ports["control"], "/readyz")[0] == 200
        assert http_get(ports["control"], "/livez")[0] == 200
        start = time.monotonic()
        process.send_signal(signum)
        process.wait(timeout=30)
        stderr = server_log(tmp_path)
        assert process.returncode == 0, stderr
        assert time.monotonic() - start < 3.0 + 5.0  # within the shutdown budget (+ slack)
    events = log_events(stderr)
    names = [event["event"] for event in events]
    assert names.index("started") < names.index("drain_started") < names.index("stopped")
    started = events[names.index("started")]
    assert started["addresses"] == ports
    assert started["version"]
    assert started["settings"]["shutdown_timeout_ms"] == 3000  # type: ignore[index]
    assert all(event["level"] in ("info", "warning") for event in events)


@pytest.mark.once
def test_ports_file_lists_enabled_faces_only(tmp_path: Path) -> None:
    with serving(tmp_path, "--tier-bind", "") as (process, ports):
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert "tier" not in ports


@pytest.mark.slow  # a port let go of, then used: one at a time (noxfile.IN_PARALLEL)
def test_flag_overrides_env_for_the_control_bind(tmp_path: Path) -> None:
    [port] = free_ports(1)
    with serving(tmp_path, "--control-bind", f"127.0.0.1:{port}") as (process, ports):
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert ports["control"] == f"127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (
            (),
            {"CMDBUS_SYNC": "sometimes"},
            "invalid setting CMDBUS_SYNC (--sync): 'sometimes': expected one of full, normal",
        ),
        (
            ("--shard-count", "zero"),
            {},
            "invalid setting CMDBUS_SHARD_COUNT (--shard-count): 'zero'",
        ),
        (
            ("--tier-bind", "nowhere"),
            {},
            "invalid setting CMDBUS_TIER_BIND (--tier-bind): 'nowhere'",
        ),
    ],
)
def test_bad_config_exits_2_with_one_line(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], expected: str
) -> None:
    result = subprocess.run(
        cli("serve", *args),
        env=environment(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"cmdbus-trio: {expected}")


@pytest.mark.once
def test_data_dir_is_created_and_an_unusable_one_exits_2(tmp_path: Path) -> None:
    with serving(tmp_path) as (process, _):
        assert (tmp_path / "data").is_dir()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    (tmp_path / "file").write_text("not a directory")
    result = subprocess.run(
        cli("serve", "--data-dir", str(tmp_path / "file" / "data")),
        env=environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("cmdbus-trio: invalid setting CMDBUS_DATA_DIR (--data-dir):")
    assert "cannot create it: Not a directory" in result.stderr


@pytest.mark.once
def test_an_address_in_use_exits_1_naming_the_face(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = subprocess.run(
            cli("serve", "--control-bind", address),
            env=environment(tmp_path),
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 1
    assert f"cmdbus-trio: cannot start the control face on {address}:" in result.stderr
    assert "in use" in result.stderr
    assert "choose another address with CMDBUS_CONTROL_BIND (--control-bind)" in result.stderr


def test_help_documents_every_setting() -> None:
    from cmdbus_trio.config import SETTINGS

    result = subprocess.run(cli("serve", "--help"), capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    flat = " ".join(result.stdout.split())
    for setting in SETTINGS:
        assert f"--{setting.flag}" in flat
        assert f"[{setting.env}]" in flat


def test_version() -> None:
    from cmdbus_trio import __version__

    result = subprocess.run(cli("--version"), capture_output=True, text=True, timeout=30)
    assert result.stdout.strip() == f"cmdbus-trio {__version__}"


@pytest.mark.once
def test_one_writer_per_data_directory(tmp_path: Path) -> None:
    """A second writer on the same directory ran beside the first: each delivered only
    what was published through it. It now exits 2 naming the directory and the holder;
    once the first is gone (killed: the kernel drops its lock), a new one starts."""
    with serving(tmp_path) as (first, _):
        second = subprocess.run(
            cli("serve"),
            env=environment(tmp_path / "other", CMDBUS_DATA_DIR=str(tmp_path / "data")),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode == 2
        lines = second.stderr.splitlines()
        assert len(lines) == 1, second.stderr
        assert lines[0].startswith("cmdbus-trio: invalid setting CMDBUS_DATA_DIR (--data-dir):")
        assert str(tmp_path / "data") in lines[0]
        assert f"in use by another writer (pid {first.pid})" in lines[0]
        first.kill()
        first.wait()
    with serving(tmp_path) as (process, _):
        assert process.poll() is None


@pytest.mark.once
def test_a_store_the_writer_cannot_open_is_one_line_naming_it(tmp_path: Path) -> None:
    """It used to end in a ~60-line ExceptionGroup traceback that never named the path."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "events.sqlite3").write_bytes(b"this is not a database" * 100)
    result = subprocess.run(
        cli("serve"), env=environment(tmp_path), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("cmdbus-trio: invalid setting CMDBUS_DATA_DIR (--data-dir):")
    assert f"{str(data)!r}: events.sqlite3: file is not a database" in lines[0]


@pytest.mark.once
def test_a_mistyped_variable_is_named_with_the_nearest_setting(tmp_path: Path) -> None:
    """`CMDBUS_SNYC=normal` was ignored without a word: the writer ran with sync=full."""
    typos = {"CMDBUS_SNYC": "normal", "CMDBUS_AUTH_TOKN": "x", "CMDBUS_ZZZZZZ": "1"}
    with serving(tmp_path, **typos) as (process, _):
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    warned = {
        line["variable"]: line["hint"]
        for line in map(json.loads, server_log(tmp_path).splitlines())
        if line["event"] == "unknown_variable"
    }
    assert warned == {
        "CMDBUS_SNYC": "did you mean CMDBUS_SYNC?",
        "CMDBUS_AUTH_TOKN": "did you mean CMDBUS_AUTH_TOKEN?",
        "CMDBUS_ZZZZZZ": "no setting has a name near it",
    }


@pytest.mark.parametrize(
    ("argv", "prefix"),
    [
        (["serve", "--ack-wait", "5"], "--ack-wait"),
        (["client", "claim", "--filter", "commands.>", "--time", "1"], "--time"),
        (["client", "tier", "read", "--execution-id", "1", "--ti", "eventlog"], "--ti"),
        (["bench", "--scenario", "stall", "--dur", "1"], "--dur"),
        (["diagnose", "--hum"], "--hum"),
    ],
)
def test_flags_are_never_matched_by_a_prefix(argv: list[str], prefix: str) -> None:
    """`serve --ack-wait 5` became `--ack-wait-ms 5`: a 5 ms lease."""
    result = subprocess.run(cli(*argv), capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert f"unrecognized arguments: {prefix}" in result.stderr


def test_help_texts_show_no_raw_markup() -> None:
    """`client --help` printed its docstring's ``literals`` and :roles:`x` raw."""
    import argparse

    from cmdbus_trio.cli import _parser

    def helps(parser: argparse.ArgumentParser) -> Iterator[str]:
        yield parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from helps(child)

    texts = list(helps(_parser()))
    assert len(texts) > 15
    for text in texts:
        assert "``" not in text and ":func:" not in text and ":class:" not in text, text
        assert "**" not in text, text
