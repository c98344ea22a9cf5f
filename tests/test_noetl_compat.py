"""Replacing a NoETL writer (issue 18): its environment names keep working, its lag ports
serve the lag series, and nothing NoETL-named is silently ignored."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import trio

from cmdbus_trio.client._shards import ShardMap
from cmdbus_trio.config import ConfigError, load
from cmdbus_trio.config.noetl import translate

from .helpers import cli, environment, frame_client, get, metric_sum, server_log, serving

# The NoETL writer's environment, as its deployment sets it (bus part).
NOETL_WRITER = {
    "NOETL_COMMAND_BUS_SHARD": "0",
    "NOETL_COMMAND_SHARD_COUNT": "1",
    "NOETL_COMMAND_BUS_WRITER_DIR": "/data/cmdbus",
    "NOETL_COMMAND_BUS_INGEST_BIND": "0.0.0.0:9100",
    "NOETL_COMMAND_BUS_CLAIM_BIND": "0.0.0.0:9101",
    "NOETL_COMMAND_BUS_METRICS_BIND": "0.0.0.0:9102",
    "NOETL_COMMAND_BUS_ACK_WAIT_SECS": "30",
    "NOETL_COMMAND_BUS_HOST": "true",
    "NOETL_EVENT_BUS_HOST": "true",
    "NOETL_EVENT_BUS_SHARD": "0",
    "NOETL_EVENT_SHARD_COUNT": "1",
    "NOETL_EVENT_BUS_INGEST_BIND": "0.0.0.0:9103",
    "NOETL_EVENT_BUS_CLAIM_BIND": "0.0.0.0:9104",
    "NOETL_EVENT_BUS_SSE_BIND": "0.0.0.0:9105",
    "NOETL_EVENT_BUS_METRICS_BIND": "0.0.0.0:9106",
    "NOETL_EVENT_BUS_ACK_WAIT_SECS": "30",
    "NOETL_EHDB_TIER_MAX_INFLIGHT": "4",
    "NOETL_SERVER_URL": "http://noetl-server:8082",
    "HOSTNAME": "noetl-cmdbus-writer-0",
}


def test_the_noetl_writer_environment_reads_as_settings() -> None:
    translated = translate(NOETL_WRITER)
    config = load({}, environ=translated.environ)
    assert (str(config.cmd_ingest_bind), str(config.cmd_claim_bind)) == (
        "0.0.0.0:9100",
        "0.0.0.0:9101",
    )
    assert (str(config.evt_ingest_bind), str(config.evt_claim_bind)) == (
        "0.0.0.0:9103",
        "0.0.0.0:9104",
    )
    assert (str(config.cmd_lag_bind), str(config.evt_lag_bind)) == (
        "0.0.0.0:9102",
        "0.0.0.0:9106",
    )
    assert (config.ack_wait_ms, config.tier_max_inflight, config.tier_max_waiters) == (
        30_000,
        4,
        32,  # 8 x inflight, as NoETL's 32 beside 4
    )
    assert ("NOETL_EHDB_TIER_MAX_INFLIGHT", "CMDBUS_TIER_MAX_INFLIGHT") in translated.used
    # Both agreeing aliases of one setting are used, and logged.
    assert ("NOETL_EVENT_BUS_ACK_WAIT_SECS", "CMDBUS_ACK_WAIT_MS") in translated.used
    assert len(translated.used) == 13
    # No equivalent: named, never silently dropped (HOSTNAME is not NoETL's).
    assert translated.ignored == (
        "NOETL_COMMAND_BUS_WRITER_DIR",
        "NOETL_EVENT_BUS_SSE_BIND",
        "NOETL_SERVER_URL",
    )


def test_a_cmdbus_variable_or_a_flag_wins_over_its_alias() -> None:
    environ = {"NOETL_EHDB_TIER_MAX_INFLIGHT": "4", "CMDBUS_TIER_MAX_INFLIGHT": "2"}
    translated = translate(environ)
    assert load({}, environ=translated.environ).tier_max_inflight == 2
    assert translated.used == () and translated.ignored == ("NOETL_EHDB_TIER_MAX_INFLIGHT",)
    flagged = translate({"NOETL_EHDB_TIER_MAX_INFLIGHT": "4"}, {"tier_max_inflight": "3"})
    assert load({"tier_max_inflight": "3"}, environ=flagged.environ).tier_max_inflight == 3


def test_a_bus_not_hosted_has_its_faces_off() -> None:
    translated = translate({"NOETL_COMMAND_BUS_HOST": "false", "NOETL_EVENT_BUS_HOST": "true"})
    config = load({}, environ=translated.environ)
    assert config.cmd_ingest_bind is None and config.cmd_claim_bind is None
    assert config.evt_ingest_bind is not None and config.evt_subscribe_bind is not None
    both = translate({"NOETL_COMMAND_BUS_HOST": "false", "NOETL_COMMAND_BUS_INGEST_BIND": ":9100"})
    assert load({}, environ=both.environ).cmd_ingest_bind is None  # not hosted wins
    assert both.ignored == ("NOETL_COMMAND_BUS_INGEST_BIND",)
    with pytest.raises(ConfigError) as info:
        translate({"NOETL_EVENT_BUS_HOST": "maybe"})
    assert str(info.value).startswith("invalid setting NOETL_EVENT_BUS_HOST (read as CMDBUS_")
    assert "'maybe': expected true or false" in str(info.value)


def test_a_hosted_bus_serves_its_lag_port_at_noetls_port() -> None:
    """A NoETL writer serves :9102 (commands) and :9106 (events), and KEDA scrapes them:
    `NOETL_*_BUS_HOST=true` opens them on CMDBUS_BIND_HOST unless a bind is given."""
    hosted = {"NOETL_COMMAND_BUS_HOST": "true", "NOETL_EVENT_BUS_HOST": "true"}
    config = load({}, environ=translate(hosted).environ)
    assert (str(config.cmd_lag_bind), str(config.evt_lag_bind)) == (
        "127.0.0.1:9102",
        "127.0.0.1:9106",
    )
    in_a_pod = translate(hosted | {"CMDBUS_BIND_HOST": "0.0.0.0"})
    config = load({}, environ=in_a_pod.environ)
    assert (str(config.cmd_lag_bind), str(config.control_bind)) == ("0.0.0.0:9102", "0.0.0.0:9090")
    assert (
        str(load({}, environ=translate(hosted | {"CMDBUS_BIND_HOST": "::"}).environ).cmd_lag_bind)
        == "[::]:9102"
    )
    given = hosted | {"NOETL_COMMAND_BUS_METRICS_BIND": "127.0.0.1:7", "CMDBUS_EVT_LAG_BIND": ""}
    config = load({}, environ=translate(given).environ)
    assert (str(config.cmd_lag_bind), config.evt_lag_bind) == ("127.0.0.1:7", None)
    assert load({}, environ=translate({}).environ).cmd_lag_bind is None  # not NoETL: off


def test_the_default_host_never_wins_over_a_noetl_value() -> None:
    """The image used to set every CMDBUS_*_BIND: they won over each NOETL_* bind, and
    NOETL_COMMAND_BUS_HOST=false did not turn the command bus off. It sets only the host
    of the default binds now."""
    image = {"CMDBUS_BIND_HOST": "0.0.0.0"}
    off = translate(image | {"NOETL_COMMAND_BUS_HOST": "false"})
    config = load({}, environ=off.environ)
    assert config.cmd_ingest_bind is None and config.cmd_lag_bind is None
    assert str(config.tier_bind) == "0.0.0.0:9110"
    moved = translate(image | {"NOETL_COMMAND_BUS_INGEST_BIND": "127.0.0.1:7100"})
    assert str(load({}, environ=moved.environ).cmd_ingest_bind) == "127.0.0.1:7100"


def test_two_aliases_of_one_setting_must_agree() -> None:
    agreeing = {"NOETL_COMMAND_BUS_ACK_WAIT_SECS": "30", "NOETL_EVENT_BUS_ACK_WAIT_SECS": "30"}
    assert load({}, environ=translate(agreeing).environ).ack_wait_ms == 30_000
    with pytest.raises(ConfigError, match=r"CMDBUS_ACK_WAIT_MS .*both set it, differently"):
        translate(agreeing | {"NOETL_EVENT_BUS_ACK_WAIT_SECS": "60"})


def test_a_bad_alias_value_is_refused_naming_the_variable_set(tmp_path: Path) -> None:
    """It was reported under the CMDBUS_* name, which the operator never wrote."""
    translated = translate({"NOETL_EHDB_TIER_MAX_INFLIGHT": "many"})
    with pytest.raises(ConfigError) as info:
        load({}, environ=translated.environ)
    assert translated.explain(info.value) == (
        "invalid setting NOETL_EHDB_TIER_MAX_INFLIGHT (read as CMDBUS_TIER_MAX_INFLIGHT): "
        "'many': expected an integer >= 1"
    )
    plain = pytest.raises(ConfigError)
    with plain as mine:
        load({}, environ={"CMDBUS_TIER_MAX_INFLIGHT": "many"})
    assert translate({}).explain(mine.value) == str(mine.value)  # not an alias's
    started = subprocess.run(
        cli("serve"),
        env=environment(tmp_path, NOETL_COMMAND_BUS_ACK_WAIT_SECS="0"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert started.returncode == 2
    assert started.stderr.startswith(
        "cmdbus-trio: invalid setting NOETL_COMMAND_BUS_ACK_WAIT_SECS (read as CMDBUS_ACK_WAIT_MS)"
    )


def test_the_clients_read_the_noetl_writer_addresses() -> None:
    environ = {"NOETL_COMMAND_BUS_WRITER_ADDRS": "0@a:9100,1@b:9100"}
    assert ShardMap.from_environ("commands", environ).addresses == ("a:9100", "b:9100")
    assert ShardMap.from_environ("events", environ) is None
    mine = environ | {"CMDBUS_CMD_WRITERS": "0@c:9100"}
    assert ShardMap.from_environ("commands", mine).addresses == ("c:9100",)  # type: ignore[union-attr]


@pytest.mark.once
async def test_a_writer_started_with_noetl_names_serves_the_lag_ports(tmp_path: Path) -> None:
    """The old scrape ports answer with their bus's lag series (and only those: a scrape
    of the control port holds everything), from the control nursery; the aliases used are
    logged once, the rest named in one warning."""
    env = {
        "NOETL_COMMAND_BUS_METRICS_BIND": "127.0.0.1:0",
        "NOETL_EVENT_BUS_METRICS_BIND": "127.0.0.1:0",
        "NOETL_EHDB_TIER_MAX_INFLIGHT": "4",
        "NOETL_EVENT_BUS_KV_BIND": "0.0.0.0:9107",
    }
    with trio.fail_after(30), serving(tmp_path, **env) as (process, ports):
        async with frame_client(ports["cmd_ingest"]) as ingest:
            record = {"execution_id": 1, "payload": json.dumps({"execution_pool": "shared"})}
            assert (await ingest.request("publish_batch", records=[record]))["ok"]
        await trio.sleep(1.5)  # the lag sampler runs every second
        commands = (await get(ports["cmd_lag"], "/metrics")).body.decode()
        events = (await get(ports["evt_lag"], "/metrics")).body.decode()
        assert metric_sum(commands, "ehdb_feed_total_lag ") == 1
        assert metric_sum(commands, 'ehdb_feed_shard_lag{shard="0"}') == 1
        assert metric_sum(commands, 'ehdb_feed_subject_lag{subject="commands.shared') == 1
        assert "ehdb_events_group_lag" not in commands and "cmdbus_" not in commands
        assert 'ehdb_events_group_lag{group="noetl_materializer"}' in events
        assert "ehdb_feed_" not in events
        assert (await get(ports["cmd_lag"], "/")).status == 200  # any path, as NoETL's
        async with frame_client(ports["cmd_claim"]) as claim:
            delivery = (await claim.request("next", filter=">", timeout_ms=2000))["delivery"]
            await trio.sleep(1.5)
            leased = (await get(ports["cmd_lag"], "/metrics")).body.decode()
            assert metric_sum(leased, 'ehdb_feed_shard_inflight{shard="0"}') == 1
            assert metric_sum(leased, "ehdb_feed_total_inflight ") == 1
            assert metric_sum(leased, 'ehdb_feed_shard_committed{shard="0"}') == 0
            await claim.request("ack", sort_key=delivery["sort_key"])
            await trio.sleep(1.5)
            acked = (await get(ports["cmd_lag"], "/metrics")).body.decode()
            assert metric_sum(acked, 'ehdb_feed_shard_committed{shard="0"}') == 1
            assert metric_sum(acked, "ehdb_feed_total_lag ") == 0
        # The command line publishes to the writers NoETL's variable names.
        published = await trio.to_thread.run_sync(
            lambda: subprocess.run(
                cli("client", "publish", "--execution-id", "2", "--payload", "{}"),
                env=environment(
                    tmp_path, NOETL_COMMAND_BUS_WRITER_ADDRS=f"0@{ports['cmd_ingest']}"
                ),
                capture_output=True,
                text=True,
                timeout=20,
            )
        )
        assert published.returncode == 0, published.stderr
        assert json.loads(published.stdout)["sort_key"] == 2
        process.terminate()
        process.wait(timeout=20)
    log = server_log(tmp_path)
    aliases = [line for line in log.splitlines() if '"noetl_alias"' in line]
    assert len(aliases) == 3 and any("NOETL_EHDB_TIER_MAX_INFLIGHT" in a for a in aliases)
    (ignored,) = [line for line in log.splitlines() if '"noetl_ignored"' in line]
    assert "NOETL_EVENT_BUS_KV_BIND" in ignored
