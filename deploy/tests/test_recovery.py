"""The recovery parts of deploy/ followed on this machine as a cluster would run them: the
backup CronJob's script (with a kubectl that execs here) against a serving writer, and the
litestream overlay's sidecar and init containers (their shell, with the volume's and the
ConfigMap's paths pointed at temp dirs) through the loss of a volume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from test_deploy import built_documents, by_kind, need, running_image_entrypoint

from cmdbus_trio.client.blocking import ClaimClient, IngestClient, TierClient
from cmdbus_trio.storage.restores import REPLICA_KEY_JUMP

BIN = Path(sys.executable).parent  # cmdbus-trio and litestream, as the images have them

FAKE_KUBECTL = """#!/bin/sh
# kubectl as backup.sh uses it, on one machine: `get pods` lists $PODS; `exec POD ... -- CMD`
# runs CMD here, and fails for a pod named pod/broken.
pod=""
while [ $# -gt 0 ]; do
    case "$1" in
        get) echo "$PODS"; exit 0 ;;
        exec) shift; pod=$1 ;;
        --) shift; [ "$pod" = pod/broken ] && exit 1; exec "$@" ;;
    esac
    shift
done
exit 2
"""


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def next_second() -> None:
    """The script names a backup by the second; two runs in one second would collide."""
    time.sleep(1.05 - time.time() % 1)


def test_the_backup_cronjob_backs_up_every_pod_and_keeps_the_newest(tmp_path: Path) -> None:
    docs = built_documents("example")
    (cronjob,) = by_kind(docs, "CronJob")
    pod = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (job,) = pod["containers"]
    assert job["command"] == ["sh", "/scripts/backup.sh"]
    (config_map,) = [d for d in by_kind(docs, "ConfigMap") if "backup.sh" in d.get("data", {})]
    assert pod["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]
    (statefulset,) = by_kind(docs, "StatefulSet")
    writer = statefulset["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "backups", "mountPath": "/backups"} in writer["volumeMounts"]
    claims = [t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]]
    assert claims == ["data", "backups"]
    keep = {e["name"]: e.get("value") for e in job["env"]}["KEEP"]
    assert keep == "7"

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(FAKE_KUBECTL)
    (bin_dir / "kubectl").chmod(0o755)
    script = tmp_path / "backup.sh"
    script.write_text(config_map["data"]["backup.sh"])
    backups = tmp_path / "backups"
    (backups / "20200101T000000Z").mkdir(parents=True)  # an old one that never finished
    (backups / "notes").mkdir()  # not the script's: left alone
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{BIN}:{os.environ['PATH']}",
        "PODS": "pod/cmdbus-trio-0",
        "DATA_DIR": str(tmp_path / "data"),
        "BACKUPS": str(backups),
        "KEEP": "2",
    }

    def run(**extra: str) -> subprocess.CompletedProcess[str]:
        next_second()
        command = ["sh", str(script)]
        return subprocess.run(command, env=env | extra, capture_output=True, text=True, timeout=120)

    with running_image_entrypoint(tmp_path) as ports, IngestClient(ports["cmd_ingest"]) as ingest:
        for _ in range(3):
            published = ingest.publish({"execution_id": 1, "payload": "{}"}).sort_key
            done = run()
            assert done.returncode == 0, done.stderr
            commands = json.loads(done.stdout.splitlines()[0])
            assert commands["sequences"]["records"] == published  # the writer served on
        failed = run(PODS="pod/broken pod/cmdbus-trio-0")
    assert failed.returncode == 1 and "the backup of pod/broken failed" in failed.stderr
    kept = sorted(p.name for p in backups.iterdir())
    assert len(kept) == 3 and kept[-1] == "notes"  # the two newest, and what is not ours
    newest = backups / kept[1]
    assert (newest / "manifest.json").exists()
    restored = tmp_path / "restored"
    restore = [str(BIN / "cmdbus-trio"), "restore", "--from", str(newest), "--json"]
    done = subprocess.run([*restore, "--data-dir", str(restored)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    check = [str(BIN / "cmdbus-trio"), "check", "--data-dir", str(restored), "--json"]
    assert subprocess.run(check, capture_output=True).returncode == 0


def litestream_pod(
    tmp_path: Path, overlay: str, **env: str
) -> tuple[dict[str, Any], Callable[[str], str], dict[str, str]]:
    """The writer pod of a Litestream overlay, its volume at ``tmp_path/data`` and its
    ConfigMap's folder at ``tmp_path/etc``: the pod's spec, what makes a path of the pod
    this machine's, and the environment its containers see (the replica a directory)."""
    need("litestream")
    docs = built_documents(overlay)
    (statefulset,) = by_kind(docs, "StatefulSet")
    (config_map,) = [d for d in by_kind(docs, "ConfigMap") if "litestream" in d["metadata"]["name"]]
    data, etc = tmp_path / "data", tmp_path / "etc"

    def here(text: str) -> str:
        return text.replace("/var/lib/cmdbus", str(data)).replace("/etc/litestream", str(etc))

    etc.mkdir()
    (etc / "litestream.yml").write_text(here(config_map["data"]["litestream.yml"]))
    replica = f"file://{tmp_path / 'replica'}"
    path = f"{BIN}:{os.environ['PATH']}"
    environment = {**os.environ, "PATH": path, "LITESTREAM_REPLICA_URL": replica, **env}
    return statefulset["spec"]["template"]["spec"], here, environment


