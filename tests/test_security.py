"""Auth token, v1 from listed networks, TLS on the data faces, and the connection cap,
against `cmdbus-trio serve` subprocesses."""

from __future__ import annotations

import json
import socket
import ssl
import urllib.request
from pathlib import Path

import pytest
import trio
import trustme

from cmdbus_trio.client import ConnectionLost, Invalid, blocking
from cmdbus_trio.client.trio import TierClient
from cmdbus_trio.config import ConfigError, load
from cmdbus_trio.protocol import encode_frame

from .helpers import frame_client, metric_sum, metrics_text, serving

TOKEN = "s3cret-token"


def status(ports: dict[str, str], path: str) -> int:
    with urllib.request.urlopen(f"http://{ports['control']}{path}", timeout=5) as response:
        return int(response.status)


def connections(text: str, face: str, outcome: str) -> float:
    return metric_sum(text, f'cmdbus_connections_total{{face="{face}",outcome="{outcome}"}} ')


async def v1_health(address: str) -> bytes | None:
    async with frame_client(address, v2=False) as client:
        return await client.v1(b"health")


async def test_a_token_is_required_in_the_v2_hello(tmp_path: Path) -> None:
    with serving(tmp_path, CMDBUS_AUTH_TOKEN=TOKEN) as (_, ports), trio.fail_after(30):
        async with await TierClient.connect(ports["tier"], token=TOKEN) as tier:
            assert (await tier.health())["status"] == "ok"
        for token in (None, "wrong"):
            with pytest.raises(Invalid, match=r"hello\.token"):
                await TierClient.connect(ports["tier"], token=token)
        assert await v1_health(ports["tier"]) is None  # v1: closed, no answer
        text = await trio.to_thread.run_sync(metrics_text, ports)  # the control face needs none
        assert connections(text, "tier", "unauthorized") == 3
        assert await trio.to_thread.run_sync(status, ports, "/readyz") == 200


async def test_v1_is_allowed_only_from_listed_networks(tmp_path: Path) -> None:
    allowed = {"CMDBUS_AUTH_TOKEN": TOKEN, "CMDBUS_ALLOW_V1": "true"}
    with serving(tmp_path, **allowed, CMDBUS_V1_CIDRS="127.0.0.0/8") as (_, ports):
        with trio.fail_after(30):
            assert await v1_health(ports["tier"]) == b"ok tier-service v1"
    with serving(tmp_path, **allowed, CMDBUS_V1_CIDRS="10.0.0.0/8,::1/128") as (_, ports):
        with trio.fail_after(30):
            assert await v1_health(ports["tier"]) is None


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def tls_env(tmp_path: Path, ca: trustme.CA) -> dict[str, str]:
    pem = tmp_path / "server.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    return {"CMDBUS_TLS_CERT": str(pem), "CMDBUS_TLS_KEY": str(pem)}


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


async def test_tls_on_the_data_faces(tmp_path: Path, ca: trustme.CA) -> None:
    with serving(tmp_path, **tls_env(tmp_path, ca)) as (_, ports), trio.fail_after(30):
        context = client_context(ca)
        async with await TierClient.connect(ports["tier"], ssl_context=context) as tier:
            await tier.append("e", "{}")
            assert (await tier.read_execution("e")).record_count == 1
        with blocking.IngestClient.connect(ports["cmd_ingest"], ssl_context=context) as ingest:
            assert ingest.publish({"execution_id": 1, "payload": "{}"}).sort_key == 1
        # A client that does not trust the CA, and one that does not speak TLS, fail.
        with pytest.raises(ConnectionLost, match="CERTIFICATE_VERIFY_FAILED"):
            await TierClient.connect(ports["tier"], ssl_context=ssl.create_default_context())
        with pytest.raises(ConnectionLost):
            await TierClient.connect(ports["tier"], connect_timeout=2)
        # The control face stays plain HTTP: probes and scrapes need no certificate.
        assert "cmdbus_connections_total" in await trio.to_thread.run_sync(metrics_text, ports)


