from __future__ import annotations

import io
from pathlib import Path

import pytest

from cmdbus_trio.config import (
    FACE_NAMES,
    SETTINGS,
    Bind,
    ConfigError,
    cpu_quota,
    load,
)


def test_defaults_follow_the_design(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("300000 100000\n")
    config = load({}, environ={}, cgroup_root=tmp_path)
    assert config.data_dir == Path("./cmdbus-data")
    assert config.enabled_faces() == {
        "control": Bind("127.0.0.1", 9090),
        "cmd_ingest": Bind("127.0.0.1", 9100),
        "cmd_claim": Bind("127.0.0.1", 9101),
        "evt_ingest": Bind("127.0.0.1", 9103),
        "evt_claim": Bind("127.0.0.1", 9104),
        "evt_subscribe": Bind("127.0.0.1", 9108),
        "tier": Bind("127.0.0.1", 9110),
    }
    assert (config.tier_max_inflight, config.tier_max_waiters) == (3, 24)
    assert config.tier_shed_after_ms == 1000
    assert (config.max_request_bytes, config.max_reply_bytes) == (1 << 20, 16 << 20)
    assert (config.shard, config.shard_count, config.sync) == (0, 1, "full")
    assert (config.ack_wait_ms, config.max_deliver) == (30000, 0)
    assert (config.shutdown_timeout_ms, config.idle_timeout_ms) == (15000, 300000)
    assert (config.read_timeout_ms, config.dedup_window_ms) == (30000, 120000)
    assert config.evt_groups == (
        "noetl_materializer",
        "noetl_result_materializer",
        "noetl_state_materializer",
    )
    assert config.subscriber_buffer == 10000
    assert config.control_keepalive_ms == 5000
    assert config.auth_token is None and config.tls_cert is None and config.ports_file is None
    assert (config.log_format, config.log_level) == ("auto", "info")
    # auto is the design's json wherever the log is read by a machine (not a terminal)
    from cmdbus_trio.logs import resolved

    assert resolved(config.log_format, io.StringIO()) == "json"
    assert resolved("json", _Terminal()) == "json"
    assert resolved("auto", _Terminal()) == "console"


def test_every_setting_has_one_env_name_and_one_flag() -> None:
    envs = [setting.env for setting in SETTINGS]
    assert len(set(envs)) == len(envs)
    assert all(env.startswith("CMDBUS_") and env == env.upper() for env in envs)
    for name in (
        "CMDBUS_DATA_DIR",
        "CMDBUS_PORTS_FILE",
        "CMDBUS_TIER_MAX_INFLIGHT",
        "CMDBUS_SHUTDOWN_TIMEOUT_MS",
        "CMDBUS_SUBSCRIBER_BUFFER",
        "CMDBUS_AUTH_TOKEN",
        "CMDBUS_LOG_LEVEL",
        *(f"CMDBUS_{face.upper()}_BIND" for face in FACE_NAMES),
    ):
        assert name in envs


def test_flag_wins_over_env_which_wins_over_default() -> None:
    assert load({}, environ={"CMDBUS_SHARD_COUNT": "4"}).shard_count == 4
    assert load({"shard_count": "8"}, environ={"CMDBUS_SHARD_COUNT": "4"}).shard_count == 8
    assert load({"shard_count": None}, environ={"CMDBUS_SHARD_COUNT": "4"}).shard_count == 4


def test_empty_bind_disables_a_face() -> None:
    config = load({}, environ={"CMDBUS_TIER_BIND": "", "CMDBUS_CMD_CLAIM_BIND": " "})
    assert "tier" not in config.enabled_faces()
    assert "cmd_claim" not in config.enabled_faces()
    assert config.bind("tier") is None


@pytest.mark.parametrize(
    ("text", "bind"),
    [
        ("0.0.0.0:9110", Bind("0.0.0.0", 9110)),
        ("localhost:0", Bind("localhost", 0)),
        ("[::1]:80", Bind("::1", 80)),
    ],
)
def test_binds_parse(text: str, bind: Bind) -> None:
    assert load({"tier_bind": text}, environ={}).tier_bind == bind


def test_bind_str_round_trips() -> None:
    assert str(Bind("::1", 80)) == "[::1]:80"
    assert str(Bind("127.0.0.1", 0)) == "127.0.0.1:0"


@pytest.mark.parametrize(
    ("env", "value", "allowed"),
    [
        ("CMDBUS_TIER_BIND", "9110", "expected HOST:PORT"),
        ("CMDBUS_TIER_BIND", "host:99999", "port must be 0..65535"),
        ("CMDBUS_CONTROL_BIND", "a b:1", "expected HOST:PORT"),
        ("CMDBUS_SHARD_COUNT", "0", "an integer >= 1"),
        ("CMDBUS_SHARD", "-1", "an integer >= 0"),
        ("CMDBUS_ACK_WAIT_MS", "soon", "an integer >= 1"),
        ("CMDBUS_TIER_MAX_INFLIGHT", "0", "an integer >= 1"),
        ("CMDBUS_TIER_MAX_WAITERS", "-3", "an integer >= 0"),
        ("CMDBUS_MAX_REQUEST_BYTES", "10", "an integer >= 64"),
        ("CMDBUS_SYNC", "off", "one of full, normal"),
        ("CMDBUS_LOG_FORMAT", "xml", "one of auto, json, console"),
        ("CMDBUS_LOG_LEVEL", "loud", "one of debug, info, warning, error"),
        ("CMDBUS_EVT_GROUPS", "a,b c", "group 'b c'"),
        ("CMDBUS_EVT_GROUPS", "a,a", "unique"),
        ("CMDBUS_DEBUG_HOOKS", "maybe", "true or false"),
        ("CMDBUS_SWITCH_INTERVAL_MS", "0", "a positive number"),
        ("CMDBUS_SWITCH_INTERVAL_MS", "nan", "a positive number"),
        ("CMDBUS_EVT_MAX_BYTES", "1048575", "0 (no cap) or an integer >= 1048576"),
        ("CMDBUS_EVT_MAX_BYTES", "-1", "0 (no cap) or an integer >= 1048576"),
    ],
)
def test_bad_values_name_the_setting_the_value_and_what_is_allowed(
    env: str, value: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load({}, environ={env: value})
    message = str(info.value)
    assert message.startswith(f"invalid setting {env} (--")
    assert repr(value) in message
    assert allowed in message


@pytest.mark.parametrize(
    ("bind", "token", "allowed"),
    [
        ("0.0.0.0:9090", "", False),
        ("[::]:9090", "", False),
        ("control.example:9090", "", False),
        ("0.0.0.0:9090", "sesame", True),
        ("127.0.0.1:9090", "", True),
        ("[::1]:9090", "", True),
        ("localhost:9090", "", True),
    ],
)
def test_debug_hooks_beyond_loopback_need_a_token(bind: str, token: str, allowed: bool) -> None:
    environ = {"CMDBUS_DEBUG_HOOKS": "true", "CMDBUS_CONTROL_BIND": bind}
    if token:
        environ["CMDBUS_AUTH_TOKEN"] = token
    if allowed:
        assert load({}, environ=environ).debug_hooks
    else:
        with pytest.raises(ConfigError, match="CMDBUS_AUTH_TOKEN") as info:
            load({}, environ=environ)
        assert str(info.value).startswith("invalid setting CMDBUS_DEBUG_HOOKS")


def test_shard_must_be_below_shard_count() -> None:
    with pytest.raises(ConfigError, match=r"CMDBUS_SHARD .*'2'.*below CMDBUS_SHARD_COUNT=2"):
        load({"shard": "2", "shard_count": "2"}, environ={})
    assert load({"shard": "1", "shard_count": "2"}, environ={}).shard == 1


def test_shard_auto_is_the_statefulset_ordinal() -> None:
    environ = {"CMDBUS_SHARD": "auto", "CMDBUS_SHARD_COUNT": "3", "HOSTNAME": "cmdbus-trio-2"}
    assert load({}, environ=environ).shard == 2
    with pytest.raises(ConfigError, match=r"'auto'.*'writer' does not end in a StatefulSet"):
        load({}, environ={**environ, "HOSTNAME": "writer"})
    with pytest.raises(ConfigError, match=r"'2': must be below CMDBUS_SHARD_COUNT=2"):
        load({"shard_count": "2"}, environ=environ)
    with pytest.raises(ConfigError, match=r"CMDBUS_SHARD .*'x'.*integer >= 0 or auto"):
        load({"shard": "x"}, environ={})


def test_pod_labels_need_a_kubernetes_lease() -> None:
    for lease in ("", "file:/tmp/lease"):
        with pytest.raises(ConfigError, match=r"CMDBUS_HA_POD_LABELS .*need a kubernetes: lease"):
            load({"ha_pod_labels": "true", "ha_lease": lease}, environ={})
    config = load({"ha_pod_labels": "true", "ha_lease": "kubernetes:ns/shard-0"}, environ={})
    assert config.ha_pod_labels and config.ha_kube_service_account == Path(
        "/var/run/secrets/kubernetes.io/serviceaccount"
    )


def test_a_command_while_primary_is_checked_before_the_writer_starts() -> None:
    lease = {"ha_lease": "file:/tmp/lease"}
    with pytest.raises(ConfigError, match=r"CMDBUS_HA_WHILE_PRIMARY .*needs CMDBUS_HA_LEASE"):
        load({"ha_while_primary": "true"}, environ={})
    with pytest.raises(ConfigError, match=r"no-such-litestream: no such program"):
        load({"ha_while_primary": "no-such-litestream replicate", **lease}, environ={})
    with pytest.raises(ConfigError, match=r"CMDBUS_HA_WHILE_PRIMARY .*not a command line"):
        load({"ha_while_primary": "true 'unclosed", **lease}, environ={})
    config = load({"ha_while_primary": "true -config '/etc/a b.yml'", **lease}, environ={})
    assert config.ha_while_primary == ("true", "-config", "/etc/a b.yml")
    assert load(lease, environ={}).ha_while_primary == ()


def test_tls_needs_both_halves() -> None:
    with pytest.raises(ConfigError, match=r"CMDBUS_TLS_KEY.*needs both"):
        load({"tls_cert": "cert.pem"}, environ={})
    with pytest.raises(ConfigError, match=r"CMDBUS_TLS_CERT.*needs both"):
        load({"tls_key": "key.pem"}, environ={})
    with pytest.raises(ConfigError, match=r"CMDBUS_TLS_CERT \(--tls-cert\): 'c.pem': no such file"):
        load({"tls_cert": "c.pem", "tls_key": "k.pem"}, environ={})


def test_two_faces_cannot_share_an_address_but_port_zero_is_free() -> None:
    with pytest.raises(ConfigError, match=r"CMDBUS_TIER_BIND.*already used by the control face"):
        load({"control_bind": "127.0.0.1:7000", "tier_bind": "127.0.0.1:7000"}, environ={})
    load({"control_bind": "127.0.0.1:0", "tier_bind": "127.0.0.1:0"}, environ={})


def test_waiters_default_follows_inflight() -> None:
    config = load({"tier_max_inflight": "5"}, environ={})
    assert config.tier_max_waiters == 40
    assert (
        load({"tier_max_inflight": "5", "tier_max_waiters": "0"}, environ={}).tier_max_waiters == 0
    )


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [("200000 100000", 2), ("150000 100000", 2), ("50000 100000", 1), ("100000 100000", 1)],
)
def test_cpu_quota_reads_cgroup_v2(tmp_path: Path, cpu_max: str, expected: int) -> None:
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    assert cpu_quota(tmp_path) == expected


def test_cpu_quota_falls_back_to_the_cpu_count(tmp_path: Path) -> None:
    import os

    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(tmp_path) == len(os.sched_getaffinity(0))
    assert cpu_quota(tmp_path / "missing") == len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("garbage")
    assert cpu_quota(tmp_path) >= 1


def test_redacted_hides_the_token_and_is_json() -> None:
    import json

    shown = load({"auth_token": "s3cret"}, environ={}).redacted()
    assert shown["auth_token"] == "***"
    assert "s3cret" not in json.dumps(shown)
    assert shown["tier_bind"] == "127.0.0.1:9110"


def test_docs_list_every_setting() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    for setting in SETTINGS:
        assert f"| `{setting.env}` | `--{setting.flag}` |" in docs, setting.env


@pytest.mark.parametrize(("value", "cap"), [("0", 0), ("1048576", 1 << 20), ("5000000", 5_000_000)])
def test_the_event_log_cap_is_off_or_at_least_a_mebibyte(value: str, cap: int) -> None:
    assert load({}, environ={"CMDBUS_EVT_MAX_BYTES": value}).evt_max_bytes == cap


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True