def processes_naming(path: Path) -> list[str]:
    """The pids of the processes with ``path`` in their command lines."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(path).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            continue  # (gone meanwhile)
    return pids


def init_containers(pod: dict[str, Any], here: Any, env: dict[str, str]) -> list[str]:
    """Each init container's shell, in order, as the pod runs them; their output."""
    outputs = []
    for init in pod["initContainers"]:
        command = [*init["command"], here(init["args"][0])]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (init["name"], done.stderr)
        outputs.append(done.stdout)
    return outputs


def test_the_litestream_overlay_brings_a_lost_volume_back_as_its_pod_would(
    tmp_path: Path,
) -> None:
    pod, here, env = litestream_pod(tmp_path, "litestream", POD_NAME="cmdbus-trio-0")
    sidecar = {c["name"]: c for c in pod["containers"]}["litestream"]
    data = tmp_path / "data"
    data.mkdir()  # a new deployment's volume: nothing to restore, nothing changed
    init_containers(pod, here, env)
    assert list(data.iterdir()) == []

    settings = {"CMDBUS_CHECKPOINTS": "litestream"}
    with running_image_entrypoint(tmp_path, settings) as ports:
        replicate = [str(BIN / "litestream"), *(here(a) for a in sidecar["args"])]
        litestream = subprocess.Popen(replicate, env=env, stderr=subprocess.DEVNULL)
        try:
            with IngestClient(ports["cmd_ingest"]) as ingest:
                keys = [ingest.publish({"execution_id": n, "payload": "{}"}).sort_key
                        for n in range(100)]  # fmt: skip
            with ClaimClient(ports["cmd_claim"]) as claim:
                taken = claim.next_batch("commands.>", 20, wait=5)
                assert all(claim.ack_many([d.sort_key for d in taken]))
            with TierClient(ports["tier"]) as tier:
                for n in range(5):
                    tier.append("exec-1", json.dumps({"event_id": f"e{n}"}))
            time.sleep(3)  # Litestream syncs every second
        finally:
            litestream.send_signal(signal.SIGKILL)
            litestream.wait()
    # The node and its disk are gone: the pod starts again on a new, empty volume.
    shutil.rmtree(data)
    data.mkdir()
    (tmp_path / "ports.json").unlink()
    _, moved = init_containers(pod, here, env)
    assert {"commands.sqlite3", "events.sqlite3", "tier.sqlite3"} <= {
        p.name for p in data.iterdir()
    }
    assert json.loads(moved.splitlines()[0])["key_jump"] == REPLICA_KEY_JUMP
    assert not (data / ".restored-from-replica").exists()
    before = snapshot(data)
    init_containers(pod, here, env)  # a restart on the restored volume changes nothing
    assert snapshot(data) == before

    with running_image_entrypoint(tmp_path, settings) as ports:
        with ClaimClient(ports["cmd_claim"]) as claim:
            assert claim.lag().total == len(keys) - len(taken)
        with TierClient(ports["tier"]) as tier:
            assert tier.read_execution("exec-1").record_count == 5
        with IngestClient(ports["cmd_ingest"]) as ingest:
            fresh = ingest.publish({"execution_id": 1, "payload": "{}"}).sort_key
            assert fresh >= keys[-1] + REPLICA_KEY_JUMP