@pytest.mark.parametrize("fault", ["missing cert", "missing key", "not a certificate"])
def test_a_bad_certificate_fails_the_start_naming_the_file(tmp_path: Path, fault: str) -> None:
    """A missing certificate failed the start naming neither the file nor the setting."""
    pem = tmp_path / "pem"
    pem.write_text("not a certificate")
    cert, key = str(pem), str(pem)
    if fault == "missing cert":
        cert = str(tmp_path / "no.pem")
    elif fault == "missing key":
        key = str(tmp_path / "no-key.pem")
    env = {"CMDBUS_TLS_CERT": cert, "CMDBUS_TLS_KEY": key}
    with pytest.raises(AssertionError, match="no ports file"), serving(tmp_path, **env):
        pass
    (line,) = (tmp_path / "server.log").read_text().splitlines()
    named = {
        "missing cert": ("CMDBUS_TLS_CERT", cert, "no such file"),
        "missing key": ("CMDBUS_TLS_KEY", key, "no such file"),
        "not a certificate": ("CMDBUS_TLS_CERT", cert, "not a PEM certificate"),
    }[fault]
    assert line.startswith(f"cmdbus-trio: invalid setting {named[0]} ")
    assert f"{named[1]!r}: {named[2]}" in line


async def test_connections_over_the_cap_are_closed_and_counted(tmp_path: Path) -> None:
    with serving(tmp_path, CMDBUS_MAX_CONNECTIONS="2") as (_, ports), trio.fail_after(30):
        first = await TierClient.connect(ports["tier"])
        second = await TierClient.connect(ports["tier"])
        with pytest.raises(ConnectionLost):
            await TierClient.connect(ports["tier"])
        await first.aclose()
        while True:  # the server sees the close soon
            try:
                third = await TierClient.connect(ports["tier"])
                break
            except ConnectionLost:
                await trio.sleep(0.05)
        assert (await third.health())["status"] == "ok"
        assert (await second.health())["status"] == "ok"
        text = await trio.to_thread.run_sync(metrics_text, ports)
        assert connections(text, "tier", "over_capacity") >= 1
        # Other faces have their own cap.
        async with await TierClient.connect(ports["cmd_ingest"]) as other:
            assert other.server is not None
        await second.aclose()
        await third.aclose()


@pytest.mark.parametrize(
    ("env", "value", "allowed"),
    [
        ("CMDBUS_V1_CIDRS", "10.0.0.0/8,nope", "'nope' is not a network"),
        ("CMDBUS_MAX_CONNECTIONS", "0", "an integer >= 1"),
        ("CMDBUS_ALLOW_V1", "maybe", "expected true or false"),
    ],
)
def test_security_settings_are_checked(env: str, value: str, allowed: str) -> None:
    with pytest.raises(ConfigError, match=allowed):
        load({}, environ={env: value})


def test_raw_tls_garbage_does_not_hurt_the_face(tmp_path: Path, ca: trustme.CA) -> None:
    """A client that sends plain frames to a TLS face is cut off; the face serves on."""
    with serving(tmp_path, **tls_env(tmp_path, ca)) as (_, ports):
        host, port = ports["tier"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(encode_frame(json.dumps({"hello": {"protocol": 2}}).encode()))
            assert raw.recv(100) == b""
        with blocking.TierClient.connect(ports["tier"], ssl_context=client_context(ca)) as tier:
            assert tier.health()["status"] == "ok"


def test_the_command_line_speaks_token_and_tls(tmp_path: Path, ca: trustme.CA) -> None:
    import subprocess

    from .helpers import cli

    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    env = {**tls_env(tmp_path, ca), "CMDBUS_AUTH_TOKEN": TOKEN}
    with serving(tmp_path, **env) as (_, ports):
        publish = [*cli("client", "publish", "--addr", ports["cmd_ingest"]), "--execution-id", "1"]
        ok = subprocess.run(
            [*publish, "--payload", "{}", "--token", TOKEN, "--tls-ca", str(ca_file)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["sort_key"] == 1
        refused = subprocess.run(
            [*publish, "--payload", "{}", "--tls-ca", str(ca_file)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert refused.returncode == 1 and "hello.token" in refused.stderr
