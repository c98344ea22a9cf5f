"""The HA overlays (deploy/k8s/overlays/ha and ha-three-shards), read as rendered: per
shard a StatefulSet of two pods that never share a node, a budget that keeps one, a
client Service that selects only the primary, RBAC for nothing beyond the shard's Lease
and its pods' labels, no preStop between SIGTERM and the hand-over, and an environment
that the writer's own settings accept as a member's of that shard."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_deploy import (
    K8S,
    SHUTDOWN_TIMEOUT_S,
    built_documents,
    by_kind,
    client_selector,
    container,
    need,
)

from cmdbus_trio.config import load
from cmdbus_trio.member import HAND_OVER_WAIT_S

SHARD_LABEL = "cmdbus-trio.io/shard"
ROLE_LABEL = "cmdbus-trio.io/role"
OVERLAYS = {"ha": 1, "ha-three-shards": 3, "ha-litestream": 1}


def named(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in by_kind(docs, kind)}


def pod_env(statefulset: dict[str, Any], ordinal: int) -> dict[str, str]:
    """The writer's environment in pod ``ordinal``, as the kubelet makes it: fieldRefs
    read off the pod, ``$(VAR)`` expanded from the variables defined above."""
    template = statefulset["spec"]["template"]
    pod = {
        "metadata.name": f"{statefulset['metadata']['name']}-{ordinal}",
        "metadata.namespace": statefulset["metadata"]["namespace"],
        "status.podIP": "127.0.0.1",
        **{f"metadata.labels['{k}']": v for k, v in template["metadata"]["labels"].items()},
    }
    env: dict[str, str] = {}
    for variable in container(statefulset)["env"]:
        source = variable.get("valueFrom", {})
        if "secretKeyRef" in source:
            env[variable["name"]] = f"<secret {source['secretKeyRef']['key']}>"
            continue
        if "fieldRef" in source:
            env[variable["name"]] = pod[source["fieldRef"]["fieldPath"]]
            continue
        value = variable["value"]
        for reference in re.findall(r"\$\((\w+)\)", value):
            assert reference in env, f"{variable['name']} names {reference}, not defined above"
            value = value.replace(f"$({reference})", env[reference])
        env[variable["name"]] = value
    return env


@pytest.mark.parametrize(("overlay", "shards"), OVERLAYS.items())
def test_each_shard_is_two_pods_on_two_nodes_with_a_budget_that_keeps_one(
    overlay: str, shards: int
) -> None:
    docs = built_documents(overlay)
    statefulsets = named(docs, "StatefulSet")
    assert sorted(statefulsets) == [f"cmdbus-trio-{n}" for n in range(shards)]
    budgets = list(by_kind(docs, "PodDisruptionBudget"))
    assert len(budgets) == shards
    for shard, (_, statefulset) in enumerate(sorted(statefulsets.items())):
        spec = statefulset["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["replicas"] == 2 and labels[SHARD_LABEL] == str(shard)
        assert spec["selector"]["matchLabels"][SHARD_LABEL] == str(shard)
        pod = spec["template"]["spec"]
        (apart,) = pod["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert apart["topologyKey"] == "kubernetes.io/hostname"
        assert apart["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
        (spread,) = pod["topologySpreadConstraints"]
        assert spread["topologyKey"] == "topology.kubernetes.io/zone"
        assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # preferred, not required
        assert spread["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
        (budget,) = [
            b
            for b in budgets
            if b["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
        ]
        assert budget["spec"]["maxUnavailable"] == 1  # of two: one member always kept
        headless = named(docs, "Service")[spec["serviceName"]]["spec"]
        assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"]
        assert headless["selector"] == spec["selector"]["matchLabels"]


@pytest.mark.parametrize(("overlay", "shards"), OVERLAYS.items())
def test_a_members_environment_is_a_member_of_its_shard(
    overlay: str, shards: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")  # litestream
    for statefulset in by_kind(built_documents(overlay), "StatefulSet"):
        name = statefulset["metadata"]["name"]
        shard = int(statefulset["spec"]["template"]["metadata"]["labels"][SHARD_LABEL])
        spec = container(statefulset)
        assert {"name": "ha", "containerPort": 9120} in spec["ports"]
        for ordinal in range(2):
            env = pod_env(statefulset, ordinal)
            assert env["CMDBUS_HA_LEASE"] == f"kubernetes:cmdbus/{name}"
            config = load({}, environ={**env, "HOSTNAME": f"{name}-{ordinal}"})
            assert (config.shard, config.shard_count) == (shard, shards)
            assert config.ha_name == f"{name}-{ordinal}"  # the pod's name: its label's
            assert config.ha_pod_labels and config.ha_advertise == "127.0.0.1"
            assert config.ha_sync == "on" and config.ha_lease_ms == 5000
            if overlay == "ha-litestream":
                assert config.checkpoints == "litestream"
                assert config.ha_while_primary == (
                    "litestream", "replicate", "-config", "/etc/litestream/litestream.yml"
                )  # fmt: skip


@pytest.mark.parametrize(("overlay", "shards"), OVERLAYS.items())
def test_the_client_service_reaches_only_the_primary(overlay: str, shards: int) -> None:
    docs = built_documents(overlay)
    services = named(docs, "Service")
    for statefulset in by_kind(docs, "StatefulSet"):
        name = statefulset["metadata"]["name"]
        selector = services[name]["spec"]["selector"]
        assert selector == {**statefulset["spec"]["selector"]["matchLabels"], ROLE_LABEL: "primary"}
        served = {port["targetPort"] for port in services[name]["spec"]["ports"]}
        assert "ha" not in served  # replication goes member to member
        assert served <= {port["name"] for port in container(statefulset)["ports"]}
    # The workers address each shard's Service, as they would a single writer.
    writers = ",".join(f"{n}@cmdbus-trio-{n}:9101" for n in range(shards))
    for deployment in by_kind(docs, "Deployment"):
        command = " ".join(deployment["spec"]["template"]["spec"]["containers"][0]["command"])
        assert (writers if shards > 1 else "cmdbus-trio-0:9101") in command


@pytest.mark.parametrize(("overlay", "shards"), OVERLAYS.items())
def test_a_member_may_touch_only_its_shards_lease_and_pods(overlay: str, shards: int) -> None:
    docs = built_documents(overlay)
    roles = named(docs, "Role")
    bindings = named(docs, "RoleBinding")
    accounts = named(docs, "ServiceAccount")
    for statefulset in by_kind(docs, "StatefulSet"):
        name = statefulset["metadata"]["name"]
        pod = statefulset["spec"]["template"]["spec"]
        account = pod["serviceAccountName"]
        assert account in accounts and pod["automountServiceAccountToken"] is True
        (binding,) = [
            b
            for b in bindings.values()
            if [(s["kind"], s["name"], s.get("namespace")) for s in b["subjects"]]
            == [("ServiceAccount", account, "cmdbus")]
        ]
        rules = roles[binding["roleRef"]["name"]]["rules"]
        granted = sorted(
            (group, resource, verb, tuple(rule.get("resourceNames", ["*"])))
            for rule in rules
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        )
        assert granted == sorted(
            [
                ("coordination.k8s.io", "leases", "get", (name,)),
                ("coordination.k8s.io", "leases", "update", (name,)),
                # (The API cannot limit a create to a name.)
                ("coordination.k8s.io", "leases", "create", ("*",)),
                ("", "pods", "patch", (f"{name}-0", f"{name}-1")),
            ]
        )


@pytest.mark.parametrize(("overlay", "shards"), OVERLAYS.items())
def test_sigterm_reaches_the_writer_at_once_and_its_drain_and_hand_over_fit_the_grace(
    overlay: str, shards: int
) -> None:
    for statefulset in by_kind(built_documents(overlay), "StatefulSet"):
        pod = statefulset["spec"]["template"]["spec"]
        spec = container(statefulset)
        assert "lifecycle" not in spec  # no preStop between SIGTERM and the hand-over
        env = {e["name"]: e.get("value") for e in spec["env"]}
        assert int(env["CMDBUS_SHUTDOWN_TIMEOUT_MS"]) == SHUTDOWN_TIMEOUT_S * 1000
        assert pod["terminationGracePeriodSeconds"] > SHUTDOWN_TIMEOUT_S + HAND_OVER_WAIT_S
        for probe, path in (
            ("startupProbe", "/livez"),
            ("livenessProbe", "/livez"),
            ("readinessProbe", "/readyz"),  # ready: serving its role (docs/deploy.md)
        ):
            assert spec[probe]["httpGet"] == {"path": path, "port": "control"}, probe


@pytest.mark.parametrize(("overlay", "shards"), OVERLAYS.items())
def test_replication_only_between_a_shards_members_and_backups_of_each_primary(
    overlay: str, shards: int
) -> None:
    docs = built_documents(overlay)
    for policy in by_kind(docs, "NetworkPolicy"):
        clients, _control, replication = policy["spec"]["ingress"]
        assert client_selector(clients) == {"cmdbus-trio/client": "true"}  # no shard label
        assert [p["port"] for p in replication["ports"]] == [9120]
        (peer,) = replication["from"]
        assert peer["podSelector"]["matchLabels"] == policy["spec"]["podSelector"]["matchLabels"]
        assert SHARD_LABEL in peer["podSelector"]["matchLabels"]
    (cronjob,) = by_kind(docs, "CronJob")
    (job,) = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in job["env"]}
    assert env["SELECTOR"] == f"app.kubernetes.io/name=cmdbus-trio,{ROLE_LABEL}=primary"
    for statefulset in by_kind(docs, "StatefulSet"):
        claims = [t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]]
        assert claims == ["data", "backups"]


def expand(env: dict[str, str], variable: re.Match[str]) -> str:
    return env[variable.group(1)]


def composed(tmp_path: Path, overlay: str, component: str) -> list[dict[str, Any]]:
    """``overlay`` with ``component`` added, as a user's own kustomization adds it (in
    the overlay's namespace: a generated ConfigMap is named by its hash only there)."""
    here = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: cmdbus\n"
        f"resources: [{here}/overlays/{overlay}]\ncomponents: [{here}/components/{component}]\n"
    )
    kubectl = need("kubectl", ci_installs=False)
    built = subprocess.run([kubectl, "kustomize", str(tmp_path)],
                           capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    return [d for d in yaml.safe_load_all(built.stdout) if d]


@pytest.mark.parametrize("overlay", ["ha-litestream", "ha-three-shards"])
def test_litestream_runs_in_the_primary_member_to_one_replica_per_shard(
    overlay: str, tmp_path: Path
) -> None:
    """No sidecar: the member runs Litestream while primary. Both members of a shard
    replicate to the shard's replica, each shard to its own; an empty volume is restored
    from it only when the pod is annotated so."""
    if overlay == "ha-litestream":
        docs = built_documents(overlay)
    else:
        docs = composed(tmp_path, overlay, "ha-litestream")
    (config_map,) = [d for d in by_kind(docs, "ConfigMap") if "litestream" in d["metadata"]["name"]]
    config = config_map["data"]["litestream.yml"]
    replicas: dict[int, set[str]] = {}
    for statefulset in by_kind(docs, "StatefulSet"):
        pod = statefulset["spec"]["template"]["spec"]
        assert [c["name"] for c in pod["containers"]] == ["writer"]
        mounts = {m["name"]: m["mountPath"] for m in container(statefulset)["volumeMounts"]}
        assert mounts["litestream-config"] == "/etc/litestream"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["litestream-config"]["configMap"]["name"] == config_map["metadata"]["name"]
        restore, keys = pod["initContainers"]
        assert restore["args"][0].startswith('[ "$RESTORE_FROM_REPLICA" = true ] || exit 0;')
        asked = {e["name"]: e for e in restore["env"]}["RESTORE_FROM_REPLICA"]
        annotation = "metadata.annotations['cmdbus-trio.io/restore-from-replica']"
        assert asked["valueFrom"]["fieldRef"]["fieldPath"] == annotation
        assert "--after-litestream" in keys["args"][0]
        for ordinal in range(2):
            env = pod_env(statefulset, ordinal)
            urls = re.findall(r"url: (\S+)", config)
            expanded = {re.sub(r"\$\{(\w+)\}", partial(expand, env), u) for u in urls}
            replicas.setdefault(int(env["CMDBUS_SHARD"]), set()).update(expanded)
    shards = 3 if overlay == "ha-three-shards" else 1
    assert sorted(replicas) == list(range(shards))
    for shard, urls in replicas.items():  # (both members' the same three)
        assert urls == {f"<secret url>/shard-{shard}/{s}" for s in ("commands", "events", "tier")}