def test_a_pair_member_runs_the_overlays_litestream_and_restores_only_when_asked(
    tmp_path: Path,
) -> None:
    """deploy/k8s/overlays/ha-litestream as its pod would run it: the member replicates
    with the overlay's command and configuration while primary. Its volume lost, the init
    containers leave it empty (the member would copy its primary) unless the pod is
    annotated, and then restore it and move its keys on."""
    pod, here, env = litestream_pod(tmp_path, "ha-litestream", CMDBUS_SHARD="0")
    writer = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    data, etc = tmp_path / "data", tmp_path / "etc"
    settings = {
        "PATH": env["PATH"],
        "LITESTREAM_REPLICA_URL": env["LITESTREAM_REPLICA_URL"],
        "CMDBUS_SHARD": "0",
        "CMDBUS_CHECKPOINTS": writer["CMDBUS_CHECKPOINTS"],
        "CMDBUS_HA_WHILE_PRIMARY": here(writer["CMDBUS_HA_WHILE_PRIMARY"]),
        "CMDBUS_HA_LEASE": f"file:{tmp_path / 'lease'}",
        "CMDBUS_HA_NAME": "cmdbus-trio-0-0",
        "CMDBUS_HA_BIND": "127.0.0.1:0",
    }
    server = running_image_entrypoint(tmp_path, settings)
    ports = server.__enter__()
    try:
        with IngestClient(ports["cmd_ingest"]) as ingest:  # (a member alone: primary)
            keys = [ingest.publish({"execution_id": n, "payload": "{}"}).sort_key
                    for n in range(100)]  # fmt: skip
        time.sleep(3)  # Litestream syncs every second
        server.process.send_signal(signal.SIGTERM)  # it stops its Litestream, then exits
        assert server.process.wait(timeout=30) == 0
    finally:
        server.__exit__()
    assert not processes_naming(etc)  # its Litestream stopped with it
    assert (tmp_path / "replica" / "shard-0" / "commands").is_dir()
    shutil.rmtree(data)
    data.mkdir()
    init_containers(pod, here, env | {"RESTORE_FROM_REPLICA": ""})  # (no annotation)
    assert list(data.iterdir()) == []
    _, moved = init_containers(pod, here, env | {"RESTORE_FROM_REPLICA": "true"})
    assert {"commands.sqlite3", "events.sqlite3", "tier.sqlite3"} <= {
        p.name for p in data.iterdir()
    }
    assert json.loads(moved.splitlines()[0])["key_jump"] == REPLICA_KEY_JUMP
    before = snapshot(data)
    init_containers(pod, here, env | {"RESTORE_FROM_REPLICA": "true"})  # a restart: nothing
    assert snapshot(data) == before
    (tmp_path / "ports.json").unlink()
    settings = {"CMDBUS_CHECKPOINTS": "litestream"}
    with (
        running_image_entrypoint(tmp_path, settings) as ports,
        ClaimClient(ports["cmd_claim"]) as claim,
    ):
        assert claim.lag().total == len(keys)
